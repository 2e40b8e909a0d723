"""Constrained decoding: a grammar (JSON schema, Lark or GBNF, regex, a choice of strings)
becomes, before every step, a bitmask of the tokens that may come next.

llguidance (the library llama.cpp uses) computes the mask here, on the guest, from the
model's own vocabulary; the mask travels as the ``mask`` input of the penalized sample
graph (Op.PENALIZE), so sampling stays on the backend and only token ids come back.
Imported only when a request asks for a constraint: ``pip install 'apir[serve]'``.
"""

from __future__ import annotations

import json

import numpy as np

from ..errors import ApirError
from ..models.tokenizer import Tokenizer

KINDS = ("json_schema", "lark", "gbnf", "regex", "choice")  # what Grammars.matcher takes
# An integer a schema leaves unbounded gets these bounds (at most 16 digits), as llama.cpp's
# schema grammars do: a small model otherwise repeats a digit until max_tokens.
JSON_INT_LIMIT = (1 << 53) - 1
# Whitespace between JSON tokens, bounded for the same reason (llama.cpp allows 20 too).
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,20}"}


class GrammarError(ApirError):
    """A grammar that does not compile, or a constraint library that is missing."""


class _Vocabulary:
    """The tokenizer as llguidance's TokenizerWrapper reads it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        n = tokenizer.vocab_size
        self.eos_token_id, self.bos_token_id = tokenizer.eos_id, tokenizer.bos_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(n)]
        # the model's rows past the tokenizer's list (padding) never match anything
        self.tokens += [f"<[pad {i}]>".encode() for i in range(n, vocab_size)]
        self.special_token_ids = [i for i in range(n) if not tokenizer.token_bytes(i, skip_special=True)
                                  and self.tokens[i]]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text only")
        return self._tokenizer.encode(text, add_bos=False, parse_special=False)


class Grammars:
    """Compiles grammars against one model's vocabulary (built once: about a second)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        try:
            import llguidance
        except ImportError:
            raise GrammarError("constrained output needs llguidance: pip install 'apir[serve]'") from None
        self._ll = llguidance
        vocab = llguidance.TokenizerWrapper(_Vocabulary(tokenizer, vocab_size))
        self._tokenizer = llguidance.LLTokenizer(vocab, n_vocab=vocab_size, eos_token=tokenizer.eos_id)
        self.words = (vocab_size + 31) // 32

    def matcher(self, kind: str, text: str) -> Matcher:
        """A fresh constraint for one generation; GrammarError (one line) if it is invalid."""
        if kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {kind!r} (one of {', '.join(KINDS)})")
        try:
            if kind == "json_schema":
                grammar = self._ll.LLMatcher.grammar_from_json_schema(
                    json.dumps(_bounded(json.loads(text))), defaults=JSON_OPTIONS)
            else:
                grammar = self._ll.grammar_from(kind, text)
            m = self._ll.LLMatcher(self._tokenizer, grammar, log_level=0)
        except (ValueError, RuntimeError) as e:
            raise GrammarError(f"invalid {kind}: {_one_line(e)}") from None
        if m.is_error():
            raise GrammarError(f"invalid {kind}: {_one_line(m.get_error())}")
        return Matcher(m, self.words)


class Matcher:
    """One generation's constraint (see ``apir.engine.model.Constraint``)."""

    def __init__(self, matcher, words: int) -> None:
        self._m, self._words = matcher, words

    def mask(self) -> np.ndarray:
        bits = np.zeros(self._words, np.int32)
        self._m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        return bits

    def advance(self, token: int) -> bool:
        if not self._m.consume_token(token):  # the mask allowed it: only a library fault lands here
            raise GrammarError(f"the grammar refused token {token}: {_one_line(self._m.get_error())}")
        return not self._m.is_stopped()


def _bounded(schema: object) -> object:
    """``schema`` with JSON_INT_LIMIT bounds on every integer that has none."""
    if isinstance(schema, list):
        return [_bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _bounded(v) for k, v in schema.items()}
    if out.get("type") == "integer":
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -JSON_INT_LIMIT
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = JSON_INT_LIMIT
    return out


def _one_line(message: object) -> str:
    return " ".join(str(message).split())[:500]
