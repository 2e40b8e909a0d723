"""The OpenAI request bodies apir accepts, validated into frozen dataclasses, and the
reply and stream-chunk bodies it sends back. No I/O here.

Validation is strict about types and ranges (a 400 naming the field) and lenient about
fields apir has no use for (``user``, ``metadata``, penalties...): they are ignored, as
llama.cpp's server does. Fields that would change the answer in a way apir cannot honour
(``n`` > 1, ``logprobs``, ``tools``, ``echo``, ``suffix``) are refused rather than ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..engine import ContextOverflowError, SamplingParams

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_STOP = 16  # OpenAI allows 4; llama.cpp more. A cap keeps the per-token search cheap.
_DEFAULTS = SamplingParams()  # fields a request leaves out sample like `apir run`


class RequestError(Exception):
    """A request the server refuses: becomes an OpenAI-style error body with ``status``."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400,
        code: str | None = None, type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = message, param, status, code, type

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---------------------------------------------------------------- field readers
def _number(body: dict, name: str, lo: float, hi: float, integer: bool = False) -> Any:
    """``body[name]`` as a number in [lo, hi], or None when absent/null."""
    value = body.get(name)
    if value is None:
        return None
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise RequestError(f"'{name}' must be {kind}, got {type(value).__name__}", name)
    # an int is finite (and math.isfinite overflows on one of 400 digits)
    if not ((isinstance(value, int) or math.isfinite(value)) and lo <= value <= hi):
        raise RequestError(f"'{name}' must be between {lo:g} and {hi:g}, got {value}", name)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"'{name}' must be a boolean", name)
    return value


def _refuse(body: dict, name: str, unless: Any, why: str) -> None:
    value = body.get(name)
    if value is not None and value != unless and value != []:
        raise RequestError(f"'{name}' is not supported by this server ({why})", name)


@dataclass(frozen=True)
class Sampling:
    """What a request asks of the sampler; ``max_tokens`` None means "up to the context"."""

    temperature: float = _DEFAULTS.temperature
    top_p: float = _DEFAULTS.top_p
    top_k: int = _DEFAULTS.top_k
    min_p: float = _DEFAULTS.min_p
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    param: str = "max_tokens"  # the field max_tokens came from, for error messages

    def params(self, prompt_tokens: int, n_ctx: int) -> SamplingParams:
        """SamplingParams for a prompt of ``prompt_tokens`` in a context of ``n_ctx``.

        Raises ContextOverflowError when the prompt plus what is asked does not fit.
        """
        if prompt_tokens == 0:
            raise RequestError("the prompt is empty: nothing to complete", "prompt")
        room = n_ctx - prompt_tokens
        wanted = self.max_tokens if self.max_tokens is not None else room
        if room <= 0 or wanted > room:
            raise ContextOverflowError(
                f"this model's context holds {n_ctx} tokens, but {prompt_tokens + max(wanted, 1)} "
                f"were requested ({prompt_tokens} in the prompt, {max(wanted, 1)} to generate); "
                f"shorten the prompt or lower '{self.param}'"
            )
        temperature = self.temperature if self.top_p > 0 else 0.0  # top_p 0 = the top token only
        return SamplingParams(
            temperature=temperature, top_k=self.top_k, top_p=self.top_p or 1.0,
            min_p=self.min_p, max_tokens=wanted, stop=self.stop,
            seed=None if self.seed is None else self.seed % (1 << 64),  # numpy wants >= 0
        )


