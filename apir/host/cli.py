"""``apir host``: run the daemon; ``apir host status``: ask a running one."""

from __future__ import annotations

import argparse
import grp
import json
import os
import re
from dataclasses import replace

from .. import env
from ..backends.base import ExecutorConfig
from ..errors import ApirError
from ..flags import add_threads, eprint, set_threads
from ..transport import default_socket_path, parse_address
from .published import KEEP_ALIVE

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'512M', '4G', '1.5G', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B)?\s*", text.upper())
    if not match:
        raise ApirError(f"bad size {text!r}: use a number with an optional K, M, G or T suffix")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def cmd_host(args: argparse.Namespace) -> int:
    from .daemon import HostConfig, gpu_host, run
    from .published import PublishedModel

    if args.action == "status":
        return cmd_status(args)
    listen = args.listen or [env.HOST_LISTEN.get() or f"unix://{default_socket_path()}"]
    token = env.read_token(args.token_file) if args.token_file else None
    if token is not None:
        if len(token) < 16:
            raise ApirError(f"the token in {args.token_file} is too short (use at least 16 characters)")
    group = None
    if args.group:
        try:
            group = grp.getgrnam(args.group).gr_gid
        except KeyError:
            raise ApirError(f"unknown group {args.group!r}") from None
    limits = {  # per-session caps; a flag left out keeps HostConfig's default
        "max_handles": args.max_handles, "max_graph_nodes": args.max_graph_nodes,
        "max_arena": parse_size(args.max_arena) if args.max_arena else None,
        "max_message": parse_size(args.max_message) if args.max_message else None,
        "io_timeout": args.io_timeout, "handshake_timeout": args.handshake_timeout,
    }
    max_memory = (parse_size(args.max_memory) if args.max_memory
                  else default_max_memory(args.device, args.max_sessions))
    config = HostConfig(
        listen=tuple(parse_address(u) for u in listen), device=args.device, token=token,
        max_memory=max_memory, max_compute_seconds=args.max_compute_seconds,
        max_sessions=args.max_sessions, group=group, spin_us=env.spin_us(),
        executor=replace(ExecutorConfig.from_env(), **({"compile_cache": args.compile_cache}
                                                       if args.compile_cache else {})),
        warm_workers=int(gpu_host(args.device)) if args.warm_workers is None else args.warm_workers,
        models=tuple(PublishedModel.parse(spec) for spec in args.model or ()), keep_alive=args.keep_alive,
        **{k: v for k, v in limits.items() if v is not None},
    )
    why = _device_missing(config.device) if config.device in ("cuda", "mps") else None
    if why:
        raise ApirError(f"apir host --device {config.device}: {why}; use --device cpu, or leave "
                        f"--device out to take the best device there is")
    set_threads(args.threads)  # in the daemon: each session's worker is forked from it
    eprint(f"apir host: sessions compute with {args.threads} CPU thread{'s' if args.threads > 1 else ''} (-t)")
    run(config)
    return 0


