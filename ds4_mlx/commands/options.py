"""Flags shared by the commands that load a model (run, chat, serve, bench), and what they turn into.

Values a flag can never take are refused by its argparse type (exit 2, one line); what depends on the machine (a
GPU backend, a writable folder) is checked here before the model loads (exit 1). Options that are accepted but have
no effect in the chosen setting are named in a warning.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from ..errors import Ds4Error, ModelFileMissing, RequestError, UsageError
from ..model.config import FLASH

DEFAULT_MODEL = "ds4flash.gguf"
MAX_CONTEXT: int = FLASH.context_length
"""DeepSeek V4 Flash's trained context, 1,048,576 tokens: the largest --ctx accepted."""
DEMO_MAX_TOKENS = 256
"""Default answer length with --demo or any random-weight file (make-model's): such a model never writes its end
token, so without a limit an answer (or a client waiting for it) would run for the whole default."""


def bounded_int(lo: int, hi: int | None = None, what: str = "an integer") -> Callable[[str], int]:
    """An argparse type for integers in [lo, hi], whose error says the range."""
    expected = f"{what} from {lo} to {hi}" if hi is not None else f"{what} >= {lo}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


context_size = bounded_int(1, MAX_CONTEXT, "a number of tokens")
"""--ctx: at least one token, at most the model's trained context."""
positive_int = bounded_int(1)
non_negative_int = bounded_int(0)
port_number = bounded_int(1, 65535, "a port number")


def add_model_options(p: argparse.ArgumentParser, default_ctx: int | None = 32768) -> None:
    """The model flags; `default_ctx` None leaves the context to the command (bench derives it)."""
    p.add_argument("-m", "--model", type=Path, help=f"GGUF file (default ./{DEFAULT_MODEL})")
    p.add_argument(
        "--demo",
        action="store_true",
        help="use the built-in tiny demo model (real tokenizer, random weights: its text is meaningless)",
    )
    p.add_argument("-c", "--ctx", type=context_size, default=default_ctx,
                   help=f"context size in tokens, up to {MAX_CONTEXT} (default"
                   + (f" {default_ctx})" if default_ctx else ": what the command needs)"))
    p.add_argument("--backend", choices=("cpu", "gpu"), help="MLX device (default: MLX's default device)")
    p.add_argument("--no-quant-sim", action="store_true", help="turn off the FP8 KV / FP4 indexer simulation")
    p.add_argument("--checkpoint", choices=("preview", "0731"),
                   help="which checkpoint the file holds, for its reasoning-effort prompts (default: told from the "
                        "file; see `inspect`)")
    p.add_argument("--memory-limit", type=byte_size, metavar="SIZE",
                   help="device memory the process may hold, e.g. 70G (default: the GPU's memory less a reserve "
                        "for what MLX does not count; on the CPU 90%% of RAM); prefill chunks shrink to stay under it")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    g = p.add_argument_group("several machines (under mlx.launch; docs/distributed.md)")
    g.add_argument("--split", choices=("tensor", "layers"),
                   help="tensor: every layer split across the ranks (default); layers: a range of layers a rank")
    g.add_argument("--split-weights", metavar="W,W,...",
                   help="each rank's share of the split, e.g. 3,5 (default: each host's device memory budget)")


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    think = p.add_mutually_exclusive_group()
    think.add_argument("--think", dest="think", action="store_const", const="low",
                       help="thinking at the default effort tier, low (the default)")
    think.add_argument("--think-high", dest="think", action="store_const", const="high",
                       help="the high tier (0731: the \"Absolute maximum\" prefix; the preview: as --think)")
    think.add_argument("--think-max", dest="think", action="store_const", const="max",
                       help="the max tier (ctx >= 393216; 0731: \"Beyond maximum\", the preview: \"Absolute maximum\")")
    think.add_argument("--nothink", dest="think", action="store_const", const="none", help="no thinking")
    p.set_defaults(think=None)  # None: not given (--think's behaviour, but --raw can tell that nothing was asked)
    p.add_argument("--temp", type=float, default=1.0, help="temperature; 0 = greedy (default 1)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens; 0 = off (default)")
    p.add_argument("--min-p", type=float, default=0.05, help="drop tokens below min-p x the top one (default 0.05)")
    p.add_argument("--seed", type=int, help="sampling seed (default: random)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI presence penalty (default 0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI frequency penalty (default 0)")


