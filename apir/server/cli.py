"""The ``apir serve`` subcommand: flags, then uvicorn running ``app.create_app``."""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import signal
import socket
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .. import env
from ..errors import ApirError
from ..flags import add_backend, add_model, eprint, remote_ready, run_config

if TYPE_CHECKING:
    pass


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, ...)")
    add_model(p)
    p.add_argument("--bind", default="127.0.0.1", metavar="ADDR",
                   help="address to listen on (default: 127.0.0.1; 0.0.0.0 opens it to the "
                        "network: set --api-key too)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default: 8080)")
    p.add_argument("--api-key", default=env.API_KEY.get(), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* (env APIR_API_KEY)")
    p.add_argument("--alias", action="append", default=[], metavar="NAME",
                   help="another model name requests may use (repeatable)")
    p.add_argument("--any-model-name", action="store_true",
                   help="serve the model whatever name a request gives (as llama-server does)")
    p.add_argument("-np", "--parallel", type=int, default=None,
                   help="generations at once, batched in each step (default: 4 on a GPU; on a CPU "
                        "up to 4, as many as leave 3/4 of the free memory after their KV caches)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for a slot before the server answers 429 (default 64)")
    p.add_argument("--pooling", choices=("mean", "cls", "last"),
                   help="how /v1/embeddings pools hidden states (default: the model's own "
                        "pooling type; a generative model has none)")
    add_backend(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from .app import ServeConfig, create_app
    except ImportError as e:
        raise ApirError(f"apir serve needs Starlette and uvicorn ({e}): pip install 'apir[serve]'") from None
    run = run_config(args)
    if run.target == "remote" and not run.remote:
        raise ApirError("--backend remote needs --remote URL (or APIR_REMOTE)")
    sock = _listen(args.bind, args.port)  # a port in use is one line now, before any loading
    with sock, remote_ready(run) as run:
        config = ServeConfig(
            run, api_key=args.api_key or None, host=args.bind, port=args.port,
            aliases=tuple(args.alias), any_model_name=args.any_model_name, pooling=args.pooling,
            parallel=args.parallel, max_queue=args.max_queue,
        )
        failed: list[Exception] = []

        def on_load_error(e: Exception) -> None:
            failed.append(e)
            server.should_exit = True

        app = create_app(config, on_load_error=on_load_error)
        log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
        log_config["handlers"]["access"]["stream"] = "ext://sys.stderr"  # stdout is for results
        server = uvicorn.Server(uvicorn.Config(
            app, host=config.host, port=config.port, log_level="info", log_config=log_config,
            timeout_graceful_shutdown=5,
        ))
        if config.api_key is None and config.host not in ("127.0.0.1", "localhost", "::1"):
            print(f"apir serve: warning: listening on {config.host} without --api-key", file=sys.stderr)
        with _exit_on_sigterm():
            server.run(sockets=[sock])
    return 1 if failed else 0


def _listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound as uvicorn binds it (SO_REUSEADDR), or one line
    saying why it cannot be."""
    where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    if not 0 <= port <= 65535:
        raise ApirError(f"--port must be in 0..65535, got {port}")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((host, port), family=family)
    except OSError as e:
        # create_server puts the address in strerror; getaddrinfo errors have negative numbers
        why = os.strerror(e.errno) if (e.errno or 0) > 0 else e.strerror or str(e)
        raise ApirError(f"apir serve cannot listen on {where}: {why}") from None
    eprint(f"apir serve: listening on http://{where.rpartition(':')[0]}:{sock.getsockname()[1]}")
    return sock


@contextlib.contextmanager
def _exit_on_sigterm() -> Iterator[None]:
    """After a graceful shutdown uvicorn re-raises the signal that asked for it; SIGTERM's
    default action would then kill the process on the spot, skipping cleanup (stopping a
    host daemon started for ``--remote auto``). Make it an exception instead."""

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, terminate)
    except ValueError:  # not the main thread: signals are not ours to handle
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
