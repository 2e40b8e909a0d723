"""The host executor's own machinery: fused products, the two-stage argmax, padded steps."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import TinyConfig, write_tiny_gguf

pytest.importorskip("torch")
import torch  # noqa: E402

import apir  # noqa: E402
from apir.backends.base import DeviceInfo, ExecutorConfig  # noqa: E402
from apir.backends.local import (
    LocalBackend,  # noqa: E402
    kernels,  # noqa: E402
)
from apir.backends.local.kernels import (  # noqa: E402
    ARGMAX_CHUNK,
    KERNELS,  # noqa: E402
    argmax,
)
from apir.backends.local.program import FusedMatmul, Leaf, Part, Step, compile_program  # noqa: E402
from apir.engine import SamplingParams  # noqa: E402
from apir.graph import DType, GraphBuilder, Op, SampleArgs, T  # noqa: E402

IDS = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33]  # 14 tokens: padded to 16


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("exec") / f"{request.param}.gguf"
    return write_tiny_gguf(path, TinyConfig(arch=request.param, n_layer=3), "F16")


def test_llama_blocks_fuse_qkv_and_gate_up(tiny):
    with apir.load(str(tiny), backend="local", device="cpu") as model:
        backend = model.backend
        prog = backend._graphs[model._logits_graph].program
        fused = [s for s in prog.steps if isinstance(s, FusedMatmul)]
        widths = sorted(len(s.members) for s in fused)
        assert widths == [2] * 3 + [3] * 3  # per layer: gate+up, q+k+v
        assert sum(isinstance(s, Part) for s in prog.steps) == 3 * (1 + 2)
        a = model.args
        qkv = next(s for s in fused if len(s.members) == 3)
        assert qkv.widths == (a.n_head * a.head_dim, a.n_head_kv * a.head_dim, a.n_head_kv * a.head_dim)
        # fused weights are read by their products alone (no separate reads of them)
        unread = [s for s in prog.steps if isinstance(s, Leaf) and not s.read]
        assert len(unread) == 3 * 5


def test_a_layers_swiglu_norms_and_residual_products_are_made_by_their_readers(tiny):
    # per layer: the SWIGLU left for the down product, both norms (and their weights' MULs)
    # for the q/k/v and gate/up products, the output and down products for their residual
    # ADDs; the output norm for the LM head. On the CPU the readers make them with the same
    # kernels, in the same order (the reference test below holds the values)
    with apir.load(str(tiny), backend="local", device="cpu") as model:
        prog = model.backend._graphs[model._logits_graph].program
        steps = [s for s in prog.steps if isinstance(s, Step)]
        made_by = {k: sum(s.kernel is k for s in steps) for k in
                   (kernels.Glu, kernels.Normed, kernels.scaled, kernels.Product, kernels.add_product,
                    kernels.roped)}
        assert made_by == {kernels.Glu: 3, kernels.Normed: 7, kernels.scaled: 7,
                           kernels.Product: 6, kernels.add_product: 6, kernels.roped: 3}
        # the queries' ROPE is left to the attention, the keys' (written to the cache) is not
        ropes = [s for s in steps if s.op is Op.ROPE]
        assert [s.kernel for s in ropes] == [kernels.roped, KERNELS[Op.ROPE]] * 3


def test_a_rope_of_a_states_view_is_made_where_it_stands():
    # the cache write between a ROPE and its attention would change what a ROPE of a view of
    # the cache reads: that one is made where it stands, a fresh value's is left to the attention
    b = GraphBuilder()
    pos = b.input("pos", (1,), DType.I32)
    x = b.input("x", (1, 2, 16))
    cache = b.state(0, 0, (8, 2, 16), DType.F32, "cache")
    q_fresh = b.rope(x, pos, 16, 10000.0, False)
    q_cache = b.rope(b.view(cache, 0, 0, 1), pos, 16, 10000.0, False)
    k_all = b.set_rows(cache, x, pos)
    a = b.attention(q_fresh, k_all, k_all, pos, 0.25)
    c = b.attention(q_cache, k_all, k_all, pos, 0.25)
    prog = compile_program(b.build(a, c), False, lambda d: d)
    assert prog.steps[q_fresh.id].kernel is kernels.roped
    assert prog.steps[q_cache.id].kernel is KERNELS[Op.ROPE]


def test_values_with_other_readers_are_made_as_values():
    # a norm that is also an output, a SWIGLU read by two products of different weight types
    # (two products: not one fused group), a product whose ADD is an output but that another
    # node reads too: each made where it stands
    b = GraphBuilder()
    x = b.input("x", (T, 64))
    nw = b.weight(0, 0, (64,), DType.F32)
    w1, w2 = b.weight(0, 256, (64, 64), DType.F16), b.weight(0, 8448, (64, 64), DType.Q8_0)
    n = b.mul(b.rms_norm(x, 1e-5), nw)
    g = b.swiglu(n, n)
    p1, p2 = b.matmul(g, w1), b.matmul(g, w2)
    norm = b.rms_norm(p2, 1e-5)
    twice = b.add(p1, p1)
    product = b.matmul(norm, w1)
    graph = b.build(twice, b.add(product, x), norm)
    prog = compile_program(graph, False, lambda d: d)
    kernel = {nid: s.kernel for nid, s in enumerate(prog.steps) if isinstance(s, Step)}
    assert kernel[n.id] is KERNELS[Op.MUL] and kernel[n.id - 1] is KERNELS[Op.RMS_NORM]  # SWIGLU reads it
    assert kernel[g.id] is KERNELS[Op.SWIGLU]
    assert kernel[p1.id] is KERNELS[Op.MATMUL]  # ADD(p1, p1): not an ADD of it and another
    assert kernel[norm.id] is KERNELS[Op.RMS_NORM]  # an output
    assert kernel[product.id] is kernels.Product and kernel[product.id + 1] is kernels.add_product


def test_fused_products_match_the_numpy_reference(tiny):
    # An f32 KV cache: with the default f16 one, a key a few f32 ulps apart between the two
    # executors can round to a neighbouring f16, and that one rounding moved one logit by
    # 2.2e-3 on CI's CPU (the rest by 1e-6): a test of the cache's rounding, not of products
    with apir.load(str(tiny), backend="local", device="cpu", cache_type=DType.F32) as local, \
            apir.load(str(tiny), backend="numpy", cache_type=DType.F32) as ref:
        np.testing.assert_allclose(local.logits(IDS), ref.logits(IDS), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [5, ARGMAX_CHUNK, ARGMAX_CHUNK + 1, 3 * ARGMAX_CHUNK + 17])
def test_two_stage_argmax_finds_the_first_maximum(n):
    rng = np.random.default_rng(n)
    x = rng.integers(0, 7, size=(4, n)).astype(np.float32)  # many ties, across chunks
    x[1, :] = -np.inf
    x[2, -1] = 100.0  # the maximum in the padded last chunk
    got = argmax(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    assert got.dtype == np.int32


class PaddingCPU(LocalBackend):
    """A CPU executor that says what a CUDA one says: the engine pads its prefill chunks."""

    def device(self) -> DeviceInfo:
        d = super().device()
        return DeviceInfo(d.name, d.kind, d.description, d.memory_free, d.memory_total,
                          frozenset({"graph_cache"}))


def test_padded_prefill_gives_the_same_logits_and_tokens(tiny):
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=12)
    with apir.load(str(tiny), backend=PaddingCPU("cpu")) as padded, \
            apir.load(str(tiny), backend="local", device="cpu") as plain:
        assert padded._pad and not plain._pad
        np.testing.assert_allclose(padded.logits(IDS), plain.logits(IDS), rtol=1e-5, atol=1e-5)
        assert padded.logits(IDS).shape == (len(IDS), padded.vocab_size)
        assert list(padded.generate_ids(IDS, params)) == list(plain.generate_ids(IDS, params))
        greedy = SamplingParams(temperature=0, max_tokens=12)
        assert list(padded.generate_ids(IDS, greedy)) == list(plain.generate_ids(IDS, greedy))


@pytest.mark.parametrize("n_tok,window,softcap", [(1, 0, 0.0), (3, 4, 0.0), (2, 0, 30.0)])
def test_compiled_decode_attention_equals_the_batched_matmul_form(n_tok, window, softcap):
    """Under torch.compile, decode-sized attention takes the products-and-sums form; traced
    here without a C compiler (aot_eager), it must agree with the eager bmm form."""
    from apir.backends.local.kernels import attention

    g = torch.Generator().manual_seed(n_tok)
    q, k, v = (torch.randn(shape, generator=g) for shape in ((n_tok, 6, 16), (20, 2, 16), (20, 2, 16)))
    pos = torch.arange(10, 10 + n_tok, dtype=torch.int32)
    args = (q, k, v, pos, 0.25, window, softcap)
    traced = torch.compile(attention, backend="aot_eager", fullgraph=True)(*args)
    torch.testing.assert_close(traced, attention(*args), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


# ---------------------------------------------------------------- feed


def _feed_graph(backend, n_rows: int = 4, width: int = 8):
    """ids (T,) -> rows of a table (n_rows, width) -> argmax per row (T,) in [0, width)."""
    from apir.graph import DType, GraphBuilder, T

    buf = backend.alloc_buffer(n_rows * width * 4)
    table = np.arange(n_rows * width, dtype=np.float32).reshape(n_rows, width)[:, ::-1].copy()
    table[:, 1] = 1e6  # the maximum of every row sits at column 1
    backend.set_tensor(buf, 0, table)
    g = GraphBuilder()
    ids = g.input("ids", (T,), DType.I32)
    scale = g.input("scale", (1,), DType.F32)
    rows = g.get_rows(g.weight(buf, 0, (n_rows, width), DType.F32), ids)
    return backend.register_graph(g.build(g.argmax(g.mul(rows, scale)), rows))


@pytest.mark.parametrize("kind", ["local", "numpy"])
def test_fed_input_takes_the_previous_output_on_the_device(kind):
    from apir.backends import create_backend

    with create_backend(kind, "cpu" if kind == "local" else None) as b:
        gid = _feed_graph(b)
        one = np.ones(1, np.float32)
        first = b.compute(gid, {"ids": np.array([3, 0], np.int32), "scale": one})
        np.testing.assert_array_equal(first[0], [1, 1])
        fed = b.compute(gid, {"scale": one}, feed={"ids": 0})  # ids = [1, 1]
        sent = b.compute(gid, {"ids": np.array([1, 1], np.int32), "scale": one})
        for got, want in zip(fed, sent):
            np.testing.assert_array_equal(got, want)
        assert b.submit(gid, {"scale": one}, feed={"ids": 0}).result()[0].tolist() == [1, 1]


@pytest.mark.parametrize("feed,inputs,message", [
    ({"ids": 0}, {"ids": np.zeros(1, np.int32), "scale": np.ones(1, np.float32)}, "either sent or fed"),
    ({"nope": 0}, {"scale": np.ones(1, np.float32)}, "not an input"),
    ({"ids": 2}, {"scale": np.ones(1, np.float32)}, "has no output 2"),
    ({"ids": 1}, {"scale": np.ones(1, np.float32)}, "cannot be fed from output 1"),
    ({"scale": 0}, {"ids": np.zeros(1, np.int32)}, "cannot be fed"),
])
def test_bad_feeds_are_refused_clearly(feed, inputs, message):
    with LocalBackend("cpu") as b:
        gid = _feed_graph(b)
        b.compute(gid, {"ids": np.zeros(1, np.int32), "scale": np.ones(1, np.float32)})
        with pytest.raises(apir.backends.BackendError, match=message):
            b.compute(gid, inputs, feed=feed)


def test_feed_needs_a_successful_previous_compute():
    with LocalBackend("cpu") as b:
        gid = _feed_graph(b, n_rows=4, width=8)
        one = np.ones(1, np.float32)
        with pytest.raises(apir.backends.BackendError, match="has not been computed"):
            b.compute(gid, {"scale": one}, feed={"ids": 0})
        b.compute(gid, {"ids": np.zeros(1, np.int32), "scale": one})
        with pytest.raises(apir.backends.BackendError, match="index out of range"):
            b.compute(gid, {"ids": np.array([9], np.int32), "scale": one})
        # the failed compute left nothing to feed from: no stale ids are used
        with pytest.raises(apir.backends.BackendError, match="last compute failed"):
            b.compute(gid, {"scale": one}, feed={"ids": 0})
        b.compute(gid, {"ids": np.zeros(1, np.int32), "scale": one})
        with pytest.raises(apir.backends.BackendError, match="must be F32"):  # refused before running
            b.compute(gid, {"ids": np.zeros(1, np.int32), "scale": np.ones(1, np.float64)})
        failed = b.submit(gid, {"scale": one}, feed={"ids": 0})  # errors wait for result()
        with pytest.raises(apir.backends.BackendError, match="last compute failed"):
            failed.result()


def test_fed_indices_without_a_known_bound_are_checked_on_the_host():
    """argmax over 8 columns may exceed a table of 4 rows: the fed ids are checked."""
    with LocalBackend("cpu") as b:
        gid = _feed_graph(b, n_rows=4, width=8)
        one = np.ones(1, np.float32)
        b.compute(gid, {"ids": np.zeros(1, np.int32), "scale": -one})  # argmax of -row: column 7
        with pytest.raises(apir.backends.BackendError, match="index out of range"):
            b.compute(gid, {"scale": one}, feed={"ids": 0})


@pytest.mark.parametrize("kind", ["local", "numpy"])
def test_a_pick_over_t_columns_has_no_known_bound(kind):
    """argmax over a (1, T) input may exceed a table of 4 rows whatever T was at
    registration: a step with T=10 picks 9, and feeding it is refused, not read out of
    bounds."""
    from apir.backends import BackendError, create_backend
    from apir.graph import DType, GraphBuilder, T

    with create_backend(kind, "cpu" if kind == "local" else None) as b:
        buf = b.alloc_buffer(4 * 8 * 4)
        b.set_tensor(buf, 0, np.zeros((4, 8), np.float32))
        g = GraphBuilder()
        x, ids = g.input("x", (1, T)), g.input("ids", (1,), DType.I32)
        gid = b.register_graph(g.build(g.argmax(x), g.get_rows(g.weight(buf, 0, (4, 8), DType.F32), ids)))
        x10 = np.arange(10, dtype=np.float32)[None]
        assert b.compute(gid, {"x": x10, "ids": np.zeros(1, np.int32)})[0].tolist() == [9]
        with pytest.raises(BackendError, match="index out of range"):
            b.compute(gid, {"x": x10}, feed={"ids": 0})


class Recording(LocalBackend):
    """Logs ("submit", pos) and ("result", pos) for the one-token steps of the engine."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.log: list[tuple[str, int]] = []

    def submit(self, gid, inputs, feed=None):
        pos = int(inputs["pos"][-1])
        self.log.append(("submit", pos))
        pending = super().submit(gid, inputs, feed)
        outer = self

        class Logged:
            def result(self):
                outer.log.append(("result", pos))
                return pending.result()

        return Logged()


