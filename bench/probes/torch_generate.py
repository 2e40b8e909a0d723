"""SmolLM2-135M (transformers, from its GGUF, offline) greedy ``generate()``: eager
PyTorch on this CPU against ``torch.compile(backend="apir")`` on the local backend and
through a host daemon started here, with its outputs returned or kept on the host
(``keep_outputs``: the KV cache stays there between steps). Prints the best wall time of a few generates after a warm-up
(the warm-up includes Dynamo's tracing; each new sequence length lowers and registers one
apir graph, so the timed runs repeat lengths already seen).

    python bench/probes/torch_generate.py [--layers N] [--prompt 6] [--new 32] [--repeat 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

import apir.torch  # noqa: F401 - registers the backend "apir"
from apir.backends import create_backend
from apir.models.resolve import resolve_model
from apir.spawn import start_host


def timed(model, ids, new: int, repeat: int) -> tuple[float, list[int]]:
    """The best of ``repeat`` timed generates, after a warm-up; and the tokens."""
    best = float("inf")
    with torch.no_grad():
        model.generate(ids, max_new_tokens=new, do_sample=False)  # warm-up: compile, register
        for _ in range(repeat):
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=new, do_sample=False)
            best = min(best, time.perf_counter() - start)
    return best, out[0].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all 30)")
    ap.add_argument("--new", type=int, default=32, help="tokens to generate")
    ap.add_argument("--prompt", type=int, default=6, help="prompt tokens (past 6: seeded random ids)")
    ap.add_argument("--device", default="cpu", help="the host's device (cpu, cuda)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs (the best is shown)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    path = resolve_model("smollm2-135m")
    extra = {"num_hidden_layers": args.layers} if args.layers else {}
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **extra).eval()
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])
    if args.prompt > 6:
        more = torch.randint(2, 49152, (1, args.prompt - 6), generator=torch.Generator().manual_seed(0))
        ids = torch.cat([ids, more], dim=1)
    results = {"eager": timed(model, ids, args.new, args.repeat)}
    with tempfile.TemporaryDirectory() as tmp:
        unix = f"unix://{Path(tmp) / 'apir.sock'}"
        host = start_host([unix], Path(tmp) / "host.log", device=args.device)
        try:
            for name, be, opts in (("apir-local", create_backend("local", device=args.device), {}),
                                   ("apir-remote", create_backend("remote", remote=unix), {}),
                                   ("apir-remote-kept", create_backend("remote", remote=unix),
                                    {"keep_outputs": True})):
                torch._dynamo.reset()
                model.forward = torch.compile(model.forward, backend="apir", options={"backend": be, **opts})
                results[name] = timed(model, ids, args.new, args.repeat)
                del model.forward
                be.close()
        finally:
            host.stop()
    base = results["eager"][0]
    for name, (seconds, tokens) in results.items():
        same = "same tokens" if tokens == results["eager"][1] else "TOKENS DIFFER"
        print(f"{name:16s} {seconds:7.3f} s  {args.new / seconds:7.1f} t/s  {seconds / base:5.2f}x eager  {same}")
    print(f"({len(model.model.layers)} layers, {ids.shape[1]}-token prompt, {args.new} new tokens, "
          f"host device {args.device})")


if __name__ == "__main__":
    main()
