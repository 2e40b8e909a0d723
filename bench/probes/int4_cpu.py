"""One decode row's product on the CPU: the f32 matmul that the dequantized cache runs,
against torch's int4 product (groups of 32, a scale and a zero each: Q4_0/Q4_1/Q4_K's
layout) with f32 and with bf16 activations. Prints ms per product, for 1 and 2 threads.

    python bench/probes/int4_cpu.py
"""

import time
from collections.abc import Callable

import torch

SHAPES = [(1536, 576), (4096, 4096), (14336, 4096)]  # (N, K): SmolLM2's gate; an 8B's q/o, gate


def ms(f: Callable[..., object], *args: object, repeat: int = 20) -> float:
    f(*args)  # warm
    t0 = time.perf_counter()
    for _ in range(repeat):
        f(*args)
    return (time.perf_counter() - t0) / repeat * 1e3


def main() -> None:
    torch.manual_seed(0)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for n, k in SHAPES:
            w, x = torch.randn(n, k), torch.randn(1, k)
            packed = torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
            scales_zeros = torch.randn(k // 32, n, 2)
            f32 = ms(torch.matmul, x, w.T)
            int4 = ms(torch._weight_int4pack_mm_for_cpu, x, packed, 32, scales_zeros)
            int4_bf16 = ms(torch._weight_int4pack_mm_for_cpu, x.bfloat16(), packed, 32, scales_zeros.bfloat16())
            print(f"threads {threads} {n}x{k}: f32 {f32:.3f} ms, int4 f32-x {int4:.3f} ms, "
                  f"int4 bf16-x {int4_bf16:.3f} ms")


if __name__ == "__main__":
    main()
