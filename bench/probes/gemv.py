"""One-row products (decode GEMVs) on a GPU: cuBLAS vs a Triton kernel vs Inductor's
reduction, per weight shape, each call on a different weight copy (as a decode step's
layers are), inside one CUDA graph. Prints µs per call and the read rate.

    python3 bench/probes/gemv.py [135m 1b 8b] [--inductor]

"triton" is apir's kernel (apir.backends.local.gemv) at the best of a sweep of blocks,
"apir(...)" the blocks apir.backends.local.gemv.blocks picks for the shape.
"""

import sys

import torch
import triton

from apir.backends.local.gemv import _gemv_kernel, blocks

SHAPES = {  # (N, K) of the weights a decode step reads: qkv, o, gate_up, down, output
    "135m": [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)],
    "1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048)],
    "8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)],
}


def triton_fn(bn, bk, warps, stages):
    def run(x, w):
        n, k = w.shape
        y = torch.empty(n, device=w.device, dtype=torch.float32)
        _gemv_kernel[(triton.cdiv(n, bn),)](x, w, y, n, k, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
        return y
    return run


def cublas(x, w):
    return torch.matmul(x[None], w.T).float()


def time_us(fn, x, ws, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for w in ws:
                fn(x, w)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w in ws:
            fn(x, w)
    for _ in range(3):
        g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / reps / len(ws)


def main(models):
    torch.manual_seed(0)
    import torch._inductor.config as ic
    ic.coordinate_descent_tuning = True
    configs = [(bn, bk, wp, st) for bn in (2, 4, 8, 16, 32) for bk in (128, 256, 512)
               for wp in (4, 8) for st in (1, 3) if bn * bk <= 8192]
    for model in models:
        for n, k in SHAPES[model]:
            copies = max(2, min(64, (512 << 20) // (n * k * 2)))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.float16) for _ in range(copies)]
            x = torch.randn(k, device="cuda", dtype=torch.float16)
            ref = (ws[0].float() @ x.float())
            mb = n * k * 2 / 1e6
            res = {"cublas": time_us(cublas, x, ws)}
            best = None
            for c in configs:
                f = triton_fn(*c)
                err = (f(x, ws[0]) - ref).abs().max().item()
                assert err < 1e-1 * max(1, ref.abs().max().item() / 100), (c, err)
                t = time_us(f, x, ws)
                if best is None or t < best[0]:
                    best = (t, c)
            res[f"triton{best[1]}"] = best[0]
            res[f"apir{blocks(n, k)}"] = time_us(triton_fn(*blocks(n, k)), x, ws)
            if "--inductor" in sys.argv:
                red = torch.compile(lambda x, w: (w.float() * x.float()[None]).sum(-1), dynamic=False)
                res["inductor"] = time_us(red, x, ws)
            line = " | ".join(f"{name} {us:.2f} µs {mb / us:.2f} TB/s" for name, us in res.items())
            print(f"{model} N={n} K={k} ({mb:.1f} MB): {line}", flush=True)
            del ws


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if a in SHAPES] or ["135m", "1b", "8b"])
