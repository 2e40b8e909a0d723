"""The OpenAI-compatible HTTP API on Starlette.

  GET  /health                 503 {"status": "loading"} until the model is ready, then 200
  GET  /metrics                Prometheus text
  GET  /v1/models              the one model served
  POST /v1/chat/completions    chat, whole or streamed (server-sent events)
  POST /v1/completions         plain text completion, whole or streamed
  POST /v1/embeddings          pooled final hidden states (--pooling, or the GGUF's own)
  POST /tokenize, /detokenize  llama-server's
  /api/*                       Ollama's API (``ollama``)

Constraints (``response_format``, ``grammar``, ``guided_*``, tools) compile with
llguidance before a request is queued, so a bad grammar is a 400. The model loads in a background thread once the server is up, so /health answers at
once. Prompts are tokenized on a thread pool; generation runs on the Runner's single
thread, one request at a time, in arrival order. A client that goes away cancels its
generation before the next token.
"""

from __future__ import annotations

import base64
import contextlib
import hmac
import json
import secrets
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import numpy as np
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..backends.base import ALIGNMENT
from ..engine import ContextOverflowError, Model
from ..engine.constraint import GrammarError
from ..engine.model import POOLINGS
from ..engine.scheduler import QueueFull
from ..flags import RunConfig, load
from ..models.errors import ChatTemplateError, TokenizerError
from ..models.resolve import DEFAULT_MODEL
from ..models.weights import KVLayout
from . import metrics as prom
from . import ollama
from . import tools as tool_calls
from .batching import BatchRunner
from .replies import ChatFormat, CompletionFormat
from .runner import Done, Failed, Job, Piece, Runner
from .schemas import (
    ChatRequest,
    CompletionRequest,
    Grammar,
    RequestError,
    Sampling,
    check_fields,
    error_body,
    parse_chat,
    parse_completion,
    parse_embeddings,
    read_flag,
)

MAX_BODY = 32 << 20  # bytes; a prompt this long is far past any context window
ENDPOINTS = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions",
             "/v1/embeddings", "/tokenize", "/detokenize", "/api/chat", "/api/generate", "/api/embed")
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's pooling_type values
MAX_TOKENS = 1 << 18  # ids /detokenize (and /tokenize's with_pieces) turn into text at once
TOKENIZE_FIELDS = frozenset({"content", "add_special", "parse_special", "with_pieces"})


@dataclass(frozen=True)
class ServeConfig:
    """What ``apir serve`` runs: the model, where it computes, and who may ask."""

    run: RunConfig = field(default_factory=RunConfig)  # the model and where it runs, as `apir run`'s
    api_key: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    aliases: tuple[str, ...] = ()  # more names clients may ask for (--alias)
    any_model_name: bool = False  # any name serves the model, as llama-server does
    pooling: str | None = None  # embeddings: mean, cls or last; None: the GGUF's pooling_type
    parallel: int | None = None  # generations at once (slots); None: see default_parallel
    max_queue: int = 64  # requests waiting for a slot before the server answers 429

    def __post_init__(self) -> None:
        if self.parallel is not None and self.parallel < 1 or self.max_queue < 0:
            raise ValueError(f"parallel must be >= 1 and max_queue >= 0, got {self.parallel}, {self.max_queue}")
        if self.pooling is not None and self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")

    @property
    def model_id(self) -> str:
        """The name clients use: the model's short name, or a .gguf file's stem."""
        name = self.run.model or DEFAULT_MODEL
        return Path(name).stem if name.lower().endswith(".gguf") else name


def load_model(run: RunConfig) -> Model:
    """``apir run``'s loader (``flags.load``), its lines prefixed with ``apir serve:``; then
    the warm-up: a GPU host compiles its decode step now, while /health says "loading"."""
    model = load(run, say=_log)
    model.warm_up()
    return model