def test_generation_submits_the_next_step_before_reading_a_token(tiny):
    with apir.load(str(tiny), backend=Recording()) as model, \
            apir.load(str(tiny), backend="local", device="cpu") as plain:
        params = SamplingParams(temperature=0.8, seed=1, max_tokens=5)
        assert list(model.generate_ids(IDS, params)) == list(plain.generate_ids(IDS, params))
        n = len(IDS)
        # step at pos n+1 is sent before the token of the step at pos n is read, and so on
        assert model.backend.log[:4] == [("submit", n), ("submit", n + 1), ("result", n), ("submit", n + 2)]
        assert model.backend.log[-1][0] == "result"  # nothing left in flight
        model.backend.log.clear()
        assert model.decode_steps(5, n, 3) == plain.decode_steps(5, n, 3)
        assert model.backend.log == [("submit", n), ("submit", n + 1), ("result", n),
                                     ("submit", n + 2), ("result", n + 1), ("result", n + 2)]


def test_warm_up_leaves_generation_unchanged(tiny):
    params = SamplingParams(temperature=0.8, seed=2, max_tokens=6)
    with apir.load(str(tiny), backend="local", device="cpu") as warm, \
            apir.load(str(tiny), backend="local", device="cpu") as cold:
        warm.warm_up()
        assert list(warm.generate_ids(IDS, params)) == list(cold.generate_ids(IDS, params))
        np.testing.assert_array_equal(warm.logits(IDS), cold.logits(IDS))


