"""apir.torch: PyTorch programs compiled with torch.compile(backend="apir") give what eager
PyTorch gives, on the local backend and through a real host daemon; weights cross once;
an op without a lowering splits the graph with a warning instead of failing.

The vision models are written here from torch.nn modules (ResNet-18 as torchvision builds
it, and a small ViT; random weights): torchvision has no build that imports beside this
project's torch 2.13.0 CPU wheel.
"""

from __future__ import annotations

import os
import warnings

import pytest

torch = pytest.importorskip("torch")

import apir.torch  # noqa: E402
from apir.backends import BackendError, create_backend  # noqa: E402

F = torch.nn.functional


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # each test compiles afresh (Dynamo caches per code object)
    yield
    torch._dynamo.reset()


@pytest.fixture(params=["local", "remote"])
def apir_backend(request):
    if request.param == "local":
        be = create_backend("local", device="cpu")
    else:
        be = create_backend("remote", remote=request.getfixturevalue("host").unix)
    yield be
    be.close()


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.fc1, self.fc2 = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)

    def forward(self, x):  # x (B, N, D)
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class TinyViT(torch.nn.Module):
    """Patches of 4x4 pixels, two pre-norm blocks, mean pooling, a classifier."""

    def __init__(self, dim: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.patch = torch.nn.Linear(3 * 4 * 4, dim)
        self.pos = torch.nn.Parameter(torch.randn(1, 16, dim) * 0.02)
        self.blocks = torch.nn.Sequential(Block(dim, 4), Block(dim, 4))
        self.norm, self.head = torch.nn.LayerNorm(dim), torch.nn.Linear(dim, classes)

    def forward(self, img):  # img (B, 3, 16, 16)
        b = img.shape[0]
        p = img.reshape(b, 3, 4, 4, 4, 4).permute(0, 2, 4, 1, 3, 5).reshape(b, 16, 48)
        x = self.blocks(self.patch(p) + self.pos)
        return self.head(self.norm(x).mean(dim=1)).softmax(-1)


def test_vit_matches_eager_and_uploads_weights_once() -> None:
    torch.manual_seed(0)
    model = TinyViT().eval()
    be = create_backend("local", device="cpu")
    compiled = torch.compile(model, backend="apir", options={"backend": be})
    session = apir.torch.session_for({"backend": be})
    params = sum(p.numel() * 4 for p in model.parameters())
    with torch.no_grad():
        for batch in (2, 2, 5):
            img = torch.randn(batch, 3, 16, 16)
            torch.testing.assert_close(compiled(img), model(img), rtol=1e-4, atol=1e-5)
        assert session.uploaded == params  # once, however many calls and batch sizes
        model.head.bias.add_(1.0)  # a changed weight is sent again, and used
        img = torch.randn(2, 3, 16, 16)
        torch.testing.assert_close(compiled(img), model(img), rtol=1e-4, atol=1e-5)
    assert session.uploaded == params + model.head.bias.numel() * 4


class BasicBlock(torch.nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        nn = torch.nn
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.downsample = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet18(torch.nn.Module):
    """torchvision's resnet18, layer for layer (its modules, widths and strides)."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        nn = torch.nn
        self.conv1, self.bn1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        blocks, cin = [], 64
        for i, cout in enumerate((64, 128, 256, 512)):
            blocks += [BasicBlock(cin, cout, 1 if i == 0 else 2), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*blocks)
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d((1, 1)), nn.Linear(512, classes)

    def forward(self, x):
        x = self.maxpool(torch.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(self.avgpool(self.layers(x)), 1))


def test_resnet18_matches_eager(apir_backend) -> None:
    torch.manual_seed(1)
    model = ResNet18().eval()
    for m in model.modules():  # random statistics, so batch norm is not the identity
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)
    compiled = torch.compile(model, backend="apir", options={"backend": apir_backend})
    img = torch.randn(2, 3, 64, 64)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="apir.torch")  # all lowered, statistics static
        got, want = compiled(img), model(img)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    with open("/proc/self/maps") as f:
        assert "libcuda" not in f.read()  # the guest ran no CUDA library


class Assorted(torch.nn.Module):
    """Lowerings the models above do not reach: integer inputs, pow by each exponent,
    reductions and softmax off the last axis, broadcast division, expand, select, slices,
    an empty input (a cache before its first step)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(20, 6)
        self.register_buffer("offset", torch.linspace(-1.0, 1.0, 6))

    def forward(self, ids, x, past):  # ids (2, 3) int64, x (2, 3, 6), past (2, 0, 6): empty
        h = self.emb(ids) + x.pow(2) - x.pow(3) / 4 + x.abs().pow(0.5) + self.offset
        h = torch.cat([past, h], dim=1)
        h = h / (1.0 + h.pow(2).sum(dim=0, keepdim=True))  # a reduction over the first axis
        g = torch.softmax(h, dim=1) * torch.sigmoid(h).amax(dim=(0, 2), keepdim=True)
        e = h[:, :1, :].expand(2, 3, 6) + h.select(1, 2).unsqueeze(1)
        tail = torch.cat([h[..., 4:], 1.0 - h[..., :2].exp().log().pow(-0.5).pow(-1.0)], dim=-1)
        return g + e, tail.mean(), (ids.float() * 2).pow(-1.0), torch.tanh(h).relu().rsqrt()


def test_assorted_lowerings_match_eager() -> None:
    torch.manual_seed(2)
    model = Assorted().eval()
    be = create_backend("numpy")
    compiled = torch.compile(model, backend="apir", options={"backend": be})
    ids, x = torch.tensor([[1, 2, 19], [0, 5, 7]]), torch.randn(2, 3, 6)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # every op lowered: no graph break, no eager fallback
        got = compiled(ids, x, torch.zeros(2, 0, 6))
    want = model(ids, x, torch.zeros(2, 0, 6))
    assert [t.dtype for t in got] == [t.dtype for t in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_zero_dim_tensors_keep_their_shape(apir_backend) -> None:
    """0-d results are 0-d, as in PyTorch: a backend gives a 0-d output back as (1,) (the
    step layout's convention), which ``x * 2`` of a scalar tensor returned as is; and
    softmax, transpose and reductions over a 0-d tensor's dim lower (a ZeroDivisionError)."""
    def f(x, y):
        return (x * 2, x + y, x.t() * 3, x.softmax(-1), x.sum(0, keepdim=True) + 1,
                x.amax(-1) * y, x * torch.ones(2, 3))

    compiled = torch.compile(f, backend="apir", options={"backend": apir_backend})
    x, y = torch.tensor(3.0), torch.tensor(-1.5)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="apir.torch")  # every op lowered
        got = compiled(x, y)
    want = f(x, y)
    assert [t.shape for t in got] == [t.shape for t in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_integer_and_bool_operands_of_float_ops_are_promoted() -> None:
    """PyTorch promotes an integer or bool operand of a float op (a mask, a position
    table, token ids scaled); apir's ops take floats, so the lowering casts: these graphs
    lowered whole failed and fell back to PyTorch, the whole graph, with a GraphError."""
    def f(x, mask, keep, ids):
        pooled = (x * mask.unsqueeze(-1)).sum(1)  # mean pooling under an attention mask
        return pooled, x * keep + torch.arange(8), ids * 0.5, ids / 2, torch.exp(ids), \
            ids.pow(0.5), ids.sum(-1, dtype=torch.float32)

    compiled = torch.compile(f, backend="apir", options={"backend": "numpy"})
    args = (torch.randn(2, 5, 8), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]),
            torch.rand(2, 5, 8) > 0.5, torch.tensor([[1, 2, 3], [4, 5, 6]]))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="apir.torch")  # lowered whole
        got = compiled(*args)
    for a, b in zip(got, f(*args)):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b)


