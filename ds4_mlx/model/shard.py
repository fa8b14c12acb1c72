"""One model over the ranks of an `mx.distributed` group: every layer split across them, or a range of layers each.

`--split tensor` (mlx-lm's idiom): every rank holds a slice of each big matrix and runs every layer.

* Attention by heads: q_b's rows and the sinks of the rank's heads, out_a's rows of the output groups those heads
  belong to (and its columns of those heads, where a rank holds part of one group), out_b's columns of those groups.
  out_b(out_a(heads)) is linear in the heads, so the ranks' outputs add up to the whole one.
* The routed and the shared experts by their hidden columns (n_ff_exp: 2048 for Flash): gate and up by output rows,
  down by input columns. Why not by expert id: a decode step's shapes are fixed (it is compiled), so a rank would
  still compute every chosen slot, masked, and one token's experts could all live on one rank; by columns every
  rank computes 1/N of each chosen expert, at any batch size, with the same shapes.
* The LM head by vocabulary rows; the ranks' logits are gathered into the full vocabulary on every rank.
* The rest (embedding, hyper-connection mixes, norms, q_a, kv, router, compressors, indexer) is replicated: each
  is small per token, and every rank keeps the same cache state, so none of it needs an exchange.

That is two sums across the ranks a layer (after attention, after the MoE, float32) and one gather of the logits.

`--split layers` (a pipeline): each rank holds a contiguous range of layers; the hyper-connection streams go from
one rank to the next (`send`/`recv`), the last computes the logits, and a sum hands them to every rank. The other
ranks' layers hold no rows in a rank's cache (`Model.new_cache`).

Slices are cut on GGUF block boundaries, each rank's share of a cut dimension in proportion to its host's device
memory budget or to `--split-weights` (3,5 is 3/8 and 5/8, rounded down to whole units); the loader reads only a
rank's own rows and columns of the file (`ShardedWeights`). Every rank runs the same program on the same tokens
and gets the same logits.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from ds4_mlx.errors import UsageError
from ds4_mlx.model import watchdog
from ds4_mlx.model.config import ModelConfig
from ds4_mlx.model.gguf import BLOCK_SIZES, TensorInfo
from ds4_mlx.model.weights import ModelWeights
from ds4_mlx.sampling import SamplingParams, fresh_seed

if TYPE_CHECKING:
    from ds4_mlx.kernels.decode.fused_norm import Norm
    from ds4_mlx.model.linear import Linear
    from ds4_mlx.model.model import Loader

SPLITS = ("tensor", "layers")


class SplitError(UsageError):
    """The model does not split as asked (too many ranks for a dimension, a slice off the quant blocks)."""


def shares(total: int, weights: Sequence[float], what: str) -> list[tuple[int, int]]:
    """`total` units as contiguous ranges, one per weight, each about its weight's share (boundaries rounded down,
    then moved so that none is empty)."""
    n = len(weights)
    if total < n:
        raise SplitError(f"{total} {what} do not split over {n} ranks")
    cuts, whole, acc = [0], sum(weights), 0.0
    for i, w in enumerate(weights[:-1]):
        acc += w
        cuts.append(min(max(int(total * acc / whole), cuts[-1] + 1), total - (n - 1 - i)))
    cuts.append(total)
    return list(zip(cuts, cuts[1:]))


@dataclass(frozen=True)
class Cut:
    """A slice of one tensor, row-major (..., OUT, IN): OUT rows [out) of each OUT block, IN columns [cols)."""

    out: tuple[int, int] | None = None
    cols: tuple[int, int] | None = None


@dataclass
class Split:
    """This rank's share of the model and the exchanges it makes."""

    kind: str
    group: mx.distributed.Group
    config: ModelConfig
    heads: tuple[int, int] = (0, 0)
    hidden: tuple[int, int] = (0, 0)
    vocab: tuple[int, int] = (0, 0)
    vocabs: tuple[tuple[int, int], ...] = ()
    """Every rank's vocabulary rows (tensor split): how the gathered logits are put together."""
    layers: tuple[int, int] = (0, 0)
    exchanges: int = field(default=0, repr=False)
    """Exchanges traced so far (each sum, gather, send or recv the model built; a compiled step counts once)."""
    exchanged_bytes: int = field(default=0, repr=False)

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    @classmethod
    def plan(cls, kind: str, group: mx.distributed.Group, weights: ModelWeights,
             share: Sequence[float] | None = None) -> Split:
        """The share of `group.rank()` for a model file: `share` the ranks' weights (None: even)."""
        if kind not in SPLITS:
            raise SplitError(f"--split must be one of {', '.join(SPLITS)}, got {kind!r}")
        n, rank, c = group.size(), group.rank(), weights.config
        share = [1.0] * n if share is None else list(share)
        if len(share) != n or min(share) <= 0:
            raise SplitError(f"--split-weights needs {n} positive numbers (one a rank), got {share}")
        if kind == "layers":
            return cls(kind, group, c, layers=shares(c.n_layer, share, "layers")[rank])
        hpg = c.n_head // c.o_groups
        if n <= c.o_groups:
            lo, hi = shares(c.o_groups, share, "attention output groups")[rank]
            heads = (lo * hpg, hi * hpg)
        else:
            heads = shares(c.n_head, share, "attention heads")[rank]
            if heads[0] // hpg != (heads[1] - 1) // hpg and (heads[0] % hpg or heads[1] % hpg):
                raise SplitError(f"{n} ranks split the {c.n_head} attention heads across their {c.o_groups} output "
                                 "groups; give --split-weights whose heads fall in one group or whole groups")
        unit = max(BLOCK_SIZES[weights.info(f"blk.{layer}.{name}").ggml_type][0]
                   for layer in range(c.n_layer) for name in ("ffn_down_exps.weight", "ffn_down_shexp.weight"))
        if c.n_ff_exp % unit:
            raise SplitError(f"the experts' {c.n_ff_exp} hidden columns are not whole blocks of {unit}")
        lo, hi = shares(c.n_ff_exp // unit, share, f"blocks of {unit} expert hidden columns")[rank]
        vocabs = tuple(shares(c.n_vocab, share, "vocabulary rows"))
        plan = cls(kind, group, c, heads=heads, hidden=(lo * unit, hi * unit), vocab=vocabs[rank], vocabs=vocabs,
                   layers=(0, c.n_layer))
        for name, cut in plan.cuts().items():  # every column cut on block boundaries
            if cut.cols is not None and weights.has(name):
                elements = BLOCK_SIZES[weights.info(name).ggml_type][0]
                if cut.cols[0] % elements or cut.cols[1] % elements:
                    raise SplitError(f"{name}: columns {cut.cols} of rank {rank} are not on its blocks of {elements}")
        return plan

    def describe(self) -> str:
        """One line: what this rank holds."""
        if self.kind == "layers":
            return f"rank {self.rank}/{self.size}: layers [{self.layers[0]}, {self.layers[1]})"
        return (f"rank {self.rank}/{self.size}: heads [{self.heads[0]}, {self.heads[1]}), expert columns "
                f"[{self.hidden[0]}, {self.hidden[1]}), vocabulary [{self.vocab[0]}, {self.vocab[1]})")

    # ---------------------------------------------------------------------------------------------- the slices

    @property
    def groups(self) -> tuple[int, int]:
        """The output groups this rank's heads belong to."""
        hpg = self.config.n_head // self.config.o_groups
        return self.heads[0] // hpg, -(-self.heads[1] // hpg)

    def local(self) -> ModelConfig:
        """The config the rank's attention is built with: its heads and output groups."""
        if self.kind == "layers":
            return self.config
        return replace(self.config, n_head=self.heads[1] - self.heads[0], o_groups=self.groups[1] - self.groups[0])

    def cuts(self) -> dict[str, Cut]:
        """The slice of each tensor this rank cuts (tensor split); the others it reads whole."""
        c = self.config
        if self.kind == "layers":
            return {}
        d, hpg, rank_o = c.head_dim, c.n_head // c.o_groups, c.o_lora_rank
        (h0, h1), (g0, g1), hidden = self.heads, self.groups, self.hidden
        within = ((h0 - g0 * hpg) * d, (h1 - g0 * hpg) * d) if g1 - g0 == 1 else None  # part of one group
        out_a = Cut(out=(g0 * rank_o, g1 * rank_o), cols=within)
        per_layer = {
            "attn_q_b.weight": Cut(out=(h0 * d, h1 * d)),
            "attn_sinks.weight": Cut(cols=(h0, h1)),
            "attn_output_a.weight": out_a,
            "attn_output_b.weight": Cut(cols=(g0 * rank_o, g1 * rank_o)),
            "ffn_gate_exps.weight": Cut(out=hidden), "ffn_up_exps.weight": Cut(out=hidden),
            "ffn_down_exps.weight": Cut(cols=hidden),
            "ffn_gate_shexp.weight": Cut(out=hidden), "ffn_up_shexp.weight": Cut(out=hidden),
            "ffn_down_shexp.weight": Cut(cols=hidden),
        }
        found = {f"blk.{layer}.{name}": cut for layer in range(c.n_layer) for name, cut in per_layer.items()}
        found["output.weight"] = Cut(out=self.vocab)
        return found

    def holds(self, name: str) -> bool:
        """Whether this rank reads tensor `name` at all (a pipeline rank: its layers' and the shared ones)."""
        if self.kind == "tensor":
            return True
        if name.startswith("blk."):
            return self.layers[0] <= int(name.split(".")[1]) < self.layers[1]
        return name != "output.weight" or self.last

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    def weights(self, weights: ModelWeights) -> ShardedWeights:
        return ShardedWeights(weights, self)

    # ---------------------------------------------------------------------------------------------- exchanges

    def _count(self, x: mx.array) -> None:
        self.exchanges += 1
        self.exchanged_bytes += x.nbytes

    def sum(self, x: mx.array) -> mx.array:
        """The sum of every rank's x, in float32."""
        x = x.astype(mx.float32)
        self._count(x)
        return mx.distributed.all_sum(x, group=self.group)

    def agree(self, value: int) -> int:
        """Rank 0's 64-bit `value` on every rank (a seed that makes every rank sample the same tokens)."""
        watchdog.beat()
        mine = np.array([value & 0xFFFFFFFF, value >> 32 & 0xFFFFFFFF] if self.first else [0, 0], dtype=np.uint32)
        lo, hi = (int(v) for v in np.array(mx.distributed.all_sum(mx.array(mine), group=self.group)))
        return lo | hi << 32

    def agree_tokens(self, tokens: list[int]) -> list[int]:
        """Rank 0's token ids (as many on every rank) on every rank."""
        watchdog.beat()
        mine = mx.array(tokens if self.first else [0] * len(tokens), dtype=mx.int32)
        return mx.distributed.all_sum(mine, group=self.group).tolist()

    def loaded(self) -> None:
        """Waits until every rank has loaded its share (of the model, of a drafter): the first wait after a load,
        given the first-use allowance, since hosts load at their disks' speeds (model/watchdog.py)."""
        watchdog.beat(slow=True)
        mx.eval(mx.distributed.all_sum(mx.zeros(1), group=self.group))
        watchdog.beat()

    def least(self, value: int) -> int:
        """The smallest of every rank's `value` (a prefill chunk's length: memory.agree_chunks)."""
        watchdog.beat()
        return int(mx.distributed.all_min(mx.array([value], dtype=mx.int32), group=self.group).item())

    def least_of(self, values: Sequence[int]) -> list[int]:
        """The smallest of every rank's value at each place, in one exchange (64-bit: byte counts fit)."""
        watchdog.beat()
        return np.array(mx.distributed.all_min(mx.array(values, dtype=mx.int64), group=self.group)).tolist()

    def every(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank."""
        return self.least(int(flag)) == 1

    def anywhere(self, flag: bool) -> bool:
        """Whether `flag` holds on some rank."""
        return not self.every(not flag)

    def identity(self) -> bytes:
        """What makes this rank's share of the model: the split, the ranks, this rank and the slices it holds (a
        disk KV checkpoint's identity covers it, kvidentity.py)."""
        return (f"split={self.kind} ranks={self.size} rank={self.rank} heads={self.heads} hidden={self.hidden} "
                f"vocab={self.vocab} layers={self.layers}").encode()

    @property
    def block_sum(self) -> Callable[[mx.array], mx.array] | None:
        """What each block's attention and MoE outputs go through: the sum across ranks (tensor split)."""
        return self.sum if self.kind == "tensor" else None

    def gather(self, x: mx.array) -> mx.array:
        """Every rank's vocabulary slice of logits x (..., its rows) side by side: (..., n_vocab) on every rank.
        The slices are padded to the longest for the gather (uneven shares) and cut back after it."""
        longest = max(hi - lo for lo, hi in self.vocabs)
        padded = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, longest - x.shape[-1])])
        self._count(padded)
        parts = mx.distributed.all_gather(padded[None], group=self.group)  # (ranks, ..., longest)
        return mx.concatenate([parts[r, ..., : hi - lo] for r, (lo, hi) in enumerate(self.vocabs)], axis=-1)

    def enter(self, streams: Callable[[], mx.array], shape: tuple[int, ...]) -> mx.array:
        """The streams (T, n_hc, n_embd) this rank's first layer reads: the embedding's (`streams()`) on the first
        pipeline rank and under a tensor split, else the previous rank's."""
        if self.kind == "tensor" or self.first:
            return streams()
        received = mx.distributed.recv(shape, mx.float32, self.rank - 1, group=self.group)
        self._count(received)
        return received

    def leave(self, streams: mx.array) -> mx.array:
        """The streams after this rank's last layer; a pipeline rank before the last hands them on (the result
        depends on the send, so that whatever reads it makes the send happen)."""
        if self.kind == "tensor" or self.last:
            return streams
        self._count(streams)
        sent = mx.distributed.send(streams.astype(mx.float32), self.rank + 1, group=self.group)
        return mx.depends([streams], [sent])[0]

    def head(self, load: Loader) -> VocabHead:
        """The LM head: this rank's vocabulary rows (read from `load`) and the sum that joins them."""
        lo, hi = self.vocab if self.kind == "tensor" else ((0, self.config.n_vocab) if self.last else (0, 0))
        return VocabHead(load.linear("output.weight") if hi > lo else None, lo, hi, self.config.n_vocab, self)