class CompilingCPU(PaddingCPU):
    """Says what a CUDA executor says: with ``compiles_prefill``, what it says under
    APIR_COMPILE=all. Logs each computed step's length and whether it is greedy."""

    def __init__(self, compiles_prefill: bool) -> None:
        super().__init__("cpu")
        self.compiles_prefill = compiles_prefill
        self.steps: list[tuple[int, bool]] = []

    def device(self) -> DeviceInfo:
        d = super().device()
        extra = {"compiled_prefill"} if self.compiles_prefill else set()
        return DeviceInfo(d.name, d.kind, d.description, d.memory_free, d.memory_total, d.capabilities | extra)

    def compute(self, gid, inputs, feed=None):
        self.steps.append((len(inputs["tokens"]), SampleArgs.unpack(inputs["params"]).greedy))
        return super().compute(gid, inputs, feed)


def test_warm_up_covers_every_prefill_length_a_compiling_host_compiles(tiny):
    params = SamplingParams(temperature=0.8, seed=2, max_tokens=6)
    with apir.load(str(tiny), backend=CompilingCPU(True)) as warm, \
            apir.load(str(tiny), backend="local", device="cpu") as cold:
        warm.warm_up()
        # after the one-token prefill: the padded chunk lengths up to the context (128
        # here), greedy and sampled each
        assert warm.backend.steps == [(1, True)] + [(n, g) for n in (16, 32, 64, 128) for g in (True, False)]
        assert list(warm.generate_ids(IDS, params)) == list(cold.generate_ids(IDS, params))
    with apir.load(str(tiny), backend=CompilingCPU(False)) as plain:  # compiles decode steps only
        plain.warm_up()
        assert plain.backend.steps == [(1, True)]  # the decode steps go through submit


