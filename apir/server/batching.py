"""Many generations at once (``apir serve --parallel N``): jobs through the engine's
continuous-batching scheduler.

Plain sampling jobs share its steps, one slot each. Jobs whose every step depends on the
token before it (repetition penalties, a grammar, logit_bias, logprobs) and embeddings run
through the one-at-a-time path on the model's own KV cache, on the scheduler's thread
between its steps (``Scheduler.call``): the batch pauses for them, and no two computations
ever share the backend. A job past the queue's bound is refused with ``QueueFull``.
"""

from __future__ import annotations

from ..engine import Model
from ..engine.model import Token
from ..engine.scheduler import Request, Scheduler
from .metrics import Metrics
from .runner import Failed, Job, JobText, Runner


class BatchRunner(Runner):
    """``Runner``'s interface over a ``Scheduler`` of ``slots`` slots."""

    def __init__(self, model: Model, metrics: Metrics, slots: int, max_queue: int) -> None:
        self.model, self.metrics = model, metrics
        self._current = None
        self.scheduler = Scheduler(model, slots, max_queue)  # warms its batch up: before serving

    @property
    def queued(self) -> int:
        return self.scheduler.queued

    @property
    def busy(self) -> int:
        return self.scheduler.busy

    def submit(self, job: Job) -> None:
        """Queue ``job``; raises QueueFull (the job never starts) when the queue is full."""
        p = job.params
        if job.work is not None or job.constraint is not None or p.penalized or p.logprobs is not None \
                or p.logit_bias:
            future = self.scheduler.call(lambda: self._serve_one(job))
            future.add_done_callback(lambda f: job.cancel() if f.cancelled() else None)
            return
        text = JobText(job, self)

        def on_end(reason: str) -> None:
            if reason == "error":
                job.emit(Failed(request.error))
                return
            if reason != "cancelled" and text.finish == "cancelled" and not job.cancelled:
                text.finish = None  # ended by itself (an end token, max_tokens, the context)
            text.cached = request.cached_tokens
            job.emit(text.done())

        request = _JobRequest(job, lambda t: text.feed(Token(t)), on_end)
        if job.start():  # from here its Done comes from on_end
            self.scheduler.submit(request)

    def close(self, timeout: float = 10.0) -> None:
        self.scheduler.close(timeout)


class _JobRequest(Request):
    """A scheduler request cancelled with its job (the client went away)."""

    def __init__(self, job: Job, on_token, on_end) -> None:
        super().__init__(job.prompt_ids, job.params, on_token, on_end)
        self.job = job

    @property
    def cancelled(self) -> bool:
        return self.job.cancelled
