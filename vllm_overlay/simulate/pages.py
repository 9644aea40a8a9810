"""Per-physical-block page contents of one leg.

A page holds whatever was last written into its physical block id: the
group that wrote it, the writer's prompt identity, how far the writer's
tokens agree with that prompt, and the positions it covers (attention) or
the number of tokens its state has absorbed (Mamba/KDA). The null block
never holds anything. Cache groups overlay one pool, so a block reused by
another group or request loses its old contents.
"""

from __future__ import annotations

from typing import NamedTuple

STATE = -1
"""``hi`` marker of a state page; ``lo`` is then the token count."""


class Page(NamedTuple):
    group: int
    uid: int
    """Prompt identity (one per simulated case); -1 for corrupt contents."""
    valid: int
    """The writer's tokens equal the prompt's tokens on positions < valid."""
    lo: int
    hi: int


class PageStore:
    """Contents by physical block id for one leg."""

    def __init__(self, null_block_id: int) -> None:
        self.null_block_id = null_block_id
        self.pages: dict[int, Page] = {}

    def get(self, block_id: int) -> Page | None:
        return self.pages.get(block_id)

    def put(self, block_id: int, page: Page | None) -> None:
        if block_id == self.null_block_id:
            return
        if page is None:
            self.pages.pop(block_id, None)
        else:
            self.pages[block_id] = page

    def _same_writer(
        self, block_id: int, group: int, uid: int, valid: int
    ) -> Page | None:
        """The block's positions page if this writer wrote it, else None."""
        cur = self.pages.get(block_id)
        if cur is None or cur.hi == STATE or cur[:3] != (group, uid, valid):
            return None
        return cur

    def write_positions(
        self, block_id: int, group: int, uid: int, valid: int, lo: int, hi: int
    ) -> None:
        """Attention KV for positions [lo, hi) written into one block."""
        if block_id == self.null_block_id or lo >= hi:
            return
        cur = self._same_writer(block_id, group, uid, valid)
        if cur is not None and cur.lo <= hi and lo <= cur.hi:
            lo, hi = min(lo, cur.lo), max(hi, cur.hi)
        self.pages[block_id] = Page(group, uid, valid, lo, hi)

    def write_ring(
        self,
        block_id: int,
        group: int,
        uid: int,
        valid: int,
        lo: int,
        hi: int,
        capacity: int,
    ) -> None:
        """Rows of positions [lo, hi) written into a ring of ``capacity`` slots
        (position p in slot p % capacity): the page then holds the latest
        contiguous run of at most ``capacity`` positions."""
        if block_id == self.null_block_id or lo >= hi:
            return
        cur = self._same_writer(block_id, group, uid, valid)
        if cur is not None and cur.hi == lo:
            lo = cur.lo
        self.pages[block_id] = Page(group, uid, valid, max(lo, hi - capacity), hi)

    def write_state(
        self, block_id: int, group: int, uid: int, valid: int, tokens: int
    ) -> None:
        """A recurrent state after ``tokens`` tokens written into one block."""
        if block_id == self.null_block_id:
            return
        self.pages[block_id] = Page(group, uid, valid, tokens, STATE)

    def zero(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self.pages.pop(block_id, None)


def holds_positions(page: Page | None, group: int, uid: int, lo: int, hi: int) -> bool:
    """Does ``page`` hold this prompt's KV of ``group`` for positions [lo, hi)?"""
    if lo >= hi:
        return True
    return (
        page is not None
        and page.hi != STATE
        and page.group == group
        and page.uid == uid
        and page.valid >= hi
        and page.lo <= lo
        and page.hi >= hi
    )


def holds_state(page: Page | None, group: int, uid: int, tokens: int) -> bool:
    """Does ``page`` hold this prompt's ``group`` state after ``tokens`` tokens?"""
    return (
        page is not None
        and page.hi == STATE
        and page.group == group
        and page.uid == uid
        and page.lo == tokens
        and page.valid >= tokens
    )