@dataclass
class VocabHead:
    """The LM head over a rank's vocabulary rows [lo, hi) (None: none of them), called as a Linear: the logits of
    every rank's rows on every rank, gathered (tensor split) or, from the last rank of a pipeline, summed with the
    others' zeros."""

    linear: Linear | None
    lo: int
    hi: int
    n_vocab: int
    split: Split

    def __call__(self, x: mx.array, norm: Norm | None = None) -> mx.array:
        watchdog.beat("head")
        if self.linear is None:
            local = mx.depends([mx.zeros((*x.shape[:-1], self.n_vocab), mx.float32)], [x])[0]
        elif self.split.kind == "tensor":
            return self.split.gather(self.linear(x, norm=norm))
        else:
            local = self.linear(x, norm=norm)
        return self.split.sum(local)


class ShardedWeights(ModelWeights):
    """A model file as one rank sees it: the tensors it holds, each cut to its slice (`Split.cuts`); their rows are
    read from the mapped file slice by slice (`tensor_rows`), never whole."""

    whole_tensors = False

    def __init__(self, weights: ModelWeights, split: Split) -> None:
        super().__init__(weights.file, weights.config, weights.expert_types, weights.variant)
        self.split = split
        self._cuts = split.cuts()
        self._infos: dict[str, TensorInfo] = {}

    def info(self, name: str) -> TensorInfo:
        found = self._infos.get(name)
        if found is None:
            found = self._infos[name] = self._cut_info(super().info(name), self._cuts.get(name))
        return found

    def has(self, name: str) -> bool:
        return self.split.holds(name) and super().has(name)

    def tensor_infos(self) -> list[TensorInfo]:
        return [self.info(name) for name in self.file.tensors if self.split.holds(name)]

    @staticmethod
    def _cut_info(info: TensorInfo, cut: Cut | None) -> TensorInfo:
        if cut is None:
            return info
        shape = list(info.shape)
        if cut.cols is not None:
            shape[0] = cut.cols[1] - cut.cols[0]
        if cut.out is not None:
            shape[1] = cut.out[1] - cut.out[0]
        elements, size = BLOCK_SIZES[info.ggml_type]
        n = 1
        for dim in shape[1:]:
            n *= dim
        return replace(info, shape=tuple(shape), nbytes=n * shape[0] // elements * size)

    def tensor_rows(self, name: str, first: int, end: int) -> np.ndarray:
        """Rows [first, end) of the cut tensor, (end - first, its row bytes) uint8: copies of only those bytes."""
        cut = self._cuts.get(name)
        if cut is None:
            return super().tensor_rows(name, first, end)
        whole = self.file.tensors[name]
        elements, size = BLOCK_SIZES[whole.ggml_type]
        n_out = whole.shape[1] if len(whole.shape) > 1 else 1
        view = self.file.tensor_bytes(name).reshape(-1, n_out, whole.row_bytes)
        o0, o1 = cut.out if cut.out is not None else (0, n_out)
        b0, b1 = ((cut.cols[0] // elements * size, cut.cols[1] // elements * size) if cut.cols is not None
                  else (0, whole.row_bytes))
        rows = np.arange(first, end)
        return np.ascontiguousarray(view[rows // (o1 - o0), o0 + rows % (o1 - o0), b0:b1])

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensor_infos())


def parse_share(text: str) -> list[float]:
    """`--split-weights 3,5` -> [3.0, 5.0]."""
    try:
        share = [float(part) for part in text.split(",")]
    except ValueError:
        raise SplitError(f"--split-weights takes numbers separated by commas (e.g. 3,5), got {text!r}") from None
    return share


def agreed(split: Split | None, params: SamplingParams) -> SamplingParams:
    """The sampling settings every rank of a split model samples with: one seed, rank 0's (each rank gets the same
    logits, bit for bit, so each draws the same tokens); unchanged in a single process or with a seed given."""
    if split is None or params.seed is not None:
        return params
    return replace(params, seed=split.agree(fresh_seed()))


def launched() -> bool:
    """Whether this process is one rank of several started by `mlx.launch` (or an MPI launcher)."""
    return any(key in os.environ for key in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"))


def rank() -> int:
    """This process's rank (0 in a single process)."""
    return mx.distributed.init().rank() if launched() else 0


def init_split(kind: str | None, share_text: str | None, weights: ModelWeights, drafter: bool = False
               ) -> Split | None:
    """This process's share under `mlx.launch` (`kind` None: tensor when launched on several ranks), or None for a
    single process. `drafter`: a drafter (--mtp) runs with the model, which a pipeline refuses: the drafter reads
    the last layer's streams (DSpark: its target layers' outputs), which one rank (DSpark: maybe several) holds, so
    every draft would wait for the last rank and be handed back; the tensor split runs it whole on every rank."""
    group = mx.distributed.init() if launched() else None
    if group is None or group.size() == 1:
        if kind is not None or share_text is not None:
            raise SplitError("--split and --split-weights need several ranks: start the command under mlx.launch "
                             "(e.g. mlx.launch --backend ring -n 2 -- ds4-mlx ...)")
        return None
    watchdog.start(group.rank())
    if kind == "layers" and drafter:
        raise SplitError("--mtp runs with --split tensor, not --split layers (the drafter reads the last layers' "
                         "states, which one rank holds): docs/distributed.md")
    share = parse_share(share_text) if share_text is not None else memory_shares(group)
    return Split.plan(kind or "tensor", group, weights, share)


def memory_shares(group: mx.distributed.Group) -> list[float]:
    """Every rank's device memory budget (memory.py, GiB), the same list on every rank: the default shares, so that
    a host with more memory takes more of the model and equal hosts split it evenly."""
    from ds4_mlx import memory

    mine = mx.array([memory.device_limit() / 2**30], dtype=mx.float32)
    return [float(v) for v in np.array(mx.distributed.all_gather(mine, group=group))]
