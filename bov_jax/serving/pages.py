"""The paged cache's bookkeeping, on the host: which pages are free, and each slot's page
table (the pages holding its positions, in order). Page 0 is never handed out: a table's
unused entries name it, and the device writes there what no page holds."""

from __future__ import annotations

import numpy as np


class PagePool:

  def __init__(self, num_pages: int, page_size: int, slots: int, max_pages: int):
    if num_pages < 2:
      raise ValueError(f"a paged cache needs at least 2 pages, it has {num_pages}")
    self.num_pages, self.page_size, self.max_pages = num_pages, page_size, max_pages
    self.free = list(range(num_pages - 1, 0, -1))  # popped from the end: 1, 2, ...
    self.table = np.zeros((slots, max_pages), np.int32)
    self.held = [0] * slots

  def pages_for(self, positions: int) -> int:
    return -(-positions // self.page_size)

  def grow(self, slot: int, positions: int) -> bool:
    """The slot holds pages for `positions` positions; False (taking none) where too few
    pages are free."""
    need = self.pages_for(positions) - self.held[slot]
    if need <= 0:
      return True
    if need > len(self.free) or self.held[slot] + need > self.max_pages:
      return False
    for _ in range(need):
      self.table[slot, self.held[slot]] = self.free.pop()
      self.held[slot] += 1
    return True

  def release(self, slot: int) -> None:
    self.free.extend(int(p) for p in self.table[slot, :self.held[slot]][::-1])
    self.table[slot] = 0
    self.held[slot] = 0

  @property
  def used(self) -> int:
    return self.num_pages - 1 - len(self.free)
