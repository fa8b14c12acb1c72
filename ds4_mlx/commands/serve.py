"""`ds4-mlx serve`: the OpenAI- and Anthropic-compatible HTTP server over one live model session."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from .options import add_model_options

DEFAULT_MAX_QUEUE = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("-n", "--tokens", type=int, default=393216,
                   help="most tokens to generate when a request sets no limit (default 393216)")
    p.add_argument("--cors", action="store_true", help="allow browser clients from any origin (CORS headers)")
    p.add_argument("--api-key", default=os.environ.get("DS4_API_KEY"),
                   help="require this key as 'Authorization: Bearer KEY' or 'x-api-key: KEY' "
                        "(default: $DS4_API_KEY; none = no authentication)")
    p.add_argument("--trace", metavar="FILE",
                   help="append rendered prompts, cache decisions, generated text and tool-parser events to FILE")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help=f"requests that may wait behind the running one; more get 429 (default {DEFAULT_MAX_QUEUE})")
    add_kv_cache_arguments(p)


def add_kv_cache_arguments(p: argparse.ArgumentParser) -> None:
    """The disk KV cache flags (ds4's names and defaults); the tuning flags matter only with --kv-disk-dir."""
    from ..kvstore import KvCacheOptions as defaults

    g = p.add_argument_group("disk KV cache")
    g.add_argument("--kv-disk-dir", type=Path, metavar="DIR",
                   help="keep session checkpoints in DIR (created 0700) and reuse them across conversations and "
                        "restarts (default: off)")
    g.add_argument("--kv-disk-space-mb", type=int, default=defaults.space_mb, metavar="N",
                   help=f"disk budget in MiB; the least useful checkpoints are evicted beyond it (default "
                        f"{defaults.space_mb})")
    g.add_argument("--kv-cache-min-tokens", type=int, default=defaults.min_tokens, metavar="N",
                   help=f"never save or load checkpoints shorter than N tokens (default {defaults.min_tokens})")
    g.add_argument("--kv-cache-cold-max-tokens", type=int, default=defaults.cold_max_tokens, metavar="N",
                   help="checkpoint first prompts of up to N tokens; loaded checkpoints longer than N are consumed "
                        f"(deleted); 0 = no cold checkpoints (default {defaults.cold_max_tokens})")
    g.add_argument("--kv-cache-continued-interval-tokens", type=int, default=defaults.continued_interval_tokens,
                   metavar="N", help="checkpoint a growing session every N tokens, rounded up to the alignment; "
                                     f"0 = off (default {defaults.continued_interval_tokens})")
    g.add_argument("--kv-cache-boundary-trim-tokens", type=int, default=defaults.boundary_trim_tokens, metavar="N",
                   help=f"tokens left off the end of a cold checkpoint (default {defaults.boundary_trim_tokens})")
    g.add_argument("--kv-cache-boundary-align-tokens", type=int, default=defaults.boundary_align_tokens, metavar="N",
                   help=f"align cold and continued checkpoints to N tokens; 0 = off (default "
                        f"{defaults.boundary_align_tokens})")
    g.add_argument("--kv-cache-reject-different-quant", action="store_true",
                   help="load only checkpoints written by a model with the same routed-expert quantization "
                        "(default: 2-bit and 4-bit files share checkpoints)")


def kv_cache_options(args: argparse.Namespace):
    """The KvCacheOptions the flags ask for (validated), or None without --kv-disk-dir."""
    from ..kvstore import KvCacheOptions

    if args.kv_disk_dir is None:
        return None
    return KvCacheOptions(
        directory=args.kv_disk_dir,
        space_mb=args.kv_disk_space_mb,
        min_tokens=args.kv_cache_min_tokens,
        cold_max_tokens=args.kv_cache_cold_max_tokens,
        continued_interval_tokens=args.kv_cache_continued_interval_tokens,
        boundary_trim_tokens=args.kv_cache_boundary_trim_tokens,
        boundary_align_tokens=args.kv_cache_boundary_align_tokens,
        reject_different_quant=args.kv_cache_reject_different_quant,
    )


def run(args: argparse.Namespace) -> int:
    from ..errors import Ds4Error
    from ..serve.app import HttpServer, ServerOptions, create_app
    from ..serve.worker import Worker
    from .options import open_engine

    if args.max_queue < 0:
        raise Ds4Error(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.tokens < 1:
        raise Ds4Error(f"--tokens must be >= 1, got {args.tokens}")
    kv_cache = kv_cache_options(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%m%d %H:%M:%S",
                        stream=sys.stderr)
    worker = Worker(lambda: open_engine(args, default_max_tokens=args.tokens, kv_cache=kv_cache), args.max_queue)
    engine = worker.start()
    app = create_app(worker, ServerOptions(cors=args.cors, api_key=args.api_key or None, trace=args.trace))
    server = HttpServer(app, worker, host=args.host, port=args.port)
    logging.getLogger("ds4_mlx.serve").info("model %s loaded, ctx %d", engine.model_name, engine.ctx)
    server.run()
    return 0
