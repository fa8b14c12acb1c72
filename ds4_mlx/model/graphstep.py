"""Decoding on CUDA through graphs of our own: one launch a token instead of ~900 MLX nodes.

MLX spends ~20 µs of host time per node of the compiled decode step on the H200, so its ~900 nodes take longer
on the host than the GPU takes to run them (bench/RESULTS.md, 2026-12-02). Every node of the step that does work
is one of our custom kernels, so the step can be recorded once per kind (`Model.ends`: which windows the token
completes) and replayed as one CUDA graph (kernels/machinery/cudagraph.py): the launches as MLX made them, with the
dependencies their address ranges give. The graph of a kind:

1. LOAD_KERNEL reads the token and its position from page-locked host memory the host wrote before the launch;
2. the step (`Model.step`) over this decoder's copy of the session's state: it replaces the raw windows and the
   compressor frontiers, and a completing step writes its row into the row buffers in place (`rows.write_row`);
3. GREEDY_KERNEL writes the argmax of the logits (never `never`, the bench's EOS) to host memory;
4. one copy launch puts the step's new raw windows and frontiers where the next step reads them.

The host writes two ints, launches, and later reads one int (or the logits, for sampled decoding). `enter` copies
the session's state into the decoder's arrays, so the graphs, made at the first entry, serve every later one: a
prefill between two requests makes new row buffers in the session's cache, not in the decoder. The cache the
session holds stays as it was while the decoder runs; `leave` hands the state back (new raw windows and frontiers,
the rows completed meanwhile written into the row buffers), so no snapshot shares a buffer this decoder writes.
When the graphs are made, each kind's is launched once and checked against the same step through MLX: logits
within CHECK_TOLERANCE and the same token, else the decoder stands down (GraphCheckError) and the session decodes
through MLX from the state it had.

A step that holds MLX ops on the values it computes (`graph.ops_after_kernels`: a fast path that fell back to its
reference, say) is refused before any graph is made: only kernels are replayed.

The default on CUDA (session.py; DS4_GRAPH_DECODE=off turns it off). On the H200 (2026-12-03, bench/RESULTS.md)
43 Flash layers decode at 121.7 tokens/s at 2k and 116.7 at 32k through the graphs against ~70 through MLX's step
(`ds4-mlx bench`, same machine), 8.2 ms a token. The graphs are made in ~14 s at the first entry; a later one
takes ~0.2 s.
Their arrays' addresses are read by a kernel (cudagraph.address), so the weights stay in the device's memory pool:
taken through numpy they moved into managed memory, which the driver evicted to the host under pressure (decoding
at 6.8 tokens/s from faulted-back pages, and host RAM the size of the weights taken while the graphs were made).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence

import mlx.core as mx

from ..kernels.machinery import nvrtc
from ..kernels.machinery.cudagraph import Driver, ReplayGraph
from ..kernels.machinery.dialect import Kernel, build
from ..sampling import device_argmax
from .cache import SessionCache, unflatten_layers
from .graph import ops_after_kernels
from .model import Model
from .stream import device_memory_bytes
from .pinned import CudaRuntime

LOAD_KERNEL = Kernel("ds4_graph_load", ("io",), ("token", "position"), """
token[0] = io[0];
position[0] = io[1];
""")

GREEDY_THREADS = 1024
GREEDY_KERNEL = Kernel("ds4_graph_greedy", ("logits",), ("chosen",), """
const int t = THREAD_IN_GROUP;
SHARED float values[1024];
SHARED int ids[1024];
float best = 0.0f;
int at = V;  // none yet (NEVER is V where every id may be chosen)
for (int i = t; i < V; i += 1024) {
  const float v = logits[i];
  if (i != NEVER && v == v && (at == V || v > best)) {
    best = v;
    at = i;
  }
}
values[t] = best;
ids[t] = at;
ds4_barrier();
for (int s = 512; s > 0; s >>= 1) {
  if (t < s) {
    const float v = values[t + s];
    const int i = ids[t + s];
    if (i != V && (ids[t] == V || v > values[t] || (v == values[t] && i < ids[t]))) {
      values[t] = v;
      ids[t] = i;
    }
  }
  ds4_barrier();
}
if (t == 0) {
  chosen[0] = ids[0];
}
""")
"""The lowest id of the largest logit (mx.argmax's choice), NaNs and `NEVER` left out."""

SCALAR_POOL_BYTES = 8
"""MLX's CUDA allocator serves arrays of this many bytes or fewer from one pool of managed memory."""
PADDED = 16
"""Values in the decoder's own copies of small arrays: 64 bytes or more, out of the pool."""
COPY_BLOCKS = 8
"""Threadgroups an array of a step's copy launch (raw windows and frontiers: a few hundred KB in all)."""
ROW_COPY_BLOCKS = 256
"""Threadgroups a row buffer of an entry's copy (16.8 MB a ratio-4 layer's compressed rows at 32k)."""
CHECK_TOLERANCE = 1e-4
"""Relative to the largest logit. The graph runs the kernels MLX runs on the same inputs, so the logits agree to
the rounding of the few kernels that sum with atomics in another order (none do today: they are equal)."""


def spare_device_bytes() -> int:
    """The device's memory not held by MLX's live arrays (what a decoder's copy of the cache would come from)."""
    return device_memory_bytes() - mx.get_active_memory()


class GraphCheckError(RuntimeError):
    """A graph's check step disagreed with MLX's; the decoder is not used again."""


def copy_kernel(sizes: Sequence[int]) -> Kernel:
    """A launch copying float32 arrays s_i to d_i (N_i values each): one row of BLOCKS threadgroups per array."""
    cases = "\n".join(f"  case {i}: src = s{i}; dst = d{i}; n = N{i}; break;" for i in range(len(sizes)))
    source = f"""
const GLOBAL_MEM float* src = s0;
GLOBAL_MEM float* dst = d0;
int n = 0;
switch (GROUP_Y) {{
{cases}
}}
for (int i = GROUP_X * 256 + THREAD_IN_GROUP; i < n; i += 256 * BLOCKS) {{
  dst[i] = src[i];
}}
"""
    count = len(sizes)
    return Kernel(f"ds4_graph_copy_{count}", tuple(f"s{i}" for i in range(count)),
                  tuple(f"d{i}" for i in range(count)), source)


def copy_into(sources: Sequence[mx.array], targets: Sequence[mx.array], blocks: int = COPY_BLOCKS) -> None:
    """Records one launch copying each source into its target (bound: the replay writes the target itself)."""
    if any(s.dtype != mx.float32 or s.shape != t.shape for s, t in zip(sources, targets)):
        raise ValueError("the decoder copies float32 state arrays of equal shapes")
    sizes = [s.size for s in sources]
    outputs = build(copy_kernel(sizes), "cuda")(
        inputs=list(sources), template=[(f"N{i}", n) for i, n in enumerate(sizes)] + [("BLOCKS", blocks)],
        grid=(256 * blocks, len(sources), 1), threadgroup=(256, 1, 1),
        output_shapes=[s.shape for s in sources], output_dtypes=[mx.float32] * len(sources))
    for out, target in zip(outputs, targets):
        nvrtc.bind(out, target)


def copy_now(driver: Driver, stream: int, groups: Sequence[tuple[Sequence[tuple[mx.array, mx.array]], int]]
             ) -> None:
    """Copies now, on `stream`: each group's (source, target) pairs in one launch of `blocks` threadgroups an array,
    through a graph run once (a target is written in place, as a decoder's graphs name it)."""
    with nvrtc.recording() as recorded:
        for pairs, blocks in groups:
            if pairs:
                copy_into(*zip(*pairs), blocks=blocks)
    graph = ReplayGraph(driver, recorded.launches, bound=recorded.bound, stream=stream)
    graph.launch()
    graph.synchronize()
    graph.close()


def row_ratios(cache: SessionCache) -> list[int]:
    """For each of the cache's arrays, the compression ratio of its rows where it is a row buffer (written in
    place, a row a window), else 0 (an array a step replaces)."""
    ratios: list[int] = []
    for layer, state in enumerate(cache.layers):
        ratio = cache.config.compress_ratio(layer)
        ratios.append(0)
        for rows in (state.comp, state.index):
            if rows is not None:
                ratios += [ratio, 0, 0]
    return ratios


class GraphDecoder:
    """Decoding of one session's cache through CUDA graphs recorded from its model's decode step: each launch
    feeds a token and chooses the next greedily (never `never`); its logits are there for a sampler.

    The decoder holds a copy of the whole cache (its row buffers too, so their memory is held twice while it lives):
    the graphs name those arrays' addresses, so they are made once and serve every later entry, whatever buffers
    the session's cache holds by then (a prefill between two entries makes new ones)."""

    def __init__(self, model: Model, cache: SessionCache, never: int | None) -> None:
        self.model, self.never = model, never
        self.driver = Driver.load()
        self.stream = self.driver.new_stream()
        runtime = CudaRuntime.load()
        self.io_address = runtime.host_alloc(16)
        self._free = lambda: runtime.free_host(self.io_address)
        self.io = (ctypes.c_int32 * 4).from_address(self.io_address)
        self.io_stand_in = mx.zeros((4,), dtype=mx.int32)
        self.token, self.position = (mx.zeros((PADDED,), dtype=mx.int32) for _ in range(2))  # off the scalar pool
        self._moved: list[mx.array] = []
        self.ratios = row_ratios(cache)
        self.state = [mx.zeros_like(a) for a in cache.arrays()]
        mx.eval(self.io_stand_in, self.token, self.position, *self.state)
        self.graphs: dict[tuple[int, ...], tuple[ReplayGraph, mx.array]] = {}
        self._managed: list[tuple[int, int]] = []  # the graphs' managed buffers, found when they are made
        self.position_entered = self.position_next = 0
        self.launched = False
        self.last: tuple[mx.array, int] | None = None  # the logits (rows) the last launch wrote, and this one's row
        self.joint: dict[tuple[int, ...], JointGraphs] = {}  # graphs of steps shared with other decoders
        self.joint_failed: set[tuple[int, ...]] = set()  # joint graphs (their decoders' ids) that failed, led by this

    def enter(self, cache: SessionCache) -> None:
        """Takes a copy of the cache's state. The first entry records every kind's graph and checks it first
        (GraphCheckError: one disagreed with MLX's step; the cache is as it was)."""
        self.position_entered = self.position_next = cache.n_tokens
        self.launched = False
        mx.synchronize()
        self._copy_in(cache.arrays())
        if not self.graphs:
            for kind in sorted({self.model.ends(n) for n in range(math.lcm(*self.model.ratios))}):
                self._graph(kind)
                self._check_kind(kind)
            spans = {span for graph, _ in self.graphs.values()
                     for reads, writes in graph.spans for span in (*reads, *writes)}
            self._managed = sorted(s for s in spans if self.driver.is_managed(s[0]))
            self._copy_in(cache.arrays())  # the checks' steps wrote the decoder's state
        self._keep_resident()

    def _keep_resident(self) -> None:
        """MLX's buffer cache and the device's memory pool give back what they hold unused, and any managed buffer
        the graphs read or write (an array made from host bytes) is moved to the GPU and advised to stay.

        Why: making the graphs runs every kind of step and its check, whose transients the pool would otherwise keep
        reserved beside a prefill's; and a managed page the driver evicted to the host is faulted back a page at a
        time by every launch that reads it. Every entry does it, since a prefill between two can grow the pool
        again (a later entry takes 0.16-0.20 s on the full model)."""
        mx.clear_cache()
        self.driver.trim_memory_pool()
        self.driver.keep_on_device(self._managed, self.stream)
        self.synchronize()

    def _copy_in(self, arrays: Sequence[mx.array]) -> None:
        """The cache's arrays copied into the decoder's, the row buffers (up to ~0.5 GB at 32k) by more blocks."""
        copy_now(self.driver, self.stream, [
            ([(a, own) for a, own, r in zip(arrays, self.state, self.ratios) if bool(r) == is_rows], blocks)
            for is_rows, blocks in ((False, COPY_BLOCKS), (True, ROW_COPY_BLOCKS))])

    def _check_kind(self, kind: tuple[int, ...], token: int = 1) -> None:
        """One launch of the kind's graph at the next position against MLX's step from the same state. The row a
        completing kind writes lies past the live rows (the step at that position writes it again)."""
        graph, logits = self.graphs[kind]
        want, choice = self._reference(token, kind)
        self.io[0], self.io[1] = token, self.position_next
        graph.launch()
        graph.synchronize()
        finite = mx.isfinite(want)
        scale = mx.max(mx.abs(mx.where(finite, want, 0))).item()
        error = mx.max(mx.abs(mx.where(finite, logits - want, 0))).item()
        if not error <= CHECK_TOLERANCE * max(scale, 1e-30) or int(self.io[2]) != choice:
            raise GraphCheckError(f"the decode graph of steps {kind or '()'} differs from MLX's step (logits off by "
                                  f"{error:.3g} of {scale:.3g}; token {int(self.io[2])} against {choice})")

    def launch(self, token: int) -> None:
        """Feeds `token` at the next position (the graph of its kind)."""
        graph, logits = self.graphs[self.model.ends(self.position_next)]
        self.io[0], self.io[1] = token, self.position_next
        graph.launch()
        self.position_next += 1
        self.launched, self.last = True, (logits, 0)

    def chosen(self) -> int:
        """The token the last launch chose (waits for it)."""
        self.synchronize()
        return int(self.io[2])

    def synchronize(self) -> None:
        self.driver.synchronize(self.stream)

    def logits(self) -> mx.array:
        """A copy of the last launch's logits (waits for it)."""
        self.synchronize()
        logits, row = self.last
        copy = logits.reshape(-1, logits.shape[-1])[row] * 1
        mx.eval(copy)
        return copy

    def leave(self, cache: SessionCache) -> None:
        """Hands the state back to `cache` at the position reached: the replaced arrays as new copies, and in each
        row buffer the rows the decoder completed since it entered (MLX writes them in place where no snapshot
        holds the buffer, else into a copy: a snapshot's rows never change)."""
        self.synchronize()
        state = []
        for mine, theirs, ratio in zip(self.state, cache.arrays(), self.ratios):
            first, end = self.position_entered // max(ratio, 1), self.position_next // max(ratio, 1)
            if not ratio:
                state.append(mine * 1)
            elif end > first:
                state.append(mx.slice_update(theirs, mine[first:end], mx.array([first]), axes=(0,)))
            else:
                state.append(theirs)
        cache.layers, cache.n_tokens = unflatten_layers(self.model.config, state), self.position_next
        del state  # the cache alone holds the old row buffers now: MLX may update them in place
        mx.eval(*cache.arrays())
        self.position_entered = self.position_next

    def _layers(self) -> list:
        return unflatten_layers(self.model.config, self.state)

    def _graph(self, kind: tuple[int, ...]) -> tuple[ReplayGraph, mx.array]:
        if kind not in self.graphs:
            layers = self._layers()
            with nvrtc.recording() as recorded:
                nvrtc.bind(self.io_stand_in, self.io_address)
                token, position = build(LOAD_KERNEL, "cuda")(
                    inputs=[self.io_stand_in], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                    output_shapes=[(1,), (1,)], output_dtypes=[mx.int32, mx.int32])
                nvrtc.bind(token, self.token[:1])
                nvrtc.bind(position, self.position[:1])
                _, logits, new_layers = self.model.step(token, position, layers, kind)
                never = logits.size if self.never is None else self.never
                (chosen,) = build(GREEDY_KERNEL, "cuda")(
                    inputs=[logits], template=[("V", logits.size), ("NEVER", never)],
                    grid=(GREEDY_THREADS, 1, 1), threadgroup=(GREEDY_THREADS, 1, 1),
                    output_shapes=[(1,)], output_dtypes=[mx.int32])
                nvrtc.bind(chosen, self.io_address + 8)
                new = [a for state in new_layers for a in state.arrays()]
                copy_into(*zip(*[(a, own) for a, own, r in zip(new, self.state, self.ratios) if not r]))
            ops = ops_after_kernels([chosen, *new])
            if ops:
                raise ValueError(f"the step holds MLX ops on computed values, which a graph does not replay: "
                                 f"{dict(ops.most_common(6))}")
            mx.eval(logits, chosen, *new)
            bound = recorded.bound + self._off_the_scalar_pool(recorded)
            self.graphs[kind] = ReplayGraph(self.driver, recorded.launches, bound=bound, stream=self.stream), logits
        return self.graphs[kind]

    def _off_the_scalar_pool(self, recorded: nvrtc.Recording) -> list[tuple[mx.array, mx.array]]:
        """Each array of SCALAR_POOL_BYTES or fewer the launches read or write, bound to a copy of its own.

        MLX keeps such arrays on shared pages of managed memory (its allocator's scalar pool), which the host
        touches whenever it makes a small array (a token, `.item()`): each touch moves the page to the host, and the
        GPU's next access to any value on it faults it back. That slowed MLX's step once (a router's counter,
        bench/RESULTS.md, 2026-12-02); a graph reads the position, the token and small constants in hundreds of
        launches. (Suspected of the 6.8 tokens/s of 2026-12-02, which turned out to be evicted weights: not
        measured without these copies.)"""
        bound = {id(a) for a, _ in recorded.bound}
        small = {id(a): a for launch in recorded.launches for a in (*launch.inputs, *launch.outputs)
                 if a.nbytes <= SCALAR_POOL_BYTES and id(a) not in bound}
        copies = [mx.concatenate([a.reshape(-1), mx.zeros((PADDED,), dtype=a.dtype)]) for a in small.values()]
        mx.eval(*copies)
        self._moved += copies
        return [(a, copy[: a.size]) for a, copy in zip(small.values(), copies)]

    def _reference(self, token: int, kind: tuple[int, ...]) -> tuple[mx.array, int]:
        """The logits and greedy choice MLX's step makes from the decoder's state (nothing of it is written)."""
        _, logits, _ = self.model.step(mx.array([token], dtype=mx.int32),
                                       mx.array([self.position_next], dtype=mx.int32), self._layers(), kind)
        choice = device_argmax(logits, self.never)
        mx.eval(logits, choice)
        return logits, int(choice.item())

    def close(self) -> None:
        for joint in list(self.joint.values()):
            joint.close()
        for graph, _ in self.graphs.values():
            graph.close()
        self.graphs.clear()
        self._moved.clear()
        self.driver.destroy_stream(self.stream)
        self._free()


def load_rows_kernel(count: int) -> Kernel:
    """LOAD_KERNEL for `count` decoders: row i's token and position from decoder i's page-locked words."""
    lines = "\n".join(f"tokens[{i}] = io{i}[0];\npositions[{i}] = io{i}[1];" for i in range(count))
    return Kernel(f"ds4_graph_load_rows_{count}", tuple(f"io{i}" for i in range(count)), ("tokens", "positions"),
                  lines)


class JointGraphs:
    """Steps shared by several decoders: row i of `Model.step_rows` is decoder i's next token, read from its
    page-locked words as its own graphs read it, its greedy choice written where its own graphs write it, its new
    state copied into its arrays: one CUDA graph a kind (`Model.ends` of the rows' positions together), recorded
    and checked at first use, each row's logits against MLX's step over the same rows. A decoder that closes closes
    the joint graphs it is in. Every decoder must have entered (its state is the session's), and none may have a
    launch in flight (`launch` waits for their streams)."""

    def __init__(self, decoders: Sequence[GraphDecoder]) -> None:
        self.decoders = list(decoders)
        self.key = tuple(id(d) for d in decoders)
        self.graphs: dict[tuple[int, ...], tuple[ReplayGraph, mx.array]] = {}
        for decoder in decoders:
            decoder.joint[self.key] = self

    @staticmethod
    def of(decoders: Sequence[GraphDecoder]) -> JointGraphs:
        """The joint graphs of these decoders (in this order), made once."""
        key = tuple(id(d) for d in decoders)
        return decoders[0].joint.get(key) or JointGraphs(decoders)

    def kind(self) -> tuple[int, ...]:
        return tuple(sorted({r for d in self.decoders for r in self.model.ends(d.position_next)}))

    @property
    def model(self) -> Model:
        return self.decoders[0].model

    def launch(self, tokens: Sequence[int]) -> None:
        """Feeds decoder i `tokens[i]` at its next position, all in one graph (made and checked first if new)."""
        for decoder in self.decoders:
            decoder.synchronize()
        kind = self.kind()
        if kind not in self.graphs:
            self._record(kind)
            self._check(kind)
        graph, logits = self.graphs[kind]
        for decoder, token in zip(self.decoders, tokens):
            decoder.io[0], decoder.io[1] = token, decoder.position_next
        graph.launch()
        graph.synchronize()  # each decoder's own stream runs its next launch: none may overlap this one
        for row, decoder in enumerate(self.decoders):
            decoder.position_next += 1
            decoder.launched, decoder.last = True, (logits, row)

    def _record(self, kind: tuple[int, ...]) -> None:
        decoders = self.decoders
        with nvrtc.recording() as recorded:
            for decoder in decoders:
                nvrtc.bind(decoder.io_stand_in, decoder.io_address)
            tokens, positions = build(load_rows_kernel(len(decoders)), "cuda")(
                inputs=[d.io_stand_in for d in decoders], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                output_shapes=[(len(decoders),)] * 2, output_dtypes=[mx.int32, mx.int32])
            _, logits, rows, _ = self.model.step_rows(tokens, positions, [d._layers() for d in decoders],
                                                      (1,) * len(decoders), kind)
            chosen_all = []
            for row, decoder in enumerate(decoders):
                never = logits.shape[-1] if decoder.never is None else decoder.never
                (chosen,) = build(GREEDY_KERNEL, "cuda")(
                    inputs=[logits[row]], template=[("V", logits.shape[-1]), ("NEVER", never)],
                    grid=(GREEDY_THREADS, 1, 1), threadgroup=(GREEDY_THREADS, 1, 1),
                    output_shapes=[(1,)], output_dtypes=[mx.int32])
                nvrtc.bind(chosen, decoder.io_address + 8)
                chosen_all.append(chosen)
            new = [[a for state in layers for a in state.arrays()] for layers in rows]
            pairs = [(a, own) for arrays, d in zip(new, decoders)
                     for a, own, r in zip(arrays, d.state, d.ratios) if not r]
            copy_into(*zip(*pairs))
        ops = ops_after_kernels([*chosen_all, *(a for arrays in new for a in arrays)])
        if ops:
            raise ValueError(f"the shared step holds MLX ops on computed values, which a graph does not replay: "
                             f"{dict(ops.most_common(6))}")
        mx.eval(logits, *chosen_all, *(a for arrays in new for a in arrays))
        bound = recorded.bound + decoders[0]._off_the_scalar_pool(recorded)
        self.graphs[kind] = ReplayGraph(decoders[0].driver, recorded.launches, bound=bound,
                                        stream=decoders[0].stream), logits

    def _check(self, kind: tuple[int, ...], token: int = 1) -> None:
        """One launch of the kind's graph from the decoders' states against MLX's step over the same rows; the
        decoders' replaced arrays are put back after (a completing kind's rows lie past the live rows)."""
        decoders = self.decoders
        kept = [[a * 1 for a, r in zip(d.state, d.ratios) if not r] for d in decoders]
        _, want, _, _ = self.model.step_rows(mx.array([token] * len(decoders), dtype=mx.int32),
                                             mx.array([d.position_next for d in decoders], dtype=mx.int32),
                                             [d._layers() for d in decoders], (1,) * len(decoders), kind)
        mx.eval(want, *(a for k in kept for a in k))
        graph, logits = self.graphs[kind]
        for decoder in decoders:
            decoder.io[0], decoder.io[1] = token, decoder.position_next
        graph.launch()
        graph.synchronize()
        finite = mx.isfinite(want)
        scale = mx.max(mx.abs(mx.where(finite, want, 0)), axis=-1)
        error = mx.max(mx.abs(mx.where(finite, logits - want, 0)), axis=-1)
        worst = mx.max(error / mx.maximum(scale, 1e-30)).item()
        copy_now(decoders[0].driver, decoders[0].stream, [
            (list(zip(arrays, [own for own, r in zip(d.state, d.ratios) if not r])), COPY_BLOCKS)
            for d, arrays in zip(decoders, kept)])
        if not worst <= CHECK_TOLERANCE:
            self.close()
            raise GraphCheckError(f"the decode graph of {len(decoders)} rows, steps {kind or '()'}, differs from "
                                  f"MLX's step (a row off by {worst:.3g} of its largest logit)")

    def close(self) -> None:
        for graph, _ in self.graphs.values():
            graph.close()
        self.graphs.clear()
        for decoder in self.decoders:
            decoder.joint.pop(self.key, None)
