"""`ds4-mlx run`: one prompt in, one answer out (reasoning dimmed, answer plain, then a stats line)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import Ds4Error
from ..progress import Progress
from .options import (
    add_kv_cache_arguments,
    add_model_options,
    add_mtp_options,
    add_sampling_options,
    encode_cli_prompt,
    open_engine,
    sampling_from_args,
    think_mode_from_args,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_options(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="the user prompt")
    src.add_argument("--prompt-file", type=Path, help="read the user prompt from a file")
    p.add_argument("-n", "--tokens", type=int, default=50000, help="most tokens to generate (default 50000)")
    p.add_argument("-sys", "--system", default="You are a helpful assistant", help="system text ('' for none)")
    add_sampling_options(p)
    add_kv_cache_arguments(p)
    add_mtp_options(p)
    p.add_argument("--dump-logprobs", type=Path, metavar="FILE", help="greedy continuation with top logprobs as JSON")
    p.add_argument("--logprobs-top-k", type=int, default=20, metavar="K", help="alternatives per step (max 128)")


def _prompt_text(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file is not None:
        try:
            return args.prompt_file.read_text(encoding="utf-8")
        except OSError as e:
            raise Ds4Error(f"cannot read --prompt-file: {e}") from e
    raise Ds4Error("give a prompt with -p TEXT or --prompt-file FILE")


def run(args: argparse.Namespace) -> int:
    from ..chat import effective_think_mode, render_cli_prompt
    from ..engine import GenerationRequest

    prompt = _prompt_text(args)
    engine = open_engine(args)
    think = effective_think_mode(think_mode_from_args(args), engine.ctx)
    tokens = encode_cli_prompt(engine.tokenizer, render_cli_prompt(prompt, system=args.system, think=think, ctx=engine.ctx))
    if args.dump_logprobs is not None:
        return _dump_logprobs(engine, tokens, args)

    from ..events import Done, PrefillProgress, ReasoningDelta, TextDelta

    req = GenerationRequest(
        prompt=tokens,
        max_tokens=args.tokens,
        sampling=sampling_from_args(args),
        thinking=think.thinking,
    )
    progress = Progress(quiet=args.quiet)
    dim = sys.stdout.isatty()
    in_reasoning = False
    done: Done | None = None
    with progress.bar("prefill") as bar:
        events = engine.generate(req)
        for ev in events:
            if isinstance(ev, ReasoningDelta):
                bar.close()
                if dim and not in_reasoning:
                    sys.stdout.write("\x1b[90m")
                in_reasoning = True
                sys.stdout.write(ev.text)
            elif isinstance(ev, TextDelta):
                bar.close()
                if in_reasoning:
                    sys.stdout.write("\x1b[0m\n" if dim else "\n")
                    in_reasoning = False
                sys.stdout.write(ev.text)
            elif isinstance(ev, Done):
                done = ev
            elif isinstance(ev, PrefillProgress):
                bar.update(ev.done, ev.total)
            sys.stdout.flush()
    engine.shutdown()
    if in_reasoning and dim:
        sys.stdout.write("\x1b[0m")
    sys.stdout.write("\n")
    assert done is not None
    u = done.usage
    prefill_tps = (u.prompt_tokens - u.cached_tokens) / done.prefill_seconds if done.prefill_seconds else 0.0
    gen_tps = u.completion_tokens / done.decode_seconds if done.decode_seconds else 0.0
    mtp = f", MTP guesses accepted {done.mtp_accepted}/{done.mtp_drafted}" if done.mtp_drafted else ""
    print(
        f"ds4-mlx: prompt {u.prompt_tokens} tokens ({u.cached_tokens} cached), prefill {prefill_tps:.1f} t/s, "
        f"generation {u.completion_tokens} tokens at {gen_tps:.1f} t/s{mtp}, finish {done.finish_reason}",
        file=sys.stderr,
    )
    return 0


def _dump_logprobs(engine, tokens: list[int], args: argparse.Namespace) -> int:
    """ds4's --dump-logprobs: a greedy continuation with each step's choice and its top-K alternatives (spec §7)."""
    from ..sampling import top_logprobs

    k = max(1, min(128, args.logprobs_top_k))
    tok = engine.tokenizer

    def token_json(i: int) -> dict:
        return {"id": i, "text": tok.token_bytes(i).decode("utf-8", "replace"), "bytes": list(tok.token_bytes(i))}

    session = engine.session
    session.reset()
    logits = session.prefill(tokens)
    steps = []
    for step in range(min(args.tokens, session.room)):
        top = top_logprobs(logits, k)
        chosen = top[0][0]
        steps.append(
            {
                "step": step,
                "selected": token_json(chosen),
                "top_logprobs": [{"token": token_json(i), "logit": lg, "logprob": lp} for i, lg, lp in top],
            }
        )
        if chosen == tok.eos_id or step + 1 >= session.room:
            break
        logits = session.decode(chosen)
    dump = {"source": "ds4-mlx", "prompt_tokens": len(tokens), "ctx": engine.ctx, "top_k": k, "steps": steps}
    args.dump_logprobs.write_text(json.dumps(dump, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"ds4-mlx: wrote {len(steps)} steps to {args.dump_logprobs}", file=sys.stderr)
    return 0
