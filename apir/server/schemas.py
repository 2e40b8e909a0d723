"""The OpenAI request bodies apir accepts, validated into frozen dataclasses (the replies
are in ``replies``). No I/O here.

Validation is strict about types and ranges (a 400 naming the field), and no field is
ever ignored silently: each endpoint lists the fields it implements (``CHAT_FIELDS``,
``COMPLETION_FIELDS``; a few, like ``user``, are informational by definition and change
nothing), and any other field, or a value apir cannot honour (``n`` > 1, ``echo``), is a
400 naming it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from ..engine import ContextOverflowError, SamplingParams
from ..engine.model import MAX_LOGPROBS

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_STOP = 16  # OpenAI allows 4; llama.cpp more. A cap keeps the per-token search cheap.
MAX_LOGIT_BIAS = 1024  # entries; OpenAI allows 300
# Fields every generation endpoint implements (OpenAI's, then llama.cpp's and vLLM's names).
_SAMPLING_FIELDS = frozenset({
    "model", "stream", "stream_options", "temperature", "top_p", "seed", "max_tokens", "stop",
    "n", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "response_format",
    "user",  # informational: names the end user, changes nothing
    "top_k", "min_p", "repeat_penalty", "repetition_penalty", "repeat_last_n",
    "grammar", "json_schema", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
})
CHAT_FIELDS = _SAMPLING_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls", "modalities", "store",
    "metadata", "safety_identifier", "prompt_cache_key",  # informational
}
COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "echo", "suffix", "best_of"}
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


def read_flag(body: dict, name: str) -> bool:
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


def check_fields(body: dict, known: frozenset[str]) -> None:
    """The rule: a field apir does not implement is refused, never ignored."""
    for name in body:
        if name not in known:
            raise RequestError(f"'{str(name)[:100]}' is not supported by this server", str(name)[:100])


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise RequestError(f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} "
                           "token ids to numbers", "logit_bias")
    out = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key) < 10):
            raise RequestError(f"'logit_bias' keys must be token ids, got {key[:20]!r}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise RequestError(f"'logit_bias[{key}]' must be a number in [-100, 100]", "logit_bias")
        out.append((int(key), float(bias)))
    return tuple(out)


@dataclass(frozen=True)
class Grammar:
    """A constraint on the output: ``kind`` is what llguidance's ``grammar_from`` takes
    ("json_schema", "lark", "gbnf", "regex", "choice"), ``text`` the grammar itself."""

    kind: str
    text: str
    param: str  # the request field it came from, for error messages


ANY_JSON_OBJECT = '{"type": "object"}'


def _grammar(body: dict) -> Grammar | None:
    """The one constraint a request asks for, from OpenAI's ``response_format`` or the
    llama.cpp (``grammar``, ``json_schema``) and vLLM (``guided_*``) fields."""
    found = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            schema = fmt.get("schema")  # llama.cpp's extension
            found.append(Grammar("json_schema", json.dumps(schema) if schema else ANY_JSON_OBJECT,
                                 "response_format"))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise RequestError("'response_format.json_schema' must be an object with a "
                                   "'schema' object", "response_format")
            found.append(Grammar("json_schema", json.dumps(spec.get("schema") or {}), "response_format"))
        elif kind != "text":
            raise RequestError("'response_format.type' must be text, json_object or json_schema",
                               "response_format")
    for name, kind in (("json_schema", "json_schema"), ("guided_json", "json_schema"),
                       ("grammar", "gbnf"), ("guided_grammar", "gbnf"),
                       ("guided_regex", "regex"), ("guided_choice", "choice")):
        value = body.get(name)
        if value is None:
            continue
        if kind == "json_schema" and isinstance(value, dict):
            value = json.dumps(value)
        elif kind == "choice":
            if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
                raise RequestError(f"'{name}' must be a non-empty list of strings", name)
            value = json.dumps(value)
        if not isinstance(value, str):
            raise RequestError(f"'{name}' must be a string", name)
        found.append(Grammar(kind, value, name))
    if len(found) > 1:
        raise RequestError(f"'{found[0].param}' and '{found[1].param}' both constrain the "
                           "output; send one", found[1].param)
    return found[0] if found else None


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
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = _DEFAULTS.penalty_last_n
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    grammar: Grammar | None = None

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
            repeat_penalty=self.repeat_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, penalty_last_n=self.penalty_last_n,
            logit_bias=self.logit_bias, logprobs=self.logprobs,
        )


def _last_n(value: int | None) -> int:
    """llama.cpp's repeat_last_n: the default when absent, -1 for the whole context."""
    return _DEFAULTS.penalty_last_n if value is None else (1 << 31) if value == -1 else value


def _sampling(body: dict, logprobs: int | None) -> Sampling:
    for name in ("n", "best_of"):
        _number(body, name, 1, 1 << 31, integer=True)
        _refuse(body, name, 1, "one choice per request: send n requests, which run at once up to --parallel")
    repeat = None
    for name in ("repeat_penalty", "repetition_penalty"):
        repeat = _number(body, name, 1e-3, 100) if repeat is None else repeat
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
        repeat_penalty=float(pick(repeat, 1.0)),
        presence_penalty=float(pick(_number(body, "presence_penalty", -2, 2), 0.0)),
        frequency_penalty=float(pick(_number(body, "frequency_penalty", -2, 2), 0.0)),
        penalty_last_n=_last_n(_number(body, "repeat_last_n", -1, 1 << 31, integer=True)),
        logit_bias=_logit_bias(body),
        logprobs=logprobs,
        grammar=_grammar(body),
    )


