"""Greedy decoding through CUDA graphs of our own (model/graphstep.py): the same tokens and logits as MLX's step,
the state handed back intact. The kernels it adds run on the CPU as CUDA text (emulated_cuda, slow); the decoder
itself needs the GPU."""

from __future__ import annotations

import re
import warnings

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.kernels.machinery.dialect import CUDA
from ds4_mlx.model import graphstep
from ds4_mlx.model.cache import unflatten_layers
from ds4_mlx.model.factory import write_model
from ds4_mlx.model.graphstep import GREEDY_KERNEL, LOAD_KERNEL, GraphDecoder, copy_kernel
from ds4_mlx.model.model import Model
from ds4_mlx.model.weights import open_weights
from ds4_mlx.sampling import SamplingParams, argmax
from ds4_mlx.session import Session
from emulated_cuda import emulated
from test_kernels_hc import NEUTRAL_WORDS

CTX = 1024


@pytest.mark.parametrize("kernel", [LOAD_KERNEL, GREEDY_KERNEL, copy_kernel([8, 3])], ids=lambda k: k.name)
def test_kernels_render_for_cuda(kernel):
    source = CUDA.render(kernel.source)
    assert not re.search(r"\b(" + "|".join(NEUTRAL_WORDS) + r")\b", source + CUDA.header(kernel))


@pytest.mark.slow
@pytest.mark.parametrize("never", [3000, 700], ids=["plain", "never"])
def test_emulated_greedy_takes_the_lowest_id_of_the_largest_logit(tmp_path, never):
    logits = np.random.default_rng(1).normal(size=3000).astype(np.float32)
    logits[[5, 700, 2999]] = 9.0  # a tie: the lowest id wins
    logits[11] = np.nan  # never chosen
    run = emulated(GREEDY_KERNEL, {"V": 3000, "NEVER": never}, tmp_path)
    (chosen,) = run([logits], [(1,)], (1, 1), 1024, [np.int32])
    assert chosen[0] == 5
    logits[5] = 0.0
    (chosen,) = run([logits], [(1,)], (1, 1), 1024, [np.int32])
    assert chosen[0] == (2999 if never == 700 else 700)


@pytest.mark.slow
def test_emulated_copy_moves_each_array(tmp_path):
    a, b = np.arange(3000, dtype=np.float32), np.arange(5, dtype=np.float32) - 9
    run = emulated(copy_kernel([3000, 5]), {"N0": 3000, "N1": 5, "BLOCKS": graphstep.COPY_BLOCKS}, tmp_path)
    got = run([a, b], [(3000,), (5,)], (graphstep.COPY_BLOCKS, 2), 256)
    assert np.array_equal(got[0], a) and np.array_equal(got[1], b)


@pytest.mark.gpu
def test_graph_decoding_equals_mlx_greedy_decoding(monkeypatch):
    """140 greedy tokens after a 124-token prompt (every kind of step: windows of 4 and of 128 end on the way)
    through the decode graphs, against MLX's step token by token; then the state handed back (a snapshot) decodes
    on through MLX as the plain session does, and a chosen token taken back is chosen again. Four layers of Flash's
    published layout (synthetic weights), where every fast path of the step is a kernel."""
    from ds4_mlx.model.synthetic import flash_config, synthetic_weights

    monkeypatch.setenv("DS4_GRAPH_DECODE", "on")
    model = Model(synthetic_weights(flash_config(4)))
    prompt = [(7 * i + 3) % 5000 + 1 for i in range(124)]
    plain, graph = Session(model, CTX), Session(model, CTX)
    for session in (plain, graph):
        session.prefill(prompt)
    for _ in range(140):
        plain.decode(argmax(plain.logits))
        graph.confirm(int(graph.feed_chosen().item()))
        assert graph.tokens == plain.tokens
    assert graph._graph is not None and not graph._graph_failed and len(graph._graph.graphs) == 3
    scale = mx.max(mx.abs(plain.logits)).item()
    assert mx.max(mx.abs(graph.logits - plain.logits)).item() <= 1e-4 * scale
    token = int(graph.feed_chosen().item())
    graph.take_back()
    assert int(graph.feed_chosen().item()) == token
    graph.take_back()
    snap = graph.snapshot()  # hands the state back
    assert snap.cache.n_tokens == plain.cache.n_tokens
    for got, want in zip(graph.cache.arrays(), plain.cache.arrays()):
        finite = mx.isfinite(want)
        assert mx.array_equal(finite, mx.isfinite(got))
        assert mx.max(mx.abs(mx.where(finite, got - want, 0))).item() <= 1e-4 * max(1.0, mx.max(mx.abs(
            mx.where(finite, want, 0))).item())
    for _ in range(6):
        plain.decode(argmax(plain.logits))
        graph.decode(argmax(graph.logits))
        assert graph.tokens == plain.tokens