def test_batch_norm_without_affine_parameters_lowers() -> None:
    """BatchNorm2d(affine=False) has no weight or bias (None in the graph): it lowered as
    "computed statistics" and the whole graph ran in PyTorch."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4, affine=False)).eval()
    model[1].running_mean.uniform_(-1.0, 1.0)
    model[1].running_var.uniform_(0.5, 2.0)
    compiled = torch.compile(model, backend="apir", options={"backend": "numpy"})
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="apir.torch")
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


def test_arguments_without_a_lowering_are_a_graph_break_not_a_whole_graph_fallback() -> None:
    """A pooling's ceil_mode (or count_include_pad=False, or addmm's beta) is seen in the
    node's arguments: only that node runs in PyTorch, split out with one warning naming it;
    it made the whole graph run in PyTorch ("cannot lower this graph for these inputs")."""
    nn = torch.nn
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.MaxPool2d(2, ceil_mode=True), nn.ReLU(),
                          nn.AvgPool2d(3, 2, 1, count_include_pad=False), nn.Conv2d(4, 2, 1)).eval()
    be = create_backend("numpy")
    compiled = torch.compile(model, backend="apir", options={"backend": be})
    x = torch.randn(2, 3, 10, 10)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = compiled(x)
    messages = sorted(str(w.message) for w in caught if "apir.torch" in str(w.message))
    assert messages == [f"apir.torch: {op} has no apir lowering: it runs in PyTorch on the guest "
                        "(a graph break)" for op in ("aten.avg_pool2d.default", "aten.max_pool2d_with_indices.default")]
    with torch.no_grad():
        torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-5)
    # the convolutions ran on apir
    assert apir.torch.session_for({"backend": be}).uploaded == sum(p.numel() * 4 for p in model.parameters())


def test_op_without_a_lowering_is_a_graph_break_with_one_warning() -> None:
    class Cumulative(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.relu(self.lin(x).cumsum(-1)) * 2, x.int() * 3  # integer arithmetic: PyTorch's

    model = Cumulative().eval()
    be = create_backend("numpy")
    compiled = torch.compile(model, backend="apir", options={"backend": be})
    x = torch.randn(3, 8)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = compiled(x), compiled(x)
    messages = sorted(str(w.message) for w in caught if "apir.torch" in str(w.message))
    assert messages == [f"apir.torch: {op} has no apir lowering: it runs in PyTorch on the guest "
                        "(a graph break)" for op in ("aten._to_copy.default", "aten.cumsum.default", "aten.mul.Tensor")]
    with torch.no_grad():
        want = model(x)
    for got in (first, second):
        torch.testing.assert_close(got, want)
        assert got[1].dtype == torch.int32
    assert apir.torch.session_for({"backend": be}).uploaded == sum(p.numel() * 4 for p in model.parameters())


def test_random_ops_draw_at_every_call() -> None:
    """torch.randn(3) or torch.randint(...) depend on no input, so they were folded while
    lowering, a constant: every call gave the first call's draw. They run in PyTorch at
    each call (a graph break), drawing what eager draws from the same seed."""
    def f(x):
        return x + torch.randn(3) * torch.randint(1, 5, (3,))

    def g():  # a graph without inputs
        return torch.rand(2, 3) * 2

    for fn, args in ((f, (torch.ones(3),)), (g, ())):
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="apir", options={"backend": "numpy"})
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the graph breaks' warnings
            torch.manual_seed(3)
            got = [compiled(*args) for _ in range(3)]
        torch.manual_seed(3)
        want = [fn(*args) for _ in range(3)]
        assert not torch.equal(got[0], got[1])
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


def test_a_graph_its_inputs_cannot_lower_runs_eagerly_with_one_warning() -> None:
    model = torch.nn.Conv2d(3, 4, 1, padding=1).eval()  # CONV2D takes padding < kernel only
    compiled = torch.compile(model, backend="apir", options={"backend": "numpy"})
    x = torch.randn(1, 3, 5, 5)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [compiled(x) for _ in range(2)]
    messages = [str(w.message) for w in caught if "apir.torch" in str(w.message)]
    assert messages == ["apir.torch: cannot lower this graph for these inputs (GraphError: CONV2D: "
                        "CONV2D padding (1, 1) must be less than the kernel (1, 1)); it runs in "
                        "PyTorch on the guest"]
    with torch.no_grad():
        for g in got:
            torch.testing.assert_close(g, model(x))


def test_training_is_refused_with_a_clear_error() -> None:
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="apir", options={"backend": "numpy"})
    with pytest.raises(Exception, match="inference only"):
        compiled(torch.randn(2, 4))


def test_unknown_options_are_named() -> None:
    with pytest.raises(ValueError, match=r"unknown apir options \['remot'\]"):
        apir.torch.session_for({"backend": "remote", "remot": "unix:///x"})


# ---------------------------------------------------------------- transformers


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M's GGUF through transformers' GGUF loader, offline, cut to its first two
    layers (the whole model takes minutes of Dynamo tracing on 2 cores; BENCHMARKS has it)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from apir.models.resolve import resolve_model

    try:
        path = resolve_model("smollm2-135m")
    except Exception as e:  # noqa: BLE001 - the package is a test extra
        pytest.skip(f"SmolLM2 GGUF not installed: {e}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                num_hidden_layers=2).eval()


def test_transformers_llama_generates_eager_tokens(smollm2, apir_backend) -> None:
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])
    with torch.no_grad():
        want_logits = smollm2(ids).logits
        want = smollm2.generate(ids, max_new_tokens=8, do_sample=False)
        smollm2.forward = torch.compile(smollm2.forward, backend="apir", options={"backend": apir_backend})
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message="apir.torch")  # every graph lowered whole
                logits = smollm2(ids).logits
                got = smollm2.generate(ids, max_new_tokens=8, do_sample=False)
        finally:
            del smollm2.forward  # the class's own forward again
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-3)
    assert got.tolist() == want.tolist()
    assert len(set(want[0, 6:].tolist())) > 1  # a real continuation, not one token repeated


def test_transformers_padded_batch_splits_graphs_and_keeps_eager_tokens(smollm2) -> None:
    """Left padding makes transformers build its mask from the attention_mask input (ops
    apir has no lowering for: where, index, integer casts): those run in PyTorch on the
    guest, the rest on apir, and the tokens stay eager's."""
    ids = torch.tensor([[2, 2, 1, 504, 3458, 282], [1, 504, 3458, 282, 4649, 314]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    be = create_backend("local", device="cpu")
    with torch.no_grad():
        want = smollm2.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=2)
        smollm2.forward = torch.compile(smollm2.forward, backend="apir", options={"backend": be})
        try:
            got = smollm2.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=2)
        finally:
            del smollm2.forward
    assert got.tolist() == want.tolist()
    assert apir.torch.session_for({"backend": be}).uploaded > 0  # apir ran the rest


