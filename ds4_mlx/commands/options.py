"""Flags shared by the commands that load a model (run, chat, serve, bench), and what they turn into."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import Ds4Error

DEFAULT_MODEL = "ds4flash.gguf"


def add_model_options(p: argparse.ArgumentParser, default_ctx: int | None = 32768) -> None:
    """The model flags; `default_ctx` None leaves the context to the command (bench derives it)."""
    p.add_argument("-m", "--model", type=Path, default=Path(DEFAULT_MODEL), help="GGUF file (default ./ds4flash.gguf)")
    p.add_argument(
        "--demo",
        action="store_true",
        help="use the built-in tiny demo model (real tokenizer, random weights: its text is meaningless)",
    )
    p.add_argument("-c", "--ctx", type=int, default=default_ctx, help="context size in tokens (default"
                   + (f" {default_ctx})" if default_ctx else ": what the command needs)"))
    p.add_argument("--backend", choices=("cpu", "gpu"), help="MLX device (default: MLX's default device)")
    p.add_argument("--no-quant-sim", action="store_true", help="turn off the FP8 KV / FP4 indexer simulation")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    think = p.add_mutually_exclusive_group()
    think.add_argument("--think", dest="think", action="store_const", const="high", help="thinking (the default)")
    think.add_argument("--think-max", dest="think", action="store_const", const="max", help="Think Max (ctx >= 393216)")
    think.add_argument("--nothink", dest="think", action="store_const", const="none", help="no thinking")
    p.set_defaults(think="high")
    p.add_argument("--temp", type=float, default=1.0, help="temperature; 0 = greedy (default 1)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens; 0 = off (default)")
    p.add_argument("--min-p", type=float, default=0.05, help="drop tokens below min-p x the top one (default 0.05)")
    p.add_argument("--seed", type=int, help="sampling seed (default: random)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI presence penalty (default 0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI frequency penalty (default 0)")


def add_kv_cache_arguments(p: argparse.ArgumentParser) -> None:
    """The disk KV cache flags (ds4's names and defaults); the tuning flags matter only with --kv-disk-dir."""
    from ..kvstore import KvCacheOptions as defaults

    g = p.add_argument_group("KV cache")
    g.add_argument("--kv-ram-budget", type=byte_size, metavar="SIZE",
                   help="memory for in-memory session checkpoints (the end of each prompt, the start of its last "
                        "message, prefill chunk boundaries), e.g. 16G or 512M; least recently used go first; 0 = "
                        "none (default: half of what the device has left after the model and the live session)")
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


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def byte_size(text: str) -> int:
    """A size in bytes: a number with an optional binary unit K, M, G or T (an optional trailing B or iB)."""
    spelled = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = spelled[-1:] if spelled[-1:] in _UNITS else ""
    try:
        value = float(spelled[: len(spelled) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 16G, 512M or 0, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a size >= 0, got {text!r}")
    return int(value * _UNITS[unit])


def _mtp_draft(text: str) -> int:
    from ..engine import MAX_MTP_DRAFT

    value = int(text)
    if not 1 <= value <= MAX_MTP_DRAFT:
        raise argparse.ArgumentTypeError(f"expected an integer from 1 to {MAX_MTP_DRAFT}, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def add_mtp_options(p: argparse.ArgumentParser) -> None:
    """ds4's MTP flags (spec §7): speculative greedy decoding with the optional MTP draft file."""
    g = p.add_argument_group("MTP speculative decoding (greedy only: --temp 0)")
    g.add_argument("--mtp", type=Path, metavar="FILE",
                   help="MTP draft file (./download_model.sh mtp) to guess tokens ahead with (default: off)")
    g.add_argument("--mtp-draft", type=_mtp_draft, default=1, metavar="N",
                   help="tokens per model call when the guesses hold: the chosen one and up to N-1 guesses; "
                        "1 = no speculation (default 1)")
    g.add_argument("--mtp-margin", type=_non_negative, default=3.0, metavar="F",
                   help="verify a lone guess only if its top-1/top-2 logit gap is at least F (default 3)")


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


def think_mode_from_args(args: argparse.Namespace):
    from ..chat import ThinkMode

    return {"high": ThinkMode.HIGH, "max": ThinkMode.MAX, "none": ThinkMode.NONE}[args.think]


def sampling_from_args(args: argparse.Namespace):
    from ..sampling import SamplingParams

    return SamplingParams(
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
    )


def select_backend(args: argparse.Namespace) -> None:
    import mlx.core as mx

    if args.backend == "cpu":
        mx.set_default_device(mx.cpu)
    elif args.backend == "gpu":
        mx.set_default_device(mx.gpu)


def open_engine(args: argparse.Namespace, **opts):
    """Loads the engine from --model, or the demo model with --demo (saying in one line what the demo is)."""
    from ..engine import Engine, ensure_demo_model

    select_backend(args)
    path = args.model
    if args.demo:
        print(
            "ds4-mlx: --demo uses a tiny random-weight model with the real tokenizer: its text is meaningless",
            file=sys.stderr,
        )
        path = ensure_demo_model()
    if getattr(args, "kv_disk_dir", None) is not None:
        opts.setdefault("kv_cache", kv_cache_options(args))
    if getattr(args, "kv_ram_budget", None) is not None:
        opts.setdefault("kv_ram_budget", args.kv_ram_budget)
    if getattr(args, "mtp_draft", 1) > 1 and args.mtp is None:
        raise Ds4Error(f"--mtp-draft {args.mtp_draft} needs an MTP draft file: --mtp FILE")
    if getattr(args, "mtp", None) is not None:
        opts.update(mtp=args.mtp, mtp_draft=args.mtp_draft, mtp_margin=args.mtp_margin)
    return Engine.load(path, args.ctx, simulate_quant=not args.no_quant_sim, quiet=args.quiet, **opts)


def encode_cli_prompt(tokenizer, pieces) -> list[int]:
    """Tokenizes the CLI prompt pieces: special markers as specials, system and user text as plain BPE."""
    ids: list[int] = []
    for text, special in pieces:
        ids += tokenizer.encode(text, specials=special)
    return ids
