"""The ``apir`` command: one parser, one function per subcommand.

stdout carries only results (generated text, JSON); logs and progress go to stderr. Any
``ApirError`` becomes one line on stderr and exit status 1 — no traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from . import env, flags
from .errors import ApirError


def _sampling(args: argparse.Namespace):
    from .engine import SamplingParams

    if args.n_predict < -1:
        raise ValueError(f"-n must be -1 (until the context is full) or >= 0, got {args.n_predict}")
    # -1: no count of ours stops it; generation ends when the context is full
    n = sys.maxsize if args.n_predict == -1 else args.n_predict
    return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, seed=args.seed, max_tokens=n)


@contextlib.contextmanager
def _ctrl_c_stops() -> Iterator[list[bool]]:
    """While a chat reply streams, Ctrl-C asks it to stop: the flag yielded is read after
    each token, so no step is cut off halfway (a remote host's stream stays whole). A
    second Ctrl-C before the reply stops interrupts at once."""
    pressed: list[bool] = []

    def handler(signum: int, frame: object) -> None:
        if pressed:
            raise KeyboardInterrupt
        pressed.append(True)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


def _generate(model, ids: list[int], params, stop: Sequence[bool] = ()) -> tuple[str, int]:
    """Stream a completion to stdout until it ends or ``stop`` turns true; returns (text,
    generated token count)."""
    t0 = time.perf_counter()
    first = None
    pieces, count = [], 0
    decoder = model.tokenizer.stream()
    tokens = model.generate_ids(ids, params)
    try:
        for tid in tokens:
            if first is None:
                first = time.perf_counter()
            count += 1
            piece = decoder.feed(tid)
            pieces.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
            if stop:
                break
    finally:
        tokens.close()  # waits for the step computed ahead
    tail = decoder.flush()
    sys.stdout.write(tail)
    sys.stdout.flush()
    end = time.perf_counter()
    first = first or end
    gen_rate = (count - 1) / (end - first) if count > 1 else 0.0
    flags.eprint(f"\nprompt {len(ids)} tokens, {len(ids) / max(first - t0, 1e-9):,.1f} t/s; "
            f"generated {count} tokens{' (stopped)' if stop else ''}, {gen_rate:,.1f} t/s; "
            f"backend {model.backend.name} ({model.backend.device().name})")
    return "".join(pieces) + tail, count


def cmd_run(args: argparse.Namespace) -> int:
    from . import sandbox

    params = _sampling(args)
    prompt = _prompt(args)  # read up front: a missing -f FILE is an error before any loading
    config = flags.run_config(args)
    if args.sandbox and not sandbox.inside():
        return _run_sandboxed(args, dataclasses.replace(config, remote=config.remote or "auto"))
    with flags.remote_ready(config) as config:
        model = flags.load(config, flags.progress_bar("uploading weights"))
        return _run(model, params, prompt, args.chat)


def _config_files() -> tuple[str, ...]:
    """The config file, when there is one, so the guest in the sandbox reads the same."""
    path = env.config_path()
    return (str(path.resolve()),) if path.is_file() else ()


def _run_sandboxed(args: argparse.Namespace, config: flags.RunConfig) -> int:
    """Re-run this command as a guest inside bubblewrap, talking to a host outside it."""
    import subprocess

    from . import sandbox
    from .transport import parse_address

    with flags.remote_ready(config) as config:
        address = parse_address(config.remote)
        if address.scheme != "unix":
            raise ApirError(f"--sandbox reaches the host through a unix socket, not {address}")
        model = str(flags.model_path(config).resolve())  # /tmp is private in there: bind it
        argv = sandbox.guest_argv([*args.argv, "--remote", str(address)])
        prompt = (str(Path(args.file).resolve()),) if args.file else ()  # -f FILE, read in there
        cmd = sandbox.sandbox_command(address.path, argv, read_only=(model, *prompt, *_config_files()))
        flags.eprint(f"sandbox: guest in bubblewrap (no network, no GPU devices, read-only root) -> {address}")
        return subprocess.run(cmd).returncode


def _prompt(args: argparse.Namespace) -> str | None:
    """-p, or the contents of -f FILE (less one trailing newline, as llama.cpp reads it)."""
    if args.file is None:
        return args.prompt
    try:
        return Path(args.file).read_text(encoding="utf-8").removesuffix("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise ApirError(f"cannot read the prompt file {args.file}: {getattr(e, 'strerror', None) or e}") from None


def _run(model, params, prompt: str | None, chat: bool) -> int:
    with model:
        if prompt is not None:
            if chat:
                ids = model.chat_ids([{"role": "user", "content": prompt}])
            else:
                ids = model.tokenize(prompt)
            _generate(model, ids, params)
            sys.stdout.write("\n")
            return 0
        return _chat_loop(model, params)


CHAT_HELP = """commands:
  /help         this list
  /clear        forget the conversation and start a new one
  /bye, exit    quit (so does Ctrl-D, or Ctrl-C at the prompt)
Ctrl-C while a reply streams stops it and returns to the prompt."""


def _chat_loop(model, params) -> int:
    from .engine import ContextOverflowError

    flags.eprint("interactive chat: /help for commands, /bye or Ctrl-D to quit, Ctrl-C stops a reply")
    messages: list[dict] = []
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):  # Ctrl-D, or Ctrl-C at the prompt
            flags.eprint()
            return 0
        command = line.strip()
        if command in ("/bye", "exit"):
            return 0
        if command in ("/clear", "/help"):
            if command == "/clear":
                messages.clear()
            flags.eprint(CHAT_HELP if command == "/help" else "(conversation cleared)")
            continue
        if not command:
            continue
        messages.append({"role": "user", "content": line})
        try:
            with _ctrl_c_stops() as stop:
                reply, _ = _generate(model, model.chat_ids(messages), params, stop)
        except ContextOverflowError as e:
            messages.pop()
            flags.eprint(f"error: {e}; or /clear to start a new conversation")
            continue
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})


def cmd_tokenize(args: argparse.Namespace) -> int:
    from .models.gguf_file import GGUFFile
    from .models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(GGUFFile(flags.model_path(flags.run_config(args))))
    print(json.dumps(tok.encode(args.text)))
    return 0


def _flags_given(args: argparse.Namespace, options_of: dict[str, tuple[str, ...]]) -> dict[str, object]:
    """The values of the flags in ``options_of`` (config key -> option strings) that appear on
    the command line itself, as opposed to defaults taken from the environment or config."""
    given = {}
    words = getattr(args, "argv", [])
    for key, options in options_of.items():
        for word in words:
            if word == "--":
                break
            if any(word == o or word.startswith(o + "=") or (not o.startswith("--") and word.startswith(o))
                   for o in options):
                given[key] = getattr(args, key)
    return given


RUN_FLAGS = {  # config key (= dest) -> its flags, for `apir info --config`
    "model": ("-m", "--model"), "backend": ("--backend",), "remote": ("--remote",),
    "token_file": ("--token-file",), "device": ("--device",), "ctx_size": ("-c", "--ctx-size"),
    "threads": ("-t", "--threads"),
}


def cmd_config(args: argparse.Namespace) -> int:
    """The effective configuration: each variable, its value and where it came from."""
    rows = env.describe(_flags_given(args, RUN_FLAGS))
    if args.json:
        print(json.dumps({"config_file": str(env.config_path()),
                          "config_file_exists": env.config_path().is_file(), "variables": rows},
                         indent=2))
        return 0
    path = env.config_path()
    print(f"# config file: {path}" + ("" if path.is_file() else " (none)"))
    for r in rows:
        value = "-" if r["value"] is None else r["value"]
        print(f"{r['name']:20} {value}  [{r['source']}]")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    if args.config:
        return cmd_config(args)
    from .models.gguf_file import GGUFFile
    from .models.registry import architecture

    f = GGUFFile(flags.model_path(flags.run_config(args)))
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

    run = sub.add_parser("run", help="generate text (one-shot with -p or -f, interactive chat "
                         "without: /help lists its commands)")
    flags.add_model(run)
    flags.add_backend(run)
    given = run.add_mutually_exclusive_group()
    given.add_argument("-p", "--prompt", help="the prompt, used exactly as given (special tokens parsed)")
    given.add_argument("-f", "--file", metavar="FILE", help="read the prompt from FILE (one trailing "
                       "newline dropped)")
    run.add_argument("-n", "--n-predict", type=int, default=256, metavar="N",
                     help="max tokens to generate (default: %(default)s; -1: until the context is full)")
    run.add_argument("--temp", type=float, default=0.8, help="temperature (0 = greedy)")
    run.add_argument("--top-k", type=int, default=40)
    run.add_argument("--top-p", type=float, default=0.95)
    run.add_argument("--min-p", type=float, default=0.05)
    run.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    run.add_argument("--chat", action="store_true", help="wrap the prompt of -p or -f in the model's chat template")
    run.add_argument("--sandbox", action="store_true",
                     help="run the guest inside a bubblewrap sandbox (no network, no GPU devices, "
                          "read-only root) with compute on the host daemon (implies --remote auto)")
    run.set_defaults(func=cmd_run)

    tok = sub.add_parser("tokenize", help="print token ids as JSON")
    flags.add_model(tok)
    tok.add_argument("text")
    tok.set_defaults(func=cmd_tokenize)

    info = sub.add_parser("info", help="architecture, size, quantization, context length; "
                          "--config: the effective configuration")
    flags.add_model(info)
    flags.add_backend(info)
    info.add_argument("--json", action="store_true")
    info.add_argument("--config", action="store_true",
                      help="print every setting, its value and where it came from (flag, env, "
                           "config file or default) instead of the model's details")
    info.set_defaults(func=cmd_info)
    from .host.cli import add_parser as add_host

    add_host(sub)
    from .bench.cli import add_parser as add_bench

    add_bench(sub)
    from .server.cli import add_parser as add_serve

    add_serve(sub)
    from .store import add_parsers as add_store

    add_store(sub)
    from .doctor import add_parser as add_doctor

    add_doctor(sub)
    from .vm.cli import add_parser as add_vm

    add_vm(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    import warnings

    # Library warnings (e.g. a model without a chat template) are one line, not a stack frame.
    warnings.showwarning = lambda message, *_args, **_kw: flags.eprint(f"warning: {message}")
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)  # flag defaults read the environment and config
    except env.ConfigError as e:
        flags.eprint(f"error: {e}")
        return 2
    args.argv = argv
    try:
        return args.func(args)
    except ApirError as e:
        flags.eprint(f"error: {e}")
        return 1
    except ValueError as e:  # bad option values (SamplingParams and friends)
        flags.eprint(f"error: {e}")
        return 2
    except KeyboardInterrupt:
        flags.eprint("\ninterrupted")
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