def add_kv_cache_arguments(p: argparse.ArgumentParser) -> None:
    """The disk KV cache flags (ds4's names and defaults); the tuning flags matter only with --kv-disk-dir."""
    from ..cache.kvstore import KvCacheOptions as defaults

    g = p.add_argument_group("KV cache")
    g.add_argument("--kv-ram-budget", type=byte_size, metavar="SIZE",
                   help="memory for in-memory session checkpoints (the end of each prompt, the start of its last "
                        "message, prefill chunk boundaries), e.g. 16G or 512M; least recently used go first; 0 = "
                        "none (default: what --memory-limit leaves after the weights, the live session and one "
                        "prefill chunk)")
    g.add_argument("--kv-disk-dir", type=Path, metavar="DIR",
                   help="keep session checkpoints in DIR (created 0700) and reuse them across conversations and "
                        "restarts (default: off)")
    g.add_argument("--kv-disk-space-mb", type=positive_int, default=defaults.space_mb, metavar="N",
                   help=f"disk budget in MiB; the least useful checkpoints are evicted beyond it (default "
                        f"{defaults.space_mb})")
    g.add_argument("--kv-cache-min-tokens", type=positive_int, default=defaults.min_tokens, metavar="N",
                   help=f"never save or load checkpoints shorter than N tokens (default {defaults.min_tokens})")
    g.add_argument("--kv-cache-cold-max-tokens", type=non_negative_int, default=defaults.cold_max_tokens, metavar="N",
                   help="checkpoint first prompts of up to N tokens; loaded checkpoints longer than N are consumed "
                        f"(deleted); 0 = no cold checkpoints (default {defaults.cold_max_tokens})")
    g.add_argument("--kv-cache-continued-interval-tokens", type=non_negative_int,
                   default=defaults.continued_interval_tokens, metavar="N",
                   help="checkpoint a growing session every N tokens, rounded up to the alignment; "
                        f"0 = off (default {defaults.continued_interval_tokens})")
    g.add_argument("--kv-cache-boundary-trim-tokens", type=non_negative_int, default=defaults.boundary_trim_tokens,
                   metavar="N",
                   help=f"tokens left off the end of a cold checkpoint (default {defaults.boundary_trim_tokens})")
    g.add_argument("--kv-cache-boundary-align-tokens", type=non_negative_int, default=defaults.boundary_align_tokens,
                   metavar="N",
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


def add_token_limit(p: argparse.ArgumentParser, default: int, what: str = "most tokens to generate") -> None:
    """-n/--tokens; left unset it becomes `default`, or DEMO_MAX_TOKENS for a random-weight model (`token_limit`)."""
    p.add_argument("-n", "--tokens", type=positive_int, metavar="N",
                   help=f"{what} (default {default}; {DEMO_MAX_TOKENS} with --demo or another random-weight file "
                        "from make-model, whose model never stops)")


def token_limit(args: argparse.Namespace, default: int, engine=None) -> int:
    """The -n the user gave, else the command's default; DEMO_MAX_TOKENS with --demo or when the loaded `engine`
    has random weights (`open_engine` says so when it loads one)."""
    if args.tokens is not None:
        return args.tokens
    return DEMO_MAX_TOKENS if args.demo or (engine is not None and engine.random_weights) else default


def model_file(args: argparse.Namespace) -> Path:
    """-m's file, else ./ds4flash.gguf (--demo's model is chosen by `open_engine`)."""
    return args.model if args.model is not None else Path(DEFAULT_MODEL)


def unused_model_note(args: argparse.Namespace) -> str | None:
    """The warning for -m given beside --demo, which loads its own model; None when there is none to give."""
    if getattr(args, "demo", False) and getattr(args, "model", None) is not None:
        return f"--demo loads the built-in demo model: -m {args.model} is unused"
    return None


def _mtp_draft(text: str) -> int:
    from ..engine import MAX_MTP_DRAFT

    return bounded_int(1, MAX_MTP_DRAFT)(text)


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def add_mtp_options(p: argparse.ArgumentParser) -> None:
    """ds4's MTP flags (ds4_cli.c): speculative greedy decoding with the optional MTP draft file."""
    g = p.add_argument_group("speculative decoding (the MTP file: greedy only, --temp 0; DSpark: any sampling)")
    g.add_argument("--mtp", type=Path, metavar="FILE",
                   help="draft file to guess tokens ahead with, told by its tensors: 0731's DSpark support file "
                        "(./download_model.sh ds4f-dspark) or the preview's MTP file (mtp) (default: off)")
    g.add_argument("--mtp-draft", type=_mtp_draft, default=1, metavar="N",
                   help="tokens per model call when the guesses hold: the chosen one and up to N-1 guesses (DSpark: "
                        "at most its block of 5, so 6 takes them all); 1 = no speculation (default 1)")
    g.add_argument("--mtp-margin", type=_non_negative, default=3.0, metavar="F",
                   help="verify a lone guess only if its top-1/top-2 logit gap is at least F (default 3)")


def kv_cache_options(args: argparse.Namespace):
    """The KvCacheOptions the flags ask for (validated, the folder created and writable), or None without
    --kv-disk-dir."""
    from ..cache.kvstore import KvCacheOptions

    if args.kv_disk_dir is None:
        return None
    _usable_folder(args.kv_disk_dir, "--kv-disk-dir", create=True)
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


def _usable_folder(path: Path, flag: str, create: bool = False) -> None:
    """Stops before loading when `path` is not a folder this process can write in (made first if `create`)."""
    if create:
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise Ds4Error(f"{flag} {path}: cannot create the folder ({e.strerror or e})") from None
    if not path.is_dir():
        raise Ds4Error(f"{flag}: {path} is not a folder" if path.exists() else f"{flag}: no folder {path}")
    if not os.access(path, os.W_OK | os.X_OK):
        raise Ds4Error(f"{flag}: the folder {path} is not writable")


def writable_file(path: Path, flag: str) -> None:
    """Stops before loading when `path` cannot be written: its folder is missing or read-only, or it is a folder."""
    if path.is_dir():
        raise Ds4Error(f"{flag} {path} is a folder; expected a file name")
    _usable_folder(path.parent, flag)


def think_mode_from_args(args: argparse.Namespace):
    from ..chat import ThinkMode

    return ThinkMode(args.think or "low")


def sampling_from_args(args: argparse.Namespace):
    """The SamplingParams of the flags; a value out of range is a usage error."""
    from ..sampling import SamplingParams

    try:
        return SamplingParams(
            temperature=args.temp,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.seed,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
        )
    except RequestError as e:
        raise UsageError(f"sampling flags: {e}") from None


def select_backend(args: argparse.Namespace) -> None:
    """Makes --backend MLX's default device; a backend this MLX build lacks is an error naming those it has."""
    import mlx.core as mx

    from .. import memory

    if getattr(args, "memory_limit", None) is not None:
        memory.set_limit(args.memory_limit)
    if args.backend is None:
        return
    devices = {"cpu": mx.cpu, "gpu": mx.gpu}
    if not mx.is_available(devices[args.backend]):
        have = ", ".join(name for name, device in devices.items() if mx.is_available(device))
        raise Ds4Error(
            f"--backend {args.backend}: this MLX build has no {args.backend} backend (available: {have}); "
            "for NVIDIA GPUs install the `cuda` extra (mlx[cuda13]), on a Mac plain `mlx`"
        )
    mx.set_default_device(devices[args.backend])


def warn_ignored_options(args: argparse.Namespace) -> None:
    """Names the options that were given but have no effect as set (one warning line each, on stderr)."""
    from ..chat import THINK_MAX_MIN_CONTEXT

    notes = [note] if (note := unused_model_note(args)) is not None else []
    if getattr(args, "raw", False) and (args.system is not None or args.think is not None):
        notes.append("--raw sends the prompt as written: --system and the thinking flags are unused")
    if getattr(args, "think", None) == "max" and not getattr(args, "raw", False) and args.ctx < THINK_MAX_MIN_CONTEXT:
        notes.append(f"--think-max needs --ctx >= {THINK_MAX_MIN_CONTEXT}; ctx={args.ctx} uses normal thinking "
                     "instead")
    if getattr(args, "mtp", None) is not None:
        if args.mtp_draft < 2:
            notes.append("--mtp without --mtp-draft N (N >= 2) does not speculate: the draft file is unused")
        elif (hasattr(args, "temp") and (args.temp > 0 or args.presence_penalty or args.frequency_penalty)
              and not _is_dspark(args.mtp)):
            notes.append("--mtp speculates only in greedy decoding (--temp 0, no penalties): it is unused here")
    for note in notes:
        print(f"ds4-mlx: warning: {note}", file=sys.stderr)


def _is_dspark(path: Path) -> bool:
    """Whether a --mtp file is a DSpark support file, whose drafts serve sampled decoding too (False for a file
    that cannot be read: loading it says why)."""
    from ..errors import GGUFError
    from ..model.dspark_file import support_kind

    try:
        return support_kind(path) == "dspark"
    except (OSError, GGUFError):
        return False


def open_engine(args: argparse.Namespace, **opts):
    """Loads the engine from --model, or the demo model with --demo (saying in one line what the demo is). With
    random weights and no -n, says that answers stop at DEMO_MAX_TOKENS (`token_limit`)."""
    from ..engine import Engine, ensure_demo_model

    if getattr(args, "mtp_draft", 1) > 1 and args.mtp is None:
        raise UsageError(f"--mtp-draft {args.mtp_draft} needs an MTP draft file: --mtp FILE")
    if getattr(args, "mtp", None) is not None and not args.mtp.exists():
        raise ModelFileMissing.mtp_at(args.mtp)  # before any warning that the file would be unused
    select_backend(args)
    if getattr(args, "kv_disk_dir", None) is not None:
        opts.setdefault("kv_cache", kv_cache_options(args))
    if not quiet_other_ranks(args):
        warn_ignored_options(args)
    path = model_file(args)
    if args.demo:
        print(
            "ds4-mlx: --demo uses a tiny random-weight model with the real tokenizer: its text is meaningless",
            file=sys.stderr,
        )
        path = ensure_demo_model()
    if getattr(args, "kv_ram_budget", None) is not None:
        opts.setdefault("kv_ram_budget", args.kv_ram_budget)
    if getattr(args, "checkpoint", None) is not None:
        from ..model.checkpoint import Checkpoint

        opts.setdefault("checkpoint", Checkpoint(args.checkpoint))
    if getattr(args, "mtp", None) is not None:
        opts.update(mtp=args.mtp, mtp_draft=args.mtp_draft, mtp_margin=args.mtp_margin)
    engine = Engine.load(path, args.ctx, simulate_quant=not args.no_quant_sim, quiet=args.quiet,
                         split=getattr(args, "split", None), split_weights=getattr(args, "split_weights", None), **opts)
    if engine.random_weights and getattr(args, "tokens", 0) is None:
        print(f"ds4-mlx: the model has random weights and never stops by itself: answers end after "
              f"{DEMO_MAX_TOKENS} tokens unless a limit is given (-n N; in the server, a request's max_tokens)",
              file=sys.stderr)
    return engine


def quiet_other_ranks(args: argparse.Namespace) -> bool:
    """Under mlx.launch every rank runs the command and rank 0 alone prints: on the others standard output goes
    nowhere and standard error passes on their errors only. Whether this process is such another rank."""
    from ..model.shard import rank

    if (at := rank()) == 0:
        return False
    args.quiet = True
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
    sys.stderr = ErrorLines(sys.stderr, f"rank {at}: ")
    return True


class ErrorLines:
    """A text stream that passes on only the lines saying `error:` (with a prefix naming the rank) and drops the
    rest: the standard error of a rank past 0, which runs the same command as rank 0 but need not repeat its
    output."""

    def __init__(self, stream, prefix: str) -> None:
        self.stream, self.prefix, self.pending = stream, prefix, ""

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            if "error:" in line:
                self.stream.write(f"{self.prefix}{line}\n")
                self.stream.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False


def encode_cli_prompt(tokenizer, pieces) -> list[int]:
    """Tokenizes the CLI prompt pieces: special markers as specials, system and user text as plain BPE."""
    ids: list[int] = []
    for text, special in pieces:
        ids += tokenizer.encode(text, specials=special)
    return ids
