"""Where a token's time goes when greedy decoding runs through the decode graphs (model/graphstep.py).

    python bench/graph_decoder.py --layers 43 --at 2048

A recorded step replayed on its own inputs ran at 11.4 ms (bench/graph_replay.py, 2026-12-02); driven by new tokens
through the session it ran at 146 ms. This split that apart (2026-12-03, bench/RESULTS.md): device memory and the
default memory pool's reserve after the model, the prefill and the graphs; the decoder driven four ways (one step
relaunched or advancing, each with or without an MLX scalar made between steps: advancing alone was slow, so the
cost followed the pages each token reads, not the host's work); the session's loop part by part (feed_chosen, which
waits for the last launch; the read-back; confirm, which launches); a second entry's cost; the GPU timeline of a
few tokens under CUPTI (bench/gpu_profile.py: kernels slowed by page faults show as long kernels, host waits as
gaps); each kind's graph launched alone. Synthetic weights in the published layout. CUDA only.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import sys
import time

import mlx.core as mx

from ds4_mlx.kernels.machinery.cudagraph import Driver
from ds4_mlx.model.model import Model
from ds4_mlx.model.synthetic import flash_config, synthetic_weights
from ds4_mlx.session import Session
from gpu_profile import kernel_table, print_medians, session_loop


POOL_ATTRIBUTES = {"reserved": 5, "reserved high": 6, "used": 7, "used high": 8}  # CU_MEMPOOL_ATTR_*


def device_memory(when: str) -> None:
    """Free and total device memory as the driver sees it (managed pages resident on the GPU count as used), the
    default memory pool's reserve and use (MLX's stream-ordered allocations), MLX's own counts."""
    lib = Driver.load().lib
    free, total, pool = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_void_p()
    lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    lib.cuDeviceGetDefaultMemPool(ctypes.byref(pool), 0)
    figures = []
    for name, attribute in POOL_ATTRIBUTES.items():
        value = ctypes.c_uint64()
        lib.cuMemPoolGetAttribute(pool, attribute, ctypes.byref(value))
        figures.append(f"{name} {value.value / 1e9:.1f}")
    print(f"device memory {when}: {free.value / 1e9:.1f} GB free of {total.value / 1e9:.1f}; pool GB "
          f"{', '.join(figures)}; MLX active {mx.get_active_memory() / 1e9:.1f}, cache "
          f"{mx.get_cache_memory() / 1e9:.1f}, peak {mx.get_peak_memory() / 1e9:.1f}")


def advancing(session: Session, tokens: int, label: str) -> None:
    """Each step's choice fed at the next position, `tokens` steps: medians, first and last."""
    decoder = session._graph
    token, times = 7, []
    for _ in range(tokens):
        t0 = time.perf_counter()
        decoder.launch(token)
        token = decoder.chosen()
        times.append(time.perf_counter() - t0)
    print_medians(label, {"token": times, "first": times[:1], "last": times[-1:]})


def variants(session: Session, tokens: int) -> None:
    """The decoder driven four ways, `tokens` steps each, to tell what slows it: one step again and again (its
    token and position fixed), or advancing (each step's choice fed at the next position); each alone, or with an
    MLX scalar made and read between steps (as the session's loop does with the token)."""
    decoder = session._graph
    at = decoder.position_next
    same, _ = decoder.graphs[session.model.ends(at)]
    token = 7
    for advancing in (False, True):
        for scalar in (False, True):
            times = []
            for _ in range(tokens):
                t0 = time.perf_counter()
                if advancing:
                    decoder.launch(token)
                    token = decoder.chosen()
                else:
                    decoder.io[0], decoder.io[1] = 7, at
                    same.launch()
                    decoder.synchronize()
                if scalar:
                    mx.array([token], dtype=mx.int32).item()
                times.append(time.perf_counter() - t0)
            label = ("advancing" if advancing else "one step") + (" + an MLX scalar" if scalar else "")
            print_medians(label, {"token": times, "first": times[:1], "last": times[-1:]})


def decoder_alone(session: Session, repeats: int) -> None:
    """Each kind's graph launched at the next position again and again (its step rewrites the same rows): the
    launch's host time, launched and waited for, and back to back."""
    decoder = session._graph
    at = decoder.position_next
    for kind, (graph, _) in sorted(decoder.graphs.items()):
        decoder.io[0], decoder.io[1] = 7, at
        graph.launch()
        graph.synchronize()
        parts: dict[str, list[float]] = collections.defaultdict(list)
        for _ in range(repeats):
            t0 = time.perf_counter()
            graph.launch()
            t1 = time.perf_counter()
            graph.synchronize()
            parts["launch"].append(t1 - t0)
            parts["waited"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(repeats):
            graph.launch()
        graph.synchronize()
        parts["back to back"].append((time.perf_counter() - t0) / repeats)
        print_medians(f"kind {kind or '()'} ({len(graph.launches)} nodes)", parts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--at", type=int, default=2048, help="decode after a prompt of this many tokens")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--profile", type=int, default=4, help="tokens under CUPTI (0: none; needs torch)")
    args = p.parse_args()
    os.environ.pop("DS4_GRAPH_DECODE", None)  # the default: decoding through the graphs
    model = Model(synthetic_weights(flash_config(args.layers)))
    session = Session(model, args.at + 8 * args.tokens + args.profile + 456)
    device_memory("after the model was made")
    session.prefill([i % 1000 + 5 for i in range(args.at)])
    mx.eval(session.logits)
    device_memory("after the prefill")
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    ready = session.prepare_greedy()
    print(f"decode graphs {'ready' if ready else 'NOT used'} in {time.perf_counter() - t0:.2f} s")
    if not ready:
        return 1
    device_memory("after the graphs were made")
    variants(session, args.tokens)
    session_loop(session, args.tokens)
    t0 = time.perf_counter()
    session.cache  # the state handed back: the next token enters the decoder again (its graphs kept)
    session.prepare_greedy()
    print(f"entered again in {time.perf_counter() - t0:.2f} s")
    session_loop(session, args.tokens)
    held = session.snapshot()  # a prefill while a snapshot holds the row buffers makes new ones
    session.prefill([i % 1000 + 7 for i in range(200)])
    t0 = time.perf_counter()
    session.prepare_greedy()
    print(f"entered again after a 200-token prefill (new row buffers) in {time.perf_counter() - t0:.2f} s")
    del held
    if args.profile:
        kernel_table(lambda: session.confirm(int(session.feed_chosen().item())), args.profile, top=25)
    session_loop(session, args.tokens)
    decoder_alone(session, args.tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