@pytest.mark.gpu
def test_a_step_with_mlx_ops_stands_the_decoder_down_and_decodes_through_mlx(monkeypatch, tmp_path):
    """The small preset's router is MLX ops (too few experts for its kernel): the decoder refuses it with one
    warning, and greedy decoding goes on through MLX's step, token for token as plain decoding."""
    from ds4_mlx.session import GraphDecodeWarning

    monkeypatch.setenv("DS4_GRAPH_DECODE", "on")
    path = tmp_path / "small.gguf"
    write_model(path, preset="small", experts="q2", vocab="small")
    model = Model(open_weights(path))
    prompt = [(7 * i + 3) % (model.config.n_vocab - 1) + 1 for i in range(60)]
    plain, graph = Session(model, CTX), Session(model, CTX)
    for session in (plain, graph):
        session.prefill(prompt)
    with pytest.warns(GraphDecodeWarning, match="MLX ops"):
        graph.confirm(int(graph.feed_chosen().item()))
    plain.decode(argmax(plain.logits))
    for _ in range(5):
        plain.decode(argmax(plain.logits))
        graph.confirm(int(graph.feed_chosen().item()))
    assert graph.tokens == plain.tokens and graph._graph is None


@pytest.mark.gpu
def test_engine_answers_through_the_graphs_as_through_mlx(monkeypatch):
    """The engine's requests through the graphs (the default on CUDA) give the tokens MLX's step gives
    (DS4_GRAPH_DECODE=off): greedy ones (fed ahead), a sampled one (the graphs' logits read back), each after a
    prefill that continues the live session (the decoder entered again, its graphs made once). Four Flash layers,
    synthetic weights."""
    from ds4_mlx.engine import Engine, GenerationRequest
    from ds4_mlx.events import Done
    from ds4_mlx.model.factory import build_vocab
    from ds4_mlx.model.synthetic import flash_config, synthetic_weights
    from ds4_mlx.sampling import SamplingParams
    from ds4_mlx.tokenizer import Tokenizer

    model = Model(synthetic_weights(flash_config(4)))
    vocab = build_vocab("real")
    tokenizer = Tokenizer(list(vocab.tokens), list(vocab.merges))
    first = [(11 * i + 5) % 9000 + 1 for i in range(200)]
    requests = [(first, 0.0), (first + [17, 23], 0.8), (first + [17, 23, 31], 0.0)]
    answers: dict[str, list[list[int]]] = {}
    made, make = [], GraphDecoder._graph

    def counted(decoder: GraphDecoder, kind: tuple[int, ...]):
        made.extend([kind] if kind not in decoder.graphs else [])
        return make(decoder, kind)

    monkeypatch.setattr(GraphDecoder, "_graph", counted)
    for mode in ("off", "on"):
        if mode == "off":
            monkeypatch.setenv("DS4_GRAPH_DECODE", mode)
        else:
            monkeypatch.delenv("DS4_GRAPH_DECODE")
        engine = Engine(model, tokenizer, CTX)
        answers[mode] = []
        if mode == "on":  # what `serve` does first: the graphs are made here, not in the first request
            engine.warm_up()
            assert len(made) == 3 and engine.session.cache.n_tokens == 0
        for prompt, temperature in requests:
            request = GenerationRequest(prompt=prompt, max_tokens=40,
                                        sampling=SamplingParams(temperature=temperature, seed=5))
            events = list(engine.generate(request))
            assert isinstance(events[-1], Done)
            answers[mode].append(events[-1].token_ids)
        if mode == "on":
            assert engine.session._graph is not None and not engine.session._graph_failed
    assert answers["on"] == answers["off"] and len(made) == len(set(made)) == 3


