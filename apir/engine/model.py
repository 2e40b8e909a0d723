"""A loaded model on a backend: weights uploaded once, graphs registered once, KV cache
kept in a backend buffer, token-by-token generation with sampling on the backend.

Graphs per model, all over the symbolic token count T:
  ``logits``  tokens (T,), pos (T,)            -> logits (T, vocab), writes the KV cache
  ``sample``  tokens (T,), pos (T,), params (5,) -> next token (1,), writes the KV cache
  ``penalized`` (registered on first use) also takes scale (V,), bias (V,), mask
              (ceil(V/32),) I32 -> token (1,), logprobs (1, MAX_LOGPROBS + 1, 2)
              (Op.PENALIZE before the draw, Op.LOGPROBS of the raw logits after it)
A prompt is prefilled in chunks through ``sample`` (only its last row is projected to
the vocabulary); each decode step then sends one token and gets one token id back.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..backends import Backend, BufferPurpose
from ..backends.base import ALIGNMENT, BackendError
from ..errors import ApirError
from ..graph import DType, Graph, GraphBuilder, Op, SampleArgs, T
from ..graph.sampling import GREEDY, PARAMS_SIZE
from ..models.gguf_file import GGUFFile
from ..models.layout import layout_digest, weight_slots
from ..models.registry import architecture
from ..models.tokenizer import Tokenizer
from ..models.weights import KVCache, KVLayout, Weights, WeightTable, pick_kv_type

DEFAULT_CTX = 4096  # like llama.cpp: a model's full context is opt-in (it sizes the KV cache)
PREFILL_CHUNK = 512  # llama.cpp's default micro-batch
PAD_MIN = 8  # steps longer than a decode step are padded to a power of two (see _step)
_GREEDY = {"params": GREEDY.pack()}  # SAMPLE params: argmax
_SAMPLED = {"params": SampleArgs(1.0, 40, 0.95, 0.05, 0.5).pack()}  # any params that sample
POOLINGS = ("mean", "cls", "last")
MAX_LOGPROBS = 20  # alternatives per token the penalized graph returns (OpenAI's top_logprobs cap)
BANNED = -100.0  # a logit_bias this low removes the token (OpenAI's "ban")


class ContextOverflowError(ApirError):
    """A prompt (plus what is asked of it) that does not fit the context window."""


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is picked (see Op.SAMPLE). temperature 0 is greedy."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = field(default_factory=tuple)
    # llama.cpp's penalties over the last penalty_last_n tokens (prompt included): a logit
    # x of a token seen there becomes x / repeat_penalty (x > 0) or x * repeat_penalty, less
    # presence_penalty, less frequency_penalty times its count
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # report each token's logprob and this many alternatives

    def __post_init__(self) -> None:
        if self.temperature < 0 or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < 0 or self.max_tokens < 0 or self.penalty_last_n < 0:
            raise ValueError("top_k, max_tokens and penalty_last_n must be >= 0")
        if not (0 < self.repeat_penalty < math.inf):
            raise ValueError(f"repeat_penalty must be > 0, got {self.repeat_penalty}")
        if not all(math.isfinite(x) for x in (self.presence_penalty, self.frequency_penalty)):
            raise ValueError("presence_penalty and frequency_penalty must be finite")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")

    @property
    def penalized(self) -> bool:
        """Whether each step's logits depend on the tokens before it."""
        return self.penalty_last_n > 0 and (
            self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0)


@dataclass(frozen=True)
class Token:
    """One generated token; with ``SamplingParams.logprobs``, its log-probability under the
    model's logits and the ``top`` most likely (id, logprob) pairs, best first."""

    id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


class Constraint(Protocol):
    """Which tokens may come next (a grammar, a JSON schema): asked before every step."""

    def mask(self) -> np.ndarray:
        """(ceil(vocab/32),) int32: bit v % 32 of word v // 32 set where token v may come."""

    def advance(self, token: int) -> bool:
        """Take the sampled ``token``; False when the constraint is complete (stop here)."""


Progress = Callable[[int, int], None]  # (bytes done, bytes total)