def _common(body: Any, known: frozenset[str]) -> tuple[str | None, bool, bool]:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    check_fields(body, known)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", "model")
    stream = read_flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError("'stream_options' must be an object", "stream_options")
    for name in options or ():
        if name != "include_usage":
            raise RequestError(f"'stream_options.{str(name)[:100]}' is not supported by this server",
                               "stream_options")
    include_usage = bool(options and read_flag(options, "include_usage"))
    return model, stream, include_usage


# ---------------------------------------------------------------- requests
@dataclass(frozen=True)
class Tools:
    """What a chat request offers to call: OpenAI ``tools`` entries (``{"type": "function",
    "function": {"name", "description", "parameters"}}``) and ``tool_choice``: "auto",
    "none", "required", or the name of the one function to call."""

    functions: tuple[dict, ...]
    choice: str = "auto"
    parallel: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f["function"]["name"] for f in self.functions)


@dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: tuple[dict, ...]  # {"role", "content"} (content a string), tool_calls, tool_call_id
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    tools: Tools | None = None


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


def _tools(body: dict) -> Tools | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise RequestError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list of tools", "tools")
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not (isinstance(f, dict) and isinstance(f.get("name"), str) and f["name"]
                and isinstance(f.get("parameters", {}), dict)):
            raise RequestError(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": "
                               "{\"name\": ..., \"parameters\": {...}}}", "tools")
    names = [t["function"]["name"] for t in tools]
    if isinstance(choice, dict):
        f = choice.get("function")
        choice = f.get("name") if choice.get("type") == "function" and isinstance(f, dict) else None
        if choice not in names:
            raise RequestError("'tool_choice' must name one of the tools", "tool_choice")
    elif choice is None:
        choice = "auto"
    elif choice not in ("auto", "none", "required"):
        raise RequestError("'tool_choice' must be auto, none, required or a function", "tool_choice")
    return Tools(tuple(tools), choice, read_flag(body, "parallel_tool_calls") if "parallel_tool_calls"
                 in body and body["parallel_tool_calls"] is not None else True)


def _message(m: dict, i: int) -> dict:
    """One message as the chat template takes it: a string content, the role OpenAI's
    "developer" stands for, an assistant's tool calls with their arguments as objects."""
    role = m["role"]
    out = {"role": "system" if role == "developer" else role, "content": _content(m, i)}
    calls = m.get("tool_calls") if role == "assistant" else None
    if calls:
        out["tool_calls"] = [_tool_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
    if role == "tool":
        for name in ("tool_call_id", "name"):
            if isinstance(m.get(name), str):
                out[name] = m[name]
    return out


def _tool_call(call: Any, where: str) -> dict:
    f = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(f, dict) and isinstance(f.get("name"), str)):
        raise RequestError(f"'{where}' must be {{\"type\": \"function\", \"function\": {{\"name\", "
                           "\"arguments\"}}}}", where)
    args = f.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        raise RequestError(f"'{where}.function.arguments' is not JSON", where) from None
    return {"id": call.get("id"), "type": "function",
            "function": {"name": f["name"], "arguments": args}}


def parse_chat(body: Any) -> ChatRequest:
    """Validate a /v1/chat/completions body; raises RequestError naming the bad field."""
    model, stream, include_usage = _common(body, CHAT_FIELDS)
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
        out.append(_message(m, i))
    _refuse(body, "store", False, "nothing is stored")
    if body.get("modalities") not in (None, ["text"]):
        raise RequestError("'modalities' must be [\"text\"]: this server answers in text", "modalities")
    logprobs = read_flag(body, "logprobs")
    top = _number(body, "top_logprobs", 0, MAX_LOGPROBS, integer=True)
    if top is not None and not logprobs:
        raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    sampling = _sampling(body, (top or 0) if logprobs else None)
    tools = _tools(body)
    if tools is not None and tools.choice != "none" and sampling.grammar is not None:
        raise RequestError(f"'{sampling.grammar.param}' and 'tools' both constrain the output; "
                           "send one", sampling.grammar.param)
    return ChatRequest(model, tuple(out), sampling, stream, include_usage, tools)


def parse_completion(body: Any) -> CompletionRequest:
    """Validate a /v1/completions body; raises RequestError naming the bad field."""
    model, stream, include_usage = _common(body, COMPLETION_FIELDS)
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
    logprobs = _number(body, "logprobs", 0, MAX_LOGPROBS, integer=True)
    return CompletionRequest(model, prompt, _sampling(body, logprobs), stream, include_usage)


EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "user"})
MAX_INPUTS = 2048  # OpenAI's cap on inputs per embeddings request


@dataclass(frozen=True)
class EmbeddingRequest:
    model: str | None
    inputs: tuple[str | tuple[int, ...], ...]  # texts, or token ids as given
    base64: bool = False  # encoding_format "base64": little-endian float32 bytes


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def parse_embeddings(body: Any) -> EmbeddingRequest:
    """Validate a /v1/embeddings body; raises RequestError naming the bad field."""
    model, _, _ = _common(body, EMBEDDING_FIELDS)
    x = body.get("input")
    inputs = [x] if isinstance(x, str) or _token_ids(x) else x
    if not (isinstance(inputs, list) and 0 < len(inputs) <= MAX_INPUTS
            and all(isinstance(i, str) or _token_ids(i) for i in inputs)):
        raise RequestError(f"'input' must be a string, a list of token ids, or a list of up to "
                           f"{MAX_INPUTS} of those", "input")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise RequestError("'encoding_format' must be float or base64", "encoding_format")
    return EmbeddingRequest(model, tuple(i if isinstance(i, str) else tuple(i) for i in inputs),
                            fmt == "base64")