class StandInDecoder:
    """GraphDecoder's part in the session, played by MLX's own step on a private cache: what the session does
    around a decoder (enter, launch on confirm, read the choice, hand the state back) runs on the CPU."""

    def __init__(self, model: Model, cache, never: int | None) -> None:
        self.model, self.never, self.launched, self.entries = model, never, False, 0
        self.cache = model.new_cache(cache.ctx)
        self.joint_failed: set = set()

    def enter(self, cache) -> None:
        self.cache.restore(cache.snapshot())
        self.entries += 1

    def launch(self, token: int) -> None:
        _, self._logits = self.model.decode(token, self.cache)
        masked = self._logits if self.never is None else mx.where(
            mx.arange(self._logits.size) == self.never, -mx.inf, self._logits)
        self._chosen = int(mx.argmax(masked).item())
        self.launched = True

    def chosen(self) -> int:
        return self._chosen

    def logits(self) -> mx.array:
        return self._logits

    def leave(self, cache) -> None:
        cache.restore(self.cache.snapshot())

    def close(self) -> None:
        self.closed = True


class StandInJoint:
    """JointGraphs' part in a shared step, played by MLX's step over the stand-in decoders' caches."""

    launches: list[int] = []

    def __init__(self, decoders: list[StandInDecoder]) -> None:
        self.decoders = decoders

    @classmethod
    def of(cls, decoders: list[StandInDecoder]) -> StandInJoint:
        return cls(decoders)

    def launch(self, tokens: list[int]) -> None:
        model = self.decoders[0].model
        _, logits, rows = model.decode_rows(tokens, [d.cache for d in self.decoders])
        for decoder, row, row_logits in zip(self.decoders, rows, logits):
            decoder.cache.advance(row, decoder.cache.n_tokens + 1)
            decoder._logits, decoder.launched = row_logits, True
        StandInJoint.launches.append(len(tokens))


@pytest.fixture
def stand_in_cuda(monkeypatch, tmp_path):
    """The session as on CUDA with the graphs on by default, its decoder played by StandInDecoder with room to
    spare; returns a tiny model's path."""
    from ds4_mlx import session as session_module

    monkeypatch.delenv("DS4_GRAPH_DECODE", raising=False)
    monkeypatch.setattr(session_module, "on_cuda", lambda: True)
    monkeypatch.setattr(session_module, "GraphDecoder", StandInDecoder)
    monkeypatch.setattr(session_module, "JointGraphs", StandInJoint)
    StandInJoint.launches.clear()
    monkeypatch.setattr(session_module, "spare_device_bytes", lambda: 1 << 40)
    path = tmp_path / "tiny.gguf"
    write_model(path, preset="tiny", experts="q2", vocab="small")
    return path


def test_session_decodes_through_a_decoder_as_plain_decoding(monkeypatch, stand_in_cuda):
    """With a decoder in use (the default on CUDA, here on the CPU through a stand-in), feed_chosen / confirm /
    take_back give plain greedy decoding's tokens and logits, `never` is never chosen; a snapshot hands the state
    back, and `decode` (sampled decoding's call) enters the decoder again and gives plain decoding's logits."""
    model = Model(open_weights(stand_in_cuda))
    prompt = [(5 * i + 2) % (model.config.n_vocab - 1) + 1 for i in range(40)]
    plain, graph = Session(model, 256), Session(model, 256)
    for session in (plain, graph):
        session.prefill(prompt)

    def plain_decode(token: int) -> None:
        with monkeypatch.context() as off:
            off.setenv("DS4_GRAPH_DECODE", "off")
            plain.decode(token)

    never = argmax(plain.logits)  # the token greedy decoding would take first: never chosen here
    assert graph.prepare_greedy(never=never)
    for step in range(8):
        masked = mx.where(mx.arange(plain.logits.size) == never, -mx.inf, plain.logits)
        plain_decode(argmax(masked))
        token = int(graph.feed_chosen(never=never).item())
        if step == 3:  # taken back, the same token is chosen again
            graph.take_back()
            assert int(graph.feed_chosen(never=never).item()) == token
        graph.confirm(token)
        assert graph.tokens == plain.tokens and token != never
        assert mx.array_equal(graph.logits, plain.logits)
    assert graph._graph.entries == 1  # reading the logits did not hand the state back
    snap = graph.snapshot()
    assert snap.cache.n_tokens == plain.cache.n_tokens == len(plain.tokens) and not graph._graph_on
    for token in (9, 31, 4):
        plain_decode(token)
        assert mx.array_equal(graph.decode(token), plain.logits)
    assert graph.tokens == plain.tokens and graph._graph.entries == 2 and graph._graph_on
    assert graph.cache.n_tokens == plain.cache.n_tokens and not graph._graph_on


