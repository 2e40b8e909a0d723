"""Text <-> token ids for a GGUF model, matching llama.cpp's tokenizer.

The vocabulary comes from the GGUF's ``tokenizer.ggml.*`` metadata; the segmentation
itself runs in Hugging Face ``tokenizers`` (Rust), configured to reproduce llama.cpp
(``src/llama-vocab.cpp``):

- ``gpt2`` (byte-level BPE): the GGUF's merges, and the pre-tokenizer regexes llama.cpp
  picks from ``tokenizer.ggml.pre``, applied one after another like its
  ``unicode_regex_split``.
- ``llama`` (SentencePiece BPE, e.g. Gemma): llama.cpp repeatedly merges the adjacent pair
  whose concatenation is the highest-scoring vocab entry. That is BPE with one merge
  ``(left, right)`` per way of splitting each token into two vocab entries, ranked by the
  token's score, plus ``<0xNN>`` byte fallback: the same construction HF uses to convert
  SentencePiece models.

Special tokens are cut out of the text first, as llama.cpp's ``tokenizer_st_partition``
does: CONTROL and UNKNOWN tokens only when ``parse_special`` is true, USER_DEFINED always.

Decoding does not use ``tokenizers``: each id maps to the bytes llama.cpp's
``llama_token_to_piece`` gives, and text is their concatenation decoded as UTF-8.
"""

from __future__ import annotations

import codecs
import threading
import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers

from .errors import TokenizerError

if TYPE_CHECKING:
    from .gguf_file import GGUFFile

K = gguf.Keys.Tokenizer
T = gguf.TokenType

# --- pre-tokenizer regexes (llama-vocab.cpp, llm_tokenizer_bpe) -------------------------
# llama.cpp writes the GPT-2 regex without the final `|\s+`, but matches it with a
# hand-written splitter (unicode_regex_split_custom_gpt2) that implements the full
# original regex, so the full one is what we give Oniguruma. Likewise llama.cpp's
# "adapted" llama3/qwen2 regexes spell out the case-insensitive contractions that
# `(?i:...)` expresses here.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")

_PRE_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2),  # digits one by one, then GPT-2
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
}
# llama.cpp sets ignore_merges and add_bos for exactly these pre-tokenizer names.
_LLAMA3_NAMES = frozenset(
    ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2")
)
# tokenizer.ggml.pre value -> key of _PRE_REGEXES, as llama.cpp groups them. Note that
# llama.cpp spells the GPT-2 one "gpt-2"; a bare "gpt2" is unknown there and gets
# "default", as here.
_PRE_ALIASES = {
    "default": "default",
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "exaone4"), "gpt2"),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        "smollm",
    ),
    **dict.fromkeys((*_LLAMA3_NAMES, "dbrx", "smaug-bpe"), "llama3"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "stablelm2", "megrez"), "qwen2"),
}

# --- end of generation (llama_vocab::impl::load) ------------------------------------------
# llama.cpp finds these by text, forces them to CONTROL, and stops generating on them.
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
    }
)
# FIM pad/repo/file-separator tokens also end generation; found by text if not in metadata.
_FIM_EOG = {
    K.FIM_PAD_ID: ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    K.FIM_REP_ID: ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    K.FIM_SEP_ID: ("<|file_sep|>",),
}


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable stand-in char -> byte value."""
    bs = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def read_tokenizer_metadata(file: GGUFFile) -> dict[str, Any]:
    """The GGUF's ``tokenizer.*`` values (those gguf.Keys.Tokenizer names), by key."""
    keys = [v for k, v in vars(K).items() if k.isupper() and isinstance(v, str)]
    return {k: file.metadata[k] for k in keys if k in file.metadata}