def default_parallel(model: Model) -> int:
    """Slots when --parallel is not given: 4 on an accelerator; on a CPU as many (up to 4)
    as leave three quarters of the free memory after their KV caches, at least 1."""
    if model.backend.device().kind != "cpu":
        return 4
    heads = model.arch.kv_heads(model.args)
    per_slot = KVLayout.plan(model.n_ctx, heads, model.kv.dtype, ALIGNMENT)[0]
    return max(1, min(4, model.backend.device().memory_free // 4 // max(per_slot, 1)))


class _State:
    """What the handlers share: the model once loaded, and how loading went."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.metrics = prom.Metrics()
        self.model: Model | None = None
        self.runner: Runner | None = None
        self.error: str | None = None
        self.closed = False
        self.aliases = {config.model_id, *config.aliases}
        if config.run.model:
            self.aliases |= {config.run.model, Path(config.run.model).name}

    def close(self) -> None:
        self.closed = True
        if self.runner is not None:
            self.runner.close()
        if self.model is not None:
            self.model.close()


def _log(message: str) -> None:
    print(f"apir serve: {message}", file=sys.stderr, flush=True)


def create_app(
    config: ServeConfig,
    loader: Callable[[], Model] | None = None,
    on_load_error: Callable[[Exception], None] | None = None,
) -> Starlette:
    """The ASGI app serving ``config``. ``loader`` (default: ``load_model(config.run)``) runs
    in a background thread at startup; ``on_load_error`` is told if it fails."""
    state = _State(config)
    load_ = loader or (lambda: load_model(config.run))

    def load_in_background() -> None:
        t0 = time.perf_counter()
        model = None
        try:
            model = load_()
            slots = config.parallel or default_parallel(model)
            runner = (Runner(model, state.metrics) if slots == 1
                      else BatchRunner(model, state.metrics, slots, config.max_queue))
        except Exception as e:
            state.error = str(e) or type(e).__name__
            _log(f"error: could not load {config.model_id}: {state.error}")
            if model is not None:
                model.close()
            if on_load_error is not None:
                on_load_error(e)
            return
        if state.closed:
            runner.close()
            model.close()
            return
        # Worded before the runner is published: from then on the runner's thread owns the
        # backend, and a remote device() here would race its first request for the channel.
        ready = (f"{config.model_id} ready ({model.arch_name}, {model.backend.name}:"
                 f"{model.backend.device().name}, ctx {model.n_ctx}, {slots} slot{'s' * (slots > 1)})")
        state.runner, state.model = runner, model
        _log(f"{ready} in {time.perf_counter() - t0:.1f}s")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        threading.Thread(target=load_in_background, name="apir-load", daemon=True).start()
        try:
            yield
        finally:
            await run_in_threadpool(state.close)

    # ------------------------------------------------------------ helpers
    def authorize(request: Request) -> None:
        key = config.api_key
        if not key:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise RequestError("invalid or missing API key: send 'Authorization: Bearer <key>'",
                               status=401, code="invalid_api_key")

    def ready_model(name: str | None) -> Model:
        if name is not None and name not in state.aliases and not config.any_model_name:
            raise RequestError(f"the model {name[:100]!r} does not exist; this server serves "
                               f"{config.model_id!r}", "model", 404, "model_not_found")
        if state.model is None:
            why = f"failed to load: {state.error}" if state.error else "is still loading"
            raise RequestError(f"the model {why}", None, 503, "model_not_ready", "server_error")
        return state.model

    async def json_body(request: Request) -> object:
        """The body as JSON, read at most MAX_BODY bytes far: a longer Content-Length is
        refused before reading, a longer stream as soon as it passes the cap."""
        too_big = RequestError(f"the request body is over {MAX_BODY >> 20} MiB", status=413)
        length = request.headers.get("content-length")
        if length is not None and not (length.isascii() and length.isdigit()):
            raise RequestError("the Content-Length header is not a byte count")
        if length is not None and int(length) > MAX_BODY:
            raise too_big
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > MAX_BODY:
                    raise too_big
        except ClientDisconnect:  # nobody hears the answer; no traceback in the log either
            raise RequestError("the client left while sending its request") from None
        try:
            return json.loads(body)
        except RecursionError:  # nesting deeper than the parser's stack
            raise RequestError("the request body is not valid JSON: nested too deeply") from None
        except ValueError as e:  # bad syntax or UTF-8, an integer of more than 4300 digits
            raise RequestError(f"the request body is not valid JSON: {str(e)[:200]}") from None

    def model_card(name: str = config.model_id) -> dict:
        path = state.model.file.path if state.model is not None else None
        created = int(path.stat().st_mtime) if path is not None else 0
        return {"id": name, "object": "model", "created": created, "owned_by": "apir"}

    def pooling(model: Model) -> str:
        """How embeddings pool: --pooling, else the GGUF's own pooling_type."""
        found = config.pooling or GGUF_POOLING.get(model.file.get("{arch}.pooling_type"))
        if found is None:
            raise RequestError(f"{config.model_id} says no pooling type (it is not an embedding "
                               "model): start apir serve with --pooling mean, cls or last to "
                               "embed with it", "model", 400, "embeddings_unavailable")
        return found

    async def embed(request: Request, model: Model, inputs: Sequence[str | Sequence[int]],
                    param: str = "input", truncate: bool = False) -> tuple[list[np.ndarray], int]:
        """Pooled, normalised vectors of ``inputs`` and their token count, run in the queue
        (``truncate``: an input longer than the context is cut to it, as Ollama does)."""
        how = pooling(model)
        ids = [await run_in_threadpool(model.tokenize, x) if isinstance(x, str) else list(x)
               for x in inputs]
        if truncate:
            ids = [t[: model.n_ctx] for t in ids]
        for i, t in enumerate(ids):
            where = f"{param}[{i}]" if len(ids) > 1 else param
            if not 0 < len(t) <= model.n_ctx:
                raise RequestError(f"'{where}' has {len(t)} tokens; 1 to {model.n_ctx} fit", param)
            if not all(0 <= x < model.vocab_size for x in t):
                raise RequestError(f"'{where}' has token ids outside [0, {model.vocab_size})", param)

        def work(m: Model, job: Job) -> list[np.ndarray] | None:
            vectors = []
            for t in ids:  # a client gone (cancelled) stops it between inputs
                if job.cancelled:
                    return None
                vectors.append(m.embed(t, how))
            return vectors

        _, done = await outcome(request, submit(Job([], None, work=work)))
        if done.result is None:
            raise RequestError("the request was cancelled", None, 499)
        return done.result, sum(map(len, ids))

    # ------------------------------------------------------------ endpoints
    async def health(request: Request) -> Response:
        if state.model is not None:
            return JSONResponse({"status": "ok"})
        if state.error is not None:  # its reason (host paths) only for clients with the API key
            try:
                authorize(request)
                reason = state.error
            except RequestError:
                reason = "the model failed to load (the reason is in the server's log)"
            return JSONResponse({"status": "error", "message": reason}, 503)
        return JSONResponse({"status": "loading"}, 503)

    async def metrics(request: Request) -> Response:
        backend = state.model.backend if state.model is not None else None
        rtt = getattr(backend, "round_trip_seconds", None)
        gauges = prom.Gauges(
            loaded=state.model is not None,
            queued=state.runner.queued if state.runner is not None else 0,
            slots=state.runner.scheduler.slots if isinstance(state.runner, BatchRunner) else 1,
            slots_busy=state.runner.busy if isinstance(state.runner, BatchRunner) else 0,
            round_trip_seconds=float(rtt) if rtt is not None else None,
        )
        return Response(state.metrics.render(gauges), media_type=prom.CONTENT_TYPE)

    async def list_models(request: Request) -> Response:
        authorize(request)
        return JSONResponse({"object": "list", "data": [model_card(n) for n in
                                                        (config.model_id, *config.aliases)]})

    async def get_model(request: Request) -> Response:
        authorize(request)
        name = request.path_params["name"]
        if name not in state.aliases and not config.any_model_name:
            raise RequestError(f"the model {name[:100]!r} does not exist", "model", 404, "model_not_found")
        return JSONResponse(model_card(name))

    async def embeddings(request: Request) -> Response:
        authorize(request)
        req = parse_embeddings(await json_body(request))
        vectors, n = await embed(request, ready_model(req.model), req.inputs)
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if req.base64
                 else v.tolist()} for i, v in enumerate(vectors)]
        return JSONResponse({"object": "list", "data": data, "model": req.model or config.model_id,
                             "usage": {"prompt_tokens": n, "total_tokens": n}})

    async def tokenize(request: Request) -> Response:
        """llama-server's /tokenize: content, add_special (BOS), parse_special, with_pieces."""
        authorize(request)
        body = await json_body(request)
        if not isinstance(body, dict) or not isinstance(body.get("content"), str):
            raise RequestError("'content' must be a string", "content")
        check_fields(body, TOKENIZE_FIELDS)
        model = ready_model(None)
        add, parse, pieces = (read_flag(body, k) if k in body else d for k, d in
                              (("add_special", False), ("parse_special", True), ("with_pieces", False)))
        ids = await run_in_threadpool(model.tokenizer.encode, body["content"], add, parse)
        if pieces:
            if len(ids) > MAX_TOKENS:
                raise RequestError(f"'with_pieces' is limited to {MAX_TOKENS} tokens; this content "
                                   f"has {len(ids)}", "with_pieces")
            return JSONResponse({"tokens": await run_in_threadpool(
                lambda: [{"id": i, "piece": model.detokenize([i])} for i in ids])})
        return JSONResponse({"tokens": ids})

    async def detokenize(request: Request) -> Response:
        authorize(request)
        body = await json_body(request)
        model = ready_model(None)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if isinstance(tokens, list) and len(tokens) > MAX_TOKENS:
            raise RequestError(f"'tokens' holds {len(tokens)} ids; at most {MAX_TOKENS} are detokenized "
                               "at once", "tokens")
        if not (isinstance(tokens, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                 and 0 <= t < model.tokenizer.vocab_size for t in tokens)):
            raise RequestError(f"'tokens' must be a list of token ids in [0, "
                               f"{model.tokenizer.vocab_size})", "tokens")
        check_fields(body, frozenset({"tokens"}))
        return JSONResponse({"content": await run_in_threadpool(model.detokenize, tokens)})

    async def chat_completions(request: Request) -> Response:
        authorize(request)
        req = parse_chat(await json_body(request))
        model = ready_model(req.model)
        ids, grammar, tools = await prepare_chat(model, req)
        fmt = ChatFormat(f"chatcmpl-{secrets.token_hex(12)}", int(time.time()), config.model_id,
                         req.stream and req.include_usage, req.sampling.logprobs is not None)
        return await generate(request, model, ids, req, fmt, grammar, tools)

    async def prepare_chat(model: Model, req: ChatRequest) -> tuple[list[int], Grammar | None, bool]:
        """The prompt ids of a chat, the constraint on its answer, and whether that answer
        is parsed for tool calls (``tool_choice`` "none" leaves the tools out)."""
        conversation = [dict(m) for m in req.messages]
        tools = req.tools if req.tools is not None and req.tools.choice != "none" else None
        if tools is not None:
            conversation = tool_calls.messages(conversation, tools)
        try:
            ids = await run_in_threadpool(model.chat_ids, conversation)
        except ChatTemplateError as e:
            raise RequestError(str(e), "messages") from None
        grammar = tool_calls.grammar(tools) if tools is not None else req.sampling.grammar
        return ids, grammar, tools is not None

    async def completions(request: Request) -> Response:
        authorize(request)
        req = parse_completion(await json_body(request))
        model = ready_model(req.model)
        if isinstance(req.prompt, str):
            ids = await run_in_threadpool(model.tokenize, req.prompt)
        else:
            bad = [t for t in req.prompt if not 0 <= t < model.vocab_size]
            if bad:
                raise RequestError(f"'prompt' has token ids outside [0, {model.vocab_size}): "
                                   f"{bad[:5]}", "prompt")
            ids = list(req.prompt)
        fmt = CompletionFormat(f"cmpl-{secrets.token_hex(12)}", int(time.time()), config.model_id,
                               req.stream and req.include_usage, req.sampling.logprobs is not None)
        return await generate(request, model, ids, req, fmt, req.sampling.grammar)

    async def start(model: Model, ids: list[int], sampling: Sampling,
                    grammar: Grammar | None = None) -> Job:
        """Queue the generation of ``ids`` (its constraint compiled first: a 400 if bad)."""
        params = sampling.params(len(ids), model.n_ctx)
        bad = [t for t, _ in params.logit_bias if t >= model.vocab_size]
        if bad:
            raise RequestError(f"'logit_bias' names tokens outside [0, {model.vocab_size}): {bad[:5]}",
                               "logit_bias")
        constraint = None
        if grammar is not None:
            try:
                constraint = await run_in_threadpool(model.constraint, grammar.kind, grammar.text)
            except GrammarError as e:
                raise RequestError(str(e), grammar.param) from None
        return submit(Job(ids, params, constraint))

    def submit(job: Job) -> Job:
        if state.closed or state.runner is None:
            raise RequestError("the server is shutting down", None, 503, None, "server_error")
        try:
            state.runner.submit(job)
        except QueueFull as e:
            raise RequestError(str(e), None, 429, None, "server_error") from None
        return job

    async def outcome(request: Request, job: Job) -> tuple[list[Piece], Done]:
        """The job's pieces and its Done, once it ends; a client that leaves cancels it."""
        events: list[Piece | Done | Failed] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_on_disconnect, request, job)
            try:
                async for event in job.events():
                    events.append(event)
            finally:
                job.cancel()  # a no-op once done; stops the generation if we are cancelled
                tg.cancel_scope.cancel()
        *pieces, last = events
        if isinstance(last, Failed):
            raise failure(last)
        assert isinstance(last, Done)
        return pieces, last

    async def generate(request: Request, model: Model, ids: list[int],
                       req: ChatRequest | CompletionRequest, fmt: ChatFormat,
                       grammar: Grammar | None = None, tools: bool = False) -> Response:
        """Run the request; with ``tools`` the answer is parsed whole (content or calls)."""
        job = await start(model, ids, req.sampling, grammar)
        if req.stream:
            return StreamingResponse(sse(job, fmt, tools), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        pieces, last = await outcome(request, job)
        text = "".join(p.text for p in pieces)
        entries = [e for p in pieces for e in p.logprobs]
        content, calls, finish = text, [], last.finish_reason
        if tools:
            content, calls = tool_calls.parse(text)
            finish = "tool_calls" if calls else finish
        return JSONResponse(fmt.reply(content, finish, last.prompt_tokens, last.completion_tokens,
                                      entries, calls, last.cached_tokens))

    async def sse(job: Job, fmt: ChatFormat, tools: bool = False) -> AsyncIterator[bytes]:
        # Starlette cancels this generator when the client disconnects; `finally` then
        # tells the worker to stop before its next token.
        held = []  # with tools: the answer, parsed once whole
        try:
            if (first := fmt.first_chunk()) is not None:
                yield _data(first)
            async for event in job.events():
                if isinstance(event, Piece) and tools:
                    held.append(event.text)
                elif isinstance(event, Piece):
                    yield _data(fmt.chunk(event.text, entries=event.logprobs))
                elif isinstance(event, Done):
                    finish = event.finish_reason
                    if tools:
                        content, calls = tool_calls.parse("".join(held))
                        finish = "tool_calls" if calls else finish
                        yield _data(fmt.chunk(content, tool_calls=calls))
                    yield _data(fmt.chunk(finish=finish))
                    if fmt.include_usage:
                        yield _data(fmt.usage_chunk(event.prompt_tokens, event.completion_tokens,
                                                        event.cached_tokens))
                else:
                    yield _data(failure(event).body())
            yield b"data: [DONE]\n\n"
        finally:
            job.cancel()

    app = Starlette(
        routes=[
            Route("/health", health),
            Route("/metrics", metrics),
            Route("/v1/models", list_models),
            Route("/v1/models/{name:path}", get_model),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/embeddings", embeddings, methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            *ollama.routes(ollama.Api(config.model_id, authorize, ready_model, json_body, start,
                                      outcome, embed, pooling, prepare_chat, failure)),
        ],
        middleware=[Middleware(_CountRequests, metrics=state.metrics)],
        exception_handlers={
            RequestError: _request_error,
            ContextOverflowError: _context_overflow,
            HTTPException: _http_error,
            Exception: _server_error,
        },
        lifespan=lifespan,
    )
    app.state.apir = state
    return app