def test_fixed_shape_graphs_are_recorded_from_their_second_run_only() -> None:
    """This frontend's graphs have no token axis: each shape is its own graph. On a GPU one
    is recorded and compiled from its second run (see test_gpu.py), never at its first: a
    generate() registers one per cache length and runs each once."""
    from apir.backends.local.executor import capturable

    backend = create_backend("local", device="cpu")
    compiled = torch.compile(torch.nn.Linear(4, 3).eval(), backend="apir", options={"backend": backend})
    with torch.no_grad():
        for _ in range(2):
            compiled(torch.randn(2, 4))
    reg = max(backend._graphs.values(), key=lambda r: r.program.runs)
    assert reg.program.fixed and reg.program.runs == 2
    assert not capturable(0)  # no token axis: the run count decides
    assert [n for n in range(1, 40) if capturable(n)] == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32]
    backend.close()


def test_kept_and_returned_graphs_of_one_backend_share_its_weights(keep_64k) -> None:
    from apir.torch import HostTensor

    layer = torch.nn.Linear(256, 512).eval()
    options = {"backend": "local", "device": "cpu"}
    returned = torch.compile(layer, backend="apir", options=options)
    kept = torch.compile(torch.nn.Sequential(layer), backend="apir", options={**options, "keep_outputs": True})
    x = torch.randn(64, 256)
    with torch.no_grad():
        assert type(returned(x)) is torch.Tensor
        session = apir.torch.session_for(options)
        uploaded = session.uploaded
        y = kept(x)
    assert isinstance(y, HostTensor) and session.uploaded == uploaded  # the same weights, not sent again
    torch.testing.assert_close(y.materialize(), layer(x).detach())


