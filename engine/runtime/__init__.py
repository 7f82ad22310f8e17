"""The serving runtime: continuous batching over one engine (:class:`Runtime`), planned step by
step by the :class:`Scheduler`."""

from engine.runtime.request import FinishReason, RuntimeRequest
from engine.runtime.runtime import Runtime
from engine.runtime.scheduler import Scheduler, SchedulerConfig

__all__ = ["FinishReason", "Runtime", "RuntimeRequest", "Scheduler", "SchedulerConfig"]
