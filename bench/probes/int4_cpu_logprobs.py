"""Where the CPU int4 path's logprob differences come from: SmolLM2 Q4_1, one thread, 8
greedy tokens after "The capital of France is"; prints the largest |decode-step logprob -
whole-prompt logprob| of the chosen tokens for one way of computing the Q4 products:

    f32            dequantized f32 copies (ExecutorConfig(cpu_int4=False))
    int4           torch's int4 kernel with bf16 activations (the CPU default)
    bf16x_f32out   f32 products of the same int4 weights, x rounded to bf16
    bf16x_bf16out  the same, the output rounded to bf16 too (as the kernel returns it)

    for m in f32 int4 bf16x_f32out bf16x_bf16out; do python3 bench/probes/int4_cpu_logprobs.py $m; done

(one mode a process: the bf16x modes replace int4cpu's functions)
"""

import sys

import numpy as np
import torch

import apir
from apir.backends.base import ExecutorConfig
from apir.backends.local import int4cpu
from apir.engine import SamplingParams
from apir.models.resolve import resolve_model


def reference_products(round_output: bool) -> None:
    """Replace the int4 kernel by f32 products of the same weights (scales and zeros in
    bf16, as packed) with x rounded to bf16."""
    dense: dict[int, torch.Tensor] = {}
    pack = int4cpu.pack

    def packing(raw, dtype, shape, blocks):
        w = pack(raw, dtype, shape, blocks)
        q, scale, zero = int4cpu._fields(raw.reshape(-1, dtype.type_size), dtype)
        bf = (scale.to(torch.bfloat16).float(), zero.to(torch.bfloat16).float())
        dense[id(w.packed)] = ((q.float() - 8) * bf[0] + bf[1]).reshape(shape)
        return w

    def product(x, w):
        y = x.reshape(-1, w.shape[1]).to(torch.bfloat16).float() @ dense[id(w.packed)].T
        y = y.to(torch.bfloat16).float() if round_output else y
        return y.reshape(*x.shape[:-1], w.shape[0])

    int4cpu.pack, int4cpu.product = packing, product


def largest_difference(mode: str) -> float:
    if mode.startswith("bf16x"):
        reference_products(mode.endswith("bf16out"))
    config = ExecutorConfig(cpu_int4=mode != "f32")
    with apir.load(str(resolve_model("smollm2-135m")), backend="local", device="cpu", executor=config) as m:
        ids = m.tokenize("The capital of France is")
        tokens = list(m.generate_tokens(ids, SamplingParams(temperature=0, max_tokens=8, logprobs=1)))
        logits = m.logits(ids + [t.id for t in tokens[:-1]])[len(ids) - 1:].astype(np.float64)
        top = logits.max(-1, keepdims=True)
        logprobs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        return max(abs(t.logprob - row[t.id]) for row, t in zip(logprobs, tokens))


if __name__ == "__main__":
    torch.set_num_threads(1)
    (mode,) = sys.argv[1:] or ["int4"]
    print(f"{mode}: {largest_difference(mode):.5f}", flush=True)
