"""Per-kernel GPU time of the compiled decode step, or of one prefill chunk, on MLX's CUDA backend.

    python bench/gpu_profile.py --layers 4                    # decode: 10 compiled steps after warm-up
    python bench/gpu_profile.py --layers 4 --prefill 512      # one 512-token prefill chunk, 3 chunks in
    python bench/gpu_profile.py --layers 43 --prefill 8192 --prefill-at 0 --timeline   # an 8k prompt's chunk

The kernels are traced with CUPTI through torch.profiler (the GPU machine has torch; CUPTI sees every kernel of
the process, MLX's included), and so are the host's CUDA runtime and driver calls (graph node adds, updates,
launches: the host side of a step). Only the optional profiler needs torch: nothing in ds4_mlx imports it. Prints the
graph's primitive count (`decode_step_ops`), the host time of building and submitting a step against its wall
time, the step fed ahead as greedy decoding runs it (the compiled call, the submission, the wait for the token;
then through the Session), the GPU timeline (the union of the kernels' intervals, and with `--timeline` each
kernel in the order it ran), the kernels by total time and the host's CUDA calls. Synthetic weights in the
published layout, the first `--layers` Flash layers (model/synthetic.py).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from ds4_mlx.model.graph import decode_step_ops
from ds4_mlx.model.model import Model
from ds4_mlx.model.synthetic import flash_config, synthetic_weights
from ds4_mlx.session import Session


def kernel_table(run, repeats: int, top: int, lines: bool = False) -> None:
    """Runs `run` `repeats` times under CUPTI and prints the kernels by GPU time per run."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.zeros(1, device="cuda")  # CUDA context and CUPTI ready before the profiled work
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
    trace = _trace(prof)
    timeline(trace, repeats, lines)
    total: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        if event.device_type.name == "CUDA":
            total[event.name] += getattr(event, "device_time", None) or getattr(event, "cuda_time", 0)
            count[event.name] += 1
    print(f"kernels per run {sum(count.values()) / repeats:.0f}, GPU busy {sum(total.values()) / repeats:.0f} us per run")
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{us / repeats:10.1f} us {count[name] / repeats:7.1f}x  {name[:120]}")
    api_table(trace, repeats)


def _trace(prof) -> dict:
    """The profile as a Chrome trace (events with start `ts` and duration `dur` in µs)."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        return json.loads(Path(f.name).read_text())


def _short(name: str) -> str:
    """A kernel's name without its namespace, template values and signature."""
    name = name.split("(")[0].replace("mlx::core::cu::", "").replace("custom_kernel_", "").replace("void ", "")
    return re.sub(r"_[0-9a-f_]{6,}$|<.*", "", name)[:48]


def timeline(trace: dict, repeats: int, lines: bool) -> None:
    """Where the GPU's time in a step goes: the kernels' durations summed count the ones that run side by side
    (MLX's CUDA graphs run independent nodes concurrently) twice, and miss the GPU's idle gaps between kernels
    and graphs. Prints, per run, the union of the kernels' intervals and the span from the first kernel's start
    to the last one's end; with `lines`, then the last run kernel by kernel: start, duration, and the gap after the
    latest end before it (negative: it overlapped)."""
    kernels = sorted((e["ts"], e["dur"], e["name"]) for e in trace.get("traceEvents", [])
                     if e.get("cat") == "kernel" and "dur" in e)
    if not kernels:
        return
    union, end = 0.0, float("-inf")
    for ts, dur, _ in kernels:
        union += max(0.0, ts + dur - max(ts, end))
        end = max(end, ts + dur)
    per_run = len(kernels) // repeats
    last = kernels[-per_run:]
    span = max(ts + dur for ts, dur, _ in last) - last[0][0]
    print(f"GPU timeline: kernels cover {union / repeats:.0f} us per run (union); the last run spans {span:.0f} us")
    if not lines:
        return
    start, end, previous, gaps = last[0][0], last[0][0], "", []
    for ts, dur, name in last:
        print(f"  {ts - start:8.1f} {dur:6.1f} us  gap {ts - end:6.1f}  {_short(name)}")
        gaps.append((ts - end, ts - start, previous, _short(name)))
        end, previous = max(end, ts + dur), _short(name)
    idle = [gap for gap in gaps if gap[0] > 0]
    print(f"idle: {sum(gap[0] for gap in idle):.0f} us in {len(idle)} gaps; the largest (gap, at, after, before):")
    for gap, at, before, after in sorted(idle, reverse=True)[:16]:
        print(f"  {gap:8.1f} us at {at:9.1f}  {before} -> {after}")


def api_table(trace: dict, repeats: int) -> None:
    """The host's CUDA runtime and driver calls per run, by total time (CUPTI records them process-wide, MLX's
    included): where building and submitting the step's graphs goes (node adds, graph updates, launches)."""
    total: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    for event in trace.get("traceEvents", []):
        if event.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in event:
            total[event["name"]] += event["dur"]
            count[event["name"]] += 1
    if not total:
        print("host API calls: none in the trace")
        return
    print(f"host API calls per run {sum(count.values()) / repeats:.0f}, {sum(total.values()) / repeats:.0f} us per run")
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:12]:
        print(f"{us / repeats:10.1f} us {count[name] / repeats:7.1f}x  {name[:100]}")