def _sampling(body: dict) -> Sampling:
    _refuse(body, "n", 1, "one choice per request")
    _refuse(body, "best_of", 1, "one choice per request")
    _refuse(body, "logprobs", False, "no log probabilities")
    _refuse(body, "top_logprobs", 0, "no log probabilities")
    max_tokens, param = body.get("max_completion_tokens"), "max_completion_tokens"
    if max_tokens is None:
        param = "max_tokens"
    max_tokens = _number(body, param, 1, 1 << 31, integer=True)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise RequestError("'stop' must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP:
        raise RequestError(f"'stop' has {len(stop)} strings; at most {MAX_STOP} are allowed", "stop")
    d = Sampling()

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    return Sampling(
        temperature=float(pick(_number(body, "temperature", 0, 2), d.temperature)),
        top_p=float(pick(_number(body, "top_p", 0, 1), d.top_p)),
        top_k=int(pick(_number(body, "top_k", 0, 1 << 31, integer=True), d.top_k)),
        min_p=float(pick(_number(body, "min_p", 0, 1), d.min_p)),
        seed=_number(body, "seed", -(1 << 63), (1 << 64) - 1, integer=True),
        max_tokens=max_tokens,
        stop=tuple(s for s in stop if s),  # an empty stop string would stop before anything
        param=param,
    )


def _common(body: Any) -> tuple[str | None, bool, bool]:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", "model")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError("'stream_options' must be an object", "stream_options")
    include_usage = bool(options and _flag(options, "include_usage"))
    return model, stream, include_usage


# ---------------------------------------------------------------- requests
@dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: tuple[dict[str, str], ...]  # {"role", "content"}; content always a string
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False


@dataclass(frozen=True)
class CompletionRequest:
    model: str | None
    prompt: str | tuple[int, ...]  # text, or token ids as given
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False


def _content(message: dict, i: int) -> str:
    """A message's content as one string (text parts joined; images refused)."""
    content, where = message.get("content"), f"messages[{i}].content"
    if content is None:
        if message.get("role") == "assistant":
            return ""  # an assistant turn that only called tools
        raise RequestError(f"'{where}' is missing", where)
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"'{where}' must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise RequestError(
                f"'{where}[{j}]' must be a text part {{\"type\": \"text\", \"text\": ...}} "
                "(this server handles text only)", where,
            )
        texts.append(part["text"])
    return "\n".join(texts)


def parse_chat(body: Any) -> ChatRequest:
    """Validate a /v1/chat/completions body; raises RequestError naming the bad field."""
    model, stream, include_usage = _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"'messages[{i}]' must be an object", f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:  # a list is unhashable; said back short
            got = repr(role)[:100] if isinstance(role, str) else type(role).__name__
            raise RequestError(f"'messages[{i}].role' must be one of {', '.join(sorted(ROLES))}, "
                               f"got {got}", f"messages[{i}].role")
        # templates know "system"; OpenAI's newer "developer" role means the same
        out.append({"role": "system" if role == "developer" else role, "content": _content(m, i)})
    _refuse(body, "tools", None, "no tool calling")
    _refuse(body, "functions", None, "no tool calling")
    return ChatRequest(model, tuple(out), _sampling(body), stream, include_usage)


def parse_completion(body: Any) -> CompletionRequest:
    """Validate a /v1/completions body; raises RequestError naming the bad field."""
    model, stream, include_usage = _common(body)
    prompt = body.get("prompt")
    # OpenAI accepts a batch of prompts; one is served per request here.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise RequestError(
                "'prompt' must be a string, a list of token ids, or a list holding one of those",
                "prompt",
            )
        prompt = tuple(prompt)
    elif not isinstance(prompt, str):
        raise RequestError("'prompt' must be a string or a list of token ids", "prompt")
    _refuse(body, "echo", False, "the prompt is not echoed")
    _refuse(body, "suffix", "", "no fill-in-the-middle")
    return CompletionRequest(model, prompt, _sampling(body), stream, include_usage)


# ---------------------------------------------------------------- replies
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass(frozen=True)
class ChatFormat:
    """Bodies of one chat completion: the whole reply, or its stream of chunks."""

    id: str
    created: int
    model: str
    include_usage: bool = False

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def reply(self, text: str, finish: str, prompt_tokens: int, completion_tokens: int) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": finish}
        return {**self._head("chat.completion"), "choices": [choice],
                "usage": usage(prompt_tokens, completion_tokens)}

    def chunk(self, text: str | None = None, finish: str | None = None, first: bool = False) -> dict:
        delta: dict = {}
        if first:
            delta = {"role": "assistant", "content": ""}
        elif text is not None:
            delta = {"content": text}
        body = {**self._head("chat.completion.chunk"),
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if self.include_usage:
            body["usage"] = None
        return body

    def first_chunk(self) -> dict | None:
        return self.chunk(first=True)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {**self._head("chat.completion.chunk"), "choices": [],
                "usage": usage(prompt_tokens, completion_tokens)}


@dataclass(frozen=True)
class CompletionFormat(ChatFormat):
    """Bodies of one text completion (``object: text_completion``, also when streamed)."""

    def reply(self, text: str, finish: str, prompt_tokens: int, completion_tokens: int) -> dict:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice],
                "usage": usage(prompt_tokens, completion_tokens)}

    def chunk(self, text: str | None = None, finish: str | None = None, first: bool = False) -> dict:
        body = {**self._head("text_completion"),
                "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]}
        if self.include_usage:
            body["usage"] = None
        return body

    def first_chunk(self) -> dict | None:
        return None  # completions streams start with text

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {**self._head("text_completion"), "choices": [],
                "usage": usage(prompt_tokens, completion_tokens)}
