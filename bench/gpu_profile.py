"""Per-kernel GPU time of the compiled decode step, or of one prefill chunk, on MLX's CUDA backend.

    python bench/gpu_profile.py --layers 4                    # decode: 10 compiled steps after warm-up
    python bench/gpu_profile.py --layers 4 --prefill 512      # one 512-token prefill chunk

The kernels are traced with CUPTI through torch.profiler (the GPU machine has torch; CUPTI sees every kernel of
the process, MLX's included), and so are the host's CUDA runtime and driver calls (graph node adds, updates,
launches: the host side of a step). Only the optional profiler needs torch: nothing in ds4_mlx imports it. Prints the
graph's primitive count (`decode_step_ops`), the host time of building and submitting a step against its wall
time, the kernels per step with the GPU's busy time, and the kernels by total time. Synthetic weights in the
published layout, the first `--layers` Flash layers (model/synthetic.py).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from ds4_mlx.model.graph import decode_step_ops
from ds4_mlx.model.model import Model
from ds4_mlx.model.synthetic import flash_config, synthetic_weights


def kernel_table(run, repeats: int, top: int) -> None:
    """Runs `run` `repeats` times under CUPTI and prints the kernels by GPU time per run."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.zeros(1, device="cuda")  # CUDA context and CUPTI ready before the profiled work
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
    total: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        if event.device_type.name == "CUDA":
            total[event.name] += getattr(event, "device_time", None) or getattr(event, "cuda_time", 0)
            count[event.name] += 1
    print(f"kernels per run {sum(count.values()) / repeats:.0f}, GPU busy {sum(total.values()) / repeats:.0f} us per run")
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{us / repeats:10.1f} us {count[name] / repeats:7.1f}x  {name[:120]}")
    api_table(prof, repeats)


def api_table(prof, repeats: int) -> None:
    """The host's CUDA runtime and driver calls per run, by total time (CUPTI records them process-wide, MLX's
    included): where building and submitting the step's graphs goes (node adds, graph updates, launches)."""
    import json
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--prefill", type=int, metavar="TOKENS", help="profile one prefill chunk of this many tokens")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args()
    model = Model(synthetic_weights(flash_config(args.layers)))
    cache = model.new_cache(args.ctx)
    if args.prefill:
        chunk = args.prefill
        tokens = mx.arange(4 * chunk, dtype=mx.int32) % 1000 + 5
        for i in range(3):  # cold, then warm
            t = time.perf_counter()
            mx.eval(model.prefill(tokens[i * chunk:(i + 1) * chunk], cache, chunk_size=chunk))
            print(f"chunk {i}: {time.perf_counter() - t:.3f} s ({chunk / (time.perf_counter() - t):.0f} t/s)")
        kernel_table(lambda: mx.eval(model.prefill(tokens[3 * chunk:], cache, chunk_size=chunk)), 1, args.top)
        return 0
    mx.eval(model.prefill(mx.arange(1, 41, dtype=mx.int32), cache, chunk_size=5))
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
    kernel_table(step, 10, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
