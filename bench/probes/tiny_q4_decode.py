"""A tiny random Q4_0 llama (tests/tiny_models.py) on CUDA: where CUDA-graph-captured and
eager greedy decoding part, with the eager logit gap there, and each decode step's logits
against the CPU's (exact f32 weights), as the largest error over the largest logit.

    python3 bench/probes/tiny_q4_decode.py

Random weights put near-ties among ~260 logits, which a ulp of difference in a norm (Inductor
against eager) can flip once x is rounded to int8; a real model's logits are far apart.
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))
from tiny_models import TinyConfig, write_tiny_gguf  # noqa: E402

import apir  # noqa: E402
from apir.backends import ExecutorConfig  # noqa: E402
from apir.backends.local import LocalBackend  # noqa: E402
from apir.engine import SamplingParams  # noqa: E402

PROMPT = "The capital of France is"


def tokens(path: str, cuda_graphs: bool) -> tuple[list[int], list[int]]:
    with apir.load(path, backend=LocalBackend("cuda", config=ExecutorConfig(cuda_graphs=cuda_graphs))) as m:
        ids = m.tokenize(PROMPT)
        greedy = list(m.generate_ids(ids, SamplingParams(temperature=0, max_tokens=48)))
        sampled = list(m.generate_ids(ids, SamplingParams(temperature=0.9, seed=3, max_tokens=48)))
        return greedy, sampled


def main() -> None:
    for weight_type in ("F16", "Q4_0"):
        path = str(write_tiny_gguf(Path(f"/tmp/tiny-q4-probe-{weight_type}.gguf"), TinyConfig(context_length=512),
                                   weight_type))
        (gc, sc), (ge, se) = tokens(path, True), tokens(path, False)
        first = next((i for i, (a, b) in enumerate(zip(gc, ge)) if a != b), None)
        print(f"{weight_type}: greedy equal {gc == ge} (first difference at {first}), sampled equal {sc == se}")
        with apir.load(path, backend="local", device="cuda") as gpu, apir.load(path, backend="local", device="cpu") as cpu:
            ids = gpu.tokenize(PROMPT)
            if first is not None:
                top = np.sort(gpu.logits(ids + ge[:first])[-1])[::-1][:3]
                print(f"  eager logits where they part: best three {top}, gap {top[0] - top[1]:.3g}")
            errs = []
            for i in range(len(ids)):
                want, got = cpu.logits(ids[i : i + 1], start=i)[-1], gpu.logits(ids[i : i + 1], start=i)[-1]
                errs.append(float(np.abs(got - want).max() / np.abs(want).max()))
            print(f"  one token a step against the CPU: max |gpu - cpu| / max |cpu| {min(errs):.4f} to {max(errs):.4f}")


if __name__ == "__main__":
    main()
