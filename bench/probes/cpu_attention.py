"""CPU attention a layer, µs: ATTENTION_SEQ's kernel on SmolLM2's shapes (9 query heads
over 3 kv heads of 64, an f16 cache), for one sequence and for four at once at a few
depths, and a 64-token prompt chunk; best of 6 rounds of 10 calls, one torch thread, the
step's plan shared as a decode step's 30 layers share it. Run it on two trees (PYTHONPATH)
to compare them:

    OMP_NUM_THREADS=1 python bench/probes/cpu_attention.py
"""

import time

import torch

from apir.backends.local import kernels

torch.set_num_threads(1)
SLOTS, N, HQ, HKV, D = 4, 2048, 9, 3, 64


def cases() -> dict:
    out = {}
    for n_kv in (32, 512, 1536):
        for n_seq in (1, 4):  # decode tokens of n_seq sequences, a few positions apart
            pos = torch.tensor([n_kv - 1 - 3 * i for i in range(n_seq)], dtype=torch.int32)
            out[f"{n_seq} x decode at {n_kv}"] = (torch.randn(n_seq, HQ, D), pos, torch.arange(n_seq, dtype=torch.int32))
    out["64-token chunk at 448"] = (torch.randn(64, HQ, D), torch.arange(448, 512, dtype=torch.int32),
                                    torch.zeros(64, dtype=torch.int32))
    return out


def main() -> None:
    k, v = (torch.randn(SLOTS, N, HKV, D).half() for _ in range(2))
    best: dict[str, float] = {}
    for _ in range(6):
        for name, (q, pos, seq) in cases().items():
            memo: dict = {}
            try:
                kernels.attention_seq_filled(q, k, v, pos, seq, 0.125, 0, 0.0, memo=memo, key=1)
                kw = dict(memo=memo, key=1)
            except TypeError:  # a tree before the kernel took the step's memo
                kw = {}
            t = time.perf_counter()
            for _ in range(10):
                kernels.attention_seq_filled(q, k, v, pos, seq, 0.125, 0, 0.0, **kw)
            best[name] = min(best.get(name, 1e9), (time.perf_counter() - t) / 10 * 1e6)
    for name, us in best.items():
        print(f"{name}: {us:,.0f} µs")


if __name__ == "__main__":
    main()