def test_keep_outputs_takes_a_bool_only() -> None:
    with pytest.raises(ValueError, match="keep_outputs must be True or False, got 'false'"):
        apir.torch.session_for({"backend": "local", "keep_outputs": "false"})


def test_arena_size_is_refused_for_a_backend_without_one() -> None:
    with pytest.raises(BackendError, match="arena_size is for the remote backend"):
        apir.torch.session_for({"backend": "local", "arena_size": 8 << 20})


def test_a_remote_session_takes_the_arena_size_it_is_given(host) -> None:
    """``arena_size`` reaches the remote backend: a batch whose step moves more than the
    default arena can be given room (the host caps it at its --max-arena)."""
    options = {"backend": "remote", "remote": host.unix, "arena_size": 8 << 20}
    session = apir.torch.session_for(options)
    try:
        # the region holding it is 8 MiB, its rings and header included (the default: 256 MiB)
        assert 4 << 20 <= session.backend.arena.size <= 8 << 20
    finally:
        apir.torch._sessions.pop(tuple(sorted(options.items()))).backend.close()


# ---------------------------------------------------------------- outputs kept on the host


class _Counting:
    """Counts a backend's byte-moving calls (and the bytes each compute returns)."""

    def __init__(self, backend) -> None:
        self.calls: dict[str, int] = {"set_tensor": 0, "copy_tensor": 0, "get_tensor": 0}
        self.returned: list[int] = []  # bytes of the outputs of each compute
        for name in self.calls:
            setattr(backend, name, self._count(name, getattr(backend, name)))
        compute = backend.compute

        def counted(*args, **kwargs):
            outs = compute(*args, **kwargs)
            self.returned.append(sum(o.nbytes for o in outs))
            return outs

        backend.compute = counted

    def _count(self, name: str, fn):
        def counted(*args, **kwargs):
            self.calls[name] += 1
            return fn(*args, **kwargs)
        return counted