def test_each_index_input_is_checked_once_against_its_tightest_use(tiny):
    with apir.load(str(tiny), backend="local", device="cpu") as model:
        checks = model.backend._graphs[model._sample_graph].program.index_checks
        assert sorted(name for name, _, _ in checks) == ["pos", "tokens"]
        assert dict((n, limit) for n, limit, _ in checks) == {"pos": model.n_ctx, "tokens": model.vocab_size}
        with pytest.raises(apir.backends.BackendError, match=r"index out of range: input 'pos' must lie in \[0, "):
            model.backend.compute(model._logits_graph, {"tokens": np.array([1], np.int32),
                                                        "pos": np.array([model.n_ctx], np.int32)})


def test_fused_products_whose_shared_operand_is_a_weight():
    """Fusion drops the separate copies of fused weights, not the activation they share,
    even when that activation is itself a weight."""
    from apir.backends.numpy_ref import NumpyBackend
    from apir.graph import DType, GraphBuilder

    outs = []
    for backend in (LocalBackend("cpu"), NumpyBackend()):
        with backend as b:
            buf = b.alloc_buffer(4 * 8 * 12)
            b.set_tensor(buf, 0, np.random.default_rng(0).standard_normal(8 * 12).astype(np.float32))
            g = GraphBuilder()
            x = g.weight(buf, 0, (3, 8), DType.F32)
            w1, w2 = g.weight(buf, 96, (4, 8), DType.F32), g.weight(buf, 224, (5, 8), DType.F32)
            outs.append(b.compute(b.register_graph(g.build(g.matmul(x, w1), g.matmul(x, w2))), {}))
    for got, want in zip(*outs):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_executor_runs_as_its_config_says_not_as_the_environment_does(tmp_path, monkeypatch):
    """A library user's LocalBackend gets the built-in defaults whatever the environment or
    ~/.config/apir/config.toml say; callers at the edge resolve those once (from_env)."""
    config = tmp_path / "config.toml"
    config.write_text('cuda_graphs = "0"\n')
    monkeypatch.setenv("APIR_CONFIG", str(config))
    monkeypatch.setenv("APIR_COMPILE", "all")
    assert ExecutorConfig.from_env() == ExecutorConfig(cuda_graphs=False, compile="all")
    monkeypatch.setenv("APIR_COMPILE", "0")
    assert ExecutorConfig.from_env().compile == "off"
    assert ExecutorConfig.from_env().dequant_cache is False  # unset: off, on every device
    monkeypatch.setenv("APIR_DEQUANT_CACHE", "1")
    assert ExecutorConfig.from_env().dequant_cache is True
    with LocalBackend("cpu") as b:
        assert not b.dequant_cache  # the default, whatever the environment says
    with LocalBackend("cpu", config=ExecutorConfig(dequant_cache=True)) as b:
        assert b.dequant_cache
    with LocalBackend("cpu") as b:
        assert (b.compile_prefill, b.cuda_graphs) == (False, False)  # cpu: never captured
    with LocalBackend("cpu", config=ExecutorConfig(compile="all")) as b:
        assert b.compile_prefill
    with pytest.raises(ValueError, match="compile must be one of"):
        ExecutorConfig(compile="1")