def test_a_new_context_gives_the_old_sessions_graphs_back(stand_in_cuda):
    """`Engine.set_context` replaces the live session: the old one's decoder is closed (its graphs, stream and copy
    of the state given back), not left to the garbage collector."""
    from ds4_mlx.engine import Engine, GenerationRequest

    engine = Engine.load(stand_in_cuda, 256)
    list(engine.generate(GenerationRequest(prompt=[5, 9, 13], max_tokens=4,
                                           sampling=SamplingParams(temperature=0.0))))
    decoder = engine.session._graph
    assert decoder is not None and decoder.entries == 1
    engine.set_context(512)
    assert getattr(decoder, "closed", False) and engine.session._graph is None and engine.ctx == 512


def test_no_decoder_where_its_copy_of_the_state_would_not_fit(monkeypatch, stand_in_cuda):
    """The decoder holds a copy of the session's state: with less spare device memory than that, decoding stays in
    MLX's step (one warning) and gives its tokens."""
    from ds4_mlx import session as session_module
    from ds4_mlx.session import GraphDecodeWarning

    model = Model(open_weights(stand_in_cuda))
    session = Session(model, 256)
    session.prefill([5, 9, 13])
    monkeypatch.setattr(session_module, "spare_device_bytes", lambda: session.cache.nbytes)
    with pytest.warns(GraphDecodeWarning, match="copy of the session's state"):
        assert not session.prepare_greedy()
    token = int(session.feed_chosen().item())
    session.confirm(token)
    assert session._graph is None and session.tokens == [5, 9, 13, token]


def test_leave_hands_back_the_rows_completed_since_the_entry_and_spares_snapshots(tmp_path):
    """`leave` on the CPU, the decoder's state played by a cache MLX's step advanced: the cache then equals that
    state in every live row, raw window and frontier, and a snapshot taken before (whose row buffers the cache
    shared) is as it was."""
    path = tmp_path / "tiny.gguf"
    write_model(path, preset="tiny", experts="q2", vocab="small")
    model = Model(open_weights(path))
    cache, ahead = model.new_cache(256), model.new_cache(256)
    model(mx.array([(3 * i + 1) % 500 + 1 for i in range(37)], dtype=mx.int32), cache)
    ahead.restore(cache.snapshot())
    before = cache.snapshot()
    kept = [np.array(a) for a in before.arrays()]
    for token in range(2, 16):  # 37 -> 51: rows end at 39, 43, 47 (ratio 4); none at ratio 128
        mx.eval(model.decode(token, ahead))
    decoder = object.__new__(GraphDecoder)
    decoder.model, decoder.ratios, decoder.state = model, graphstep.row_ratios(cache), ahead.arrays()
    decoder.position_entered, decoder.position_next = 37, 51
    decoder.synchronize = lambda: None
    decoder.leave(cache)
    assert cache.n_tokens == 51 and decoder.position_entered == 51
    for got, want, ratio in zip(cache.arrays(), ahead.arrays(), decoder.ratios, strict=True):
        live = 51 // ratio if ratio else got.shape[0]
        assert mx.array_equal(got[:live], want[:live])
    assert all(np.array_equal(a, np.array(b)) for a, b in zip(kept, before.arrays()))


def test_ops_after_kernels_are_the_mlx_ops_on_computed_values():
    """Counted: ops that take a kernel's output (directly or through others); not counted: views, kernels, ops on
    constants alone."""
    from ds4_mlx.kernels.machinery import registry
    from ds4_mlx.kernels.machinery.dialect import stand_in
    from ds4_mlx.model.graph import ops_after_kernels

    with registry.planning("cuda"):
        constant = mx.arange(8, dtype=mx.float32)
        (x,) = stand_in(inputs=[constant], output_shapes=[(8,)], output_dtypes=[mx.float32])
        (y,) = stand_in(inputs=[x.reshape(2, 4)], output_shapes=[(2, 4)], output_dtypes=[mx.float32])
        assert ops_after_kernels([y]) == {}
        z = mx.exp(x.reshape(2, 4)) + mx.sqrt(constant).reshape(2, 4)
        assert ops_after_kernels([y, z]) == {"Exp": 1, "Add": 1}