def _gc_live() -> int:
    import gc

    from apir.torch import held

    gc.collect()
    return held.live()


@pytest.fixture
def keep_64k(monkeypatch):
    """Outputs of 64 KiB or more kept (the default threshold, 1 MiB, is for real models)."""
    from apir.torch import held

    monkeypatch.setattr(held, "KEEP_MIN_BYTES", 64 << 10)


def test_kept_outputs_stay_on_the_host_until_read_and_feed_back_without_crossing(apir_backend, keep_64k) -> None:
    from apir.torch import HostTensor

    w1, w2 = torch.randn(64, 512), torch.randn(512, 64)

    def layer(x, w):
        return (x @ w).relu(), x.sum()

    count = _Counting(apir_backend)
    compiled = torch.compile(layer, backend="apir", options={"backend": apir_backend, "keep_outputs": True})
    x = torch.randn(256, 64)
    with torch.no_grad():
        h, total = compiled(x, w1)  # h: 512 KiB, kept; total: 4 bytes, returned
        assert isinstance(h, HostTensor) and not isinstance(total, HostTensor)
        assert h.shape == (256, 512) and h.dtype == torch.float32
        assert count.returned == [4] and count.calls["get_tensor"] == 0
        y, _ = compiled(h, w2)  # fed back: copied on the host, never downloaded or sent
        assert count.calls["get_tensor"] == 0 and count.calls["copy_tensor"] >= 2
        assert isinstance(y, HostTensor) and count.returned[-1] == 4  # y: 64 KiB, the threshold
        torch.testing.assert_close(h + 0, (x @ w1).relu(), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(y.materialize(), ((x @ w1).relu() @ w2).relu(), rtol=1e-4, atol=1e-3)
    gets = count.calls["get_tensor"]
    assert gets >= 1  # read: downloaded once, then held by the guest
    assert h.tolist() == (h * 1).tolist() and count.calls["get_tensor"] == gets
    del h, y
    assert _gc_live() == 0


def test_a_host_tensor_the_guest_writes_is_fed_back_as_the_guest_wrote_it(keep_64k) -> None:
    be = create_backend("local", device="cpu")
    compiled = torch.compile(lambda x: x * 2, backend="apir", options={"backend": be, "keep_outputs": True})
    count = _Counting(be)
    with torch.no_grad():
        x = torch.randn(128, 256)
        y = compiled(x)
        y.add_(1)  # the guest's downloaded copy is the value now
        z = compiled(y)
        assert count.calls["set_tensor"] >= 1  # uploaded, not copied from the host's stale bytes
        torch.testing.assert_close(z.materialize(), (x * 2 + 1) * 2)
        v = compiled(x)[0]  # a view of a HostTensor is a plain tensor over its download
        v[0] = 5.0
        assert isinstance(v, torch.Tensor) and float(v[0]) == 5.0
        other = create_backend("local", device="cpu")  # another session's: its bytes uploaded
        elsewhere = torch.compile(lambda x: x + 3, backend="apir", options={"backend": other})
        torch.testing.assert_close(elsewhere(compiled(x)), x * 2 + 3)
        other.close()
    be.close()


def test_a_host_tensor_pickles_as_its_value_and_refuses_its_address(keep_64k) -> None:
    import io

    be = create_backend("local", device="cpu")
    compiled = torch.compile(lambda x: x - 1, backend="apir", options={"backend": be, "keep_outputs": True})
    with torch.no_grad():
        x = torch.randn(256, 128)
        y = compiled(x)
    saved = io.BytesIO()
    torch.save({"y": y}, saved)
    saved.seek(0)
    loaded = torch.load(saved)["y"]  # weights_only: a plain tensor, nothing of apir's
    assert type(loaded) is torch.Tensor and torch.equal(loaded, x - 1)
    with pytest.raises(RuntimeError, match=r"on the apir host .*materialize\(\)"):
        y.data_ptr()
    be.close()


def test_transformers_generate_with_kept_outputs_keeps_the_cache_on_the_host(smollm2, apir_backend,
                                                                             monkeypatch) -> None:
    """transformers feeds its KV cache back every step: kept on the host, it never crosses
    (the compute replies carry the logits only), grows by one position a call without a
    recompile per step, and the tokens stay eager's."""
    from apir.torch import HostTensor, held

    monkeypatch.setattr(held, "KEEP_MIN_BYTES", 1)  # this 2-layer cut's cache is small
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])
    count = _Counting(apir_backend)
    with torch.no_grad():
        want = smollm2.generate(ids, max_new_tokens=8, do_sample=False)
        smollm2.forward = torch.compile(smollm2.forward, backend="apir",
                                        options={"backend": apir_backend, "keep_outputs": True})
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message="apir.torch")
                warnings.filterwarnings("error", message=".*recompile_limit")
                out = smollm2(ids)
                got = smollm2.generate(ids, max_new_tokens=8, do_sample=False)
                # once more: Dynamo's dynamic graph, compiled last, now takes the first decode
                # length too (one more lowering); then every length is registered
                smollm2.generate(ids, max_new_tokens=8, do_sample=False)
                count.calls = dict.fromkeys(count.calls, 0)
                count.returned.clear()
                again = smollm2.generate(ids, max_new_tokens=8, do_sample=False)
        finally:
            del smollm2.forward
    assert got.tolist() == want.tolist() == again.tolist()
    layer = out.past_key_values.layers[0]
    assert isinstance(layer.keys, HostTensor) and layer.keys.shape[-2] == 6
    # the repeat: no byte of the cache crossed either way; each step replied with the
    # 4-byte placeholder, and generate read each step's logits once
    assert count.calls["set_tensor"] == 0 and count.calls["get_tensor"] == 8
    assert count.returned == [4] * 8
    del out, layer
    assert _gc_live() == 0