def fed_ahead(model: Model, cache, tokens: int = 12) -> None:
    """Decoding as greedy sessions run it (Session.feed_chosen): each step is built while the device still runs
    the one before, then the previous token is read. Prints the medians of the compiled step's call (the graph
    recorded on the host), its submission (MLX evaluates every node into CUDA graphs) and the wait for the token,
    and of the token's whole time: which of host and GPU sets the pace."""
    logits = model.decode(7, cache)[1]
    mx.eval(logits, *cache.arrays())
    parts: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(tokens):
        t0 = time.perf_counter()
        token = mx.argmax(logits).astype(mx.int32).reshape(1)
        mx.async_eval(token)
        t1 = time.perf_counter()
        logits = model.decode(token, cache)[1]
        t2 = time.perf_counter()
        mx.async_eval(logits, *cache.arrays())
        t3 = time.perf_counter()
        token.item()
        t4 = time.perf_counter()
        for name, value in (("call", t2 - t1), ("submit", t3 - t2), ("wait", t4 - t3), ("token", t4 - t0)):
            parts[name].append(value)
    mx.eval(logits)
    print_medians("fed ahead", parts)


def session_loop(session: Session, tokens: int = 12) -> None:
    """The same through the session, as `ds4-mlx bench` and the engine decode: feed_chosen (which also keeps the
    step's undo point), the read-back, confirm. Prints the medians of each and of the token."""
    parts: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(tokens):
        t0 = time.perf_counter()
        token = session.feed_chosen()
        t1 = time.perf_counter()
        value = int(token.item())
        t2 = time.perf_counter()
        session.confirm(value)
        t3 = time.perf_counter()
        for name, v in (("feed_chosen", t1 - t0), ("read", t2 - t1), ("confirm", t3 - t2), ("token", t3 - t0)):
            parts[name].append(v)
    mx.eval(session.logits)
    print_medians("session", parts)


def print_medians(label: str, parts: dict[str, list[float]]) -> None:
    """One line: each part's median in ms."""
    print(f"{label}: " + ", ".join(f"{name} {1e3 * statistics.median(v):.2f} ms" for name, v in parts.items()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--at", type=int, default=40, help="decode after a prompt of this many tokens")
    p.add_argument("--prefill", type=int, metavar="TOKENS", help="profile one prefill chunk of this many tokens")
    p.add_argument("--prefill-at", type=int, metavar="POSITION",
                   help="the profiled chunk's first position (default 3 chunks in; 0: a prompt's first chunk)")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--timeline", action="store_true", help="list the last step's kernels in the order they ran")
    args = p.parse_args()
    model = Model(synthetic_weights(flash_config(args.layers)))
    if args.prefill:
        chunk = args.prefill
        at = 3 * chunk if args.prefill_at is None else args.prefill_at
        tokens = mx.arange(at + chunk, dtype=mx.int32) % 1000 + 5

        def filled():
            """A new cache holding the tokens before the profiled chunk, prefilled in chunks of its size."""
            cache = model.new_cache(at + chunk + 16)
            if at:
                mx.eval(model.prefill(tokens[:at], cache, chunk_size=chunk))
            return cache

        for i in range(2):  # cold, then warm
            cache = filled()
            t = time.perf_counter()
            mx.eval(model.prefill(tokens[at:], cache, chunk_size=chunk))
            print(f"chunk at {at}, run {i}: {time.perf_counter() - t:.3f} s ({chunk / (time.perf_counter() - t):.0f} t/s)")
        cache = filled()
        kernel_table(lambda: mx.eval(model.prefill(tokens[at:], cache, chunk_size=chunk)), 1, args.top,
                     args.timeline)
        return 0
    session = Session(model, args.ctx)
    session.prefill([i % 1000 + 5 for i in range(args.at)])
    cache = session.cache
    ops = decode_step_ops(model, cache)
    print(f"graph: {ops['total']} nodes, {ops['kernels']} not views, per layer {ops['per_layer']}")

    def step() -> None:
        mx.eval(model.decode(7, cache)[1], *cache.arrays())

    for _ in range(5):
        step()
    host, wall = [], []
    for _ in range(10):
        t = time.perf_counter()
        out = model.decode(7, cache)[1]
        mx.async_eval(out, *cache.arrays())
        host.append(time.perf_counter() - t)
        mx.eval(out)
        wall.append(time.perf_counter() - t)
    print(f"step: host build + submit {1e3 * statistics.median(host):.2f} ms, wall {1e3 * statistics.median(wall):.2f} ms")
    fed_ahead(model, cache)
    session_loop(session)
    kernel_table(step, 10, args.top, args.timeline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
