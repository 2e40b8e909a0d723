"""One decode query's attention over a long cache on a GPU (decode_attention.attend_visible,
an 8B llama's heads: 32 query heads, 8 kv heads of 128, an f16 cache), for several key
splits and key blocks: µs per layer and the effective read rate of the visible keys and
values. Each call reads another layer's cache (as a decode step does), inside one CUDA
graph; the splits' combination is timed with the kernel.

    python3 bench/probes/decode_attention.py [--depths 1024,4096,16384]
    python3 bench/probes/decode_attention.py --short [--caches 128,512,1024]

The row marked * is what the module picks today. --short: a decode step's attention as it
was at caches of up to 1,024 rows (RoPE of q, then the masked form over the whole cache,
compiled by Inductor as a decode step traces it: three kernels and the RoPE's) against
today's one launch (q rotated as it is loaded, only the visible rows read), at a query
position of a quarter, half and all of the cache.
"""

import sys

import torch
from gemv import time_us  # bench/probes/gemv.py, beside this file

from apir.backends.local import decode_attention as da
from apir.backends.local import inductor, kernels

HQ, HKV, D, LAYERS = 32, 8, 128, 16


def short(caches: list[int]) -> None:
    print("| cache rows | position | RoPE + masked form (µs a layer) | one launch (µs) | ÷ |\n"
          "| ---: | ---: | ---: | ---: | ---: |")
    scale = D ** -0.5

    def masked(x, kv, pos):
        k, v = kv
        cos, sin = kernels.rope_angles(pos, D, 10000.0, 1.0)
        q = kernels.rope_apply(x, cos, sin, D, 0)
        return kernels.attend(q, k, v, kernels.attention_mask(pos, k.shape[0], 0, HQ // HKV), scale, 0.0)

    for n_keys in caches:
        layers = [(torch.randn(n_keys, HKV, D, device="cuda").half(),
                   torch.randn(n_keys, HKV, D, device="cuda").half()) for _ in range(LAYERS)]
        q = torch.randn(1, HQ, D, device="cuda")
        for at in (n_keys // 4, n_keys // 2, n_keys - 1):
            pos = torch.tensor([at], device="cuda", dtype=torch.int32)
            before = torch.compile(masked, dynamic=False)
            with inductor._traced():  # the decode step's form: products and sums, fused by Inductor
                want = before(q, layers[0], pos)
            angles = kernels.rope_angles(pos, D, 10000.0, 1.0)

            def now(x, kv, pos=pos, angles=angles):
                return kernels.attention(kernels.Roped(x, *angles, D, 0), *kv, pos, scale, 0, 0.0)

            err = (now(q, layers[0]) - want).abs().max().item()
            old_us = time_us(lambda x, kv, pos=pos, before=before: before(x, kv, pos), q, layers)
            new_us = time_us(now, q, layers)
            print(f"| {n_keys} | {at} | {old_us:.1f} | {new_us:.1f} | {old_us / new_us:.2f} |"
                  + (f" max error {err:.1e}" if err > 2e-3 else ""), flush=True)
        del layers


def main() -> None:
    if "--short" in sys.argv:
        caches = [128, 512, 1024]
        if "--caches" in sys.argv:
            caches = [int(v) for v in sys.argv[sys.argv.index("--caches") + 1].split(",")]
        short(caches)
        return
    depths = [1024, 4096, 16384]
    if "--depths" in sys.argv:
        depths = [int(v) for v in sys.argv[sys.argv.index("--depths") + 1].split(",")]
    chosen = da.SPLIT_KEYS, da.WAVES, da.tiles
    variants = [(split, waves, block, warps) for split in (256, 128, 64) for waves in (4, 8, 16)
                for block, warps in ((None, None), (32, 4), (64, 8), (128, 8))]
    print("| depth | split keys | waves | block | warps | µs a layer | GB/s |\n"
          "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for depth in depths:
        n_keys = depth + 256
        caches = [(torch.randn(1, n_keys, HKV, D, device="cuda").half(),
                   torch.randn(1, n_keys, HKV, D, device="cuda").half()) for _ in range(LAYERS)]
        q = torch.randn(1, HQ, D, device="cuda")
        pos = torch.tensor([depth], device="cuda", dtype=torch.int32)
        seq = torch.zeros(1, device="cuda", dtype=torch.int32)
        want = da.attend_visible(q, *caches[0], pos, seq, D ** -0.5, 0, 0.0)
        visible = 2 * (depth + 1) * HKV * D * 2  # bytes of keys and values read
        for split, waves, block, warps in variants:
            da.SPLIT_KEYS, da.WAVES = split, waves

            def tiles(group, dim, dim_v, block=block, warps=warps):
                gp, dp, dvp, b, w = chosen[2](group, dim, dim_v)
                return gp, dp, dvp, block or b, warps or w

            da.tiles = tiles
            got = da.attend_visible(q, *caches[0], pos, seq, D ** -0.5, 0, 0.0)
            err = (got - want).abs().max().item()
            us = time_us(lambda x, kv, pos=pos, seq=seq: da.attend_visible(x, *kv, pos, seq, D ** -0.5, 0, 0.0),
                         q, caches)
            mark = "*" if (split, waves, block) == (*chosen[:2], None) else ""
            print(f"| {depth} | {split}{mark} | {waves} | {block or 'auto'} | {warps or 'auto'} | {us:.1f} | "
                  f"{visible / us / 1e3:.0f} |" + (f" max error {err:.1e}" if err > 1e-3 else ""), flush=True)
        del caches
    da.SPLIT_KEYS, da.WAVES, da.tiles = chosen


if __name__ == "__main__":
    main()
