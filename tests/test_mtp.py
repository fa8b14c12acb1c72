"""The MTP draft file and block, and speculative greedy decoding with it (ds4.c).

A random MTP block almost never guesses what a random model writes, so most tests replace its guesses with an
oracle that knows the plain greedy continuation (and is wrong on purpose at chosen positions): the block still
runs and keeps its cache, only its logits are replaced. Whatever the guesses, speculative decoding must give the
tokens of plain greedy decoding and leave the live session holding the tokens plain decoding would have fed.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

import mlx.core as mx
import pytest

from ds4_mlx.kernels.machinery import registry
from ds4_mlx.cli import main
from ds4_mlx.engine import Engine, GenerationRequest
from ds4_mlx.errors import LayoutError, ModelFileMissing
from ds4_mlx.events import Done
from ds4_mlx.cache.kvidentity import ModelIdentity
from ds4_mlx.cache.kvstore import KvCacheOptions, KvStore
from ds4_mlx.model.factory import model_tensors, mtp_tensors, tensor_data, write_gguf, write_model, write_mtp_model
from ds4_mlx.model.gguf import GGMLType
from ds4_mlx.model.model import Model
from ds4_mlx.model.mtp import MTP, open_mtp
from ds4_mlx.model.weights import open_weights
from ds4_mlx.sampling import SamplingParams
from ds4_mlx.session import Session
from ds4_mlx.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0)
CTX = 256
EOS = 1
PROMPTS = [
    [0, 300, 301, 45, 67],
    [0, 7, 7, 7, 7, 7, 7, 7, 7],
    [0, *range(100, 131)],  # longer than the tiny model's 16-token window
]
# Logits rows of speculative steps come from one call over several tokens, plain decoding's from one call per
# token: equal up to float32 rounding (measured ~1e-6 on the tiny model on the CPU; up to ~1e-4 on the H200, whose
# quantized-matmul kernels sum in a different order for one token than for several).
LOGITS_ATOL = 1e-4 if os.environ.get("DS4_TEST_DEVICE", "cpu") == "cpu" else 1e-3


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return write_model(root / "tiny.gguf", preset="tiny", seed=5), write_mtp_model(root / "mtp.gguf", seed=5)


@pytest.fixture(scope="module")
def weights(paths):
    return open_weights(paths[0])


@pytest.fixture(scope="module")
def model(weights):
    return Model(weights)


@pytest.fixture(scope="module")
def tokenizer(weights):
    return Tokenizer.from_gguf(weights.file)


@pytest.fixture(scope="module")
def mtp(paths, model):
    return MTP.load(paths[1], model)


@pytest.fixture(scope="module")
def plain_runs(model, tokenizer):
    """Plain greedy decoding of every prompt: (generated tokens, session tokens, last logits)."""
    engine = Engine(model, tokenizer, CTX)
    runs = []
    for prompt in PROMPTS:
        done = generate(engine, prompt, max_tokens=24)
        runs.append((done.token_ids, list(engine.session.tokens), engine.session.logits))
    return runs


def generate(engine: Engine, prompt: list[int], **kw) -> Done:
    kw.setdefault("sampling", GREEDY)
    events = list(engine.generate(GenerationRequest(prompt=prompt, **kw)))
    assert isinstance(events[-1], Done)
    return events[-1]


def one_hot(token: int, n_vocab: int, gap: float = 200.0) -> mx.array:
    return mx.where(mx.arange(n_vocab) == token, gap / 2, -gap / 2)


def oracle(monkeypatch, sequence: list[int], wrong=lambda position: False, gap: float = 200.0) -> None:
    """Make the MTP block guess sequence[q] for the token at position q (a wrong token where `wrong(q)`)."""
    real = MTP.__call__

    def guess(self, tokens, hidden, position, cache):
        _, streams = real(self, tokens, hidden, position, cache)
        target = position + tokens.size
        token = sequence[target] if target < len(sequence) else 0
        if wrong(target):
            token = (token + 1) % self.config.n_vocab
        cache.logits = one_hot(token, self.config.n_vocab, gap)
        return cache.logits, streams

    monkeypatch.setattr(MTP, "__call__", guess)


def count_model_calls(monkeypatch, model: Model) -> list[int]:
    """Count the main model's forward calls: chunks go through Model.hidden, single tokens through Model.decode
    (which hands them to Model.hidden itself in the reference kernel mode), verified blocks through
    Model.decode_rows (their rows)."""
    calls = []
    real_hidden, real_decode, real_rows = model.hidden, model.decode, model.decode_rows

    def counted(tokens, cache):
        calls.append(len(tokens))
        return real_hidden(tokens, cache)

    def counted_decode(token, cache):
        if registry.mode() == "fast":
            calls.append(1)
        return real_decode(token, cache)

    def counted_rows(tokens, caches, groups=None):
        calls.append(len(tokens))
        return real_rows(tokens, caches, groups)

    monkeypatch.setattr(model, "hidden", counted)
    monkeypatch.setattr(model, "decode", counted_decode)
    monkeypatch.setattr(model, "decode_rows", counted_rows)
    return calls


# --------------------------------------------------------------------------------------------------------------
# The file


def test_mtp_file_has_the_published_layout(paths, weights):
    mtp_weights = open_mtp(paths[1], weights.config)
    tensors = mtp_weights.file.tensors
    assert all(name.startswith("mtp.0.") for name in tensors)
    assert len(tensors) == len(mtp_tensors(weights.config)) == 32
    assert tensors["mtp.0.e_proj.weight"].ggml_type == GGMLType.Q8_0
    assert tensors["mtp.0.h_proj.weight"].shape == (256, 256)
    assert tensors["mtp.0.ffn_gate_exps.weight"].ggml_type == GGMLType.Q4_K
    assert tensors["mtp.0.ffn_down_exps.weight"].ggml_type == GGMLType.Q4_K
    for name in ("hc_head_fn", "hc_attn_fn", "hc_ffn_fn", "ffn_gate_inp"):
        assert tensors[f"mtp.0.{name}.weight"].ggml_type == GGMLType.F32
    assert "mtp.0.exp_probs_b.bias" in tensors
    assert not any("compressor" in name or "indexer" in name or "tid2eid" in name for name in tensors)
    assert mtp_weights.variant == "mtp q4"


def test_mtp_file_is_deterministic(tmp_path):
    a = write_mtp_model(tmp_path / "a.gguf", seed=3, experts="q2").read_bytes()
    assert a == write_mtp_model(tmp_path / "b.gguf", seed=3, experts="q2").read_bytes()
    assert a != write_mtp_model(tmp_path / "c.gguf", seed=4, experts="q2").read_bytes()


def _write_mtp(path, tensors):
    with open(path, "wb") as f:
        write_gguf(f, [], tensors, lambda spec: tensor_data(spec, seed=0))
    return path


def test_bad_mtp_files_are_layout_errors(tmp_path, paths, weights):
    config = weights.config
    with pytest.raises(LayoutError, match="is not an MTP file: it has no mtp.* tensors"):
        open_mtp(paths[0], config)  # the main model given in its place
    hc_head = [t for t in mtp_tensors(config) if t.name != "mtp.0.hc_head_base.weight"]
    with pytest.raises(LayoutError, match="tensor mtp.0.hc_head_base.weight is missing"):
        open_mtp(_write_mtp(tmp_path / "no_hc_head.gguf", hc_head), config)
    with pytest.raises(LayoutError, match=r"mtp.0.hc_head_fn.weight has shape \[2048, 4\], expected \[1024, 4\]"):
        open_mtp(write_mtp_model(tmp_path / "small.gguf", main_preset="small"), config)
    no_bias = [t for t in mtp_tensors(config) if t.name != "mtp.0.exp_probs_b.bias"]
    with pytest.raises(LayoutError, match="mtp.0.exp_probs_b.bias is missing"):
        open_mtp(_write_mtp(tmp_path / "no_bias.gguf", no_bias), config)
    compressor = next(t for t in model_tensors(config) if t.name == "blk.2.attn_compressor_kv.weight")
    extra = [*mtp_tensors(config), replace(compressor, name="mtp.0.attn_compressor_kv.weight")]
    with pytest.raises(LayoutError, match="unexpected tensor mtp.0.attn_compressor_kv.weight"):
        open_mtp(_write_mtp(tmp_path / "extra.gguf", extra), config)
    with pytest.raises(ModelFileMissing, match="no MTP file at"):
        open_mtp(tmp_path / "missing.gguf", config)


def test_engine_rejects_a_bad_mtp_file_before_loading(paths, tmp_path):
    with pytest.raises(LayoutError, match="unsupported --mtp file tiny.gguf: expected legacy MTP tensors"):
        Engine.load(paths[0], ctx=CTX, mtp=paths[0], mtp_draft=2)


# --------------------------------------------------------------------------------------------------------------
# The draft block


def test_draft_block_runs_a_chunk_like_single_steps(model, mtp):
    tokens = mx.array([0, *range(40, 60)], dtype=mx.int32)  # 21 tokens: past the 16-token window
    hidden = model.hidden(tokens, model.new_cache(CTX))
    chunk = mtp.new_cache()
    logits, streams = mtp(tokens, hidden, 0, chunk)
    assert logits.shape == (model.config.n_vocab,) and streams.shape == (model.config.n_hc, model.config.n_embd)
    assert chunk.position == 21 and bool(mx.all(mx.isfinite(logits)))
    steps = mtp.new_cache()
    for i in range(tokens.size):
        step_logits, step_streams = mtp.draft(tokens[i].item(), hidden[i], i, steps)
    # Same math in one call or in 21: float32 rounding only.
    assert mx.allclose(step_logits, logits, atol=1e-5) and mx.allclose(step_streams, streams, atol=1e-5)
    # The main model's streams are an input: other streams, another guess.
    other, _ = mtp(tokens[-1:], hidden[:1], 21, mtp.new_cache())
    assert not mx.allclose(other, logits, atol=1e-3)


def test_draft_cache_snapshot_restore_and_positions(model, mtp):
    tokens = mx.array([0, 5, 6, 7], dtype=mx.int32)
    hidden = model.hidden(tokens, model.new_cache(CTX))
    cache = mtp.new_cache()
    mtp(tokens[:3], hidden[:3], 40, cache)  # an empty cache starts its run anywhere (a session loaded from disk)
    assert (cache.origin, cache.position) == (40, 43)
    before = cache.snapshot()
    first, streams = mtp.draft(7, hidden[3], 43, cache)
    mtp.draft(9, streams, 44, cache)
    cache.restore(before)
    again, _ = mtp.draft(7, hidden[3], 43, cache)
    assert mx.array_equal(first, again)
    with pytest.raises(ValueError, match="continues at position 44, not 50"):
        mtp.draft(7, hidden[3], 50, cache)


# --------------------------------------------------------------------------------------------------------------
# Speculative decoding


@pytest.mark.parametrize("n_draft", [2, pytest.param(3, marks=pytest.mark.slow), 4])
def test_speculative_greedy_equals_plain_greedy(monkeypatch, model, tokenizer, mtp, plain_runs, n_draft):
    for prompt, (generated, fed, logits) in zip(PROMPTS, plain_runs):
        oracle(monkeypatch, [*prompt, *generated], wrong=lambda q: q % 3 == 0)
        engine = Engine(model, tokenizer, CTX, mtp=mtp, mtp_draft=n_draft, mtp_margin=0.0)
        done = generate(engine, prompt, max_tokens=24)
        assert done.token_ids == generated
        assert engine.session.tokens == fed
        assert mx.allclose(engine.session.logits, logits, atol=LOGITS_ATOL)
        assert 0 < done.mtp_accepted < done.mtp_drafted  # right and wrong guesses both happened


def test_random_mtp_guesses_change_nothing(model, tokenizer, mtp, plain_runs):
    engine = Engine(model, tokenizer, CTX, mtp=mtp, mtp_draft=3, mtp_margin=0.0)
    for prompt, (generated, fed, _) in zip(PROMPTS[:2], plain_runs):
        done = generate(engine, prompt, max_tokens=24)
        assert done.token_ids == generated and engine.session.tokens == fed
        assert done.mtp_drafted > 0


@pytest.mark.parametrize("n_draft", [2, 4])
def test_right_guesses_are_all_accepted_and_save_model_calls(monkeypatch, model, tokenizer, mtp, plain_runs,
                                                             n_draft):
    prompt, (generated, _, _) = PROMPTS[0], plain_runs[0]
    assert len(generated) == 24  # stopped by max_tokens: 23 of them fed
    oracle(monkeypatch, [*prompt, *generated])
    calls = count_model_calls(monkeypatch, model)
    done = generate(Engine(model, tokenizer, CTX, mtp=mtp, mtp_draft=n_draft), prompt, max_tokens=24)
    assert done.token_ids == generated
    steps = [n_draft] * (23 // n_draft) + ([23 % n_draft] if 23 % n_draft else [])
    assert calls == [len(prompt), *steps]
    # A step checks the block's guess for its first token and drafts the rest, unless it has room for that token
    # only (the last of max_tokens is never fed): then nothing is guessed.
    assert done.mtp_accepted == done.mtp_drafted == sum(n for n in steps if n > 1)
    assert len(calls) == 1 + math.ceil(23 / n_draft)  # plain decoding: 1 + 23


def test_temperature_or_penalties_turn_speculation_off(monkeypatch, model, tokenizer, mtp, plain_runs):
    prompt, (generated, _, _) = PROMPTS[0], plain_runs[0]
    oracle(monkeypatch, [*prompt, *generated])
    sampled = SamplingParams(temperature=0.8, seed=11)
    expected = generate(Engine(model, tokenizer, CTX), prompt, max_tokens=12, sampling=sampled).token_ids
    engine = Engine(model, tokenizer, CTX, mtp=mtp, mtp_draft=4)
    calls = count_model_calls(monkeypatch, model)
    done = generate(engine, prompt, max_tokens=12, sampling=sampled)
    assert done.token_ids == expected and done.mtp_drafted == 0
    assert len(calls) == 12  # the prefill, then one call per token fed
    penalised = generate(engine, prompt, max_tokens=6, sampling=SamplingParams(temperature=0, presence_penalty=1))
    assert penalised.mtp_drafted == 0


def test_margin_gates_a_lone_guess(monkeypatch, model, tokenizer, mtp, plain_runs):
    prompt, (generated, _, _) = PROMPTS[0], plain_runs[0]
    oracle(monkeypatch, [*prompt, *generated], gap=1.0)  # right, but with a top-1/top-2 gap of 1
    calls = count_model_calls(monkeypatch, model)
    done = generate(Engine(model, tokenizer, CTX, mtp=mtp, mtp_draft=2, mtp_margin=3.0), prompt, max_tokens=24)
    assert done.token_ids == generated and len(calls) == 24  # below the margin: never verified
    calls.clear()
    done = generate(Engine(model, tokenizer, CTX, mtp=mtp, mtp_draft=2, mtp_margin=0.5), prompt, max_tokens=24)
    assert done.token_ids == generated and len(calls) == 1 + math.ceil(23 / 2)


def test_an_answer_ending_inside_a_speculative_step_unfeeds_its_tokens(monkeypatch, model, tokenizer, mtp,
                                                                       plain_runs):
    prompt, (generated, _, _) = PROMPTS[2], plain_runs[2]
    oracle(monkeypatch, [*prompt, *generated])
    rewinds = []
    real_rewind = Session.rewind

    def rewind(self, n_tokens):
        rewinds.append(len(self.tokens) - n_tokens)
        real_rewind(self, n_tokens)

    monkeypatch.setattr(Session, "rewind", rewind)
    for stop_after in (5, 6, 7):  # cancelled between tokens; with 4 per step some fed tokens are not emitted yet
        emitted = []

        def cancel() -> bool:
            emitted.append(None)
            return len(emitted) > stop_after

        plain = Engine(model, tokenizer, CTX)
        expected = list(plain.generate(GenerationRequest(prompt=prompt, max_tokens=24, sampling=GREEDY),
                                       cancel))[-1]
        emitted.clear()
        engine = Engine(model, tokenizer, CTX, mtp=mtp, mtp_draft=4)
        done = list(engine.generate(GenerationRequest(prompt=prompt, max_tokens=24, sampling=GREEDY), cancel))[-1]
        assert done.token_ids == expected.token_ids and done.finish_reason == expected.finish_reason == "error"
        assert engine.session.tokens == plain.session.tokens
        assert mx.allclose(engine.session.logits, plain.session.logits, atol=LOGITS_ATOL)
    assert sorted(rewinds) == [1, 2, 3]  # tokens fed but not emitted when the answer ended


def test_session_speculate_and_rewind(monkeypatch, model, mtp, plain_runs):
    prompt, (generated, _, _) = PROMPTS[1], plain_runs[1]
    sequence = [*prompt, *generated]
    oracle(monkeypatch, sequence, wrong=lambda q: q == len(prompt) + 3)
    session = Session(model, CTX, mtp)
    session.prefill(prompt)
    step = session.speculate(generated[0], max_drafts=5)
    assert step.tokens == tuple(generated[:3]) and (step.drafted, step.accepted) == (6, 3)  # the 4th guess was wrong
    plain = Session(model, CTX)
    plain.prefill(prompt)
    for i, token in enumerate(step.tokens):
        assert mx.allclose(step.logits[i], plain.decode(token), atol=LOGITS_ATOL)
    assert mx.allclose(session.logits, plain.logits, atol=LOGITS_ATOL)
    session.rewind(len(prompt) + 1)
    plain_one = Session(model, CTX)
    plain_one.prefill([*prompt, generated[0]])
    assert session.tokens == plain_one.tokens and mx.allclose(session.logits, plain_one.logits, atol=LOGITS_ATOL)
    with pytest.raises(ValueError, match="can rewind to between"):
        session.rewind(len(prompt) - 1)
    eos_next = [*sequence[: len(prompt) + 2], EOS]
    oracle(monkeypatch, eos_next)
    step = session.speculate(generated[1], max_drafts=5, stop=(EOS,))
    assert step.tokens == (generated[1],)  # the block guessed EOS next: nothing to verify


def test_speculation_keeps_disk_checkpoints_where_plain_decoding_takes_them(monkeypatch, tmp_path, model, tokenizer,
                                                                            mtp, plain_runs):
    prompt, (generated, _, _) = PROMPTS[0], plain_runs[0]
    oracle(monkeypatch, [*prompt, *generated])
    saved = {}
    for name, opts in (("plain", {}), ("speculative", {"mtp": mtp, "mtp_draft": 4})):
        options = KvCacheOptions(tmp_path / name, min_tokens=1, cold_max_tokens=0, continued_interval_tokens=5,
                                 boundary_align_tokens=0)
        engine = Engine(model, tokenizer, CTX, kv_store=KvStore(options, quant_bits=2, identity=ModelIdentity(bytes(16), bytes(16))), **opts)
        real = engine._checkpoint
        saved[name] = []

        def record(lane, reason, real=real, out=saved[name]):
            out.append((reason, tuple(lane.session.tokens)))
            real(lane, reason)

        monkeypatch.setattr(engine, "_checkpoint", record)
        assert generate(engine, prompt, max_tokens=24).token_ids == generated
    assert [len(tokens) for _, tokens in saved["plain"]] == [5, 10, 15, 20, 25]
    assert saved["speculative"] == saved["plain"]


def test_mtp_draft_needs_an_mtp_block(model, tokenizer):
    with pytest.raises(ValueError, match="needs an MTP draft block"):
        Engine(model, tokenizer, CTX, mtp_draft=2)
    with pytest.raises(ValueError, match="between 1 and 16"):
        Engine(model, tokenizer, CTX, mtp_draft=17)


# --------------------------------------------------------------------------------------------------------------
# Command line


def test_make_model_and_run_with_mtp(tmp_path, capsys):
    main_path, mtp_path = tmp_path / "m.gguf", tmp_path / "m-mtp.gguf"
    assert main(["make-model", str(main_path), "--mtp", str(mtp_path), "--seed", "2"]) == 0
    assert "MTP draft block for preset tiny" in capsys.readouterr().out
    base = ["run", "-m", str(main_path), "-c", "128", "-p", "hi", "-n", "6", "--temp", "0", "-q"]
    assert main(base + ["--mtp", str(mtp_path), "--mtp-draft", "3", "--mtp-margin", "0"]) == 0
    assert "drafts accepted" in capsys.readouterr().err
    assert main(base + ["--mtp-draft", "3"]) == 2  # a usage mistake
    assert "--mtp-draft 3 needs an MTP draft file: --mtp FILE" in capsys.readouterr().err


def test_speculation_is_off_where_the_decode_graphs_run(monkeypatch, caplog, model, tokenizer, mtp, paths):
    """Where the decode graphs run (CUDA), a verify call through MLX costs ~10 graph tokens: --mtp-draft is unused
    there, said once in the log, and Engine.load does not build the draft block; the bench still speculates."""
    from ds4_mlx import engine as engine_module

    monkeypatch.setattr(engine_module, "speculation_pays", lambda: False)
    with caplog.at_level("WARNING", logger="ds4_mlx.engine"):
        engine = Engine(model, tokenizer, CTX, mtp=mtp, mtp_draft=3)
    assert engine.session.mtp is None and engine.mtp_draft == 1
    assert [r.getMessage() for r in caplog.records if "--mtp-draft 3 is unused" in r.getMessage()]
    assert Engine(model, tokenizer, CTX, mtp=mtp, mtp_draft=3, speculate_anyway=True).session.mtp is mtp
    loaded = Engine.load(paths[0], CTX, mtp=paths[1], mtp_draft=2)
    assert loaded.session.mtp is None and "mtp" not in loaded.load_phases
    monkeypatch.setattr(engine_module, "speculation_pays", lambda: True)
    assert Engine(model, tokenizer, CTX, mtp=mtp, mtp_draft=3).session.mtp is mtp