async def cancel_on_disconnect(request: Request, job: Job) -> None:
    """Wait for the client to hang up (the body is already read), then cancel ``job``."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


def failure(event: Failed) -> RequestError:
    e = event.error
    if isinstance(e, (ValueError, TokenizerError)):  # bad sampling values, token ids
        return RequestError(str(e))
    return RequestError(f"generation failed: {e}", None, 500, None, "server_error")


def _data(body: dict) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"


# ---------------------------------------------------------------- errors as OpenAI bodies
async def _request_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestError)
    headers = {"Retry-After": "1"} if exc.status == 429 else None  # a slot frees within seconds
    return JSONResponse(exc.body(), exc.status, headers=headers)


async def _context_overflow(request: Request, exc: Exception) -> Response:
    return JSONResponse(error_body(str(exc), "invalid_request_error", None, "context_length_exceeded"), 400)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}", kind),
                        exc.status_code, headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    # The text of an unexpected exception (paths, internals) stays in the server's log.
    traceback.print_exception(exc, file=sys.stderr)
    return JSONResponse(error_body(f"internal error ({type(exc).__name__}); the server's log has "
                                   "the details", "server_error"), 500)


class _CountRequests:
    """Counts requests by endpoint and status; /v1 requests are also "in flight" until
    their last byte is sent (a stream's whole length)."""

    def __init__(self, app: ASGIApp, metrics: prom.Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "/v1/models" if path.startswith("/v1/models/") else "other"
        status = 500

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        tracked = path.startswith("/v1/")
        if tracked:
            self.metrics.request_started()
        try:
            await self.app(scope, receive, send_and_note)
        finally:
            if tracked:
                self.metrics.request_finished(endpoint, status)
            else:
                self.metrics.request_counted(endpoint, status)
