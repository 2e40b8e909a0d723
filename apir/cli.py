"""The ``apir`` command: one parser, one function per subcommand.

stdout carries only results (generated text, JSON); logs and progress go to stderr. Any
``ApirError`` becomes one line on stderr and exit status 1 — no traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence

from . import env
from .errors import ApirError


def _eprint(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=env.MODEL.get(),
                   help="model name (smollm2-135m, gemma3-270m) or .gguf path (default: smollm2-135m)")


def _add_backend(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default=env.BACKEND.get(), choices=("local", "numpy", "remote"),
                   help="where graphs execute (default: local = PyTorch in-process; remote with --remote)")
    p.add_argument("--remote", default=env.REMOTE.get(), metavar="URL",
                   help="execute on the host daemon at URL (unix:///PATH, tcp://HOST:PORT, "
                        "vsock://CID:PORT) or 'auto' (the default socket, starting a daemon if none)")
    p.add_argument("--token-file", default=env.TOKEN_FILE.get(),
                   help="the shared secret for tcp/vsock hosts (or set APIR_TOKEN)")
    p.add_argument("--device", default=env.DEVICE.get(), choices=("cpu", "cuda", "mps"),
                   help="device for the local backend (default: best available)")
    ctx = env.CTX_SIZE.get()
    p.add_argument("-c", "--ctx-size", type=int, default=int(ctx) if ctx else None,
                   help="context window in tokens (default: min(4096, the model's))")


def _progress_bar(label: str):
    start = time.perf_counter()
    tty = sys.stderr.isatty()

    def report(done: int, total: int) -> None:
        if not tty and done < total:
            return
        mb, total_mb = done / 1e6, total / 1e6
        rate = mb / max(time.perf_counter() - start, 1e-9)
        end = "\n" if done >= total else ""
        print(f"\r{label}: {mb:7.1f}/{total_mb:.1f} MB ({rate:,.0f} MB/s)", end=end,
              file=sys.stderr, flush=True)

    return report


def _load(args: argparse.Namespace, remote: str | None = None):
    from .engine import load

    t0 = time.perf_counter()
    backend = "remote" if remote else args.backend
    if backend == "remote" and not remote:
        raise ApirError("--backend remote needs --remote URL (or APIR_REMOTE)")
    model = load(args.model, backend=backend, device=args.device, n_ctx=args.ctx_size,
                 progress=_progress_bar("uploading weights"), remote=remote,
                 token_file=args.token_file)
    dev = model.backend.device()
    where = f"{model.backend.name}:{dev.name}" + (f" via {remote}" if remote else "")
    _eprint(f"loaded {model.file.path.name} ({model.arch_name}, {model.file.quantization()}) "
            f"on {where} in {time.perf_counter() - t0:.1f}s")
    if args.device is None and dev.kind == "cpu" and backend != "numpy":
        _eprint("note: no GPU found; running on the CPU")
    return model


def _sampling(args: argparse.Namespace):
    from .engine import SamplingParams

    return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, seed=args.seed, max_tokens=args.n_predict)


def _generate(model, ids: list[int], params) -> tuple[str, int]:
    """Stream a completion to stdout; returns (text, generated token count)."""
    t0 = time.perf_counter()
    first = None
    pieces, count = [], 0
    decoder = model.tokenizer.stream()
    for tid in model.generate_ids(ids, params):
        if first is None:
            first = time.perf_counter()
        count += 1
        piece = decoder.feed(tid)
        pieces.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
    tail = decoder.flush()
    sys.stdout.write(tail)
    sys.stdout.flush()
    end = time.perf_counter()
    first = first or end
    gen_rate = (count - 1) / (end - first) if count > 1 else 0.0
    _eprint(f"\nprompt {len(ids)} tokens, {len(ids) / max(first - t0, 1e-9):,.1f} t/s; "
            f"generated {count} tokens, {gen_rate:,.1f} t/s; backend {model.backend.name} "
            f"({model.backend.device().name})")
    return "".join(pieces) + tail, count


def cmd_run(args: argparse.Namespace) -> int:
    from . import sandbox
    from .host.autostart import remote_host

    params = _sampling(args)
    if args.sandbox and not sandbox.inside():
        return _run_sandboxed(args)
    with remote_host(args.remote, args.device) as remote:
        return _run(args, _load(args, remote), params)


def _run_sandboxed(args: argparse.Namespace) -> int:
    """Re-run this command as a guest inside bubblewrap, talking to a host outside it."""
    import subprocess

    from . import sandbox
    from .host.autostart import remote_host
    from .transport import parse_address

    with remote_host(args.remote or "auto", args.device) as remote:
        address = parse_address(remote)
        if address.scheme != "unix":
            raise ApirError(f"--sandbox reaches the host through a unix socket, not {address}")
        from .models.resolve import resolve_model

        model = str(resolve_model(args.model).resolve())  # /tmp is private in there: bind it
        argv = sandbox.guest_argv([*args.argv, "--remote", str(address)])
        cmd = sandbox.sandbox_command(address.path, argv, read_only=(model,))
        _eprint(f"sandbox: guest in bubblewrap (no network, no GPU devices, read-only root) -> {address}")
        return subprocess.run(cmd).returncode


def _run(args: argparse.Namespace, model, params) -> int:
    with model:
        if args.prompt is not None:
            if args.chat:
                ids = model.chat_ids([{"role": "user", "content": args.prompt}])
            else:
                ids = model.tokenize(args.prompt)
            _generate(model, ids, params)
            sys.stdout.write("\n")
            return 0
        return _chat_loop(model, params)


def _chat_loop(model, params) -> int:
    _eprint("interactive chat: type a message, an empty line or Ctrl-D to quit")
    messages: list[dict] = []
    while True:
        try:
            line = input("> ")
        except EOFError:
            _eprint()
            return 0
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        ids = model.chat_ids(messages)
        reply, _ = _generate(model, ids, params)
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})


def cmd_tokenize(args: argparse.Namespace) -> int:
    from .models.gguf_file import GGUFFile
    from .models.resolve import resolve_model
    from .models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(GGUFFile(resolve_model(args.model)).reader)
    print(json.dumps(tok.encode(args.text)))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from .models.gguf_file import GGUFFile
    from .models.registry import architecture
    from .models.resolve import resolve_model

    f = GGUFFile(resolve_model(args.model))
    params = sum(math.prod(t.shape) for t in f.tensors.values())
    info = {
        "path": str(f.path),
        "name": f.get("general.name"),
        "architecture": f.arch,
        "parameters": params,
        "size_bytes": f.nbytes,
        "quantization": f.quantization(),
        "context_length": f.get("{arch}.context_length"),
        "supported": True,
    }
    try:
        architecture(f.arch)
    except ApirError:
        info["supported"] = False
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            print(f"{k:15} {v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(prog="apir", description="LLM inference with API remoting")
    p.add_argument("--version", action="version", version=f"apir {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate text (one-shot with -p, interactive chat without)")
    _add_model(run)
    _add_backend(run)
    run.add_argument("-p", "--prompt", help="the prompt, used exactly as given (special tokens parsed)")
    run.add_argument("-n", "--n-predict", type=int, default=256, help="max tokens to generate")
    run.add_argument("--temp", type=float, default=0.8, help="temperature (0 = greedy)")
    run.add_argument("--top-k", type=int, default=40)
    run.add_argument("--top-p", type=float, default=0.95)
    run.add_argument("--min-p", type=float, default=0.05)
    run.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    run.add_argument("--chat", action="store_true", help="wrap -p in the model's chat template")
    run.add_argument("--sandbox", action="store_true",
                     help="run the guest inside a bubblewrap sandbox (no network, no GPU devices, "
                          "read-only root) with compute on the host daemon (implies --remote auto)")
    run.set_defaults(func=cmd_run)

    tok = sub.add_parser("tokenize", help="print token ids as JSON")
    _add_model(tok)
    tok.add_argument("text")
    tok.set_defaults(func=cmd_tokenize)

    info = sub.add_parser("info", help="architecture, size, quantization, context length")
    _add_model(info)
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=cmd_info)
    from .host.cli import add_parser as add_host

    add_host(sub)
    from .bench.cli import add_parser as add_bench

    add_bench(sub)
    from .server.cli import add_parser as add_serve

    add_serve(sub)
    from .store import add_parsers as add_store

    add_store(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    import warnings

    # Library warnings (e.g. a model without a chat template) are one line, not a stack frame.
    warnings.showwarning = lambda message, *_args, **_kw: _eprint(f"warning: {message}")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    except ApirError as e:
        _eprint(f"error: {e}")
        return 1
    except ValueError as e:  # bad option values (SamplingParams and friends)
        _eprint(f"error: {e}")
        return 2
    except KeyboardInterrupt:
        _eprint("\ninterrupted")
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
