"""The CUDA path (run on a GPU host: pytest -m gpu). Skipped where torch sees no GPU."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import TinyConfig, write_tiny_gguf

import apir
from apir.engine import SamplingParams
from apir.models.errors import ModelNotFoundError
from apir.models.resolve import resolve_model

pytestmark = pytest.mark.gpu
PROMPT = "The capital of France is"


def _models(tmp_path) -> list[str]:
    # F16, and Q4_0: its decode steps through the fused kernel, which makes the norms and
    # SwiGLU as it rounds x and adds the residuals as it writes y
    out = [str(write_tiny_gguf(tmp_path / f"tiny-{t}.gguf", TinyConfig(context_length=512), t))
           for t in ("F16", "Q4_0")]
    for name in ("smollm2-135m", "gemma3-270m"):
        try:
            out.append(str(resolve_model(name)))
        except ModelNotFoundError:
            pass
    return out


def _decode(path: str, cuda_graphs: bool) -> tuple[list[int], list[int], np.ndarray]:
    from apir.backends import ExecutorConfig
    from apir.backends.local import LocalBackend

    backend = LocalBackend("cuda", config=ExecutorConfig(cuda_graphs=cuda_graphs))
    with apir.load(path, backend=backend) as model:
        ids = model.tokenize(PROMPT)
        greedy = list(model.generate_ids(ids, SamplingParams(temperature=0, max_tokens=48)))
        sampled = list(model.generate_ids(ids, SamplingParams(temperature=0.9, seed=3, max_tokens=48)))
        return greedy, sampled, model.logits(ids)


def test_captured_graph_decode_equals_eager_decode(tmp_path):
    # not the tiny Q4_0 model: random weights put its three best logits within 0.012 of
    # each other at the fourth greedy step, where an x value that Inductor's norm rounds to
    # another int8 step parts the two runs (on main's kernels too: an H100, 2026-12-07,
    # bench/results/h100-2026-12-07-s22-callG.txt); its decode is held to the CPU below
    models = _models(tmp_path)
    for path in [models[0], *models[2:]]:
        captured = _decode(path, cuda_graphs=True)
        eager = _decode(path, cuda_graphs=False)
        assert captured[0] == eager[0], path
        assert captured[1] == eager[1], path
        # A 5-token prompt is a step short enough to be compiled (CAPTURE_MAX_DECODE), and
        # Inductor sums in another order than eager (SmolLM2 on the H200: 78% of the logits
        # off by up to 0.04, the tokens identical).
        np.testing.assert_allclose(captured[2], eager[2], rtol=1e-2, atol=5e-2)


def test_cuda_matches_cpu_reference(tmp_path):
    path, quantized = _models(tmp_path)[:2]
    with apir.load(path, backend="local", device="cuda") as gpu, apir.load(path, backend="numpy") as ref:
        ids = gpu.tokenize(PROMPT)
        np.testing.assert_allclose(gpu.logits(ids), ref.logits(ids), rtol=2e-2, atol=2e-2)
    # Q4_0, one token a step (the fused decode kernel: x rounded to int8 per group of 32)
    # against the CPU's products from the exact f32 weights. The tiny model's rows are two
    # groups: its steps' logits were off by 1.8-3.9% of their largest, the same with and
    # without the activations made in the kernel (an H100, 2026-12-07)
    with apir.load(quantized, backend="local", device="cuda") as gpu, \
            apir.load(quantized, backend="local", device="cpu") as cpu:
        ids = gpu.tokenize(PROMPT)
        for i in range(len(ids)):
            want = cpu.logits(ids[i : i + 1], start=i)[-1]
            got = gpu.logits(ids[i : i + 1], start=i)[-1]
            np.testing.assert_allclose(got, want, rtol=0, atol=0.06 * float(np.abs(want).max()))


def test_remote_cuda_is_identical_to_local_cuda(tmp_path):
    from hosts import start_host

    host = start_host(tmp_path, "--device", "cuda")
    try:
        for path in _models(tmp_path)[:2]:
            with apir.load(path, backend="local", device="cuda") as local:
                ids = local.tokenize(PROMPT)
                want = list(local.generate_ids(ids, SamplingParams(temperature=0, max_tokens=32)))
            with apir.load(path, backend="remote", remote=host.unix) as remote:
                assert list(remote.generate_ids(ids, SamplingParams(temperature=0, max_tokens=32))) == want
    finally:
        host.stop()


def test_one_row_product_kernel_matches_float64():
    import torch

    from apir.backends.local import gemv, kernels

    torch.manual_seed(0)
    # llama shapes (q/k/v, down, output of the 135M and 1B) and ragged ones (masks)
    for n, k in [(960, 576), (576, 1536), (3072, 2048), (2048, 8192), (49152, 576), (100, 300), (7, 33)]:
        for dtype in (torch.float16, torch.bfloat16):
            w = torch.randn(n, k, dtype=dtype, device="cuda")
            x = torch.randn(1, k, device="cuda")
            assert gemv.usable(x, w)
            y = kernels.matmul(x, w)
            want = x.to(dtype).double() @ w.double().T
            assert y.dtype == torch.float32 and y.shape == (1, n)
            torch.testing.assert_close(y.double(), want, rtol=0, atol=1e-5 * k ** 0.5 * 4)
            assert torch.equal(y, gemv.gemv(x, w))  # the same blocks, the same bits


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_quantized_weights_packed_in_place_match_the_reference(tmp_path, qtype):
    """A quantized model on CUDA: its weights packed in place for the kernels (qpack), the
    logits those of the numpy reference, its memory the GGUF's bytes, and a weight read
    back through the API its GGUF bytes."""
    path = str(write_tiny_gguf(tmp_path / f"{qtype}.gguf", TinyConfig(context_length=512), qtype))
    with apir.load(path, backend="local", device="cuda") as gpu, apir.load(path, backend="numpy") as ref:
        ids = gpu.tokenize(PROMPT)
        np.testing.assert_allclose(gpu.logits(ids), ref.logits(ids), rtol=2e-2, atol=2e-2)
        be = gpu.backend
        spans = [(buf, off, rec) for buf in be._buffers.values()
                 for off, rec in be._packed.get(id(buf), {}).items()]
        assert spans  # packed in place
        buf, off, (qt, n, k, size) = spans[0]
        handle = next(h for h, b in be._buffers.items() if b is buf)
        packed = buf.storage[off : off + size].clone()
        from apir.backends.local import qpack
        assert be.get_tensor(handle, off, size) == qpack.unpack(packed, qt, n, k).cpu().numpy().tobytes()


def test_fixed_shape_torch_graph_is_recorded_from_its_second_run():
    """A torch frontend graph (no token axis) runs eagerly once, then is compiled and
    replayed as one CUDA graph; every run gives eager PyTorch's result for its own input."""
    torch = pytest.importorskip("torch")
    import apir.torch  # noqa: F401 - registers the backend "apir"
    from apir.backends.local import LocalBackend

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.LayerNorm(128),
                                torch.nn.Linear(128, 10)).eval()
    backend = LocalBackend("cuda")
    try:
        compiled = torch.compile(model, backend="apir", options={"backend": backend})
        with torch.no_grad():
            for run in range(4):
                x = torch.randn(8, 64)
                torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
                # the forward's graph (Dynamo may register others, run once)
                reg = max(backend._graphs.values(), key=lambda r: r.program.runs)
                assert reg.program.fixed and reg.program.runs == run + 1
                assert bool(reg.program.captured) == (run >= 1)
    finally:
        backend.close()


