"""Continuous batching: many generations at once over a model's slotted KV cache.

One thread owns the backend. Each step carries the next token of every decoding sequence
plus prompt chunks of admitted ones (at most ``PREFILL_CHUNK`` tokens in all), and samples
one token for every sequence whose chunk ends its known tokens. A request waits in a
bounded FIFO for a free slot (``QueueFull`` past ``max_queue``); cancelling one frees its
slot before the next step. A slot keeps the KV rows of its last sequence: a new prompt
that starts with those tokens (a shared system prompt, the earlier turns of a chat) takes
that slot and computes only the rest, as llama-server's ``cache_prompt``.

Work that cannot join a batch (``call``: penalized or constrained generations, embeddings
on the model's own cache) runs on the same thread between steps, so no two computations
ever share the backend at once.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future

import numpy as np

from ..errors import ApirError
from ..graph import SampleArgs
from .batch import Batch, Chunk, Step
from .model import PREFILL_CHUNK, Model, SamplingParams, texts


class QueueFull(ApirError):
    """Every slot is busy and the waiting queue is full: try again later."""


class Request:
    """One generation: ``on_token(id) -> bool`` is called on the scheduler's thread for
    each generated token (False: stop here, as a stop string does), then ``on_end(reason)``
    once, with "stop", "length", "cancelled" or "error" (``error`` holds the exception: the
    backend's, or what ``on_token`` raised). The end-of-generation token is not passed on."""

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams,
                 on_token: Callable[[int], bool], on_end: Callable[[str], None]) -> None:
        self.prompt_ids, self.params = list(prompt_ids), params
        self.on_token, self.on_end = on_token, on_end
        self.cached_tokens = 0  # prompt tokens whose KV a slot already held (set on admission)
        self.generated = 0
        self.error: Exception | None = None
        self._rng = np.random.default_rng(params.seed)
        # Model.generate_tokens draws for each prompt chunk and samples the first token with
        # the last chunk's draw: skipping the others, a seed gives the same tokens here
        for _ in range(-(-len(self.prompt_ids) // PREFILL_CHUNK) - 1):
            self._rng.random()
        self._cancelled = threading.Event()
        self.slot: int | None = None
        self.ids: list[int] = []  # prompt and generated tokens
        self.done = 0  # how many of ids have their KV in the slot

    def cancel(self) -> None:
        """End this request before its next step (its slot is free then)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def draw(self) -> SampleArgs:
        p = self.params
        return SampleArgs(p.temperature, p.top_k, p.top_p, p.min_p, u=self._rng.random())


class Scheduler:
    """Generations of ``model`` over ``slots`` slots; ``close`` ends it."""

    def __init__(self, model: Model, slots: int, max_queue: int) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.model, self.max_queue = model, max_queue
        self.batch = Batch(model, slots)
        self.batch.warm_up()  # on a GPU host: every step length recorded before any request
        self.computed_tokens = 0  # tokens the backend has run (prefix reuse shows here)
        self._waiting: collections.deque[Request | tuple[Callable, Future]] = collections.deque()
        self._running: dict[int, Request] = {}
        self._cached: list[list[int]] = [[] for _ in range(slots)]  # per slot: tokens its KV holds
        self._used = [0] * slots  # when each slot last ran a sequence (least recent goes first)
        # a decode step queued before the one it follows was read: (step, chunks, requests)
        self._ahead: tuple[Step, list[Chunk], list[Request]] | None = None
        self._clock = 0
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="apir-scheduler", daemon=True)
        self._thread.start()

    @property
    def slots(self) -> int:
        return self.batch.slots

    @property
    def busy(self) -> int:
        return len(self._running)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def submit(self, request: Request) -> Request:
        """Queue ``request``; QueueFull when ``max_queue`` are waiting already."""
        with self._wake:
            if self._closed:
                raise ApirError("the scheduler is closed")
            if len(self._waiting) >= self.max_queue + (self.slots - len(self._running)):
                raise QueueFull(f"all {self.slots} slots are busy and {len(self._waiting)} requests wait")
            self._waiting.append(request)
            self._wake.notify()
        return request

    def call(self, fn: Callable[[], object]) -> Future:
        """Run ``fn`` on the scheduler's thread between steps, in queue order (not bounded:
        the caller's own queue bounds it); its result or exception in the Future."""
        future: Future = Future()
        with self._wake:
            if self._closed:
                raise ApirError("the scheduler is closed")
            self._waiting.append((fn, future))
            self._wake.notify()
        return future

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        """The generated token ids of one request, as ``Model.generate_ids`` yields them
        (the same ones for a seed); a failed step raises here."""
        out: collections.deque = collections.deque()
        ready = threading.Condition()

        def put(item) -> bool:
            with ready:
                out.append(item)
                ready.notify()
            return True

        request = self.submit(Request(prompt_ids, params, put, lambda reason: put(None)))
        try:
            while True:
                with ready:
                    ready.wait_for(lambda: out)
                    item = out.popleft()
                if item is None:
                    if request.error is not None:
                        raise request.error
                    return
                yield item
        finally:
            request.cancel()

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[str]:
        """Text pieces of one request, as ``Model.stream`` gives them (stop strings cut)."""
        with contextlib.closing(self.generate(prompt_ids, params)) as generated:
            yield from texts(self.model.tokenizer, generated, params.stop)

    def close(self, timeout: float = 10.0) -> None:
        """Stop after the current step; what is running or waiting ends cancelled."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout)

    # ------------------------------------------------------------ the thread
    def _serve(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._closed or self._waiting or self._running or self._ahead)
                if self._closed:
                    break
                work = self._take_work() if self._ahead is None else None  # a queued step first
            if work is not None:
                fn, future = work
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as e:  # the caller sees it; the scheduler goes on
                        future.set_exception(e)
                continue
            self._drop_cancelled()
            self._admit()
            if self._running or self._ahead is not None:
                self._step()
        if self._ahead is not None:  # read, so the backend holds no reply for nobody
            with contextlib.suppress(ApirError):
                self._ahead[0].result()
        for request in [*self._running.values(), *(w for w in self._waiting if isinstance(w, Request))]:
            request.on_end("cancelled")
        for w in self._waiting:
            if not isinstance(w, Request):
                w[1].cancel()

    def _take_work(self) -> tuple[Callable, Future] | None:
        """The first waiting ``call``, when it is next in line (holding the lock)."""
        if self._waiting and not isinstance(self._waiting[0], Request):
            return self._waiting.popleft()
        return None

    def _finish(self, request: Request, reason: str) -> None:
        self._cached[request.slot] = request.ids[: request.done]
        del self._running[request.slot]
        request.on_end(reason)

    def _drop_cancelled(self) -> None:
        for request in [r for r in self._running.values() if r.cancelled]:
            self._finish(request, "cancelled")
        with self._wake:
            for request in [w for w in self._waiting if isinstance(w, Request) and w.cancelled]:
                self._waiting.remove(request)
                request.on_end("cancelled")

    def _admit(self) -> None:
        """Free slots to waiting requests, FIFO; each takes the free slot holding the
        longest prefix of its prompt (the least recently used among equals)."""
        while True:
            free = [s for s in range(self.slots) if s not in self._running]
            with self._wake:
                if not free or not self._waiting or not isinstance(self._waiting[0], Request):
                    return
                request = self._waiting.popleft()
            prompt = request.prompt_ids
            try:
                self.model._check_fits(len(prompt))
            except ApirError:
                request.on_end("length")  # the caller checks lengths first; never a crash here
                continue
            if request.params.max_tokens == 0:
                request.on_end("length")
                continue
            shared = {s: _common(self._cached[s], prompt) for s in free}
            slot = max(free, key=lambda s: (shared[s], -self._used[s]))
            # the last prompt token is always computed: its logits give the first token
            request.slot, request.ids = slot, list(prompt)
            request.done = request.cached_tokens = min(shared[slot], len(prompt) - 1)
            self._clock += 1
            self._used[slot] = self._clock
            self._running[slot] = request

    def _step(self) -> None:
        """One step: every decoding sequence's token, then prompt chunks while they fit.
        Where the batch chains, a step of decodes only is followed at once by the next,
        queued before this one's tokens are read and fed them on the device: the host's
        work on one step (reading it, the callbacks, planning) overlaps the device's on the
        next, as the single-sequence path does. A sequence that ends meanwhile has its
        step-ahead token dropped (its KV row is past what its slot is known to hold)."""
        if self._ahead is not None:
            (step, chunks, requests), self._ahead = self._ahead, None
        else:
            chunks, requests = self._plan()
            step = self.batch.submit(chunks)
        if self._chains(chunks, requests):
            following = [Chunk(c.slot, (0,), c.start + 1, r.draw()) for c, r in zip(chunks, requests)]
            self._ahead = (self.batch.submit(following, fed=True), following, requests)
        try:
            tokens = step.result()
        except ApirError as e:  # a failed step fails its requests, not the scheduler
            for request in requests:
                if self._running.get(request.slot) is request:
                    request.error = e
                    self._finish(request, "error")
            return
        self.computed_tokens += sum(len(c.ids) for c in chunks)
        eot = self.model.tokenizer.eot_ids if self.model.tokenizer is not None else ()
        for request, chunk, token in zip(requests, chunks, tokens):
            if self._running.get(request.slot) is not request:
                continue  # it ended while this step was queued ahead
            request.done += len(chunk.ids)
            if chunk.draw is None:
                continue
            if token in eot:
                self._finish(request, "stop")
                continue
            request.ids.append(token)
            request.generated += 1
            try:
                more = request.on_token(token)
            except Exception as e:  # the caller's failure ends its request, not the scheduler
                request.error = e
                self._finish(request, "error")
                continue
            if not more:
                self._finish(request, "stop")
            elif request.generated >= request.params.max_tokens or len(request.ids) > self.model.n_ctx:
                self._finish(request, "length")

    def _plan(self) -> tuple[list[Chunk], list[Request]]:
        """The next step's chunks: decodes first, then prompt chunks within PREFILL_CHUNK."""
        budget, chunks, requests = PREFILL_CHUNK, [], []
        by_need = sorted(self._running.values(), key=lambda r: len(r.ids) - r.done)  # decodes first
        for request in by_need:
            n = min(len(request.ids) - request.done, budget)
            if n <= 0:
                break
            end = request.done + n
            draw = request.draw() if end == len(request.ids) else None
            chunks.append(Chunk(request.slot, request.ids[request.done : end], request.done, draw))
            requests.append(request)
            budget -= n
        return chunks, requests

    def _chains(self, chunks: list[Chunk], requests: list[Request]) -> bool:
        """Whether the step after ``chunks`` is known now: every running sequence decodes
        one token in it, each will need another and has room for it, and nothing waits to
        join (a waiting request or call goes first)."""
        return (self.batch.chains and not self._waiting and len(requests) == len(self._running)
                and all(len(c.ids) == 1 and c.draw is not None and not r.cancelled
                        and r.generated + 1 < r.params.max_tokens and c.start + 1 < self.model.n_ctx
                        for c, r in zip(chunks, requests)))


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n
