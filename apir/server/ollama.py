"""Ollama's API on the same model and queue as the OpenAI one.

  GET  /api/version  /api/tags  /api/ps     what is served
  POST /api/show                            one model's details and chat template
  POST /api/chat     /api/generate          chat and raw completion; streamed as NDJSON
                                            (Ollama's default) or whole with "stream": false
  POST /api/embed                           pooled, normalised embeddings

Each request is translated into the OpenAI body it means and validated by the same
parsers, so every field is implemented or refused (a 400 naming it) exactly as there;
errors come back in Ollama's shape, ``{"error": "..."}``. A model name may carry Ollama's
``:latest`` tag.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..engine import ContextOverflowError, Model
from . import tools as tool_calls
from .runner import Done, Failed, Job, Piece
from .schemas import (
    MAX_INPUTS,
    ChatRequest,
    Grammar,
    RequestError,
    Sampling,
    check_fields,
    parse_chat,
    read_flag,
)

VERSION = "0.12.0"  # the Ollama API these endpoints follow
CHAT_FIELDS = frozenset({"model", "messages", "tools", "format", "options", "stream", "keep_alive", "think"})
GENERATE_FIELDS = frozenset({"model", "prompt", "system", "raw", "format", "options", "stream",
                             "keep_alive", "think", "suffix", "images"})
EMBED_FIELDS = frozenset({"model", "input", "truncate", "options", "keep_alive"})
# Ollama option -> the OpenAI field it sets
OPTIONS = {"num_predict": "max_tokens", "temperature": "temperature", "top_k": "top_k",
           "top_p": "top_p", "min_p": "min_p", "seed": "seed", "stop": "stop",
           "repeat_penalty": "repeat_penalty", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty", "repeat_last_n": "repeat_last_n"}


@dataclass(frozen=True)
class Api:
    """What the Ollama handlers use of the app (see ``app.create_app``)."""

    model_id: str
    authorize: Callable[[Request], None]
    ready_model: Callable[[str | None], Model]
    json_body: Callable[[Request], Awaitable[object]]
    start: Callable[[Model, list[int], Sampling, Grammar | None], Awaitable[Job]]
    outcome: Callable[[Request, Job], Awaitable[tuple[list[Piece], Done]]]
    embed: Callable[..., Awaitable[tuple[list, int]]]
    pooling: Callable[[Model], str]
    prepare_chat: Callable[[Model, ChatRequest], Awaitable[tuple[list[int], Grammar | None, bool]]]
    failure: Callable[[Failed], RequestError]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _name(body: dict) -> str | None:
    name = body.get("model")
    if name is None:
        return None
    if not isinstance(name, str):
        raise RequestError("'model' must be a string", "model")
    return name.removesuffix(":latest")


def _keep_alive(body: dict) -> None:
    """Ollama's keep_alive: how long the model stays loaded after the request. apir serve
    keeps its one model loaded while it runs, which any duration gets (a negative one:
    forever); only 0, "unload it now", asks for what this server does not do."""
    value = body.get("keep_alive")
    if value == 0 or (isinstance(value, str) and value.rstrip("smh") == "0"):  # 0, "0", "0s", "0m"
        raise RequestError("'keep_alive' 0 (unload the model) is not supported: apir serve keeps "
                           "its model loaded while it runs", "keep_alive")


def _openai(body: dict, fields: frozenset[str]) -> dict:
    """The OpenAI fields an Ollama body means: options, format, stream."""
    check_fields(body, fields)
    _keep_alive(body)
    if body.get("think"):
        raise RequestError("'think' is not supported by this server", "think")
    for name in ("images", "suffix"):
        if body.get(name):
            raise RequestError(f"'{name}' is not supported by this server", name)
    out: dict = {}
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise RequestError("'options' must be an object", "options")
    for key, value in options.items():
        if key not in OPTIONS:
            raise RequestError(f"'options.{str(key)[:100]}' is not supported by this server", "options")
        if not (key == "num_predict" and isinstance(value, int) and value < 0):  # -1, -2: no limit
            out[OPTIONS[key]] = value
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise RequestError("'format' must be \"json\" or a JSON schema", "format")
    return out


def _message(m: object, i: int) -> object:
    """An Ollama message as OpenAI writes it (tool calls typed, tool_name as name)."""
    if not isinstance(m, dict):
        return m
    if m.get("images"):
        raise RequestError(f"'messages[{i}].images': this server handles text only", "messages")
    out = {k: v for k, v in m.items() if k in ("role", "content")}
    if m.get("tool_calls"):
        out["tool_calls"] = [{"type": "function", **c} for c in m["tool_calls"] if isinstance(c, dict)]
    if isinstance(m.get("tool_name"), str):
        out["name"] = m["tool_name"]
    return out


def routes(api: Api) -> list[Route]:
    def details(model: Model | None) -> dict:
        arch = model.arch_name if model is not None else ""
        return {"format": "gguf", "family": arch, "families": [arch] if arch else [],
                "parameter_size": "", "quantization_level": ""}

    def card(model: Model | None) -> dict:
        size = model.file.path.stat().st_size if model is not None else 0
        modified = (datetime.fromtimestamp(model.file.path.stat().st_mtime, timezone.utc).isoformat()
                    if model is not None else _now())
        return {"name": f"{api.model_id}:latest", "model": f"{api.model_id}:latest",
                "modified_at": modified, "size": size, "digest": "", "details": details(model)}

    def loaded() -> Model | None:
        try:
            return api.ready_model(None)
        except RequestError:
            return None

    def ollama_errors(handler: Callable[[Request], Awaitable[Response]]) -> Callable:
        async def wrapped(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestError as e:
                return JSONResponse({"error": e.message}, e.status)
            except ContextOverflowError as e:
                return JSONResponse({"error": str(e)}, 400)
        return wrapped

    async def body_of(request: Request) -> dict:
        api.authorize(request)
        body = await api.json_body(request)
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        return body

    async def version(request: Request) -> Response:
        return JSONResponse({"version": VERSION})

    async def tags(request: Request) -> Response:
        api.authorize(request)
        return JSONResponse({"models": [card(loaded())]})

    async def ps(request: Request) -> Response:
        api.authorize(request)
        model = loaded()
        running = [{**card(model), "expires_at": "2318-01-01T00:00:00Z", "size_vram": 0,
                    "context_length": model.n_ctx}] if model is not None else []
        return JSONResponse({"models": running})

    async def show(request: Request) -> Response:
        body = await body_of(request)
        check_fields(body, frozenset({"model", "name", "verbose"}))
        if body.get("verbose"):
            raise RequestError("'verbose' is not supported by /api/show here: the reply has no "
                               "tensor list", "verbose")
        model = api.ready_model(_name({"model": body.get("model", body.get("name"))}))
        capabilities = ["completion", "tools"]
        try:
            api.pooling(model)
            capabilities.append("embedding")
        except RequestError:
            pass
        info = {"general.architecture": model.arch_name,
                f"{model.arch_name}.context_length": model.n_ctx,
                f"{model.arch_name}.vocab_size": model.vocab_size}
        return JSONResponse({"modelfile": "", "parameters": "",
                             "template": model.file.get("tokenizer.chat_template") or "",
                             "details": details(model), "model_info": info,
                             "capabilities": capabilities, "modified_at": card(model)["modified_at"]})

    async def run(request: Request, model: Model, ids: list[int], sampling: Sampling,
                  grammar: Grammar | None, stream: bool, key: str, tools: bool) -> Response:
        """Generate; each line or the whole reply carries the text under ``key``."""
        t0 = time.perf_counter_ns()
        job = await api.start(model, ids, sampling, grammar)
        name = f"{api.model_id}:latest"

        def final(done: Done, text: str) -> dict:
            body = {"model": name, "created_at": _now(), "done": True,
                    "done_reason": "length" if done.finish_reason == "length" else "stop",
                    "total_duration": time.perf_counter_ns() - t0, "load_duration": 0,
                    "prompt_eval_count": done.prompt_tokens, "eval_count": done.completion_tokens}
            content, calls = tool_calls.parse(text) if tools else (text, [])
            calls = [{"function": {"name": c["function"]["name"],
                                   "arguments": json.loads(c["function"]["arguments"])}} for c in calls]
            if key == "response":
                return {**body, "response": content}
            return {**body, "message": {"role": "assistant", "content": content or "",
                                        **({"tool_calls": calls} if calls else {})}}

        def piece(text: str) -> dict:
            value = text if key == "response" else {"role": "assistant", "content": text}
            return {"model": name, "created_at": _now(), key: value, "done": False}

        if not stream:
            pieces, done = await api.outcome(request, job)
            return JSONResponse(final(done, "".join(p.text for p in pieces)))

        async def lines() -> AsyncIterator[bytes]:
            held = []
            try:
                async for event in job.events():
                    if isinstance(event, Piece):
                        held.append(event.text)
                        if not tools:
                            yield (json.dumps(piece(event.text)) + "\n").encode()
                    elif isinstance(event, Done):
                        last = final(event, "".join(held) if tools else "")
                        yield (json.dumps(last) + "\n").encode()
                    else:
                        yield (json.dumps({"error": api.failure(event).message}) + "\n").encode()
            finally:
                job.cancel()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def chat(request: Request) -> Response:
        body = await body_of(request)
        openai = _openai(body, CHAT_FIELDS)
        messages = body.get("messages")
        messages = [_message(m, i) for i, m in enumerate(messages)] if isinstance(messages, list) else messages
        req = parse_chat({**openai, "messages": messages, "tools": body.get("tools")})
        model = api.ready_model(_name(body))
        ids, grammar, tools = await api.prepare_chat(model, req)
        return await run(request, model, ids, req.sampling, grammar,
                         read_flag(body, "stream") if "stream" in body else True, "message", tools)

    async def generate(request: Request) -> Response:
        body = await body_of(request)
        openai = _openai(body, GENERATE_FIELDS)
        prompt, system = body.get("prompt"), body.get("system")
        if not isinstance(prompt, str) or not isinstance(system, (str, type(None))):
            raise RequestError("'prompt' (and 'system') must be strings", "prompt")
        model = api.ready_model(_name(body))
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        req = parse_chat({**openai, "messages": messages})
        if read_flag(body, "raw"):
            if system:
                raise RequestError("'system' has no place in a raw prompt: write it into 'prompt'", "system")
            ids, grammar = await run_in_threadpool(model.tokenize, prompt), req.sampling.grammar
        else:
            ids, grammar, _ = await api.prepare_chat(model, req)
        return await run(request, model, ids, req.sampling, grammar,
                         read_flag(body, "stream") if "stream" in body else True, "response", False)

    async def embed(request: Request) -> Response:
        body = await body_of(request)
        check_fields(body, EMBED_FIELDS)
        _keep_alive(body)
        if body.get("options"):
            raise RequestError("'options' is not supported by /api/embed here", "options")
        inputs: Sequence = [body.get("input")] if isinstance(body.get("input"), str) else body.get("input")
        if not (isinstance(inputs, list) and 0 < len(inputs) <= MAX_INPUTS
                and all(isinstance(x, str) for x in inputs)):
            raise RequestError(f"'input' must be a string or a list of up to {MAX_INPUTS} strings", "input")
        # Ollama's default: an input longer than the context is cut to it, not refused
        truncate = read_flag(body, "truncate") if "truncate" in body else True
        t0 = time.perf_counter_ns()
        vectors, n = await api.embed(request, api.ready_model(_name(body)), inputs, truncate=truncate)
        return JSONResponse({"model": f"{api.model_id}:latest", "embeddings": [v.tolist() for v in vectors],
                             "total_duration": time.perf_counter_ns() - t0, "load_duration": 0,
                             "prompt_eval_count": n})

    return [
        Route("/api/version", ollama_errors(version)),
        Route("/api/tags", ollama_errors(tags)),
        Route("/api/ps", ollama_errors(ps)),
        Route("/api/show", ollama_errors(show), methods=["POST"]),
        Route("/api/chat", ollama_errors(chat), methods=["POST"]),
        Route("/api/generate", ollama_errors(generate), methods=["POST"]),
        Route("/api/embed", ollama_errors(embed), methods=["POST"]),
    ]
