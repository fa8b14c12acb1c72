"""The replay graph's dependencies (kernels/machinery/cudagraph.py): which earlier launches each launch waits for, from
the address ranges they read and write. The driver itself needs a GPU (bench/graph_replay.py runs it there)."""

from __future__ import annotations

import ctypes
import random

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.kernels.machinery.cudagraph import Moves, address, dependencies, is_row_contiguous


def test_a_reader_waits_for_the_writer_of_what_it_reads():
    # 0 writes A, 1 writes B, 2 reads A and writes C, 3 reads B and C
    reads = [[], [], [(0, 16)], [(100, 108), (200, 204)]]
    writes = [[(0, 16)], [(100, 116)], [(200, 208)], [(300, 304)]]
    assert dependencies(reads, writes) == [[], [], [0], [1, 2]]


def test_views_overlap_their_buffers_and_neighbours_do_not():
    reads = [[], [(8, 12)], [(16, 20)]]  # a view inside launch 0's output; the next buffer, untouched by it
    writes = [[(0, 16)], [(32, 40)], [(48, 56)]]
    assert dependencies(reads, writes) == [[], [0], []]


def test_overwriting_waits_for_earlier_readers_and_writers():
    reads = [[(0, 8)], [(0, 8)], []]
    writes = [[(8, 16)], [(16, 24)], [(0, 16)]]  # 2 writes in place what 0 and 1 read, and what 0 wrote
    assert dependencies(reads, writes) == [[], [], [0, 1]]


def test_dependencies_match_a_plain_search():
    rng = random.Random(4)
    spans = lambda: [(s, s + rng.randint(1, 64)) for s in (rng.randrange(0, 512) for _ in range(rng.randint(0, 3)))]
    reads, writes = [spans() for _ in range(60)], [spans() for _ in range(60)]
    overlap = lambda a, b: any(s < f and t < e for s, e in a for t, f in b)
    expected = [sorted(i for i in range(j) if overlap(reads[j], writes[i]) or overlap(writes[j], writes[i])
                       or overlap(writes[j], reads[i])) for j in range(60)]
    assert dependencies(reads, writes) == expected


def test_address_and_contiguity_of_arrays_and_views():
    x = mx.arange(12, dtype=mx.float32).reshape(3, 4)
    mx.eval(x)
    assert address(x[1:]) == address(x) + 16 and address(x.astype(mx.bfloat16)) != 0
    assert is_row_contiguous(x) and is_row_contiguous(x[1:]) and not is_row_contiguous(x.T)
    assert not is_row_contiguous(mx.broadcast_to(x[:1], (3, 4)))
    assert np.asarray(x).ctypes.data == address(x)


def test_bound_arrays_and_their_views_move_to_the_target():
    rows, out, other = mx.zeros((4, 8)), mx.ones((4, 8)), mx.zeros((3,))
    mx.eval(rows, out, other)
    moves = Moves([(out, rows), (other, 4096)])
    assert moves.span(out) == (address(rows), address(rows) + 128)
    assert moves.span(out[2:]) == (address(rows) + 64, address(rows) + 128)  # a view of the bound array
    assert moves.span(other) == (4096, 4108) and moves.span(rows) == (address(rows), address(rows) + 128)
    with pytest.raises(ValueError, match="bound to one of"):
        Moves([(other, rows)])


class FakeDriver:
    """Stands in for the CUDA driver: hands out handles and keeps each kernel node's launch, parameters (the
    addresses the kernel is given) and dependencies."""

    def __init__(self):
        self.nodes: list[dict] = []
        self.lib = None

    def new_stream(self) -> int:
        return 1

    def destroy_stream(self, stream: int) -> None:
        pass

    def function(self, cubin: bytes, name: str, shared_memory: int) -> int:
        return 99

    def handle(self, function: str, *args) -> int:
        if function == "cuGraphAddKernelNode_v2":
            params = args[3]._obj
            deps = ctypes.cast(args[1], ctypes.POINTER(ctypes.c_void_p))
            pointers = ctypes.cast(params.params, ctypes.POINTER(ctypes.c_void_p))
            self.nodes.append({"params": pointers, "deps": [deps[i] for i in range(args[2])],
                               "grid": tuple(params.grid), "block": tuple(params.block)})
            return 1000 + len(self.nodes)
        return 7


def test_replay_graph_gives_each_launch_moved_addresses_and_its_dependencies():
    """A launch writing a bound array writes its target; a later reader of that array reads the target and waits
    for the writer; independent launches wait for nothing."""
    from ds4_mlx.kernels.machinery.cudagraph import ReplayGraph
    from ds4_mlx.kernels.machinery.nvrtc import Launch

    rows, out, x, y = mx.zeros((4, 8)), mx.zeros((4, 8)), mx.ones((8,)), mx.ones((8,))
    mx.eval(rows, out, x, y)
    writer = Launch(b"cubin", "write", (2, 1, 1), (32, 1, 1), 0, (x,), (out,), True, None)
    other = Launch(b"cubin", "other", (1, 1, 1), (32, 1, 1), 0, (x,), (y,), True, None)
    reader = Launch(b"cubin", "read", (1, 1, 1), (64, 1, 1), 0, (out[1:],), (mx.zeros((3, 8)),), True, None)
    mx.eval(*reader.outputs)
    driver = FakeDriver()
    graph = ReplayGraph(driver, [writer, other, reader], bound=[(out, rows)])
    first, second, third = driver.nodes
    given = lambda node, i: ctypes.cast(node["params"][i], ctypes.POINTER(ctypes.c_void_p))[0]
    assert given(first, 0) == address(x) and given(first, 1) == address(rows)  # written in place of `out`
    assert given(third, 0) == address(rows) + 32  # the view of `out` read from the target
    assert first["deps"] == [] and second["deps"] == [] and third["deps"] == [1001]
    assert first["grid"] == (2, 1, 1) and third["block"] == (64, 1, 1) and graph.edges == 1
