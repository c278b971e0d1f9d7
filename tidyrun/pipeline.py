"""One engine step: schedule → run → book, or, with async scheduling, the next step launched first.

A synchronous step leaves the device idle while the host books the step's
tokens (appends, stop checks, outputs), schedules the next step and stages
its inputs. With ``async_scheduling=True`` (vLLM's name) a step of plain
sequences is launched without waiting for its tokens; the next ``step``
call schedules and launches the step after it, whose inputs for those
tokens are taken on the device (``ops.take_pending``), and only then waits for
and books the first one, so the host's work overlaps the device's.

Steps whose sampling needs the host to have seen the step before (grammar
masks, penalties, bans, ``min_tokens``: ``deferrable``) launch their forward
pass the same way, and are sampled once the step before is booked: the
forward overlaps the booking and the masks' fill. Steps with drafts, prompt
logprobs or top-k logprobs run synchronously. The tokens and records are
the same either way.

The price: a sequence that finishes at step N was computed once more in
step N + 1, whose row for it is dropped. No other state is kept between
steps: at most one launched step, sampled, and none once every sequence in
it has finished.
"""

from __future__ import annotations

from collections.abc import Collection
from functools import partial
from operator import attrgetter

from .runner.model_runner import LaunchedStep
from .scheduler import ScheduledBatch, Scheduler
from .sequence import deferrable, launchable

_NEEDS_PROCESSING, _ONE_PASS = attrgetter("needs_processing"), attrgetter("one_pass")
PLAIN, DEFER = "plain", "defer"  # how a step is launched ahead: sampled at once, or after the step before


class StepPipeline:
    """Runs the engine's steps; holds the step launched ahead (its tokens on the device) between calls.

    ``runner``: a ModelRunner (``execute``; with ``ahead``, ``launch`` and ``collect`` too).
    """

    def __init__(self, scheduler: Scheduler, runner, eos_token_ids: Collection[int], ahead: bool) -> None:
        self.scheduler, self.runner, self.eos_token_ids, self.ahead = scheduler, runner, eos_token_ids, ahead
        self._launchable = partial(launchable, raw_logprobs=runner.config.logprobs_mode == "raw_logprobs")
        self._in_flight: LaunchedStep | None = None

    def step(self) -> set[str]:
        """Book one step (launching the next one first when it can); returns the ids of requests with a
        sequence that finished. On failure the requests of the steps involved end with "abort"."""
        if self._in_flight is None:
            how = self._how()
            batch = self.scheduler.schedule()
            if not batch.seqs:
                return set()
            if how is None:
                return self._run(batch)
            self._in_flight = self._sample(self._launch(batch, None, how))
        done, self._in_flight = self._in_flight, None
        how = self._how()
        if how is not None:
            batch = self.scheduler.schedule()
            if batch.seqs:
                self._in_flight = self._launch(batch, done, how)
        finished = self._book(done)
        if self._in_flight is not None:  # a deferred step is sampled now: its grammars have done's tokens
            launched, self._in_flight = self._in_flight, None
            self._in_flight = self._sample(launched)
        return finished | self.settle()

    @property
    def idle(self) -> bool:
        """No step in flight: the running sequences' states hold every token sampled so far (the engine
        fills the next grammar masks ahead only then)."""
        return self._in_flight is None

    def settle(self) -> set[str]:
        """Wait for and drop a launched step whose sequences have all finished (their last step came
        before it, or they were aborted): none stays in flight without a sequence to serve."""
        if self._in_flight is not None and all(s.is_finished for s in self._in_flight.batch.seqs):
            return self.drain()
        return set()

    def drain(self) -> set[str]:
        """Wait for and book the launched step, if any (before sleep, weight updates, shutdown)."""
        if self._in_flight is None:
            return set()
        done, self._in_flight = self._in_flight, None
        return self._book(done)

    def _how(self) -> str | None:
        """How every step the scheduler can make now (it takes running and waiting sequences) is launched
        ahead: PLAIN when each sequence is ``launchable`` (logprob records only where every one is one-pass),
        DEFER when each is ``deferrable``, None (synchronously) otherwise or without async scheduling."""
        if not self.ahead:
            return None
        s = self.scheduler
        if all(map(self._launchable, s.running)) and all(map(self._launchable, s.waiting)) and (
                not (any(map(_NEEDS_PROCESSING, s.running)) or any(map(_NEEDS_PROCESSING, s.waiting)))
                or (all(map(_ONE_PASS, s.running)) and all(map(_ONE_PASS, s.waiting)))):
            return PLAIN
        return DEFER if all(map(deferrable, s.running)) and all(map(deferrable, s.waiting)) else None

    def _run(self, batch: ScheduledBatch) -> set[str]:
        try:
            output = self.runner.execute(batch)
        except BaseException:
            self._abort(batch)
            raise
        return self.scheduler.update_from_output(batch, output, self.eos_token_ids, self.runner.max_model_len)

    def _launch(self, batch: ScheduledBatch, after: LaunchedStep | None, how: str) -> LaunchedStep:
        try:
            launched = self.runner.launch(batch, after, defer=how == DEFER)
        except BaseException:
            # The step before (if any) has no step after it to feed and its sequences' state counts a
            # pending token this one was to compute: both end.
            self._abort(batch, after.batch if after is not None else None)
            raise
        self.scheduler.book_launch(batch, launched.seqs)
        return launched

    def _sample(self, launched: LaunchedStep) -> LaunchedStep:
        """A deferred step sampled (``ModelRunner.sample_launched``; a sampled one as it is)."""
        if launched.tokens is not None:
            return launched
        try:
            return self.runner.sample_launched(launched)
        except BaseException:
            self._abort(launched.batch)
            raise

    def _book(self, done: LaunchedStep) -> set[str]:
        try:
            output = self.runner.collect(done)
        except BaseException:
            self._abort(done.batch, self._in_flight.batch if self._in_flight is not None else None)
            self._in_flight = None
            raise
        return self.scheduler.book_output(done.batch, output, self.eos_token_ids, self.runner.max_model_len)

    def _abort(self, *batches: ScheduledBatch | None) -> None:
        """Do not retry failing steps forever: their requests end with "abort" and the engine stays usable."""
        for request_id in {s.request_id for b in batches if b is not None for s in b.seqs}:
            self.scheduler.abort(request_id)
