"""One model, one KV cache: generations run one at a time, first come first served.

Requests put a :class:`Job` on a FIFO; a single worker thread takes them in order and
runs each to the end (generation is synchronous Python) before starting the next, so two
requests never interleave in the KV cache. Text goes back to the event loop through
``loop.call_soon_threadsafe`` onto the job's asyncio queue. A job is cancelled (the
client went away) by setting its flag: a queued job ends at once with
``Done("cancelled")``, a running one stops before its next token. Every job ends with
exactly one Done or Failed, so whoever waits on its events always returns.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from ..engine import Model, SamplingParams
from ..engine.model import Constraint, Token
from .metrics import Metrics


@dataclass(frozen=True)
class Piece:
    """Generated text, stop strings already cut out; with logprobs asked for, the entries
    (OpenAI chat's shape) of the tokens generated since the previous piece."""

    text: str
    logprobs: tuple[dict, ...] = ()


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop" (end token or stop string), "length", or "cancelled"
    prompt_tokens: int
    completion_tokens: int
    result: object = None  # what a work job's function returned
    cached_tokens: int = 0  # prompt tokens whose KV a slot already held (batched serving)


@dataclass(frozen=True)
class Failed:
    error: Exception


Event = Piece | Done | Failed


class Job:
    """One generation request, created on the event loop that will read its events."""

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams | None,
                 constraint: Constraint | None = None,
                 work: Callable[[Model, Job], object] | None = None) -> None:
        """A generation of ``params`` from ``prompt_ids``; or, with ``work``, that function
        run on the model and this job in the queue's turn (an embedding: it writes the KV
        cache too; it returns None when it sees the job cancelled)."""
        self.prompt_ids = list(prompt_ids)
        self.params, self.constraint, self.work = params, constraint, work
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._started = False

    def cancel(self) -> None:
        """Stop this job; one that has not started ends here, with its Done."""
        with self._lock:
            self._cancel.set()
            if self._started:
                return  # the runner emits the Done before its next token
            self._started = True  # never starts now
        self.emit(Done("cancelled", len(self.prompt_ids), 0))

    def start(self) -> bool:
        """Called by the worker thread: False when the job was cancelled before it ran."""
        with self._lock:
            if self._started:
                return False
            self._started = True
            return True

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def emit(self, event: Event) -> None:
        """Called from the worker thread."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel()

    async def events(self) -> AsyncIterator[Event]:
        """Pieces, then one Done or Failed."""
        while True:
            event = await self._events.get()
            yield event
            if not isinstance(event, Piece):
                return


class Runner:
    """The worker thread that owns ``model`` and serves jobs from a FIFO."""

    def __init__(self, model: Model, metrics: Metrics) -> None:
        self.model, self.metrics = model, metrics
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._current: Job | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="apir-generate", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        return self._jobs.qsize()

    def submit(self, job: Job) -> None:
        with self._lock:
            if not self._closed:
                self._jobs.put(job)
                return
        job.cancel()  # the runner has stopped: the job ends at once

    def close(self, timeout: float = 10.0) -> None:
        """Stop after the current token; jobs still queued end cancelled."""
        with self._lock:  # no job is queued after the None
            self._closed = True
            self._jobs.put(None)
        current = self._current
        if current is not None:
            current.cancel()
        self._thread.join(timeout)
        while True:  # the thread is stuck past the timeout: end the rest here
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            if self._closed:
                job.cancel()  # closing: what is still queued ends, cancelled
                continue
            self._serve_one(job)

    def _serve_one(self, job: Job) -> None:
        if not job.start():
            return  # cancelled while queued: it has emitted its Done
        self._current = job
        try:
            if job.work is not None:
                job.emit(Done("stop", len(job.prompt_ids), 0, job.work(self.model, job)))
            else:
                job.emit(self._run(job))
        except Exception as e:  # a failed generation fails its request, not the server
            job.emit(Failed(e))
        finally:
            self._current = None

    def _run(self, job: Job) -> Done:
        """Generate on the model's own cache, one token at a time (see ``JobText``)."""
        text = JobText(job, self)
        ids = self.model.generate_tokens(job.prompt_ids, job.params, job.constraint)
        try:
            for token in ids:
                if not text.feed(token):
                    break
            else:
                text.finish = None  # the generation ended by itself
        finally:
            ids.close()
        return text.done()

    def _entry(self, token: Token) -> dict:
        """A token's logprobs as OpenAI's chat ``logprobs.content`` entry."""
        def one(tid: int, logprob: float) -> dict:
            data = self.model.tokenizer.token_bytes(tid) if tid < self.model.tokenizer.vocab_size else b""
            return {"token": data.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(data)}

        return {**one(token.id, token.logprob), "top_logprobs": [one(*t) for t in token.top]}


class JobText:
    """One job's text as tokens arrive: emits pieces as it is safe to, never half a
    character and never a piece of a stop string (up to the longest stop string's length
    is held back)."""

    def __init__(self, job: Job, runner: Runner) -> None:
        self.job, self.runner = job, runner
        self.decoder = runner.model.tokenizer.stream()
        self.hold = max((len(s) for s in job.params.stop), default=1) - 1
        self.text, self.sent, self.count = "", 0, 0
        self.finish: str | None = "cancelled"  # None: the generation ended by itself
        self.first: float | None = None
        self.entries: list[dict] = []  # logprobs not yet sent
        self.cached = 0  # prompt tokens reused from a slot's cache

    def feed(self, token: Token) -> bool:
        """Take one token; False when the job is over (a stop string, or cancelled)."""
        job = self.job
        self.count += 1
        self.first = self.first or time.perf_counter()
        self.text += self.decoder.feed(token.id)
        if token.logprob is not None:
            self.entries.append(self.runner._entry(token))
        cut = _find_stop(self.text, job.params.stop, self.sent)
        if cut >= 0:
            self.text, self.finish = self.text[:cut], "stop"
            return False
        if job.cancelled:
            self.finish = "cancelled"
            return False
        if len(self.text) - self.hold > self.sent:
            job.emit(Piece(self.text[self.sent : len(self.text) - self.hold], tuple(self.entries)))
            self.sent, self.entries = len(self.text) - self.hold, []
        return True

    def done(self) -> Done:
        """The job's last piece and its Done (``finish`` None: it ended by itself)."""
        job = self.job
        if self.finish is None:
            self.text += self.decoder.flush()
            cut = _find_stop(self.text, job.params.stop, self.sent)
            if cut >= 0:
                self.text, self.finish = self.text[:cut], "stop"
            else:
                self.finish = "length" if self.count >= job.params.max_tokens else "stop"
        decode_seconds = time.perf_counter() - self.first if self.first else 0.0
        self.runner.metrics.generation(len(job.prompt_ids), self.count, decode_seconds,
                                       cancelled=self.finish == "cancelled")
        if self.finish != "cancelled" and (len(self.text) > self.sent or self.entries):
            job.emit(Piece(self.text[self.sent :], tuple(self.entries)))
        return Done(self.finish, len(job.prompt_ids), self.count, cached_tokens=self.cached)


def _find_stop(text: str, stops: Sequence[str], start: int) -> int:
    """Where the earliest stop string begins in ``text[start:]``, or -1. Text before
    ``start`` was already checked (and sent), so a match cannot begin there."""
    return min((i for i in (text.find(s, start) for s in stops) if i >= 0), default=-1)
