"""The runner's lifecycle: one ordered table of components, and every transition as a loop over it.

A component owns one kind of device or pinned host memory (the weights, their
host copy, the RoPE table, the KV cache, ...) and says, in one small
protocol, how to acquire it, release it, and what it does when the engine
sleeps at level 1 or 2 and wakes. The runner lists its components once, in
acquisition order; start, sleep, wake, the level-2 weight refill, failure
rollback and shutdown are the loops below. Adding a component is adding a
row: no transition can forget it, and no owner name has to be remembered in
an if-chain.

Order rules the loops rely on:
- start acquires in table order; a failed acquire releases, in reverse, what
  was acquired (the failing row too: ``release`` must be safe on a partial
  acquire).
- sleep goes in reverse table order (graphs before the buffers they read,
  the host copy is made before the device weights are dropped); a failed
  sleep wakes again, in table order, the rows it had already put to sleep.
  A row's ``sleep`` is atomic: it fails without having changed anything.
- wake goes in table order; a failed wake ``unwake``s, in reverse, the rows
  it woke (and the failing row), so the engine is back in the asleep state it
  started from. Only when every row woke is ``woken`` called: the place for
  steps that cannot be undone (dropping the host copy of the weights).
- shutdown releases in reverse table order; a row that fails to release does
  not stop the others (its error is returned).

Sleep levels belong to rows, not to the engine. A sleep puts every row that
is still awake to sleep at the level asked for and leaves the rows already
asleep at theirs (so ``sleep(2)``, ``wake_up(["weights"])``, ``sleep(1)``
keeps the weights on the host and the KV cache discarded); a wake gives each
row the level it went to sleep at. Only a sleep with nothing left awake is
refused (by the runner). The engine's level is the deepest of its sleeping
rows: 2 as long as anything sleeps at level 2.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from ..resources import drop_traceback_locals

WEIGHTS, KV_CACHE, STEP = "weights", "kv_cache", "step"
SLEEP_TAGS = (WEIGHTS, KV_CACHE)  # what users name in wake_up(tags)


@dataclass(frozen=True)
class Transition:
    """What a sleep or wake is about: its level, and for a level-2 refill the caller's weights."""

    level: int
    # (HF name, tensor) pairs to fill the weights from at a level-2 wake (the caller's, or the model
    # source's for a reload); None: a level-2 wake allocates the weights' memory and loads nothing.
    weights: Iterable | None = None


class Component:
    """One owner of device or pinned host memory; a row of the runner's lifecycle table.

    ``owner`` is the ledger owner of what it allocates. ``tag`` says when it
    sleeps and wakes: with the weights, with the KV cache, ``STEP`` (needs
    both: it wakes when nothing else sleeps), or None (never sleeps, e.g. a
    process group). The defaults fit a component whose memory is worth
    nothing across a sleep: sleeping releases it, waking acquires it again.
    """

    owner: str = ""
    tag: str | None = None

    def acquire(self) -> None:
        """Allocate (and fill) what this component owns."""

    def release(self) -> None:
        """Drop every reference to what it owns; idempotent and safe after a partial acquire."""

    def sleep(self, t: Transition) -> None:
        self.release()

    def wake(self, t: Transition) -> None:
        self.acquire()

    def unwake(self, t: Transition) -> None:
        """Undo a ``wake`` (or a partial one) and keep what ``sleep`` kept."""
        self.release()

    def woken(self, t: Transition) -> None:
        """Called once every component of a wake succeeded."""


class Lifecycle:
    """The ordered table and its state: which rows are acquired, which sleep and at what level."""

    def __init__(self, components: list[Component]) -> None:
        self.table = components
        self.acquired: list[Component] = []
        self.asleep: dict[Component, int] = {}  # sleeping rows, in table order -> the level each sleeps at
        self.seconds: dict[str, float] = {}  # start-up time by owner

    @property
    def sleeping_tags(self) -> set[str]:
        return {c.tag for c in self.asleep if c.tag in SLEEP_TAGS}

    @property
    def level(self) -> int | None:
        """The deepest level any row sleeps at; None when nothing sleeps."""
        return max(self.asleep.values(), default=None)

    def level_of(self, tag: str) -> int | None:
        """The level the rows of ``tag`` sleep at; None when they are awake."""
        return max((level for c, level in self.asleep.items() if c.tag == tag), default=None)

    @property
    def fully_asleep(self) -> bool:
        """Whether every row that can sleep sleeps (a further sleep would release nothing)."""
        return all(c in self.asleep for c in self.table if c.tag is not None)

    def start(self) -> None:
        for c in self.table:
            t0 = time.perf_counter()
            try:
                c.acquire()
            except BaseException:
                self.acquired.append(c)  # partially acquired: released with the others
                self.shutdown()
                raise
            self.acquired.append(c)
            self.seconds[c.owner] = time.perf_counter() - t0

    def sleep(self, level: int) -> None:
        """Put the rows still awake to sleep at ``level``; the rows already asleep keep theirs."""
        t = Transition(level)
        done: list[Component] = []
        for c in reversed(self.table):
            if c.tag is None or c in self.asleep:
                continue
            try:
                c.sleep(t)
            except BaseException:
                for d in reversed(done):
                    d.wake(t)
                raise
            done.append(c)
        self.asleep = {c: self.asleep.get(c, level) for c in self.table if c in self.asleep or c in done}

    def wake(self, tags: Iterable[str], weights: Iterable | None = None) -> list[Component]:
        """Wake the sleeping rows of ``tags`` (and the ``STEP`` rows once nothing else sleeps), each at the
        level it sleeps at; returns them."""
        wanted = set(tags)
        rest = [c for c in self.asleep if c.tag not in wanted and c.tag != STEP]
        targets = [c for c in self.asleep if c.tag in wanted or (c.tag == STEP and not rest)]
        done: list[Component] = []
        for c in targets:
            try:
                c.wake(Transition(self.asleep[c], weights))
            except BaseException:
                for d in reversed([*done, c]):
                    d.unwake(Transition(self.asleep[d], weights))
                raise
            done.append(c)
        for c in done:
            c.woken(Transition(self.asleep.pop(c), weights))
        return done

    def shutdown(self) -> list[str]:
        """Release every acquired row in reverse order; returns what failed, as text.

        Errors are kept as text, their frames cleared: an exception object
        would keep the locals of the failed release (tensors among them) alive.
        """
        errors = []
        while self.acquired:
            c = self.acquired.pop()
            try:
                c.release()
            except Exception as exc:  # noqa: BLE001 - one row's failure must not keep the others' memory
                drop_traceback_locals(exc)
                errors.append(f"releasing {c.owner} failed: {type(exc).__name__}: {exc}")
        self.asleep = {}
        return errors