def test_kept_outputs_feed_back_through_recorded_steps(monkeypatch):
    """keep_outputs on CUDA: a graph whose input is the previous call's kept output, run
    eagerly once, then compiled and replayed, gives eager PyTorch's chain of results (the
    STATE writes and the device copies between them ordered with the replays)."""
    torch = pytest.importorskip("torch")
    import apir.torch  # noqa: F401 - registers the backend "apir"
    from apir.backends.local import LocalBackend
    from apir.torch import HostTensor, held

    monkeypatch.setattr(held, "KEEP_MIN_BYTES", 64 << 10)
    torch.manual_seed(0)
    w = torch.randn(256, 256) / 16
    backend = LocalBackend("cuda")
    try:
        step = torch.compile(lambda x, w: torch.tanh(x @ w) + x, backend="apir",
                             options={"backend": backend, "keep_outputs": True})
        with torch.no_grad():
            x = want = torch.randn(128, 256)
            for _ in range(5):
                x, want = step(x, w), torch.tanh(want @ w) + want
            assert isinstance(x, HostTensor)
            torch.testing.assert_close(x.materialize(), want, rtol=1e-4, atol=1e-4)
        assert any(r.program.captured for r in backend._graphs.values())
    finally:
        backend.close()


def test_a_warm_worker_has_paid_the_first_launches(caplog):
    """warm_device, as a warm host worker runs it: every tiny call succeeds (no warning),
    and what a session's first kernel would compute (Triton's own hash, Inductor's hash of
    torch) is already cached in this process."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from triton.runtime.cache import triton_key

    from apir.backends.local.warm import warm_device

    with caplog.at_level("WARNING", logger="apir.local"):
        warm_device(torch.device("cuda"), compiles=True)
    assert not caplog.records
    assert triton_key.cache_info().currsize == 1


def test_a_fixed_shape_graph_that_compiles_runs_eagerly_first_then_replays_its_compiled_step():
    """A fixed-shape graph whose compile succeeds (a scale of its input): the first run
    is eager (no compiled step kept outside a recording, where the replay would find it),
    later runs replay the compiled, recorded step; every run gives the input times 2."""
    from apir.backends.local import LocalBackend
    from apir.backends.local.capture import CapturedStep
    from apir.graph import GraphBuilder

    backend = LocalBackend("cuda")
    try:
        g = GraphBuilder()
        gid = backend.register_graph(g.build(g.scale(g.input("x", (64, 256)), 2.0)))
        prog = backend._graphs[gid].program
        for run in range(3):
            x = np.full((64, 256), run + 0.5, np.float32)
            (out,) = backend.compute(gid, {"x": x})
            np.testing.assert_array_equal(out, 2 * x)
            assert all(isinstance(step, CapturedStep) for step in prog.captured.values())
            assert bool(prog.captured) == (run >= 1)
    finally:
        backend.close()


def test_a_large_input_is_copied_straight_into_a_recorded_step():
    """A recorded step's large input (a batch of images) skips the pinned host staging:
    copied from where it lies, pageable or page-locked, into its device view. Every replay
    computes with that step's own values, the small input's beside it too, also when the
    caller rewrites the same array between steps."""
    torch = pytest.importorskip("torch")
    from apir.backends.local import LocalBackend
    from apir.backends.local.capture import DIRECT_MIN_BYTES
    from apir.graph import GraphBuilder

    rows = DIRECT_MIN_BYTES // (4 * 256) * 3  # 3 MiB of f32
    backend = LocalBackend("cuda")
    try:
        g = GraphBuilder()
        big, small = g.input("big", (rows, 256)), g.input("small", (1, 256))
        gid = backend.register_graph(g.build(g.add(big, small)))
        prog = backend._graphs[gid].program
        pinned = torch.empty((rows, 256), dtype=torch.float32, pin_memory=True).numpy()
        pageable = np.empty((rows, 256), np.float32)
        for run in range(6):
            x = pinned if run % 2 else pageable
            x[:] = np.arange(rows, dtype=np.float32)[:, None] + run
            s = np.full((1, 256), 10.0 * run, np.float32)
            (out,) = backend.compute(gid, {"big": x, "small": s})
            np.testing.assert_array_equal(out, x + s)
        (step,) = prog.captured.values()
        assert step.staged_bytes == 256 * 4  # only the small input is staged
    finally:
        backend.close()
