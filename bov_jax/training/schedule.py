"""The training loop's periodic work (train.py): what runs after which step."""

from __future__ import annotations


class Schedule:
  """The loop's periodic work: named actions after every step (levanter's
  `Trainer.add_hook(fn, every=)`), independent of one another. An action is due after
  step s when s is a multiple of its `every` (0: never by count), after the last step
  unless `at_end` is off, and whenever its `also(s)` says so; which are due is decided
  for all of them before the first runs, so no action decides for another by running
  first (they run in the order added)."""

  def __init__(self, last_step: int):
    self.last_step = last_step
    self.actions: dict[str, tuple] = {}

  def add(self, name, fn, every=0, at_end=True, also=None) -> None:
    self.actions[name] = (fn, every, at_end, also or (lambda step: False))

  def is_due(self, name: str, step: int) -> bool:
    if name not in self.actions:
      return False
    _, every, at_end, also = self.actions[name]
    return ((every > 0 and step % every == 0) or (at_end and step == self.last_step)
            or also(step))

  def run(self, step: int) -> None:
    due = [fn for name, (fn, *_) in self.actions.items() if self.is_due(name, step)]
    for fn in due:
      fn(step)