class Model:
    """A GGUF model running on ``backend``. Use ``apir.load`` to make one."""

    def __init__(
        self, gguf: GGUFFile, backend: Backend, n_ctx: int | None = None,
        progress: Progress | None = None, cache_type: DType | None = None,
    ) -> None:
        """``cache_type``: the KV cache's dtype, F16 or F32 (None: F16, see ``pick_kv_type``)."""
        self.file, self.backend = gguf, backend
        self.arch_name = gguf.arch
        self.arch = architecture(gguf.arch)
        self.args = self.arch.args_from_gguf(gguf)
        # a source without one (bench's synthetic weights) feeds token ids only
        self.tokenizer = Tokenizer.from_gguf(gguf) if gguf.has_tokenizer else None
        if n_ctx is not None and not 0 < n_ctx <= self.args.context_length:  # before any upload
            raise ContextOverflowError(f"a context of {n_ctx} tokens was asked for (--ctx-size); "
                                       f"this model's holds 1 to {self.args.context_length}")
        self.n_ctx = min(n_ctx or DEFAULT_CTX, self.args.context_length)
        kv_type = pick_kv_type(cache_type)
        self.weights = self._upload_weights(progress)
        heads = self.arch.kv_heads(self.args)
        size, slots = KVLayout.plan(self.n_ctx, heads, kv_type, ALIGNMENT)
        self.kv = KVLayout(backend.alloc_buffer(size, BufferPurpose.KV), self.n_ctx, kv_type, tuple(slots))
        capabilities = backend.device().capabilities
        # a host that caches per-length graphs wants few lengths (see _step)
        self._pad = "graph_cache" in capabilities
        # a host that compiles every prefill length (APIR_COMPILE=all) wants them all warmed up
        self._compiled_prefill = "compiled_prefill" in capabilities
        self._logits: int | None = None  # the all-rows logits graph, registered on first use
        self._sample_graph = self._register(last_only=True)
        self._penalized_graph: int | None = None
        self._grammars = None  # apir.engine.constraint.Grammars, built on first use
        self._hidden_graph: int | None = None  # the final hidden states, for embeddings
        self._grammars_lock = threading.Lock()

    # ------------------------------------------------------------ setup
    def _upload_weights(self, progress: Progress | None) -> WeightTable:
        slots, offset = weight_slots(self.file.tensors.values())
        # a host that publishes this model (by the file's name) lends its copy: no upload
        try:
            shared = self.backend.open_published(self.file.path.stem, layout_digest(slots), offset)
        except BackendError:  # not published there, or another layout: upload our own
            shared = None
        if shared is not None:
            return WeightTable(shared, slots)
        buffer = self.backend.alloc_buffer(offset, BufferPurpose.WEIGHTS)
        done = 0
        for t in self.file.tensors.values():
            self.backend.set_tensor(buffer, slots[t.name].offset, t.data)
            done += t.data.nbytes
            if progress:
                progress(done, self.file.nbytes)
        return WeightTable(buffer, slots)

    @property
    def _logits_graph(self) -> int:
        """Registered on first use: generation samples from the last row only (the sample
        graph), so most sessions never ask for every row's logits, and a one-shot run
        saves the graph's build and its registration on the host."""
        if self._logits is None:
            self._logits = self._register(last_only=False)
        return self._logits

    def _register(self, last_only: bool, penalized: bool = False) -> int:
        g = GraphBuilder()
        tokens = g.input("tokens", (T,), DType.I32)
        pos = g.input("pos", (T,), DType.I32)
        w, kv = Weights(g, self.weights), KVCache(g, self.kv)
        logits = self.arch.build(g, self.args, w, tokens, pos, kv, last_only)
        if not last_only:
            return self.backend.register_graph(g.build(logits))
        params, v = g.input("params", (PARAMS_SIZE,), DType.F32), logits.shape[-1]
        if not penalized:
            return self.backend.register_graph(g.build(g.sample(logits, params)))
        adjusted = g.op(Op.PENALIZE, logits, g.input("scale", (v,)), g.input("bias", (v,)),
                        g.input("mask", ((v + 31) // 32,), DType.I32))
        token = g.sample(adjusted, params)
        logprobs = g.op(Op.LOGPROBS, logits, token, attrs=(MAX_LOGPROBS,))
        return self.backend.register_graph(g.build(token, logprobs))

    def _register_hidden(self) -> int:
        """The logits graph cut before its output projection: the normalised final hidden
        states (T, n_embd), what embeddings pool."""
        g = GraphBuilder()
        tokens, pos = g.input("tokens", (T,), DType.I32), g.input("pos", (T,), DType.I32)
        logits = self.arch.build(g, self.args, Weights(g, self.weights), tokens, pos, KVCache(g, self.kv), False)
        graph = g.build(logits)
        node = graph.nodes[graph.outputs[0]]
        if node.op is not Op.MATMUL or node.label != "output":
            raise ApirError(f"embeddings are not available for {self.arch_name}: its graph does "
                            "not end in the output projection")
        hidden = node.inputs[0]  # nodes are in topological order: all it needs comes before
        return self.backend.register_graph(Graph(graph.nodes[: hidden + 1], (hidden,)))

    def embed(self, ids: Sequence[int], pooling: str) -> np.ndarray:
        """The final hidden states of ``ids`` (a fresh pass from position 0) pooled as
        llama.cpp's ``--pooling`` (mean, cls: the first token, last) and L2-normalised:
        (n_embd,) float32."""
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        self._check_fits(len(ids), "input")
        if self._hidden_graph is None:
            self._hidden_graph = self._register_hidden()
        rows = np.concatenate([out[0] for out in self._chunks(self._hidden_graph, ids)], 0)
        rows = rows.astype(np.float64)
        v = rows.mean(0) if pooling == "mean" else rows[0] if pooling == "cls" else rows[-1]
        norm = np.linalg.norm(v)
        return (v / norm if norm > 0 else v).astype(np.float32)


    # ------------------------------------------------------------ tokens
    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    def tokenize(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids as llama.cpp gives them: special tokens parsed, BOS per the metadata."""
        return self.tokenizer.encode(text, add_bos=add_bos)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of ``messages`` rendered with the model's chat template, ready to generate.

        Templates often write the BOS token themselves; like llama.cpp, it is dropped from
        the text when the tokenizer adds one anyway, so the prompt never starts with two.
        """
        from ..models.chat import render_chat, template_for  # jinja is only needed for chat

        tok = self.tokenizer
        bos, eos = tok.token_text(tok.bos_id), tok.token_text(tok.eos_id)
        template = template_for(self.file.get("tokenizer.chat_template"), self.arch_name)
        text = render_chat(template, messages, bos_token=bos, eos_token=eos)
        if tok.add_bos and bos and text.startswith(bos):
            text = text[len(bos):]
        return self.tokenize(text)

    def constraint(self, kind: str, text: str) -> Constraint:
        """A fresh constraint for one generation: ``kind`` is one of
        ``apir.engine.constraint.KINDS``; raises GrammarError when ``text`` is invalid."""
        from .constraint import Grammars  # llguidance is only needed for constraints

        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.vocab_size)
        return self._grammars.matcher(kind, text)

    def _check_fits(self, n: int, what: str = "prompt") -> None:
        if n == 0:
            raise ApirError(f"the {what} is empty: nothing to run")
        if n > self.n_ctx:
            whole = self.args.context_length  # advise raising --ctx-size only while it can go up
            raise ContextOverflowError(f"the {what} has {n} tokens but the context holds {self.n_ctx}; " + (
                f"shorten it or raise --ctx-size (up to {whole})" if self.n_ctx < whole
                else "the model's whole context: shorten it"))

    # ------------------------------------------------------------ compute
    def _step(self, graph: int, ids: Sequence[int], start: int,
              extra: Mapping[str, np.ndarray] | None = None) -> list[np.ndarray]:
        """One compute of ``ids`` at positions ``start``... (``extra``: the other inputs);
        the outputs, the logits graph's rows one per token.

        For a host that records a graph per step length, a prefill chunk is padded to the
        next power of two by repeating its last token at its last position. The copies
        compute the very same K/V row as the original (so the KV cache write is the same)
        and the same output row, which is then dropped.
        """
        n = len(ids)
        size = 1 << (n - 1).bit_length() if self._pad and n > PAD_MIN else n
        tokens = np.empty(size, np.int32)
        tokens[:n], tokens[n:] = ids, ids[-1]
        pos = np.arange(start, start + size, dtype=np.int32)
        pos[n:] = start + n - 1
        outs = self.backend.compute(graph, {"tokens": tokens, "pos": pos, **(extra or {})})
        return outs if size == n else [o[:n] if o.shape[:1] == (size,) else o for o in outs]

    def logits(self, ids: Sequence[int], start: int = 0) -> np.ndarray:
        """Logits (len(ids), vocab) float32 of one causal pass over ``ids`` placed at ``start``.

        Positions before ``start`` must already be in the KV cache (from an earlier call);
        ``start=0`` is a fresh pass.
        """
        self._check_fits(start + len(ids))
        rows = [out[0] for out in self._chunks(self._logits_graph, ids, start)]
        return np.concatenate(rows, axis=0).astype(np.float32)

    def _chunks(self, graph: int, ids: Sequence[int], start: int = 0,
                extra: Callable[[], Mapping[str, np.ndarray]] = dict) -> list[list[np.ndarray]]:
        """Run ``ids`` at ``start``... in steps of PREFILL_CHUNK tokens (``extra()``: the
        other inputs of each step); the outputs of each step."""
        return [self._step(graph, ids[i : i + PREFILL_CHUNK], start + i, extra())
                for i in range(0, len(ids), PREFILL_CHUNK)]

    def prefill(self, ids: Sequence[int], start: int = 0) -> int:
        """Run ``ids`` at positions ``start``... through the sample graph (positions before
        ``start`` must be in the KV cache); returns the greedy next token."""
        self._check_fits(start + len(ids))
        return int(self._chunks(self._sample_graph, ids, start, lambda: _GREEDY)[-1][0][0])

    def _submit_next(self, pos: int, extra: Mapping[str, np.ndarray], token: int | None = None,
                     graph: int | None = None):
        """Submit the one-token step at ``pos`` of ``graph`` (default: the sample graph).
        Without ``token`` its token is the one the previous step of that graph samples: fed
        on the backend, so the step can be sent before that token is read (a remote guest
        keeps one step in flight)."""
        graph = self._sample_graph if graph is None else graph
        inputs = {"pos": np.array([pos], np.int32), **extra}
        if token is not None:
            inputs["tokens"] = np.array([token], np.int32)
            return self.backend.submit(graph, inputs)
        return self.backend.submit(graph, inputs, feed={"tokens": 0})

    def warm_up(self) -> None:
        """Run a greedy and a sampled decode step now, so one-time work of the backend
        (recording CUDA graphs, compiling the decode step: tens of seconds on a GPU host)
        is done before the first request rather than inside it. A host that compiles
        prefill chunks too gets each padded chunk length in both sampling modes (a compile
        each). The KV cache keeps rows of this, which the next prompt overwrites."""
        if self.n_ctx < 3:
            return
        token = self.prefill([0])
        self.decode_steps(token, 1, 1)
        self._submit_next(2, _SAMPLED).result()
        size = 2 * PAD_MIN  # the shortest padded chunk (see _step)
        while self._compiled_prefill and size <= min(PREFILL_CHUNK, self.n_ctx):
            for params in (_GREEDY, _SAMPLED):
                self._step(self._sample_graph, [0] * size, 0, params)
            size *= 2

    def decode_steps(self, token: int, start: int, n: int) -> list[int]:
        """``n`` greedy single-token steps: feed ``token`` at ``start``, then each sampled one.

        Ends only after ``n`` steps (no end-of-generation check), so a benchmark always
        times the same work. Positions before ``start`` must be in the KV cache.
        """
        self._check_fits(start + n, "generation")
        if n == 0:
            return []
        pending = self._submit_next(start, _GREEDY, token)
        out = []
        for i in range(1, n + 1):
            following = self._submit_next(start + i, _GREEDY) if i < n else None
            out.append(int(pending.result()[0][0]))
            pending = following
        return out

    def generate_ids(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        """Yield generated token ids until an end-of-generation token or ``max_tokens``."""
        with contextlib.closing(self.generate_tokens(prompt_ids, params)) as tokens:
            for token in tokens:
                yield token.id

    def generate_tokens(self, prompt_ids: Sequence[int], params: SamplingParams,
                        constraint: Constraint | None = None) -> Iterator[Token]:
        """Yield generated tokens until an end-of-generation token, ``max_tokens``, or the
        end of ``constraint``.

        The end token itself is not yielded. Stop strings are handled by ``stream``. One
        step runs ahead: step n+1 is submitted (its token fed on the backend) before token
        n is read; a step past the end is computed and dropped. Where a step's inputs
        depend on the token before it (penalties, a constraint's mask) it cannot be sent
        before that token is read: those steps run one at a time.
        """
        self._check_fits(len(prompt_ids))
        rng = np.random.default_rng(params.seed)
        knobs = [params.temperature, params.top_k, params.top_p, params.min_p]
        plain = (constraint is None and params.logprobs is None and not params.logit_bias
                 and not params.penalized)
        if not plain and self._penalized_graph is None:
            self._penalized_graph = self._register(True, penalized=True)
        graph = self._sample_graph if plain else self._penalized_graph
        adjust = None if plain else _Adjustments(self.vocab_size, params, constraint)
        history = list(prompt_ids)

        def extra() -> dict[str, np.ndarray]:
            draw = {"params": SampleArgs(*knobs, u=rng.random()).pack()}
            return draw if adjust is None else {**draw, **adjust.inputs(history)}

        token = _token(self._chunks(graph, prompt_ids, 0, extra)[-1], params.logprobs)
        pos = len(prompt_ids)  # where token goes in the cache
        ahead = None
        if adjust is None or not adjust.dynamic:
            ahead = self._submit_next(pos, extra(), graph=graph) if pos < self.n_ctx else None
        try:
            for _ in range(params.max_tokens):
                if self.tokenizer is not None and token.id in self.tokenizer.eot_ids:
                    return
                yield token
                history.append(token.id)
                if constraint is not None and not constraint.advance(token.id):
                    return
                if pos >= self.n_ctx:
                    return  # the context is full
                if adjust is not None and adjust.dynamic:
                    current = self._submit_next(pos, extra(), token.id, graph)
                else:
                    current = ahead
                    ahead = self._submit_next(pos + 1, extra(), graph=graph) if pos + 1 < self.n_ctx else None
                pos += 1
                token = _token(current.result(), params.logprobs)
        finally:
            if ahead is not None:  # wait for the step nobody reads, so none is left in flight
                try:
                    ahead.result()
                except ApirError:
                    pass

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text pieces as they are generated; never half a UTF-8 character."""
        params = params or SamplingParams()
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        with contextlib.closing(self.generate_ids(ids, params)) as generated:
            yield from texts(self.tokenizer, generated, params.stop)

    def generate(self, prompt: str | Sequence[int], **kwargs) -> str:
        """The whole completion as a string; keyword arguments are ``SamplingParams`` fields."""
        return "".join(self.stream(prompt, SamplingParams(**kwargs)))

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def texts(tokenizer: Tokenizer, ids: Iterator[int], stop: Sequence[str]) -> Iterator[str]:
    """The text of generated ``ids`` in pieces, never half a UTF-8 character, ending
    before the first ``stop`` string (and then no more ids are taken)."""
    decoder = tokenizer.stream()
    hold = max((len(s) for s in stop), default=1) - 1  # a stop string may be forming
    text, emitted = "", 0

    def stop_at() -> int:
        return min((i for i in (text.find(s, emitted) for s in stop) if i >= 0), default=-1)

    for tid in ids:
        text += decoder.feed(tid)
        hit = stop_at()
        if hit >= 0:
            if hit > emitted:
                yield text[emitted:hit]
            return
        if len(text) - hold > emitted:
            yield text[emitted : len(text) - hold]
            emitted = len(text) - hold
    text += decoder.flush()
    hit = stop_at()
    end = hit if hit >= 0 else len(text)
    if end > emitted:
        yield text[emitted:end]


def _token(outputs: list[np.ndarray], logprobs: int | None) -> Token:
    """The token of a sample step's outputs, (1,) token [, (1, MAX_LOGPROBS + 1, 2)], with
    its logprob and ``logprobs`` alternatives when asked for."""
    if logprobs is None:
        return Token(int(outputs[0][0]))
    (lp, tid), *top = outputs[1][0].tolist()
    return Token(int(tid), lp, tuple((int(i), v) for v, i in top[:logprobs]))


class _Adjustments:
    """The penalized sample graph's inputs for one generation (see Op.PENALIZE)."""

    def __init__(self, vocab: int, params: SamplingParams, constraint: Constraint | None) -> None:
        self.params, self.constraint = params, constraint
        self.scale = np.ones(vocab, np.float32)
        self.bias = np.zeros(vocab, np.float32)
        for tid, b in params.logit_bias:
            if not 0 <= tid < vocab:
                raise ValueError(f"logit_bias names token {tid}, outside [0, {vocab})")
            self.bias[tid] = -np.inf if b <= BANNED else b
        self.mask = np.full((vocab + 31) // 32, -1, np.int32)  # every token allowed
        self.dynamic = constraint is not None or params.penalized

    def inputs(self, history: list[int]) -> dict[str, np.ndarray]:
        p, scale, bias = self.params, self.scale, self.bias
        if p.penalized:
            ids, counts = np.unique(np.asarray(history[-p.penalty_last_n:], np.int64), return_counts=True)
            scale, bias = scale.copy(), bias.copy()
            scale[ids] = p.repeat_penalty
            bias[ids] -= p.presence_penalty + p.frequency_penalty * counts
        mask = self.mask if self.constraint is None else self.constraint.mask()
        return {"scale": scale, "bias": bias, "mask": mask}