def test_a_step_with_mlx_ops_on_its_values_is_refused_before_any_graph(tmp_path):
    """The small preset's learned router falls back to MLX ops (too few experts for the route kernel): its
    recorded step holds them, so no graph of it could be right."""
    from ds4_mlx.kernels.machinery import nvrtc, registry
    from ds4_mlx.model.graph import ops_after_kernels

    path = tmp_path / "small.gguf"
    write_model(path, preset="small", experts="q2", vocab="small")
    with registry.planning("cuda"):
        model = Model(open_weights(path))
        cache = model.new_cache(256)
        mx.eval(model.decode(7, cache))
        with nvrtc.recording():
            _, logits, layers = model.step(mx.array([7], dtype=mx.int32), mx.array([cache.n_tokens], dtype=mx.int32),
                                           cache.layers, (4,))
        ops = ops_after_kernels([logits, *(a for state in layers for a in state.arrays())])
    assert ops["Sqrt"] > 0 and ops["ArgPartition"] > 0 and "DynamicSliceUpdate" not in ops


def test_small_arrays_get_copies_off_the_scalar_pool():
    """Arrays of 8 bytes or fewer that the launches read or write, unless already bound, are bound to copies of
    their values large enough to be allocated apart (MLX serves small arrays from shared managed pages)."""
    from types import SimpleNamespace

    from ds4_mlx.kernels.machinery import nvrtc

    position, eps, big, token = mx.array([7], dtype=mx.int32), mx.array([1e-6, 0.5]), mx.zeros((4, 4)), \
        mx.array([3], dtype=mx.int32)
    launch = nvrtc.Launch(b"", "f", (1, 1, 1), (1, 1, 1), 0, (position, eps, big), (token,), True, None)
    recorded = nvrtc.Recording([launch, launch], [(token, mx.zeros((1,), dtype=mx.int32))])
    holder = SimpleNamespace(_moved=[])
    moves = GraphDecoder._off_the_scalar_pool(holder, recorded)
    assert [a is b for (a, _), b in zip(moves, (position, eps))] == [True, True] and len(moves) == 2
    for (array, copy), whole in zip(moves, holder._moved, strict=True):
        assert copy.nbytes == array.nbytes and mx.array_equal(copy, array)
        assert whole.nbytes > graphstep.SCALAR_POOL_BYTES


def test_a_shared_step_goes_through_the_decoders_joint_graph(stand_in_cuda):
    """Where the decode graphs run, sessions decoding together take one launch of their decoders' joint graph
    (here a stand-in on the CPU): each session's tokens and logits are those of decoding alone, its decoder keeps
    the state (not handed back between steps), and a plain `decode` after goes on from there."""
    from ds4_mlx.session import Session, decode_together

    model = Model(open_weights(stand_in_cuda))
    prompts = [[(5 * i + 2 + 3 * s) % (model.config.n_vocab - 1) + 1 for i in range(30 + 7 * s)] for s in range(3)]
    together, alone = ([Session(model, 256) for _ in prompts] for _ in range(2))
    for group in (together, alone):
        for session, prompt in zip(group, prompts):
            session.prefill(prompt)
    for step in range(4):
        tokens = [argmax(s.logits) for s in alone]
        want = []
        for session, token in zip(alone, tokens):
            with pytest.MonkeyPatch.context() as off:
                off.setenv("DS4_GRAPH_DECODE", "off")
                want.append(session.decode(token))
        got = decode_together(together, tokens)
        for g, w in zip(got, want):
            assert mx.max(mx.abs(g - w)).item() <= 1e-5 * mx.max(mx.abs(w)).item()
    assert StandInJoint.launches == [3, 3, 3, 3]
    assert all(s._graph_on and s._graph.entries == 1 for s in together)  # entered once, the state kept there
    assert [s.tokens for s in together] == [s.tokens for s in alone]
    assert all(s.cache.n_tokens == a.cache.n_tokens for s, a in zip(together, alone))


