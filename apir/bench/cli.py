"""``apir bench`` (run the benchmark) and ``apir bench compare BASE NEW``.

Results go to stdout in the chosen format; progress goes to stderr; every run is also
appended to the history file (JSONL).
"""

from __future__ import annotations

import argparse
import sys

from .. import env
from ..backends import ExecutorConfig
from ..flags import add_cache_type, eprint
from ..models.resolve import DEFAULT_MODEL
from ..models.weights import KV_TYPES
from .backends import BACKENDS, BackendOptions, parse_backends
from .errors import BenchError, BenchInputError
from .report import FORMATS

DEFAULT_BACKENDS = "native,remote-shm"
DEFAULT_MAX_REGRESSION = 10.0  # percent


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token counts like 512 or 128,512, got {text!r}") from None


def _split(values: list[str] | None) -> list[str]:
    return [v.strip() for item in values or () for v in item.split(",") if v.strip()]


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_action == "compare":
        return cmd_compare(args)
    if args.bench_action == "transport":
        from .transport import markdown, run

        print(markdown(run(args.remote, _token(args), args.calls, args.upload_mb, args.device, env.spin_us(),
                           ExecutorConfig.from_env())))
        return 0
    if args.bench_action == "peer":
        from .peer import run as run_peer

        try:
            print(run_peer(args.llamacpp, args.apir), end="")
        except BenchInputError as e:
            eprint(f"error: {e}")
            return 2
        return 0
    if args.bench_action == "profile":
        from .profile import run as run_profile

        print(run_profile(args.synthetic, args.device, args.n_gen, args.n_prompt, ExecutorConfig.from_env(),
                          args.streams))
        return 0
    if args.bench_action == "serve":
        from .runner import Source
        from .serve import run as run_serve

        source = Source(args.synthetic, synthetic=True) if args.synthetic else Source(args.model)
        options = _backend_options(args)
        print(run_serve(source, parse_backends(args.backends), options, args.concurrency,
                        args.n_prompt, args.n_gen, eprint, args.shared_prefix))
        return 0
    if args.write_gguf:
        from .gguf_out import write_all

        if not args.synthetic:
            raise BenchError("--write-gguf writes the --synthetic models: name them, e.g. "
                             "--synthetic llama-8b:q4_0,llama-8b:q4_k")
        write_all(_split(args.synthetic), args.write_gguf, lambda line: eprint(f"bench: {line}"))
        return 0
    from .report import emit
    from .runner import BenchConfig, Source, run

    backends = parse_backends(args.backends)
    sources = [Source(s) for s in _split(args.model)]
    sources += [Source(s, synthetic=True) for s in _split(args.synthetic)]
    if not sources:
        sources = [Source(env.MODEL.get() or DEFAULT_MODEL)]
    config = BenchConfig(
        sources=tuple(sources), backends=tuple(backends), n_prompt=tuple(args.n_prompt),
        n_gen=tuple(args.n_gen), n_depth=tuple(args.n_depth), reps=args.repetitions,
        cache_type=KV_TYPES.get(args.cache_type or ""),
        options=_backend_options(args), cache_dir=env.cache_dir(),
    )
    if args.plot:
        from .plot import require_matplotlib

        require_matplotlib()
    records = run(config, lambda line: eprint(f"bench: {line}"))
    emit(records, args.output, None if args.no_history else args.history)
    if args.plot:
        from .plot import plot

        plot(records, args.plot)
        eprint(f"bench: wrote {args.plot}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from .compare import compare, load_records, regressions, render

    try:
        rows = compare(load_records(args.base), load_records(args.new))
    except BenchInputError as e:
        eprint(f"error: {e}")
        return 2
    if not any(r.change is not None for r in rows):
        eprint(f"error: {args.base} and {args.new} have no (model, backend, test) in common")
        return 2
    sys.stdout.write(render(rows, args.max_regression))
    bad = regressions(rows, args.max_regression)
    if bad:
        names = ", ".join(" ".join(r.key) for r in bad)
        eprint(f"{len(bad)} test(s) lost more than {args.max_regression:g}%: {names}")
        return 1
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``bench`` (and its ``compare``) to the ``apir`` parser."""
    p = sub.add_parser(
        "bench", help="measure prompt (ppN) and generation (tgN) throughput per backend",
        description="llama-bench-style throughput of one or more models on several backends, "
                    "interleaved, with % of native. `apir bench compare BASE NEW` compares two "
                    "result files.",
    )
    p.add_argument("-m", "--model", action="append", metavar="MODEL",
                   help="model name or .gguf path; repeatable or comma-separated "
                        f"(default: {DEFAULT_MODEL})")
    p.add_argument("--synthetic", action="append", metavar="SHAPE[:TYPE]",
                   help="random weights of a real shape, no download: llama-135m, llama-1b, "
                        "llama-8b, llama-70b (llama-tiny for tests), TYPE f16 (default), bf16, f32, "
                        "q8_0, q4_0, q6_k, q4_k (a Q4_K_M-like mix); "
                        "repeatable or comma-separated for a size sweep")
    p.add_argument("--write-gguf", metavar="DIR",
                   help="write the --synthetic models as GGUF files into DIR (e.g. for "
                        "llama.cpp's llama-bench: scripts/bench-llamacpp.sh) instead of measuring")
    p.add_argument("-p", "--n-prompt", type=_ints, default=[512], metavar="N[,N...]",
                   help="prompt tokens of the ppN tests (default 512; 0 = none)")
    p.add_argument("-n", "--n-gen", type=_ints, default=[128], metavar="N[,N...]",
                   help="generated tokens of the tgN tests (default 128; 0 = none)")
    p.add_argument("-d", "--n-depth", type=_ints, default=[0], metavar="N[,N...]",
                   help="tokens already in the KV cache before each test (llama-bench's -d; "
                        "default 0)")
    add_cache_type(p)
    p.add_argument("-r", "--repetitions", type=int, default=5, metavar="N",
                   help="timed runs per test and backend, after one warm-up (default 5)")
    p.add_argument("--backends", default=DEFAULT_BACKENDS, metavar="LIST",
                   help=f"comma-separated, measured side by side: {', '.join(BACKENDS)} "
                        f"(default: {DEFAULT_BACKENDS})")
    p.add_argument("--device", choices=("cpu", "cuda", "mps"), default=env.DEVICE.get(),
                   help="device of native and of a started host daemon (default: best available)")
    p.add_argument("--remote", metavar="URL",
                   help="remote-* use the daemon already at URL instead of starting one")
    p.add_argument("--token-file", default=env.TOKEN_FILE.get(),
                   help="the shared secret of a tcp/vsock --remote host (or set APIR_TOKEN)")
    p.add_argument("-o", "--output", choices=FORMATS, default="md", help="stdout format (default md)")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the results (needs matplotlib)")
    p.add_argument("--history", metavar="FILE", default=env.BENCH_HISTORY.get(),
                   help=f"append records here (default: ${env.BENCH_HISTORY.name} or "
                        f"{env.BENCH_HISTORY.default})")
    p.add_argument("--no-history", action="store_true", help="do not append to the history file")
    p.set_defaults(func=cmd_bench, bench_action=None)

    actions = p.add_subparsers(dest="bench_action", metavar="{compare,transport,profile,serve,peer}")
    t = actions.add_parser("transport", help="null-call, one-token and 512-token round trips, "
                                             "upload GB/s, per transport, side by side")
    t.add_argument("--remote", action="append", metavar="URL",
                   help="measure these daemons (default: start one on unix + tcp)")
    t.add_argument("--token-file", help="token for a tcp --remote")
    t.add_argument("--calls", type=int, default=2000, help="round trips per measurement")
    t.add_argument("--upload-mb", type=int, default=256, help="bytes uploaded for the GB/s figure")
    t.add_argument("--device", choices=("cpu", "cuda", "mps"), default="cpu",
                   help="device of the daemon the bench starts")
    pr = actions.add_parser("profile", help="kernels per step and GPU busy time of native "
                                             "decode and prefill (PyTorch profiler)")
    pr.add_argument("--synthetic", default="llama-135m", metavar="SHAPE[:TYPE]",
                    help="the synthetic model to profile (default llama-135m)")
    pr.add_argument("-n", "--n-gen", type=int, default=32, help="decode steps profiled")
    pr.add_argument("-p", "--n-prompt", type=int, default=512, help="prefill tokens profiled (0 = none)")
    pr.add_argument("--streams", type=int, default=0, metavar="N",
                    help="also decode steps of N streams at once, as apir serve --parallel runs them")
    pr.add_argument("--device", choices=("cpu", "cuda", "mps"), default=env.DEVICE.get())
    sv = actions.add_parser("serve", help="aggregate and per-stream t/s and time to first token of "
                                          "many streams at once (continuous batching)")
    sv.add_argument("-m", "--model", default=env.MODEL.get() or DEFAULT_MODEL, help="model name or .gguf path")
    sv.add_argument("--synthetic", metavar="SHAPE[:TYPE]", help="random weights of a real shape instead")
    sv.add_argument("--concurrency", type=_ints, default=[1, 2, 4, 8], metavar="N[,N...]",
                    help="streams at once, one round each (default 1,2,4,8)")
    sv.add_argument("-p", "--n-prompt", type=int, default=128, help="prompt tokens per stream (default 128)")
    sv.add_argument("-n", "--n-gen", type=int, default=128, help="tokens generated per stream (default 128)")
    sv.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                    help="also time prefix reuse: a second request sharing an N-token prefix with "
                         "the first (its TTFT against the first's; default 0 = not run). Every "
                         "slot's cache is sized for it: time large concurrencies apart")
    sv.add_argument("--backends", default=DEFAULT_BACKENDS, metavar="LIST",
                    help=f"comma-separated: {', '.join(BACKENDS)} (default: {DEFAULT_BACKENDS})")
    sv.add_argument("--device", choices=("cpu", "cuda", "mps"), default=env.DEVICE.get())
    sv.add_argument("--remote", metavar="URL", help="remote-* use the daemon already at URL")
    sv.add_argument("--token-file", default=env.TOKEN_FILE.get(), help="its shared secret (tcp/vsock)")
    pe = actions.add_parser("peer", help="llama-bench's results beside apir's on the same GGUF "
                                         "files: apir ÷ llama.cpp per test",
                            description="LLAMACPP files are `llama-bench -o json` output, APIR "
                                        "files `apir bench -o json` output; models are matched "
                                        "by file name (scripts/bench-llamacpp.sh makes both).")
    pe.add_argument("--llamacpp", nargs="+", required=True, metavar="FILE")
    pe.add_argument("--apir", nargs="+", required=True, metavar="FILE")
    c = actions.add_parser("compare", help="compare two result files; exit 1 on a regression",
                           description="BASE and NEW are files written by -o json / -o jsonl or "
                                       "the history file (the last run of each test counts).")
    c.add_argument("base", metavar="BASE")
    c.add_argument("new", metavar="NEW")
    c.add_argument("--max-regression", type=float, default=DEFAULT_MAX_REGRESSION, metavar="PCT",
                   help="fail when a test's t/s dropped by more than PCT percent "
                        f"(default {DEFAULT_MAX_REGRESSION:g})")


def _backend_options(args: argparse.Namespace) -> BackendOptions:
    """The edge: the environment and token file read once, for every backend the bench opens."""
    return BackendOptions(args.device, args.remote, _token(args), env.spin_us(), ExecutorConfig.from_env())


def _token(args: argparse.Namespace) -> str:
    """The daemons' shared secret, read only when the bench is pointed at running ones
    (daemons it starts get a fresh token of their own)."""
    return env.read_token(args.token_file) if args.remote else ""