def _device_missing(device: str) -> str | None:
    """Why torch cannot compute on ``device`` (cuda, mps) here, or None. Asked in a forked
    child: a daemon that initialised CUDA could not use it in the workers it forks."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            from ..doctor import _torch, check_cuda, check_mps

            torch = _torch()  # None without torch: run() says what to install
            check = torch and (check_cuda if device == "cuda" else check_mps)(torch)
            os.write(write, (check.detail if check and check.status == "missing" else "").encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        why = f.read().decode()
    os.waitpid(pid, 0)
    return why or None


def default_max_memory(device: str | None, max_sessions: int) -> int:
    """``--max-memory``'s default: the memory free now, shared by ``max_sessions`` but by
    at most 4 (the default 16 would cap a CPU host's session at 1.5 GB of 24, too little
    for a 270M model with its dequantized cache; sessions that all fill their cap at once
    past that meet the OS's limits, each worker's own first): the host's available memory,
    and on a GPU host the least of that and the device's free memory (asked through NVML,
    so the daemon never initialises CUDA before it forks)."""
    try:
        with open("/proc/meminfo") as f:
            free = int(re.search(r"MemAvailable:\s+(\d+) kB", f.read()).group(1)) << 10
    except OSError:  # no /proc (macOS): the physical memory
        free = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if device in (None, "cuda"):
        free = min(free, _gpu_free() or free)
    return max(free // min(max(max_sessions, 1), 4), 1 << 20)


def _gpu_free() -> int | None:
    """Free bytes of GPU 0 by NVML (None without an NVIDIA driver)."""
    import ctypes

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    info, handle = (ctypes.c_ulonglong * 3)(), ctypes.c_void_p()  # total, free, used
    if nvml.nvmlInit_v2() or nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)):
        return None
    ok = nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(info)) == 0
    nvml.nvmlShutdown()
    return info[1] if ok else None


def cmd_status(args: argparse.Namespace) -> int:
    from ..backends.remote import host_status

    url = (args.listen or [None])[0]
    st = host_status(url, env.read_token(args.token_file))
    sessions = [
        {"session": s.session, "pid": s.pid, "peer": s.peer, "allocated": s.allocated, "peak": s.peak}
        for s in st.sessions
    ]
    pool = {"size": st.warm_workers, "ready": st.idle_ready, "served_warm": st.served_warm,
            "served_cold": st.served_cold}
    print(json.dumps({"version": st.version, "device": st.device.name, "max_sessions": st.max_sessions,
                      "max_memory": st.max_memory, "sessions": sessions, "warm_workers": pool,
                      "published": {"models": list(st.published), "resident_bytes": st.shared_bytes,
                                    "loads": st.shared_loads,
                                    "copies": [{"model": c.name, "where": c.where, "bytes": c.nbytes,
                                                "sessions": c.sessions} for c in st.shared]}}, indent=2))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("host", help="run the host daemon that executes guests' graphs",
                       epilog="apir host status [--listen URL] [--token-file FILE] prints a running "
                              "daemon's status as JSON; the other options are the daemon's")
    p.add_argument("action", nargs="?", choices=("serve", "status"), default="serve",
                   help="serve (default) or print a running daemon's status")
    p.add_argument("--listen", action="append", metavar="URL",
                   help="unix:///PATH (default: the user's socket), tcp://HOST:PORT (needs "
                        "--token-file), vsock://CID:PORT; repeatable")
    p.add_argument("--device", choices=("cpu", "cuda", "mps"), default=env.DEVICE.get(),
                   help="where sessions execute (default: best available)")
    p.add_argument("--token-file", default=env.TOKEN_FILE.get(),
                   help="file holding the shared secret guests must present on tcp/vsock")
    p.add_argument("--max-memory", metavar="SIZE",
                   help="per-session memory cap (buffers, dequantized and fused weights, graph "
                        "metadata, compute scratch and replies), e.g. 8G, also enforced by the OS "
                        "on each worker; 0: none (default: the memory free at start, the device's "
                        "on a GPU host, divided by --max-sessions, at most by 4)")
    p.add_argument("--max-compute-seconds", type=float, default=0, metavar="S",
                   help="a request (one compute) running longer ends its session with a QUOTA "
                        "error (default 0: no limit). A graph's first compute includes compiling "
                        "it and making its weights' forms (tens of seconds on a cold cache): "
                        "allow for that")
    p.add_argument("--max-sessions", type=int, default=16, help="concurrent sessions (default 16)")
    p.add_argument("--max-handles", type=int, metavar="N",
                   help="live buffers + graphs per session (default 65536)")
    p.add_argument("--max-graph-nodes", type=int, metavar="N", help="nodes per graph (default 65536)")
    p.add_argument("--max-arena", metavar="SIZE", help="shared arena per session (default 1G)")
    p.add_argument("--max-message", metavar="SIZE",
                   help="largest frame a guest may send (default 64M; tcp guests send 8M chunks)")
    p.add_argument("--io-timeout", type=float, metavar="S",
                   help="seconds a started frame may stall, or a reply wait to be read, before "
                        "the session is closed (default 60)")
    p.add_argument("--handshake-timeout", type=float, metavar="S",
                   help="seconds a new connection has to complete its handshake (default 5)")
    p.add_argument("--warm-workers", type=int, metavar="N",
                   help="idle workers kept started, device initialised, so a new session starts "
                        "at once instead of after torch's CUDA setup (~5 s); each holds a device "
                        "context. Default 1 on a GPU host, 0 on a CPU one, where a cold start is "
                        "a fork of the daemon and an idle worker would only hold memory (max 8)")
    p.add_argument("--model", action="append", metavar="NAME=PATH",
                   help="publish a GGUF model: the host loads its weights itself, once, and every "
                        "guest whose own GGUF file has PATH's name, or NAME.gguf, and the same "
                        "tensors uses that read-only copy instead of uploading its own; a PATH "
                        "alone is published as its file name less .gguf; repeatable")
    p.add_argument("--keep-alive", type=float, default=KEEP_ALIVE, metavar="S",
                   help="seconds a published model stays loaded after its last session ends "
                        "(default 300, as Ollama's keep_alive); negative: loaded at start and "
                        "kept, so no guest can tell from its start-up time whether another "
                        "guest uses it")
    p.add_argument("--compile-cache", metavar="DIR",
                   help="where compiled decode steps are kept (one subdirectory per torch and apir "
                        "version, mode 0700), so a later session of the same model and device "
                        "loads them instead of compiling again (default: $APIR_COMPILE_CACHE, "
                        "else ~/.cache/apir/compile)")
    p.add_argument("--group", help="make the unix socket usable by this group (mode 0660)")
    add_threads(p, "each session's worker computes with")
    p.set_defaults(func=cmd_host)
