"""Issue 24's forward-pass table: a PyTorch model compiled with ``backend="apir"`` in a
GPU-less guest process, its host daemon on DEVICE, against ``torch.compile`` (Inductor) run
natively on DEVICE; per forward pass, batch 1 and 32, the median of --repeat calls after a
warm-up (which includes Dynamo's tracing and the apir registration).

Models, random weights (the speed does not depend on them):
- transformers' LlamaForCausalLM with SmolLM2-135M's configuration: a prompt of --seq tokens
  per sequence, logits of the last position (``logits_to_keep=1``, as generate()'s prefill),
  returning its KV cache (``smollm2``: at batch 32 and 128 tokens, 2 x 30 layers of
  (32, 3, 128, 64) f32 = 180 MiB that must cross from host to guest every call) or not
  (``smollm2-nocache``: the forward pass alone), or returning it kept on the host
  (``smollm2-kept``: apir's ``keep_outputs``, the cache's tensors stay on the host as they
  stay on the GPU for Inductor; the logits are read back inside the timed call);
- torchvision's ResNet-18 on 224x224 images.

Inductor is timed twice: its input already on DEVICE, and copied there from host memory
inside the timed call (where an apir guest's input starts). apir is timed twice: its
executor in this process (local: the graph's cost without the remoting) and behind the
host daemon (remote: what a guest gets). ``--profile`` adds, per case,
the top kernels of one apir forward with the executor in this process (the local backend).

    python3 bench/probes/torch_forward.py [--device cuda] [--seq 128] [--repeat 20] [--profile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import apir.torch  # noqa: F401 - registers the backend "apir"
from apir.backends import create_backend
from apir.spawn import start_host
from apir.torch import HostTensor


def smollm2_shape() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      rope_theta=100000.0, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def resnet18() -> torch.nn.Module:
    import torchvision

    return torchvision.models.resnet18(weights=None).eval()


def median_ms(fn, args: tuple, kwargs: dict, repeat: int, sync) -> float:
    with torch.no_grad():
        fn(*args, **kwargs)  # warm-up: trace, compile or register
        fn(*args, **kwargs)
        times = []
        for _ in range(repeat):
            sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if isinstance(out, HostTensor):
                out.materialize()  # what the guest reads, it downloads
            elif isinstance(out, torch.Tensor):
                out.sum().item() if out.is_cuda else None
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seq", type=int, default=128, help="prompt tokens per sequence (LLM)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--models", default="smollm2,smollm2-kept,smollm2-nocache,resnet18")
    ap.add_argument("--profile", action="store_true", help="top kernels of one apir forward, in process")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        unix = f"unix://{Path(tmp) / 'apir.sock'}"
        host = start_host([unix], Path(tmp) / "host.log", device=args.device)
        remote = create_backend("remote", remote=unix)
        local = create_backend("local", device=args.device)
        try:
            kept = {"keep_outputs": True}
            models = {"smollm2": ("smollm2-135m (transformers)", smollm2_shape, {"logits_to_keep": 1}, {}),
                      "smollm2-kept": ("smollm2-135m, KV kept on the host", smollm2_shape,
                                       {"logits_to_keep": 1}, kept),
                      "smollm2-nocache": ("smollm2-135m, no KV returned", smollm2_shape,
                                          {"logits_to_keep": 1, "use_cache": False}, {}),
                      "resnet18": ("resnet18 (torchvision)", resnet18, {}, {})}
            for name, make, kw, opts in (models[m] for m in args.models.split(",")):
                guest = make()
                native = make().to(dev)
                native.load_state_dict(guest.state_dict())
                for b in (int(x) for x in args.batches.split(",")):
                    if name.startswith("resnet"):
                        x = torch.randn(b, 3, 224, 224)
                    else:
                        x = torch.randint(0, 49152, (b, args.seq))

                    def call(m, inp, kw=kw):
                        out = m(inp, **kw)
                        return out.logits if hasattr(out, "logits") else out

                    torch._dynamo.reset()
                    inductor = torch.compile(native)
                    t_native = median_ms(call, (inductor, x.to(dev)), {}, args.repeat, sync)
                    t_from_host = median_ms(lambda m, inp: call(m, inp.to(dev)), (inductor, x), {},
                                            args.repeat, sync)
                    torch._dynamo.reset()
                    in_process = torch.compile(guest, backend="apir", options={"backend": local, **opts})
                    t_local = median_ms(call, (in_process, x), {}, args.repeat, sync)
                    torch._dynamo.reset()
                    compiled = torch.compile(guest, backend="apir", options={"backend": remote, **opts})
                    t_remote = median_ms(call, (compiled, x), {}, args.repeat, sync)
                    with torch.no_grad():
                        want = call(inductor, x.to(dev)).float().cpu()
                        got = call(compiled, x).float()
                    err = ((got - want).abs().max() / want.abs().max()).item()
                    rows.append((name, b, t_native, t_from_host, t_local, t_remote, err))
                    print(f"{name} batch {b}: inductor {t_native:.2f} ms ({t_from_host:.2f} ms input from "
                          f"host memory), apir local {t_local:.2f} ms, remote {t_remote:.2f} ms, "
                          f"ratio {t_native / t_remote:.3f}, max rel err {err:.1e}", flush=True)
                    if args.profile:
                        profile(guest, call, x, args.device)
        finally:
            local.close()
            remote.close()
            host.stop()
    print(f"\n| model | batch | Inductor native ({args.device}) ms | input from host memory ms "
          f"| apir local ms | apir remote (host {args.device}) ms | remote ÷ native "
          "| ÷ native from host memory | max rel. error |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, b, tn, th, tl, tr, err in rows:
        print(f"| {name} | {b} | {tn:.2f} | {th:.2f} | {tl:.2f} | {tr:.2f} | {tn / tr:.3f} | {th / tr:.3f} "
              f"| {err:.1e} |")


def profile(guest: torch.nn.Module, call, x: torch.Tensor, device: str) -> None:
    """The kernels of one apir forward, the executor in this process (after two warm-ups:
    the second records and compiles a fixed-shape graph)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch._dynamo.reset()
    local = create_backend("local", device=device)
    try:
        compiled = torch.compile(guest, backend="apir", options={"backend": local})
        with torch.no_grad():
            for _ in range(3):
                call(compiled, x)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
            with torch_profile(activities=activities) as prof:
                call(compiled, x)
        key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=15), flush=True)
    finally:
        local.close()

if __name__ == "__main__":
    main()
