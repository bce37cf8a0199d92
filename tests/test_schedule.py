"""The training loop's named actions: due by count, after the last step, on a condition."""
from bov_jax.training import schedule


def test_actions_run_in_the_order_added_when_due():
  ran = []
  s = schedule.Schedule(last_step=10)
  s.add("every3", lambda step: ran.append(("every3", step)), every=3)
  s.add("never_at_end", lambda step: ran.append(("never_at_end", step)), every=4, at_end=False)
  s.add("odd", lambda step: ran.append(("odd", step)), also=lambda step: step % 2 == 1)
  for step in range(1, 11):
    s.run(step)
  assert [n for n, st in ran if st == 10] == ["every3", "odd"]  # the last step, in order
  assert [st for n, st in ran if n == "every3"] == [3, 6, 9, 10]
  assert [st for n, st in ran if n == "never_at_end"] == [4, 8]  # by count, not for the end
  assert [st for n, st in ran if n == "odd"] == [1, 3, 5, 7, 9, 10]
  assert s.is_due("every3", 6) and not s.is_due("every3", 7) and not s.is_due("missing", 3)


def test_no_action_decides_for_another_by_running_first():
  """Which actions are due after a step is decided before any runs: an action that
  changes what another's `also` reads takes effect from the next step, whatever the order."""
  state = {"stop": False}
  ran = []
  s = schedule.Schedule(last_step=100)
  s.add("stop", lambda step: state.update(stop=step == 4), every=1)
  s.add("save", lambda step: ran.append(step), also=lambda step: state["stop"])
  for step in range(1, 7):
    s.run(step)
  assert ran == [5]  # seen at step 5; its own run at step 5 clears it for step 6
