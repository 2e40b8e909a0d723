"""``apir vm build | run | bench``: the guest in a QEMU/KVM virtual machine.

``apir vm run`` takes every ``apir run`` option; the guest runs ``apir run`` with them
and ``--remote ivshmem``, compute happens here on ``--device``. ``apir vm bench`` runs
``apir bench`` in the guest (backend ``remote-vm``) and the native backend here, and
prints one table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from .. import env
from ..backends.base import ExecutorConfig
from ..errors import ApirError

# options of `apir run` / `apir bench` that describe this side, not the guest's command
HOST_SIDE = {"model", "backend", "remote", "token_file", "device", "sandbox", "func", "bench_action",
             "backends", "output", "plot", "history", "no_history", "help"}
VM_OPTIONS = {"memory", "cpus", "require_kvm", "accel", "rebuild", "vm_timeout", "no_native"}


def _eprint(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def guest_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The command line that reproduces ``args`` (options left at their defaults omitted),
    without this side's and the VM's own options."""
    out: list[str] = []
    for a in parser._actions:  # noqa: SLF001 - argparse has no public list of actions
        if not a.option_strings or a.dest in HOST_SIDE | VM_OPTIONS or not hasattr(args, a.dest):
            continue
        value = getattr(args, a.dest)
        if value == a.default or value is None:
            continue
        flag = a.option_strings[-1]
        if isinstance(a, argparse._StoreTrueAction):  # noqa: SLF001
            out.append(flag)
        elif isinstance(value, list) and isinstance(a, argparse._AppendAction):  # noqa: SLF001
            for v in value:
                out += [flag, str(v)]
        elif isinstance(value, list):
            out += [flag, ",".join(str(v) for v in value)]
        else:
            out += [flag, str(value)]
    return out


def _image(args: argparse.Namespace):
    from .image import ensure_image

    return ensure_image(args.rebuild, lambda s: _eprint(f"apir vm: {s}"))


def _config(args: argparse.Namespace, argv: list[str], model: Path | None):
    from .launch import VMConfig

    return VMConfig(tuple(argv), model, args.device, args.memory, args.cpus, args.require_kvm,
                    args.accel, args.vm_timeout, spin_us=env.spin_us(), executor=ExecutorConfig.from_env())


def cmd_build(args: argparse.Namespace) -> int:
    from .image import versions

    image = _image(args)
    _eprint(f"apir vm: kernel {image.kernel}, initramfs {image.initramfs} "
            f"({image.initramfs.stat().st_size / 2**20:.0f} MiB), {versions()}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from ..flags import model_path, run_config
    from .launch import run_vm

    if args.prompt is None:
        raise ApirError("apir vm run needs -p PROMPT (the guest has no terminal for a chat)")
    model = model_path(run_config(args)).resolve()
    argv = ["run", *guest_args(args.run_parser, args), "--remote", "ivshmem"]
    image = _image(args)
    sys.stdout.flush()
    return run_vm(image, _config(args, argv, model))


def cmd_bench(args: argparse.Namespace) -> int:
    from .. import env
    from ..bench.backends import BackendOptions
    from ..bench.report import emit
    from ..bench.runner import BenchConfig, Source, run
    from ..flags import RunConfig, model_path
    from .launch import run_vm

    if args.bench_action:
        raise ApirError("apir vm bench runs the benchmark itself; compare results with apir bench compare")
    models = [v.strip() for item in args.model or () for v in item.split(",") if v.strip()]
    if len(models) > 1 or (models and args.synthetic):
        raise ApirError("apir vm bench takes one -m model (or --synthetic shapes)")
    model = None if args.synthetic else model_path(RunConfig(models[0] if models else None,
                                                              cache_dir=env.cache_dir())).resolve()
    argv = ["bench", *guest_args(args.bench_parser, args), "--backends", "remote-shm", "--remote",
            "ivshmem", "-o", "jsonl", "--no-history"]
    image = _image(args)
    with tempfile.TemporaryFile() as out:
        code = run_vm(image, _config(args, argv, model), stdout=out)
        out.seek(0)
        lines = [ln for ln in out.read().decode(errors="replace").splitlines() if ln.startswith("{")]
    if code != 0:
        raise ApirError(f"the benchmark inside the VM exited with status {code} (its stderr is above)")
    guest = [json.loads(ln) for ln in lines]
    records = []
    if not args.no_native:
        sources = [Source(s, synthetic=True) for s in (args.synthetic or [])] or [Source(str(model))]
        config = BenchConfig(sources=tuple(sources), backends=("native",), n_prompt=tuple(args.n_prompt),
                             n_gen=tuple(args.n_gen), reps=args.repetitions,
                             options=BackendOptions(args.device))
        records = run(config, lambda line: _eprint(f"bench: {line}"))
    labels = {r["test"]: r["model"] for r in records}
    for r in guest:
        r["backend"] = "remote-vm"
        r["model"] = labels.get(r["test"], r["model"])
    records += guest
    native = {(r["model"], r["test"]): r["avg_ts"] for r in records if r["backend"] == "native"}
    for r in records:
        base = native.get((r["model"], r["test"]))
        r["pct_native"] = 100.0 * r["avg_ts"] / base if base else None
    emit(records, args.output, None if args.no_history else args.history)
    return 0


def _vm_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("virtual machine")
    g.add_argument("--memory", type=int, default=1536, metavar="MIB", help="guest RAM (default 1536 MiB)")
    g.add_argument("--cpus", type=int, default=1, help="guest vCPUs (default 1)")
    g.add_argument("--require-kvm", action="store_true",
                   help="fail instead of falling back to slow software emulation without KVM")
    g.add_argument("--accel", choices=("auto", "kvm", "tcg"), default="auto",
                   help="auto: KVM when /dev/kvm is usable, else software emulation (tcg, slow)")
    g.add_argument("--rebuild", action="store_true", help="rebuild the cached guest image first")
    g.add_argument("--vm-timeout", type=float, default=1800.0, metavar="S",
                   help="stop the VM after this many seconds (default 1800)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``vm`` to the ``apir`` parser (after ``run`` and ``bench``, whose options it reuses)."""
    p = sub.add_parser("vm", help="run the guest in a QEMU/KVM virtual machine over VM shared memory",
                       description="The guest (model, tokenizer, sampling) runs in a KVM virtual machine "
                                   "with no GPU and no network; its tensor graphs run here, reached "
                                   "through an ivshmem shared-memory device.")
    actions = p.add_subparsers(dest="vm_action", required=True)
    b = actions.add_parser("build", help="build (or --rebuild) the cached guest image")
    b.add_argument("--rebuild", action="store_true", help="rebuild even if cached")
    b.set_defaults(func=cmd_build)
    run_parser = sub.choices["run"]
    r = actions.add_parser("run", parents=[run_parser], add_help=False,
                           help="apir run inside the VM (takes apir run's options; needs -p)")
    _vm_options(r)
    r.set_defaults(func=cmd_run, run_parser=run_parser)
    if "bench" in sub.choices:
        bench_parser = sub.choices["bench"]
        bp = argparse.ArgumentParser(add_help=False)
        for a in bench_parser._actions:  # noqa: SLF001 - every option but the sub-actions
            if a.option_strings and a.dest != "help":
                bp._add_action(a)  # noqa: SLF001
        bb = actions.add_parser("bench", parents=[bp],
                                help="apir bench inside the VM (backend remote-vm) and native here")
        bb.add_argument("--no-native", action="store_true", help="skip the native runs on this host")
        _vm_options(bb)
        bb.set_defaults(func=cmd_bench, bench_parser=bench_parser, bench_action=None)
