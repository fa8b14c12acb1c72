"""`ds4-mlx run`: one prompt in, one answer out, then a stats line on stderr.

On a terminal the reasoning is shown dimmed before the answer, as ds4 does. In a pipe or a file, standard output
gets the answer alone and the reasoning goes to standard error, so `answer=$(ds4-mlx run -p ...)` works;
`--hide-reasoning` drops it. `-p -` and `--prompt-file -` read the prompt from standard input, and `--raw` sends it
without the chat template.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..errors import UsageError
from ..progress import Progress
from .options import (
    add_kv_cache_arguments,
    add_model_options,
    add_mtp_options,
    add_sampling_options,
    add_token_limit,
    bounded_int,
    encode_cli_prompt,
    open_engine,
    sampling_from_args,
    think_mode_from_args,
    token_limit,
    writable_file,
)
from .terminal import AnswerPrinter, stop_on_interrupt
from .tokens import prompt_from_args, prompt_source

DEFAULT_MAX_TOKENS = 50000
DEFAULT_TOP_K = 20
MAX_TOP_K = 128


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_options(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="the user prompt; - reads it from standard input")
    src.add_argument("--prompt-file", type=Path, help="read the user prompt from a file (- for standard input)")
    add_token_limit(p, DEFAULT_MAX_TOKENS)
    p.add_argument("-sys", "--system", help="system text ('' for none; default 'You are a helpful assistant')")
    p.add_argument("--raw", action="store_true",
                   help="send the prompt as written, without the chat template (chat special strings are read as "
                        "specials; BOS is added unless the prompt starts with it)")
    p.add_argument("--hide-reasoning", action="store_true", help="print the answer without the model's reasoning")
    add_sampling_options(p)
    add_kv_cache_arguments(p)
    add_mtp_options(p)
    p.add_argument("--dump-logprobs", type=Path, metavar="FILE", help="greedy continuation with top logprobs as JSON")
    p.add_argument("--logprobs-top-k", type=bounded_int(1, MAX_TOP_K), metavar="K",
                   help=f"alternatives per step with --dump-logprobs, 1 to {MAX_TOP_K} (default {DEFAULT_TOP_K})")


def _prompt_pieces(args: argparse.Namespace, prompt: str, ctx: int, checkpoint):
    """The prompt as pieces to tokenize: ds4's CLI chat prompt, or with --raw the text as written after BOS."""
    from ..chat import BOS, DEFAULT_SYSTEM, PromptPiece, effective_think_mode, render_cli_prompt

    if args.raw:
        return [PromptPiece(prompt if prompt.startswith(BOS) else BOS + prompt, True)]
    think = effective_think_mode(think_mode_from_args(args), ctx)
    system = DEFAULT_SYSTEM if args.system is None else args.system
    return render_cli_prompt(prompt, system=system, think=think, ctx=ctx, checkpoint=checkpoint)


def run(args: argparse.Namespace) -> int:
    from ..engine import GenerationRequest
    from ..events import Done, PrefillProgress, ReasoningDelta, TextDelta

    if args.logprobs_top_k is not None and args.dump_logprobs is None:
        raise UsageError("--logprobs-top-k applies to --dump-logprobs FILE only")
    if args.dump_logprobs is not None:
        writable_file(args.dump_logprobs, "--dump-logprobs")
    sampling = sampling_from_args(args)
    prompt = prompt_from_args(args)
    if prompt is None:
        raise UsageError("give a prompt with -p TEXT or --prompt-file FILE (- reads standard input)")
    if not prompt.strip():
        raise UsageError(f"the prompt from {prompt_source(args)} is empty: there is nothing to answer")
    engine = open_engine(args)
    tokens = encode_cli_prompt(engine.tokenizer, _prompt_pieces(args, prompt, engine.ctx, engine.checkpoint))
    if args.dump_logprobs is not None:
        return _dump_logprobs(engine, tokens, args)

    req = GenerationRequest(prompt=tokens, max_tokens=token_limit(args, DEFAULT_MAX_TOKENS, engine),
                            sampling=sampling)
    colour = "NO_COLOR" not in os.environ
    terminal = sys.stdout.isatty()
    answer = AnswerPrinter(sys.stdout, grey=terminal and colour)
    aside = AnswerPrinter(sys.stderr, grey=sys.stderr.isatty() and colour)  # reasoning, when stdout is not a terminal
    reasoning = None if args.hide_reasoning else answer if terminal else aside
    done: Done | None = None
    try:
        with stop_on_interrupt() as stopped, Progress(quiet=args.quiet).bar("prefill") as bar:
            for ev in engine.generate(req, cancel=stopped):
                if isinstance(ev, ReasoningDelta):
                    bar.close()
                    if reasoning is not None:
                        reasoning.reasoning(ev.text)
                elif isinstance(ev, TextDelta):
                    bar.close()
                    answer.text(ev.text)
                elif isinstance(ev, PrefillProgress):
                    bar.update(ev.done, ev.total)
                elif isinstance(ev, Done):
                    done = ev
    finally:  # also on a second Ctrl+C: the terminal is never left grey
        answer.end()
        if reasoning is not None and reasoning is not answer:
            reasoning.end()
    engine.shutdown()
    assert done is not None
    print(stats_line(done), file=sys.stderr)
    return 130 if done.error == "cancelled" else 0


def stats_line(done) -> str:
    """After the answer: prompt size and reuse, both speeds, the drafts accepted (--mtp), and why generation ended."""
    u = done.usage
    prefill_tps = (u.prompt_tokens - u.cached_tokens) / done.prefill_seconds if done.prefill_seconds else 0.0
    gen_tps = u.completion_tokens / done.decode_seconds if done.decode_seconds else 0.0
    mtp = f", drafts accepted {done.mtp_accepted}/{done.mtp_drafted}" if done.mtp_drafted else ""
    finish = "cancelled" if done.error == "cancelled" else done.finish_reason
    return (
        f"ds4-mlx: prompt {u.prompt_tokens} tokens ({u.cached_tokens} cached), prefill {prefill_tps:.1f} t/s, "
        f"generation {u.completion_tokens} tokens at {gen_tps:.1f} t/s{mtp}, finish {finish}"
    )


def _dump_logprobs(engine, tokens: list[int], args: argparse.Namespace) -> int:
    """ds4's --dump-logprobs: a greedy continuation with each step's choice and its top-K alternatives (ds4_cli.c)."""
    from ..sampling import top_logprobs

    k = args.logprobs_top_k or DEFAULT_TOP_K
    tok = engine.tokenizer

    def token_json(i: int) -> dict:
        return {"id": i, "text": tok.token_bytes(i).decode("utf-8", "replace"), "bytes": list(tok.token_bytes(i))}

    session = engine.session
    session.reset()
    logits = session.prefill(tokens)
    steps = []
    for step in range(min(token_limit(args, DEFAULT_MAX_TOKENS, engine), session.room)):
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