@pytest.mark.gpu
def test_joint_graphs_decode_each_session_as_alone(monkeypatch):
    """Three sessions at different positions decode together through their decoders' joint graphs (every kind of
    step, windows of 4 and of 128 ending on the way; two of them alone for a while, then the three again), token
    for token and within 1e-4 of the largest logit as each session alone through MLX's step. Four layers of Flash's
    published layout (synthetic weights), where every fast path of a step over 2-3 rows is a kernel."""
    from ds4_mlx.model.synthetic import flash_config, synthetic_weights
    from ds4_mlx.session import decode_together

    monkeypatch.delenv("DS4_GRAPH_DECODE", raising=False)
    model = Model(synthetic_weights(flash_config(4)))
    prompts = [[(7 * i + 3 + s) % 5000 + 1 for i in range(n)] for s, n in enumerate((60, 100, 126))]
    together, alone = ([Session(model, CTX) for _ in prompts] for _ in range(2))
    for group in (together, alone):
        for session, prompt in zip(group, prompts):
            session.prefill(prompt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(80):
            rows = [0, 2] if 20 <= step < 30 else [0, 1, 2]
            tokens = [argmax(alone[i].logits) for i in rows]
            monkeypatch.setenv("DS4_GRAPH_DECODE", "off")
            want = [alone[i].decode(t) for i, t in zip(rows, tokens)]
            monkeypatch.delenv("DS4_GRAPH_DECODE")
            got = decode_together([together[i] for i in rows], tokens)
            for g, w in zip(got, want):
                assert mx.max(mx.abs(g - w)).item() <= 1e-4 * mx.max(mx.abs(w)).item()
    assert [s.tokens for s in together] == [s.tokens for s in alone]
    assert all(s._graph is not None and s._graph_on for s in together)
    assert len(together[0]._graph.joint) == 2  # the three, and two of them


def test_where_no_joint_graph_can_be_made_each_session_takes_its_own_graph_step(stand_in_cuda, monkeypatch):
    """A joint graph that cannot be made (or disagrees) is not tried again for those decoders (one warning); their
    sessions then take their own graph steps in turn, each as it would alone."""
    from ds4_mlx.session import GraphDecodeWarning, Session, decode_together

    def broken(self, tokens):
        raise ValueError("the shared step holds MLX ops")

    monkeypatch.setattr(StandInJoint, "launch", broken)
    model = Model(open_weights(stand_in_cuda))
    together, alone = ([Session(model, 256) for _ in range(2)] for _ in range(2))
    for group in (together, alone):
        for i, session in enumerate(group):
            session.prefill([3 + i, 9, 27, 5 * i + 1])
    with pytest.warns(GraphDecodeWarning, match="MLX ops") as caught:
        for _ in range(3):
            tokens = [argmax(s.logits) for s in alone]
            with monkeypatch.context() as off:
                off.setenv("DS4_GRAPH_DECODE", "off")
                want = [s.decode(t) for s, t in zip(alone, tokens)]
            got = decode_together(together, tokens)
            assert all(mx.max(mx.abs(g - w)).item() <= 1e-5 * mx.max(mx.abs(w)).item() for g, w in zip(got, want))
    assert len([w for w in caught if issubclass(w.category, GraphDecodeWarning)]) == 1
    assert all(s._graph_on for s in together) and StandInJoint.launches == []  # each one's own decoder stepped
    assert [s.tokens for s in together] == [s.tokens for s in alone]


def test_a_joint_step_with_mlx_ops_is_refused_before_any_graph(tmp_path):
    """JointGraphs records the step over its decoders' states (their tokens loaded, each row's choice, the new
    state copied back) and refuses it before any graph is made where it holds MLX ops: the tiny preset's learned
    router (too few experts for the route kernel), as for one decoder."""
    from types import SimpleNamespace

    from ds4_mlx.kernels.machinery import registry
    from ds4_mlx.model.graphstep import JointGraphs, row_ratios

    path = write_model(tmp_path / "tiny.gguf", preset="tiny", experts="q2", vocab="small")
    with registry.planning("cuda"):
        model = Model(open_weights(path))
        decoders = []
        for i in range(3):
            cache = model.new_cache(256)
            state = list(cache.arrays())
            decoders.append(SimpleNamespace(
                model=model, never=None, io_stand_in=mx.zeros((4,), dtype=mx.int32), io_address=4096 * (i + 1),
                state=state, ratios=row_ratios(cache), joint={}, position_next=40 + i,
                _layers=lambda state=state: unflatten_layers(model.config, state)))
        joint = JointGraphs(decoders)
        with pytest.raises(ValueError, match="holds MLX ops on computed values"):
            joint._record(joint.kind())
    assert all(d.joint == {joint.key: joint} for d in decoders) and not joint.graphs
    joint.close()
    assert all(d.joint == {} for d in decoders)
