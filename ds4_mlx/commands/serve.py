"""`ds4-mlx serve`: the OpenAI- and Anthropic-compatible HTTP server over one live model session."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING

from .options import (
    add_kv_cache_arguments,
    add_model_options,
    add_mtp_options,
    add_token_limit,
    non_negative_int,
    port_number,
    positive_int,
    token_limit,
)

if TYPE_CHECKING:
    from ..engine import Engine

DEFAULT_MAX_TOKENS = 393216
"""The answer limit of a request that sets none (ds4's), DEMO_MAX_TOKENS for a random-weight model."""
DEFAULT_MAX_QUEUE = 64
DEFAULT_PARALLEL = 4
"""--parallel's default where four sessions fit beside the weights (Engine.load picks fewer where they do not)."""
WRITE_TIMEOUT_SECONDS = 30
"""--write-timeout's default (serve/guard.py's, kept here so that `--help` does not import the server)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="also serve requests whose Host header is NAME (repeatable; '*' = any). By default only "
                        "localhost, loopback addresses and the --host address are served, so that web pages cannot "
                        "reach the server through DNS rebinding")
    add_token_limit(p, DEFAULT_MAX_TOKENS, "most tokens to generate when a request sets no limit")
    p.add_argument("--cors", action="store_true", help="allow browser clients from any origin (CORS headers)")
    p.add_argument("--api-key", default=os.environ.get("DS4_API_KEY"),
                   help="require this key as 'Authorization: Bearer KEY' or 'x-api-key: KEY' "
                        "(default: $DS4_API_KEY; none = no authentication)")
    p.add_argument("--trace", metavar="FILE",
                   help="append rendered prompts, cache decisions, generated text and tool-parser events to FILE")
    p.add_argument("--parallel", type=positive_int, default=None, metavar="N",
                   help="requests that run at once, each on a session of its own, their tokens decoded together "
                        f"(default: {DEFAULT_PARALLEL}, fewer where the sessions' state at --ctx does not fit; more than "
                        "fit is refused at start with what would)")
    p.add_argument("--max-queue", type=non_negative_int, default=DEFAULT_MAX_QUEUE,
                   help=f"requests that may wait behind the running ones; more get 429 (default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--write-timeout", type=positive_int, default=WRITE_TIMEOUT_SECONDS, metavar="SECONDS",
                   help="a client that takes no byte of its answer for this long (once the buffers on the way are "
                        "full) is treated as disconnected: its generation stops and the worker moves on "
                        f"(default {WRITE_TIMEOUT_SECONDS})")
    add_kv_cache_arguments(p)
    add_mtp_options(p)


def check_listen(host: str, port: int) -> None:
    """Stops before the model loads (minutes for the real one) when the address cannot be listened on: a port in
    use, an address that is not this machine's, a name that does not resolve."""
    from ..errors import Ds4Error

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:  # its errno is the resolver's (EAI_*), which os.strerror does not know
        raise Ds4Error(f"cannot listen on {host}:{port}: the host {host!r} cannot be resolved to an address "
                       f"({e.strerror}); give an IP address or a name of this machine, e.g. 127.0.0.1") from None
    try:
        with socket.create_server((host, port), family=family):
            pass
    except OSError as e:
        reason = os.strerror(e.errno) if e.errno else str(e)
        raise Ds4Error(f"cannot listen on {host}:{port}: {reason}") from None


def run(args: argparse.Namespace) -> int:
    from ..serve.app import HttpServer, ServerOptions, create_app
    from ..serve.worker import Worker
    from .options import kv_cache_options

    from ..model.shard import rank
    from ..serve.relay import Relay, follow

    kv_cache = kv_cache_options(args)  # validated before the model loads
    if rank() != 0:  # under mlx.launch: rank 0 serves, the others run what its worker runs (serve/relay.py)
        # Ctrl+C reaches every local rank: rank 0 alone decides when they stop (a rank gone first would leave rank 0
        # waiting for it in an exchange)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        engine = warmed(serving_engine(args, kv_cache))
        follow(engine, Relay(engine.model.split))
        return 0
    check_listen(args.host, args.port)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        datefmt="%Y-%m-%dT%H:%M:%S%z", stream=sys.stderr)  # ISO 8601
    worker = Worker(lambda: warmed(serving_engine(args, kv_cache)), args.max_queue)
    engine = worker.start()
    warn_if_exposed(args.host, args.api_key)
    app = create_app(worker, ServerOptions(cors=args.cors, api_key=args.api_key or None, trace=args.trace,
                                           bind_host=args.host, allowed_hosts=tuple(args.allow_host),
                                           write_timeout_seconds=args.write_timeout))
    server = HttpServer(app, worker, write_timeout=args.write_timeout, host=args.host, port=args.port)
    logging.getLogger("ds4_mlx.serve").info("model %s loaded, ctx %d", engine.model_name, engine.ctx)
    server.run()
    return 0


def serving_engine(args: argparse.Namespace, kv_cache: object) -> Engine:
    """The engine of the flags, whose answer limit for a request that sets none is -n, else DEFAULT_MAX_TOKENS,
    else DEMO_MAX_TOKENS for a random-weight model (options.token_limit: the rule `run` and `chat` follow)."""
    from .options import open_engine

    engine = open_engine(args, kv_cache=kv_cache, parallel=args.parallel or -DEFAULT_PARALLEL)
    engine.default_max_tokens = token_limit(args, DEFAULT_MAX_TOKENS, engine)
    return engine


def warmed(engine: Engine) -> Engine:
    """The engine after `Engine.warm_up` on a GPU (kernels compiled and checked, the decode graphs made), so that
    the first request does not wait for them; on the CPU there is little to warm."""
    import mlx.core as mx

    if mx.default_device() == mx.gpu:
        seconds = engine.warm_up()
        logging.getLogger("ds4_mlx.serve").info("warmed up in %.1f s (kernels, decode graphs)", seconds)
    return engine


def warn_if_exposed(host: str, api_key: str | None) -> None:
    """One warning when the server listens beyond this machine with no API key."""
    if not api_key and not _loopback(host):
        logging.getLogger("ds4_mlx.serve").warning(
            "listening on %s without an API key: anyone who can reach this address can use the model; set "
            "--api-key (or DS4_API_KEY), or listen on 127.0.0.1", host)


def _loopback(host: str) -> bool:
    """Whether `--host` keeps the server on this machine (a loopback address or name)."""
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