class Tokenizer:
    """A GGUF model's tokenizer. Build it with :meth:`from_gguf`."""

    def __init__(self, metadata: dict[str, Any]) -> None:
        """Build from ``tokenizer.ggml.*`` values (keys as in GGUF). Prefer from_gguf."""
        model = metadata.get(K.MODEL)
        if model not in ("gpt2", "llama"):
            raise TokenizerError(f"unsupported tokenizer model {model!r} (supported: gpt2, llama)")
        self.model: str = model
        if not metadata.get(K.LIST):
            raise TokenizerError("the GGUF file has no tokenizer (tokenizer.ggml.tokens)")
        # llama.cpp renames empty tokens so every text is unique and non-empty.
        tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(metadata[K.LIST])]
        n = len(tokens)
        types = np.array(metadata.get(K.TOKEN_TYPE, [T.NORMAL] * n), dtype=np.int32)  # a copy
        if types.shape != (n,):
            raise TokenizerError(f"{K.TOKEN_TYPE} has {types.size} entries for {n} tokens")
        self._tokens = tokens
        ids = {t: i for i, t in enumerate(tokens)}

        def meta_id(key: str, default: int | None) -> int | None:
            # llama.cpp ignores an out-of-range id in metadata and keeps its default.
            for value in (metadata.get(key), default):
                if value is not None and 0 <= int(value) < n:
                    return int(value)
            return None

        spm = model == "llama"
        pre_name = str(metadata.get(K.PRE, "default")) if not spm else "default"
        # Defaults when the metadata is silent, as llama.cpp: SPM adds BOS, BPE doesn't
        # (except the llama3 family); SPM prefixes a space unless told otherwise.
        self.bos_id = meta_id(K.BOS_ID, 1 if spm else 11)
        self.eos_id = meta_id(K.EOS_ID, 2 if spm else 11)
        self.add_bos: bool = bool(metadata.get(K.ADD_BOS, spm or pre_name in _LLAMA3_NAMES))
        self.add_space_prefix: bool = bool(metadata.get(K.ADD_PREFIX, spm))

        eog = {i for t, i in ids.items() if t in _EOG_TEXTS}
        for key, texts in _FIM_EOG.items():
            found = meta_id(key, None)
            if found is None:
                found = min((ids[t] for t in texts if t in ids), default=None)
            eog.add(found)
        eog |= {self.eos_id, meta_id(K.EOT_ID, None), meta_id(K.EOM_ID, None)}
        eog.discard(None)
        types[list(eog)] = T.CONTROL  # llama.cpp overrides their type the same way
        self.eot_ids: frozenset[int] = frozenset(eog)
        self._types = types

        self._hf = (
            self._build_spm(tokens, ids, metadata)
            if spm
            else self._build_bpe(tokens, ids, metadata, pre_name)
        )
        # Special tokens, cut out of the text before anything else. CONTROL/UNKNOWN are
        # "special" to HF, so encode_special_tokens=True (parse_special=False) leaves them
        # as plain text while USER_DEFINED ones are still matched, as in llama.cpp.
        special = np.flatnonzero(np.isin(types, (T.CONTROL, T.UNKNOWN, T.USER_DEFINED)))
        self._hf.add_tokens(
            [
                AddedToken(tokens[i], special=bool(types[i] != T.USER_DEFINED), normalized=False)
                for i in special.tolist()
            ]
        )
        self._lock = threading.Lock()  # guards the encode_special_tokens toggle

        self._pieces = self._build_pieces(tokens, types, spm)
        self._skippable = np.isin(types, (T.CONTROL, T.UNKNOWN))

    @classmethod
    def from_gguf(cls, file: GGUFFile) -> Tokenizer:
        """Read the tokenizer from an opened GGUF file."""
        return cls(read_tokenizer_metadata(file))

    # --- building ---------------------------------------------------------------------

    def _build_spm(
        self, tokens: list[str], ids: dict[str, int], metadata: dict[str, Any]
    ) -> tokenizers.Tokenizer:
        scores = np.asarray(metadata.get(K.SCORES, np.zeros(len(tokens))), dtype=np.float32)
        # Every split of a token into two vocab entries is a merge; the merge's priority
        # is the whole token's score (ties: token order, then left/right id), so BPE's
        # "lowest rank first, then leftmost" equals llama.cpp's "highest score first,
        # then leftmost" (llm_tokenizer_spm_session).
        merges: list[tuple[str, str]] = []
        get = ids.get
        for i in np.argsort(-scores, kind="stable").tolist():
            t = tokens[i]
            local = [(left, right) for k in range(1, len(t))
                     if (left := get(t[:k])) is not None and (right := get(t[k:])) is not None]
            if len(local) > 1:
                local.sort()
            merges += [(tokens[a], tokens[b]) for a, b in local]
        unk = metadata.get(K.UNK_ID)
        bpe = models.BPE(
            vocab=ids,
            merges=merges,
            byte_fallback=True,
            fuse_unk=True,
            unk_token=tokens[unk] if unk is not None and 0 <= unk < len(tokens) else None,
        )
        hf = tokenizers.Tokenizer(bpe)
        # llama.cpp escapes spaces as U+2581 and, with add_space_prefix, starts every
        # text fragment (the start, and text after each special token) with one.
        steps = [normalizers.Prepend("▁")] if self.add_space_prefix else []
        hf.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
        return hf

    def _build_bpe(
        self, tokens: list[str], ids: dict[str, int], metadata: dict[str, Any], pre_name: str
    ) -> tokenizers.Tokenizer:
        if K.MERGES not in metadata:
            raise TokenizerError("gpt2 tokenizer without tokenizer.ggml.merges")
        merges = [tuple(m.split(" ", 1)) for m in metadata[K.MERGES]]
        bpe = models.BPE(vocab=ids, merges=merges, ignore_merges=pre_name in _LLAMA3_NAMES)
        hf = tokenizers.Tokenizer(bpe)
        key = _PRE_ALIASES.get(pre_name)
        if key is None:
            warnings.warn(
                f"unknown pre-tokenizer {pre_name!r}, using 'default' as llama.cpp does",
                stacklevel=3,
            )
            key = "default"
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [
                *(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_REGEXES[key]),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        return hf

    @staticmethod
    def _build_pieces(tokens: list[str], types: np.ndarray, spm: bool) -> list[bytes]:
        """Each token's bytes as llama_token_to_piece(special=True) gives them."""
        byte_decoder = {} if spm else _gpt2_byte_decoder()
        # GPT-2's alphabet maps each char to one byte: as a translation to the latin-1 char
        # of that byte, a token of only such chars is encoded at C speed
        to_latin1, alphabet = str.maketrans({c: chr(b) for c, b in byte_decoder.items()}), set(byte_decoder)
        pieces = []
        for text, kind in zip(tokens, types.tolist(), strict=True):
            if kind in (T.CONTROL, T.UNKNOWN, T.USER_DEFINED):
                pieces.append(text.encode())
            elif kind == T.NORMAL and spm:
                pieces.append(text.replace("▁", " ").encode())
            elif kind == T.NORMAL and alphabet.issuperset(text):
                pieces.append(text.translate(to_latin1).encode("latin-1"))
            elif kind == T.NORMAL:
                # A char outside GPT-2's alphabet stays as its UTF-8 (llama.cpp inserts
                # an "[UNK_BYTE_...]" marker instead; no real vocab has one).
                pieces.append(
                    b"".join(
                        bytes([byte_decoder[c]]) if c in byte_decoder else c.encode() for c in text
                    )
                )
            elif kind == T.BYTE and spm:
                pieces.append(bytes([int(text[3:5], 16)]))  # "<0xNN>"
            else:
                pieces.append(b"")  # UNUSED, UNDEFINED, BPE byte tokens: llama.cpp prints nothing
        return pieces

    # --- public API -------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def token_text(self, token_id: int) -> str:
        """The token as stored in the vocabulary (e.g. ``▁the``, ``Ġthe``, ``<0x0A>``)."""
        return self._tokens[self._check(token_id)]

    def token_bytes(self, token_id: int, skip_special: bool = False) -> bytes:
        """The bytes this token adds to the text; may be part of a UTF-8 character."""
        if skip_special and self._skippable[self._check(token_id)]:
            return b""
        return self._pieces[self._check(token_id)]

    def encode(
        self, text: str, add_bos: bool | None = None, parse_special: bool = True
    ) -> list[int]:
        """Token ids for ``text``, as llama_tokenize(text, add_special=add_bos, parse_special).

        ``add_bos=None`` follows the model (``tokenizer.ggml.add_bos_token``).
        """
        with self._lock:
            self._hf.encode_special_tokens = not parse_special
            ids = self._hf.encode(text, add_special_tokens=False).ids
        add = self.add_bos if add_bos is None else add_bos
        if add and self.bos_id is not None:
            return [self.bos_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``ids``: the concatenation of their pieces, decoded as UTF-8.

        ``skip_special`` drops CONTROL/UNKNOWN tokens (llama.cpp's ``special=false``);
        user-defined tokens are always printed. Invalid UTF-8 becomes U+FFFD.
        """
        data = b"".join(self.token_bytes(i, skip_special) for i in ids)
        return data.decode("utf-8", errors="replace")

    def stream(self, skip_special: bool = False) -> StreamDecoder:
        """A decoder fed one id at a time that only ever returns whole characters."""
        return StreamDecoder(self, skip_special)

    def _check(self, token_id: int) -> int:
        if not 0 <= token_id < len(self._tokens):
            raise TokenizerError(f"token id {token_id} out of range [0, {len(self._tokens)})")
        return token_id


class StreamDecoder:
    """Incremental detokenizer for generation.

    A character may span tokens (byte-fallback ``<0xNN>`` tokens, byte-level BPE pieces),
    so bytes of an unfinished UTF-8 sequence are held back until it completes. Bytes that
    can never form a character come out as U+FFFD, like ``decode``; so the concatenation
    of every ``feed`` and the final ``flush`` equals ``decode`` of all the ids.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Add one token; return the text it completes (often "", never half a char)."""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id, self._skip_special))

    def feed_many(self, ids: Sequence[int]) -> str:
        return "".join(self.feed(i) for i in ids)

    def flush(self) -> str:
        """End of stream: return what is held back (U+FFFD if it never completed)."""
        return self._utf8.decode(b"", final=True)
