"""Exception types users can catch.

Every failure a user can cause (a bad model file, a bad parameter, a call at the
wrong time) maps to one of these, so callers never have to parse a bare
``KeyError`` or ``RuntimeError`` from deep inside torch.
"""


class TidyrunError(Exception):
    """Base class of every error tidyrun raises on purpose."""


class ModelLoadError(TidyrunError):
    """The model source is missing, unreadable, truncated or inconsistent."""


class UnsupportedModelError(ModelLoadError):
    """The model source is readable but describes something tidyrun cannot run."""


class InvalidRequestError(TidyrunError, ValueError):
    """A request is malformed: bad sampling parameters, empty or oversized prompt."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus at least one generated token) does not fit the context."""


class OutOfResourcesError(TidyrunError):
    """The device cannot hold what the configuration asks for (e.g. the KV cache)."""


class EngineShutdownError(TidyrunError, RuntimeError):
    """A call was made on an engine or runner after ``shutdown()``."""


class EngineSleepingError(TidyrunError, RuntimeError):
    """A call needs device state that ``sleep()`` released; call ``wake_up()`` first."""


class WeightsNotLoadedError(EngineSleepingError):
    """The weights were discarded by ``sleep(level=2)`` and woken without loading; push or reload them first.

    A subclass of EngineSleepingError: code that waits for an engine to be
    awake catches both, and the message names what is missing and what to call.
    """


class ResourceLeakError(TidyrunError, RuntimeError):
    """``shutdown(strict=True)`` found device tensors that outlived the runner."""


class WorkerError(TidyrunError, RuntimeError):
    """A tensor-parallel worker failed (at start-up or while running); the engine cannot run steps any more."""


class WorkerDiedError(WorkerError):
    """A tensor-parallel worker process exited (crashed or was killed) while the engine needed it."""
