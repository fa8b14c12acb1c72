"""`ds4-mlx inspect`: validate a DeepSeek V4 Flash GGUF and describe it without loading any weight.

Prints the variant, the dimensions, the routed-expert types per layer (runs of equal layers), tensor bytes per
type, and the memory a session at `--ctx` would need (weights + session state). The weights count as
`run` loads them on this backend, the figure its memory check uses: converted forms differ from the file's bytes,
and the breakdown says by how much. Plain aligned text, so that it reads the same in a terminal and in a log.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import UsageError
from ..model.checkpoint import detect as detect_checkpoint
from ..model.config import ModelConfig, memory_estimate
from ..model.dspark import open_drafter
from ..model.dspark_file import DSparkWeights
from ..model.weights import ModelWeights, MTPWeights, open_weights
from .options import DEFAULT_MODEL, context_size

FORMS = {
    "affine": "Q8_0/Q4_K in MLX's quantized form: the file's {stored} + a float32 scale and bias per 32 values",
    "mxfp4": "MXFP4 experts in MLX's mxfp4 form, the file's bytes reordered: {stored} in the file",
    "float16": "F16 compressor, indexer and router matrices kept as float16 for the half matvec: {stored} in the file",
    "float32": "small matrices and vectors dequantized once: {stored} in the file",
    "raw": "kept as stored, dequantized when used",
}
"""What each form of loaded weights is (model/linear.py), for the breakdown under the weights line."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", type=Path, nargs="?", help=f"DeepSeek V4 Flash GGUF file (default ./{DEFAULT_MODEL})")
    p.add_argument("-m", "--model", type=Path, metavar="FILE",
                   help="the GGUF file, given as the other commands take it (instead of the positional FILE)")
    p.add_argument("-c", "--ctx", type=context_size, default=32768,
                   help="context size for the memory estimate (default 32768)")
    p.add_argument("--mtp", type=Path, help="draft GGUF file (MTP or DSpark) to validate and count in")


def format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _layer_runs(items: list) -> list[tuple[int, int, object]]:
    """Collapse per-layer values into (first, last, value) runs of equal neighbours."""
    runs: list[tuple[int, int, object]] = []
    for i, item in enumerate(items):
        if runs and runs[-1][2] == item:
            runs[-1] = (runs[-1][0], i, item)
        else:
            runs.append((i, i, item))
    return runs


def _dims(c: ModelConfig) -> list[str]:
    return [
        f"layers {c.n_layer}, n_embd {c.n_embd}, vocab {c.n_vocab}, hyper-connection streams {c.n_hc} "
        f"(sinkhorn {c.sinkhorn_iters})",
        f"attention: {c.n_head} heads x {c.head_dim} (kv heads {c.n_head_kv}, rope {c.n_rot}), q_lora "
        f"{c.q_lora_rank}, output {c.o_groups} groups x lora {c.o_lora_rank}, window {c.sliding_window}",
        f"indexer: {c.indexer_n_head} heads x {c.indexer_head_dim}, top-k {c.indexer_top_k}",
        f"experts: {c.n_expert} routed ({c.n_expert_used} per token, width {c.n_ff_exp}), {c.n_expert_shared} "
        f"shared, hash routing on the first {c.n_hash_layer} layers",
        "compression: " + ", ".join(
            f"ratio {r} on {sum(x == r for x in c.compress_ratios)} layers" for r in sorted(set(c.compress_ratios))),
    ]


def describe(weights: ModelWeights, ctx: int, mtp: MTPWeights | DSparkWeights | None = None) -> str:
    """The whole report as text (the command prints it)."""
    c, f = weights.config, weights.file
    name = f.metadata.get("general.name", "?")
    trained = f"{c.context_length}" if c.context_length else "not stated"
    checkpoint, basis = detect_checkpoint(f.metadata, f.path, tuple(t for pair in weights.expert_types for t in pair))
    lines = [
        f"file        {f.path} ({format_bytes(f.size)}, GGUF v{f.version}, {len(f.tensors)} tensors)",
        f"model       {name}, variant {weights.variant}",
        f"checkpoint  {checkpoint.value} ({basis})",
        f"context     trained {trained}",
    ]
    lines += [f"{'dims' if i == 0 else '':<12}{line}" for i, line in enumerate(_dims(c))]
    for i, (first, last, (gate, down)) in enumerate(_layer_runs(weights.expert_types)):
        span = f"layer {first}" if first == last else f"layers {first}-{last}"
        lines.append(f"{'experts' if i == 0 else '':<12}{span:<14}gate/up {gate.name:<8} down {down.name}")
    lines.append("bytes by type")
    lines += [f"  {name:<10}{format_bytes(n):>12}" for name, n in weights.bytes_by_type().items()]

    from ..kernels.machinery.registry import current_backend
    from ..model.linear import loaded_forms

    state = memory_estimate(c, ctx)
    forms, mtp_ring = loaded_forms(weights), 0
    if mtp is not None:
        lines.append(f"mtp         {mtp.file.path} ({len(mtp.file.tensors)} tensors, {format_bytes(mtp.nbytes)}, "
                     f"{mtp.variant})")
        forms = {form: tuple(map(sum, zip(forms[form], extra))) for form, extra in loaded_forms(mtp).items()}
        # the draft block's own raw ring (ds4.c), or a DSpark drafter's context window per stage
        stages = mtp.spec.n_stages if isinstance(mtp, DSparkWeights) else 1
        mtp_ring = stages * c.sliding_window * c.head_dim * 4
    weight_bytes = sum(held for _, held in forms.values())
    note = f" (beyond the trained context {c.context_length})" if c.context_length and ctx > c.context_length else ""
    lines += [
        f"memory at ctx {ctx}{note}, weights as loaded on the {current_backend()} backend",
        f"  {'weights':<18}{format_bytes(weight_bytes):>12}"
        f"  ({format_bytes(sum(stored for stored, _ in forms.values()))} in the file)",
    ]
    lines += [f"    {form:<16}{format_bytes(held):>12}  {FORMS[form].format(stored=format_bytes(stored))}"
              for form, (stored, held) in forms.items() if stored]
    lines += [
        f"  {'raw window rings':<18}{format_bytes(state.raw):>12}",
        f"  {'compressed rows':<18}{format_bytes(state.compressed):>12}",
        f"  {'indexer rows':<18}{format_bytes(state.indexer):>12}",
        f"  {'frontiers':<18}{format_bytes(state.frontiers):>12}",
        f"  {'logits':<18}{format_bytes(state.logits):>12}",
    ]
    if mtp_ring:
        lines.append(f"  {'mtp raw ring':<18}{format_bytes(mtp_ring):>12}")
    lines.append(f"  {'total':<18}{format_bytes(weight_bytes + state.total + mtp_ring):>12}")
    return "\n".join(lines)


def model_path(args: argparse.Namespace) -> Path:
    """The file to describe: the positional one or -m's (both only when they agree), else ./ds4flash.gguf."""
    if args.file is not None and args.model is not None and args.file != args.model:
        raise UsageError(f"two files given, {args.file} and -m {args.model}: give one")
    return args.file or args.model or Path(DEFAULT_MODEL)


def run(args: argparse.Namespace) -> int:
    with open_weights(model_path(args)) as weights:
        mtp = open_drafter(args.mtp, weights.config) if args.mtp else None
        try:
            print(describe(weights, args.ctx, mtp))
        finally:
            if mtp is not None:
                mtp.close()
    return 0
