"""`ds4-mlx make-model OUT.gguf`: write a DeepSeek V4 Flash-layout GGUF with random weights.

For tests and demos without the 81 GB download: `tiny` builds in a second, `small` is a ~260 MB CPU demo with the
real vocabulary, `flash` has exactly the published shapes (81 GB with q2 experts; `--sparse` leaves the data as a
file hole so the layout can be inspected without writing it; `--repeat` draws 64 MB of random rows per tensor and
repeats them, for speed tests). `--mtp` also writes a matching MTP draft file, `--dspark` a matching DSpark support
file (the 0731 drafter, model/dspark_file.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import Ds4Error
from ..model.dspark_file import write_dspark_model
from ..model.factory import (EXPERT_KINDS, PRESET_VOCAB, PRESETS, REPEAT_AFTER, VOCAB_KINDS, Progress,
                             export_reference, model_tensors, mtp_tensors, preset_config, write_model,
                             write_mtp_model)


def _seed(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text}")
    return value


def _jobs(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", metavar="OUT.gguf", type=Path, help="file to write")
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny",
                        help="tiny: reference tests; small: CPU demo; flash: the published shapes (default tiny)")
    parser.add_argument("--experts", choices=EXPERT_KINDS, default="q2",
                        help="routed expert types: q2 (IQ2_XXS/Q2_K), q4 (Q4_K), mxfp4 (0731's MXFP4, the rest as q4), "
                             "mixed (q2, last third q4)")
    parser.add_argument("--vocab", choices=VOCAB_KINDS, default=None,
                        help="small (512 ids) or real (the V4 tokenizer, 129280 ids); default: small for tiny, "
                             "real otherwise")
    parser.add_argument("--seed", type=_seed, default=0, help="random seed (default 0); same seed, same bytes")
    data = parser.add_mutually_exclusive_group()
    data.add_argument("--sparse", action="store_true",
                      help="leave tensor data as a file hole (all zeros): the layout only, written instantly")
    data.add_argument("--repeat", action="store_true",
                      help=f"draw each tensor's first {REPEAT_AFTER >> 20} MB of random rows and repeat them: a "
                           "full-size file in a fraction of the time, for speed tests (speed does not depend on the "
                           "values)")
    parser.add_argument("--jobs", type=_jobs, default=1, metavar="N",
                        help="processes drawing the random data (same bytes; N times sooner for flash) (default 1)")
    parser.add_argument("--mtp", type=Path, metavar="MTP.gguf",
                        help="also write a random MTP draft file for this preset (Q4_K experts, as published), "
                             "for --mtp speculative decoding")
    parser.add_argument("--dspark", type=Path, metavar="DSPARK.gguf",
                        help="also write a random DSpark support file for this preset in the published layout "
                             "(3 stages, block 5, Markov rank 256), for --mtp speculative decoding")
    parser.add_argument("--reference-dir", type=Path, metavar="DIR",
                        help="also write the weights dequantized to float32 under the published DeepSeek names "
                             "(model.safetensors + config.json, loadable by transformers)")


def run(args: argparse.Namespace) -> int:
    data = "sparse" if args.sparse else "repeated" if args.repeat else "random"
    note = "" if data == "random" else f", {data}"
    vocab = args.vocab or PRESET_VOCAB[args.preset]
    try:
        with _progress_bar(f"writing {args.out.name}") as progress:
            path = write_model(args.out, preset=args.preset, experts=args.experts, vocab=vocab, seed=args.seed,
                               data=data, progress=progress, jobs=args.jobs)
    except OSError as e:
        raise Ds4Error(f"cannot write {args.out}: {e.strerror or e}") from e
    n_tensors = len(model_tensors(preset_config(args.preset), args.experts))
    size = path.stat().st_size
    print(f"wrote {path}: {_human(size)} ({size} bytes), {n_tensors} tensors; preset {args.preset}, "
          f"experts {args.experts}, vocab {vocab}, seed {args.seed}{note}")
    if args.mtp:
        try:
            with _progress_bar(f"writing {args.mtp.name}") as progress:
                mtp = write_mtp_model(args.mtp, main_preset=args.preset, seed=args.seed, data=data, progress=progress)
        except OSError as e:
            raise Ds4Error(f"cannot write {args.mtp}: {e.strerror or e}") from e
        size = mtp.stat().st_size
        print(f"wrote {mtp}: {_human(size)} ({size} bytes), {len(mtp_tensors(preset_config(args.preset)))} tensors; "
              f"MTP draft block for preset {args.preset}, seed {args.seed}{note}")
    if args.dspark:
        try:
            with _progress_bar(f"writing {args.dspark.name}") as progress:
                dspark = write_dspark_model(args.dspark, main_preset=args.preset, seed=args.seed, data=data,
                                            vocab=vocab, progress=progress)
        except OSError as e:
            raise Ds4Error(f"cannot write {args.dspark}: {e.strerror or e}") from e
        size = dspark.stat().st_size
        print(f"wrote {dspark}: {_human(size)} ({size} bytes), 81 tensors; DSpark support file for preset "
              f"{args.preset}, seed {args.seed}{note}")
    if args.reference_dir:
        try:
            out = export_reference(path, args.reference_dir)
        except OSError as e:
            raise Ds4Error(f"cannot write the reference export to {args.reference_dir}: {e.strerror or e}") from e
        print(f"wrote {out / 'model.safetensors'} and {out / 'config.json'} (float32, DeepSeek checkpoint names)")
    return 0


@contextmanager
def _progress_bar(description: str) -> Iterator[Progress | None]:
    """A rich byte progress bar on stderr, or nothing when stderr is not a terminal."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress as Bar, TimeRemainingColumn, TransferSpeedColumn

    with Bar("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
             TimeRemainingColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def _human(n_bytes: int) -> str:
    size = float(n_bytes)
    for unit in ("B", "KB", "MB"):
        if size < 1000:
            return f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"
