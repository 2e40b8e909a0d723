"""The OpenAI reply and stream-chunk bodies apir sends back. No I/O here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; ``cached_tokens``: prompt tokens whose KV a slot already held."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(frozen=True)
class ChatFormat:
    """Bodies of one chat completion: the whole reply, or its stream of chunks. ``logprobs``
    entries come in OpenAI chat's shape (``{"token", "logprob", "bytes", "top_logprobs"}``)."""

    id: str
    created: int
    model: str
    include_usage: bool = False
    logprobs: bool = False  # asked for: a "logprobs" object, else null

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, entries: Sequence[dict]) -> dict | None:
        return {"content": list(entries), "refusal": None} if self.logprobs else None

    def reply(self, text: str | None, finish: str, prompt_tokens: int, completion_tokens: int,
              entries: Sequence[dict] = (), tool_calls: Sequence[dict] = (), cached_tokens: int = 0) -> dict:
        message: dict = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = list(tool_calls)
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(entries),
                  "finish_reason": finish}
        return {**self._head("chat.completion"), "choices": [choice],
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}

    def chunk(self, text: str | None = None, finish: str | None = None, first: bool = False,
              entries: Sequence[dict] = (), tool_calls: Sequence[dict] = ()) -> dict:
        delta: dict = {}
        if first:
            delta = {"role": "assistant", "content": ""}
        elif tool_calls:
            delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(tool_calls)]}
        elif text is not None:
            delta = {"content": text}
        logprobs = self._logprobs(entries) if entries else None
        body = {**self._head("chat.completion.chunk"),
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if self.include_usage:
            body["usage"] = None
        return body

    def first_chunk(self) -> dict | None:
        return self.chunk(first=True)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
        return {**self._head("chat.completion.chunk"), "choices": [],
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


@dataclass(frozen=True)
class CompletionFormat(ChatFormat):
    """Bodies of one text completion (``object: text_completion``, also when streamed)."""

    def _logprobs(self, entries: Sequence[dict]) -> dict | None:
        """The legacy completions shape: parallel lists, alternatives as {text: logprob}."""
        if not self.logprobs:
            return None
        offsets, at = [], 0
        for e in entries:
            offsets.append(at)
            at += len(e["token"])
        return {"tokens": [e["token"] for e in entries],
                "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                "text_offset": offsets}

    def reply(self, text: str | None, finish: str, prompt_tokens: int, completion_tokens: int,
              entries: Sequence[dict] = (), tool_calls: Sequence[dict] = (), cached_tokens: int = 0) -> dict:
        choice = {"index": 0, "text": text, "logprobs": self._logprobs(entries), "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice],
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}

    def chunk(self, text: str | None = None, finish: str | None = None, first: bool = False,
              entries: Sequence[dict] = (), tool_calls: Sequence[dict] = ()) -> dict:
        logprobs = self._logprobs(entries) if entries else None
        body = {**self._head("text_completion"),
                "choices": [{"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}]}
        if self.include_usage:
            body["usage"] = None
        return body

    def first_chunk(self) -> dict | None:
        return None  # completions streams start with text

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
        return {**self._head("text_completion"), "choices": [],
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
