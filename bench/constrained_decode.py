"""Decode speed with and without a JSON schema, and the token mask's cost, on a model file (default: the demo model).

Runs the same chat prompt free and held to a schema that lets the answer run long (at least 40 short strings), greedy
and sampled, and reports decode tokens/s (the engine's own timing) and the mask's cost a token: the time llguidance
spends computing it (on its helper thread, beside the model's step) and the time the decode loop waits for it.

    python bench/constrained_decode.py [-m MODEL.gguf] [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from ds4_mlx import constrain
from ds4_mlx.chat import Message, ThinkMode, render_chat
from ds4_mlx.engine import Engine, GenerationRequest, ensure_demo_model
from ds4_mlx.events import Done
from ds4_mlx.sampling import SamplingParams

SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string", "maxLength": 40},
                                                     "minItems": 40, "maxItems": 200}},
          "required": ["notes"], "additionalProperties": False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    engine = Engine.load(args.model or ensure_demo_model(), 4096)
    prompt = render_chat([Message("user", "Write notes.")], think=ThinkMode.NONE, ctx=engine.ctx)
    fmt = constrain.Constraint.make(constrain.OutputFormat.build("json_schema", SCHEMA, "notes", "schema"), ())
    masks: list[constrain.TokenMask] = []
    waits: list[float] = []
    start, apply = constrain.Constraint.start, constrain.TokenMask.apply

    def recording_start(self, *a, **k):
        masks.append(start(self, *a, **k))
        return masks[-1]

    def timed_apply(self, logits):
        t0 = time.perf_counter()
        bits = self.allowed()
        waits.append(time.perf_counter() - t0)
        self.allowed = lambda: bits  # apply reads it once more below
        try:
            return apply(self, logits)
        finally:
            del self.allowed

    constrain.Constraint.start = recording_start
    constrain.TokenMask.apply = timed_apply
    for name, sampling in (("greedy", SamplingParams(temperature=0)), ("sampled", SamplingParams(temperature=1,
                                                                                                 seed=7))):
        for output in (None, fmt):
            rates, n = [], 0
            for _ in range(args.repeats + 1):  # the first run warms up
                req = GenerationRequest(prompt, max_tokens=args.tokens, sampling=sampling, output=output)
                done = [e for e in engine.generate(req) if isinstance(e, Done)][0]
                rates.append(done.usage.completion_tokens / done.decode_seconds)
                n = done.usage.completion_tokens
            line = f"{name:7} {'schema' if output else 'free':6} decode {statistics.median(rates[1:]):6.2f} t/s ({n} tokens)"
            if output is not None:
                used = masks[-args.repeats:]
                cost = sum(m.seconds for m in used) / sum(m.masks for m in used)
                wait = statistics.median(waits[-sum(m.masks for m in used):])
                line += f"; mask {cost * 1e6:.0f} µs a token computed, {wait * 1e6:.0f} µs waited (median)"
            print(line, flush=True)


if __name__ == "__main__":
    main()