def test_generate_with_kept_outputs_shares_staging_across_cache_lengths(smollm2, monkeypatch) -> None:
    """Each cache length is its own registered graph; their staging buffers are shared per
    role (and grow by doubling), so generating 12 more tokens holds about what 4 did, not
    another logits-sized staging pair per length."""
    from apir.backends import BufferPurpose
    from apir.torch import held

    monkeypatch.setattr(held, "KEEP_MIN_BYTES", 1)
    be = create_backend("local", device="cpu")
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])

    def kv_bytes() -> int:  # staging buffers: the KV-purpose ones but the pool's idle blocks
        _gc_live()
        idle = apir.torch.session_for({"backend": be, "keep_outputs": True}).pool.idle_bytes()
        return sum(b.size for b in be._buffers.values() if b.purpose == BufferPurpose.KV) - idle

    with torch.no_grad():
        smollm2.forward = torch.compile(smollm2.forward, backend="apir",
                                        options={"backend": be, "keep_outputs": True})
        try:
            smollm2.generate(ids, max_new_tokens=4, do_sample=False)
            short = kv_bytes()
            smollm2.generate(ids, max_new_tokens=16, do_sample=False)
            long = kv_bytes()
        finally:
            del smollm2.forward
    logits = 4 * 49152  # one position's, the largest output of a decode step
    assert long - short < 2 * logits  # one staging pair per length would add 12 x 2 x logits
    be.close()


def test_a_released_block_reaches_the_backend_only_at_the_next_take() -> None:
    """The last HostTensor of a block may be collected inside a backend call (the garbage
    collector runs in any allocation): the release only queues the block; the next take
    reuses it or frees what the pool does not keep, from a call of its own."""
    from apir.torch import held

    calls: list[tuple[str, int]] = []

    class Recorder:
        def alloc_buffer(self, size, purpose):
            calls.append(("alloc", size))
            return len(calls)

        def free_buffer(self, handle):
            calls.append(("free", handle))

    pool = held.Pool(Recorder())
    blocks = [pool.take(300_000 * (i + 1), 1) for i in range(held.POOL_BLOCKS + 2)]  # six size classes
    before = list(calls)
    for b in blocks:
        b.release()
    assert calls == before  # nothing sent from a release
    reused = pool.take(300_000, 1)  # the first block's class: reused; five idle, one freed
    assert reused.handle == blocks[0].handle
    assert calls[len(before):] == [("free", blocks[1].handle)]  # returned longest ago
    assert pool.idle_bytes() == sum(b.size for b in blocks[1:]) - sum(
        b.size for b in blocks if ("free", b.handle) in calls)
