"""The DSpark support file and drafter (model/dspark_file.py, model/dspark.py), and speculative decoding with it.

No published framework here ships the drafter (transformers 5.23.0 has no DSpark code: its deepseek_v4 model has
none, and its one mention of the word, in mistral_large4, drops `mtp_dspark.*` weights at load), so the forward pass is held against an independent float32 NumPy reference written here from the description of
the reference model in ../shared/spec/dspark.md §2 (the stages, the context rows, the heads), over the file's
weights dequantized by the GGUF reader.
"""

from __future__ import annotations

import io
import re
from collections import Counter
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.cache.checkpoints import snapshot_arrays
from ds4_mlx.engine import Engine, GenerationRequest
from ds4_mlx.errors import LayoutError
from ds4_mlx.events import Done
from ds4_mlx.model.dspark import DSpark, Draft, accept_sampled, open_drafter
from ds4_mlx.model.dspark_file import (aliases, dspark_metadata, dspark_tensors, open_dspark_weights, published_spec,
                                       support_kind, write_dspark_model)
from ds4_mlx.model.factory import preset_config, tensor_data, write_gguf, write_model, write_mtp_model
from ds4_mlx.model.gguf import GGUFFile
from ds4_mlx.model.model import Model
from ds4_mlx.model.weights import MTPWeights, open_weights
from ds4_mlx.sampling import SamplingParams
from ds4_mlx.session import Session
from ds4_mlx.tokenizer import Tokenizer

CTX = 256
PUBLISHED_BYTES = 5_989_114_272
"""`DeepSeek-V4-Flash-DSpark-support-0731.gguf`'s size (the C engine's model catalog)."""


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark")
    return (write_model(root / "tiny.gguf", preset="tiny", seed=5), write_dspark_model(root / "dspark.gguf", seed=5),
            write_mtp_model(root / "mtp.gguf", seed=5))


@pytest.fixture(scope="module")
def weights(paths):
    return open_weights(paths[0])


@pytest.fixture(scope="module")
def model(weights):
    return Model(weights)


@pytest.fixture(scope="module")
def drafter(paths, model):
    return DSpark.load(paths[1], model)


def _write(path, metadata, tensors):
    with open(path, "wb") as f:
        write_gguf(f, metadata, tensors, lambda spec: tensor_data(spec, seed=0))
    return path


# --------------------------------------------------------------------------------------------------------------
# The file


def test_flash_size_file_is_the_published_one_byte_for_byte_in_size():
    config = preset_config("flash")
    spec = published_spec(config)
    tensors = dspark_tensors(config, spec)
    assert len(tensors) == 81 and [t.name for t in tensors] == sorted(t.name for t in tensors)
    assert Counter(t.ggml_type.name for t in tensors) == {"F32": 34, "Q8_0": 31, "F16": 7, "IQ2_XXS": 6, "Q2_K": 3}
    assert write_gguf(io.BytesIO(), dspark_metadata(spec), tensors, None) == PUBLISHED_BYTES
    by_name = {t.name: t for t in tensors}
    assert by_name["mtp.0.main_proj.weight"].ne == (12288, 4096)
    assert by_name["mtp.2.markov_head.markov_w1.weight"].ne == (256, 129280)
    assert by_name["mtp.2.confidence_head.proj.weight"].ne == (4352, 1)
    assert by_name["mtp.1.ffn_gate_inp.weight"].ggml_type.name == "Q8_0"
    assert by_name["mtp.1.ffn_gate_exps.weight"].ne == (4096, 2048, 256)
    assert spec.target_layers == (40, 41, 42) and spec.noise_token == 128799


def test_tiny_file_loads_with_its_metadata(paths, weights):
    dspark = open_dspark_weights(paths[1], weights.config)
    metadata = dspark.file.metadata
    assert list(metadata) == ["general.architecture", "general.name", "general.alignment", "dspark.block_size",
                              "dspark.markov_rank", "dspark.noise_token_id", "dspark.target_layer_ids",
                              "dspark.stage_count", "dspark.n_layers"]
    assert dspark.file.metadata_types["dspark.target_layer_ids"] == "array[u32]"
    assert dspark.spec.target_layers == (3, 4, 5) and dspark.spec.block_size == 5 and dspark.spec.markov_rank == 256
    assert dspark.file.tensors["mtp.0.main_proj.weight"].shape == (3 * 256, 256)


@pytest.mark.parametrize("alias", [0, 1])
def test_metadata_keys_under_every_alias(tmp_path, weights, alias):
    spec = published_spec(weights.config)
    renamed = [(aliases(key.split(".", 1)[1])[alias], *rest) if key.startswith("dspark.") and
               key.split(".", 1)[1] in ("block_size", "markov_rank", "noise_token_id", "target_layer_ids")
               else (key, *rest) for key, *rest in dspark_metadata(spec)]
    path = _write(tmp_path / "alias.gguf", renamed, dspark_tensors(weights.config, spec))
    assert open_dspark_weights(path, weights.config).spec == spec


def _bad(tmp_path, config, change: dict | None = None, drop: str | None = None, spec=None):
    spec = spec or published_spec(config)
    metadata = [(key, vtype, (change or {}).get(key, value), element)
                for key, vtype, value, element in dspark_metadata(spec) if key != drop]
    return _write(tmp_path / "bad.gguf", metadata, dspark_tensors(config, spec))


@pytest.mark.parametrize("change, message", [
    ({"dspark.block_size": 0}, "block size 0"),
    ({"dspark.block_size": 17}, "block size 17"),
    ({"dspark.markov_rank": 0}, "Markov rank 0"),
    ({"dspark.noise_token_id": 512}, r"noise token 512 is outside the main model's vocabulary \[0, 512\)"),
    ({"dspark.target_layer_ids": [3, 5, 4]}, r"target layers \[3, 5, 4\]"),
    ({"dspark.target_layer_ids": [4, 5, 6]}, r"target layers \[4, 5, 6\]"),
])
def test_bad_metadata_is_one_clear_error(tmp_path, weights, change, message):
    with pytest.raises(LayoutError, match=message):
        open_dspark_weights(_bad(tmp_path, weights.config, change), weights.config)


def test_bad_files_are_layout_errors(tmp_path, paths, weights):
    config = weights.config
    with pytest.raises(LayoutError, match="has no noise_token_id"):
        open_dspark_weights(_bad(tmp_path, config, drop="dspark.noise_token_id"), config)
    spec = published_spec(config)
    with pytest.raises(LayoutError, match="mtp.0.main_proj.weight has shape"):  # 2 target layers for 3 in the file
        open_dspark_weights(_bad(tmp_path, config, {"dspark.target_layer_ids": [4, 5]}), config)
    four = replace(spec, n_stages=4)
    with pytest.raises(LayoutError, match="has 4 stages"):
        open_dspark_weights(_write(tmp_path / "four.gguf", dspark_metadata(four), dspark_tensors(config, four)), config)
    no_sink = [t for t in dspark_tensors(config, spec) if t.name != "mtp.1.attn_sinks.weight"]
    with pytest.raises(LayoutError, match="tensor mtp.1.attn_sinks.weight is missing"):
        open_dspark_weights(_write(tmp_path / "sink.gguf", dspark_metadata(spec), no_sink), config)
    with pytest.raises(LayoutError, match=r"target layers \[5, 6, 7\]: expected strictly increasing ids"):
        open_dspark_weights(write_dspark_model(tmp_path / "small.gguf", main_preset="small", vocab="small"), config)
    with pytest.raises(LayoutError, match="is not a DSpark support file"):
        open_dspark_weights(paths[2], config)


def test_mtp_file_kind_comes_from_its_tensors(paths, weights):
    assert support_kind(paths[1]) == "dspark" and support_kind(paths[2]) == "mtp"
    assert isinstance(open_drafter(paths[2], weights.config), MTPWeights)
    assert open_drafter(paths[1], weights.config).spec.n_stages == 3
    with pytest.raises(LayoutError, match="unsupported --mtp file tiny.gguf"):
        open_drafter(paths[0], weights.config)


def test_make_model_writes_the_dspark_file(tmp_path, capsys):
    from ds4_mlx.cli import main

    assert main(["make-model", str(tmp_path / "m.gguf"), "--dspark", str(tmp_path / "d.gguf"), "--seed", "5"]) == 0
    assert "DSpark support file for preset tiny" in capsys.readouterr().out
    with GGUFFile.open(tmp_path / "d.gguf") as f:
        assert len(f.tensors) == 81 and f.metadata["general.architecture"] == "deepseek4-dspark"
    run = ["run", "-m", str(tmp_path / "m.gguf"), "-c", "128", "-p", "hi", "-n", "4", "--temp", "0", "-q"]
    assert main(run + ["--mtp", str(tmp_path / "d.gguf"), "--mtp-draft", "2"]) == 0
    assert "drafts accepted" in capsys.readouterr().err
    bench = ["bench", "-m", str(tmp_path / "m.gguf"), "--mtp", str(tmp_path / "d.gguf"), "--mtp-draft", "6",
             "--ctx-start", "16", "--ctx-max", "16", "--gen-tokens", "4"]
    assert main(bench) == 0
    out = capsys.readouterr()
    assert "DSpark t/s" in out.out and "one DSpark draft of 5 guesses" in out.out
    assert "DSpark guesses accepted" in out.err


# --------------------------------------------------------------------------------------------------------------
# The forward pass against an independent float32 reference


def test_taps_are_the_mean_streams_after_the_target_layers(model, drafter):
    tokens = mx.array([0, *range(40, 60)], dtype=mx.int32)  # 21 tokens: a chunk taps its last 16 (the window)
    streams = model.hidden(tokens, model.new_cache(CTX))
    chunk = model.tapped
    assert chunk.shape == (16, 3 * model.config.n_embd)
    np.testing.assert_allclose(np.array(chunk[:, -model.config.n_embd:]), np.array(mx.mean(streams[5:], axis=1)),
                               rtol=0, atol=1e-6)  # the last target is the last layer: its output is the final state
    cache = model.new_cache(CTX)
    model.hidden(tokens[:15], cache)
    _, _, _ = model.decode_rows(tokens[15:].tolist(), [cache], groups=[6])
    np.testing.assert_allclose(np.array(model.tapped), np.array(chunk[10:]), rtol=0, atol=1e-4)


class Reference:
    """The drafter from its description (dspark.md §2), in float64 NumPy over the dequantized weights."""

    def __init__(self, dspark_weights, main_weights):
        self.w = lambda name: np.array(dspark_weights.array(name), dtype=np.float64)
        self.main = lambda name: np.array(main_weights.array(name), dtype=np.float64)
        self.c = main_weights.config
        self.spec = dspark_weights.spec

    def rms(self, x, weight=None):
        y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.c.rms_eps)
        return y if weight is None else y * weight

    def rope(self, x, positions, inverse=False):
        n = self.c.n_rot
        freqs = 1.0 / self.c.rope_freq_base ** (np.arange(0, n, 2) / n)
        angle = positions[:, None] * freqs[None, :] * (-1 if inverse else 1)
        shape = (len(positions),) + (1,) * (x.ndim - 2) + (n // 2,)
        cos, sin = np.cos(angle).reshape(shape), np.sin(angle).reshape(shape)
        a, b = x[..., -n::2], x[..., -n + 1::2]
        out = x.copy()
        out[..., -n::2], out[..., -n + 1::2] = a * cos - b * sin, a * sin + b * cos
        return out

    def hc_pre(self, h, p, kind):
        n = self.c.n_hc
        mix = self.rms(h.reshape(h.shape[0], -1)) @ self.w(f"{p}hc_{kind}_fn.weight").T
        scale, base = self.w(f"{p}hc_{kind}_scale.weight"), self.w(f"{p}hc_{kind}_base.weight")
        sig = lambda v: 1 / (1 + np.exp(-v))
        pre = sig(mix[:, :n] * scale[0] + base[:n]) + self.c.hc_eps
        post = 2 * sig(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
        logits = (mix[:, 2 * n:] * scale[2] + base[2 * n:]).reshape(-1, n, n)
        comb = np.exp(logits - logits.max(-1, keepdims=True))
        comb = comb / comb.sum(-1, keepdims=True) + self.c.hc_eps
        comb = comb / (comb.sum(-2, keepdims=True) + self.c.hc_eps)
        for _ in range(self.c.sinkhorn_iters - 1):
            comb = comb / (comb.sum(-1, keepdims=True) + self.c.hc_eps)
            comb = comb / (comb.sum(-2, keepdims=True) + self.c.hc_eps)
        return (pre[:, :, None] * h).sum(1), post, comb

    @staticmethod
    def hc_post(out, h, post, comb):  # H'_c = post_c out + sum_r comb[r, c] H_r
        return post[:, :, None] * out[:, None, :] + np.einsum("trc,trd->tcd", comb, h)

    def kv(self, p, x, positions):
        return self.rope(self.rms(x @ self.w(f"{p}attn_kv.weight").T, self.w(f"{p}attn_kv_a_norm.weight")),
                         positions)

    def attention(self, p, x, positions, context):
        c = self.c
        q = self.rms(x @ self.w(f"{p}attn_q_a.weight").T, self.w(f"{p}attn_q_a_norm.weight"))
        q = self.rope(self.rms((q @ self.w(f"{p}attn_q_b.weight").T).reshape(len(x), c.n_head, c.head_dim)),
                      positions)
        keys = np.concatenate([context, self.kv(p, x, positions)])  # every context row and the whole block
        scores = q @ keys.T / np.sqrt(c.head_dim)  # (B, H, N)
        sink = self.w(f"{p}attn_sinks.weight")[None, :, None]
        top = np.maximum(scores.max(-1, keepdims=True), sink)
        e = np.exp(scores - top)
        heads = self.rope((e @ keys) / (e.sum(-1, keepdims=True) + np.exp(sink - top)), positions, inverse=True)
        groups = heads.reshape(len(x), c.o_groups, -1)
        wo_a = self.w(f"{p}attn_output_a.weight").reshape(c.o_groups, c.o_lora_rank, -1)
        low = np.einsum("tgi,goi->tgo", groups, wo_a).reshape(len(x), -1)
        return low @ self.w(f"{p}attn_output_b.weight").T

    def swiglu(self, x, gate, up, down):
        g, u = np.minimum(x @ gate.T, 10.0), np.clip(x @ up.T, -10.0, 10.0)
        return (g / (1 + np.exp(-g)) * u) @ down.T

    def moe(self, p, x):
        c = self.c
        scores = np.sqrt(np.logaddexp(0, x @ self.w(f"{p}ffn_gate_inp.weight").T))
        gate, up, down = (self.w(f"{p}ffn_{k}_exps.weight") for k in ("gate", "up", "down"))
        out = self.swiglu(x, *(self.w(f"{p}ffn_{k}_shexp.weight") for k in ("gate", "up", "down")))
        for t in range(len(x)):
            ids = np.argsort(-(scores[t] + self.w(f"{p}exp_probs_b.bias")))[:c.n_expert_used]
            weights = scores[t, ids] / scores[t, ids].sum() * c.expert_weights_scale
            for e, wt in zip(ids, weights):
                out[t] += wt * self.swiglu(x[t:t + 1], gate[e], up[e], down[e])[0]
        return out

    def stage(self, s, h, positions, context):
        p = f"mtp.{s}."
        x, post, comb = self.hc_pre(h, p, "attn")
        h = self.hc_post(self.attention(p, self.rms(x, self.w(p + "attn_norm.weight")), positions, context), h,
                         post, comb)
        x, post, comb = self.hc_pre(h, p, "ffn")
        return self.hc_post(self.moe(p, self.rms(x, self.w(p + "ffn_norm.weight"))), h, post, comb)

    def draft(self, features, anchor):
        """The context rows of positions 0..len(features)-1, then the block after them: (base logits, drafts,
        confidences)."""
        c, spec = self.c, self.spec
        n = len(features)
        main_x = self.rms(features @ self.w("mtp.0.main_proj.weight").T, self.w("mtp.0.main_norm.weight"))
        first = max(0, n - c.sliding_window)
        context_positions = np.arange(first, n, dtype=np.float64)
        tokens = [anchor] + [spec.noise_token] * (spec.block_size - 1)
        positions = np.arange(n, n + spec.block_size, dtype=np.float64)
        h = np.repeat(self.main("token_embd.weight")[tokens][:, None, :], c.n_hc, axis=1)
        for s in range(spec.n_stages):
            h = self.stage(s, h, positions, self.kv(f"mtp.{s}.", main_x[first:], context_positions))
        mix = self.rms(h.reshape(len(h), -1)) @ self.w("mtp.2.hc_head_fn.weight").T
        pre = 1 / (1 + np.exp(-(mix * self.w("mtp.2.hc_head_scale.weight")[0] + self.w("mtp.2.hc_head_base.weight"))))
        x = ((pre + c.hc_eps)[:, :, None] * h).sum(1)
        base = self.rms(x, self.w("mtp.2.norm.weight")) @ self.main("output.weight").T
        w1, w2 = self.w("mtp.2.markov_head.markov_w1.weight"), self.w("mtp.2.markov_head.markov_w2.weight")
        proj = self.w("mtp.2.confidence_head.proj.weight")[0]
        prev, drafts, confidence = anchor, [], []
        for k in range(spec.block_size):
            confidence.append(1 / (1 + np.exp(-(proj @ np.concatenate([x[k], w1[prev]])))))
            prev = int(np.argmax(base[k] + w2 @ w1[prev]))
            drafts.append(prev)
        return base, drafts, confidence


def _tapped_rows(model: Model, tokens: mx.array) -> mx.array:
    """The taps of every token, fed in chunks of the window (a chunk taps its last window rows)."""
    cache, window = model.new_cache(CTX), model.config.sliding_window
    taps = []
    for start in range(0, tokens.size, window):
        model.hidden(tokens[start : start + window], cache)
        taps.append(model.tapped)
    return mx.concatenate(taps)


@pytest.mark.parametrize("n_context", [7, 40])  # fewer rows than the 16-row window, and more
def test_drafter_equals_the_float32_reference(paths, weights, n_context):
    exact = Model(weights, simulate_quant=False)  # the reference has no activation quantisation
    dspark = DSpark.load(paths[1], exact)
    tokens = mx.array([0, *range(100, 100 + n_context - 1)], dtype=mx.int32)
    features = _tapped_rows(exact, tokens)
    cache = dspark.new_cache()
    dspark.commit(features[:3], 0, cache)  # in two parts, as a prefill then verified rows
    dspark.commit(features[3:], 3, cache)
    assert (cache.end, cache.n_rows) == (n_context, min(n_context, 16))
    base, _ = dspark.logits(77, cache)
    draft = dspark.draft(77, cache)
    ref_base, ref_drafts, ref_confidence = Reference(open_dspark_weights(paths[1], weights.config), weights).draft(
        np.array(features, dtype=np.float64), 77)
    np.testing.assert_allclose(np.array(base), ref_base, rtol=0, atol=2e-4 * np.abs(ref_base).max())
    assert draft.tokens == ref_drafts
    np.testing.assert_allclose(draft.confidence, ref_confidence, rtol=0, atol=1e-4)


# --------------------------------------------------------------------------------------------------------------
# Speculative decoding


PROMPTS = [
    [0, 300, 301, 45, 67],
    [0, 7, 7, 7, 7, 7, 7, 7, 7],
    [0, *range(100, 131)],  # longer than the tiny model's 16-token window
]
GREEDY = SamplingParams(temperature=0)
LOGITS_ATOL = 1e-4


def generate(engine: Engine, prompt: list[int], **kw) -> Done:
    kw.setdefault("sampling", GREEDY)
    events = list(engine.generate(GenerationRequest(prompt=prompt, **kw)))
    assert isinstance(events[-1], Done)
    return events[-1]


@pytest.fixture(scope="module")
def tokenizer(weights):
    return Tokenizer.from_gguf(weights.file)


@pytest.fixture(scope="module")
def plain_runs(model, tokenizer):
    """Plain greedy decoding of every prompt: (generated tokens, session tokens, last logits)."""
    engine = Engine(model, tokenizer, CTX)
    runs = []
    for prompt in PROMPTS:
        done = generate(engine, prompt, max_tokens=24)
        runs.append((done.token_ids, list(engine.session.tokens), engine.session.logits))
    return runs


def oracle(monkeypatch, sequence: list[int], wrong=lambda position: False) -> None:
    """Make the drafter propose sequence[q] for the token at position q (a wrong token where `wrong(q)`); it still
    runs its forward pass."""
    real = DSpark.draft

    def draft(self, anchor, cache, *args, **kw):
        proposed = real(self, anchor, cache, *args, **kw)
        at = range(cache.end + 1, cache.end + 1 + self.block_size)
        tokens = [(sequence[q] if q < len(sequence) else 0) + (1 if wrong(q) else 0) for q in at]
        return Draft(tokens, proposed.probs, proposed.confidence)

    monkeypatch.setattr(DSpark, "draft", draft)


def test_random_drafts_change_nothing(model, tokenizer, drafter, plain_runs):
    engine = Engine(model, tokenizer, CTX, mtp=drafter, mtp_draft=6)
    for prompt, (generated, fed, logits) in zip(PROMPTS[2:], plain_runs[2:]):
        done = generate(engine, prompt, max_tokens=24)
        assert done.token_ids == generated and engine.session.tokens == fed
        assert mx.allclose(engine.session.logits, logits, atol=LOGITS_ATOL)
        assert done.mtp_drafted > 0


@pytest.mark.parametrize("n_draft", [6, pytest.param(3, marks=pytest.mark.slow)])
def test_speculative_greedy_equals_plain_greedy(monkeypatch, model, tokenizer, drafter, plain_runs, n_draft):
    for prompt, (generated, fed, logits) in zip(PROMPTS, plain_runs):
        oracle(monkeypatch, [*prompt, *generated], wrong=lambda q: q % 4 == 0)
        engine = Engine(model, tokenizer, CTX, mtp=drafter, mtp_draft=n_draft)
        done = generate(engine, prompt, max_tokens=24)
        assert done.token_ids == generated
        assert engine.session.tokens == fed
        assert mx.allclose(engine.session.logits, logits, atol=LOGITS_ATOL)
        assert 0 < done.mtp_accepted < done.mtp_drafted  # right and wrong drafts both happened


def test_right_drafts_are_all_accepted_in_six_row_steps(monkeypatch, model, tokenizer, drafter, plain_runs):
    prompt, (generated, _, _) = PROMPTS[0], plain_runs[0]
    oracle(monkeypatch, [*prompt, *generated])
    rows = []
    real_rows = model.decode_rows

    def counted(tokens, caches, groups=None):
        rows.append(len(tokens))
        return real_rows(tokens, caches, groups)

    monkeypatch.setattr(model, "decode_rows", counted)
    done = generate(Engine(model, tokenizer, CTX, mtp=drafter, mtp_draft=6), prompt, max_tokens=24)
    assert done.token_ids == generated
    assert rows == [6, 6, 6, 5]  # 23 tokens fed: three full blocks, then the anchor and the 4 drafts left room for
    assert done.mtp_accepted == done.mtp_drafted == 5 + 5 + 5 + 4


def test_session_speculate_rewind_and_the_drafter_windows(monkeypatch, model, drafter, plain_runs):
    prompt, (generated, _, _) = PROMPTS[2], plain_runs[2]
    sequence = [*prompt, *generated]
    oracle(monkeypatch, sequence, wrong=lambda q: q == len(prompt) + 3)
    session = Session(model, CTX, drafter)
    session.prefill(prompt)
    assert (session.mtp_cache.end, session.mtp_cache.n_rows) == (len(prompt), 16)
    step = session.speculate(generated[0], max_drafts=5)
    assert step.tokens == tuple(generated[:3]) and (step.drafted, step.accepted) == (5, 2)  # the 3rd draft was wrong
    assert session.mtp_cache.end == len(prompt) + 3
    plain = Session(model, CTX)
    plain.prefill(prompt)
    for i, token in enumerate(step.tokens):
        assert mx.allclose(step.logits[i], plain.decode(token), atol=LOGITS_ATOL)
    # the windows equal those of a drafter that followed the accepted tokens one by one
    followed = Session(model, CTX, drafter)
    followed.prefill(prompt)
    for token in step.tokens:
        followed.decode(token)
    for got, want in zip(session.mtp_cache.rings, followed.mtp_cache.rings):
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=1e-4)
    session.rewind(len(prompt) + 1)
    assert session.mtp_cache.end == len(prompt) + 1
    step = session.speculate(generated[1], max_drafts=5, stop=(sequence[len(prompt) + 2],))
    assert step.tokens == (generated[1],) and step.drafted == 0  # the first draft is a stop token: nothing verified


def test_snapshots_keep_the_drafter_rows_and_a_lost_window_refills(monkeypatch, model, drafter, plain_runs):
    prompt, (generated, _, _) = PROMPTS[1], plain_runs[1]
    oracle(monkeypatch, [*prompt, *generated])
    session = Session(model, CTX, drafter)
    session.prefill(prompt)
    saved = session.snapshot()
    assert saved.mtp.rings[0].shape == (len(prompt), model.config.head_dim)
    assert all(any(a is ring for a in snapshot_arrays(saved)) for ring in saved.mtp.rings)  # RAM checkpoints' bytes
    first = session.speculate(generated[0], max_drafts=5)
    session.restore(saved)
    assert session.speculate(generated[0], max_drafts=5).tokens == first.tokens
    session.restore(replace(saved, mtp=None))  # as from the disk cache, which holds no drafter rows
    step = session.speculate(generated[0], max_drafts=5)
    assert step.tokens == (generated[0],) and step.drafted == 0  # no window yet: fed alone, which starts one
    assert (session.mtp_cache.end, session.mtp_cache.n_rows) == (len(prompt) + 1, 1)
    step = session.speculate(generated[1], max_drafts=5)
    assert step.tokens == tuple(generated[1:7]) and step.accepted == 5


def test_acceptance_rule_gives_the_target_distribution():
    """Rejection sampling (dspark.md §3.4): whatever the drafts' distribution q, the first emitted token is
    distributed as the target's p."""
    rng = np.random.default_rng(3)
    p = np.array([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = np.array([0.1, 0.2, 0.3, 0.4])
    counts = np.zeros(4)
    for _ in range(20000):
        d = int(rng.choice(4, p=q))
        kept, token = accept_sampled(p, Draft([d], q[None], [1.0]), rng)
        counts[d if kept else token] += 1
    np.testing.assert_allclose(counts / counts.sum(), p[0], atol=0.015)
    assert accept_sampled(p, Draft([3], q[None], [1.0]), rng)[0] == 0  # p(3) = 0: always rejected

    class Rejecting:
        """Draws 1.0 (a draw at the top of [0, 1)), so that a draft with p = q is rejected."""

        def random(self) -> float:
            return 1.0

        def choice(self, n: int, p: np.ndarray) -> int:
            return int(rng.choice(n, p=p))

    same = np.array([[0.0, 0.5, 0.5, 0.0], [0.25] * 4])  # p = q: the residual has no mass
    kept, token = accept_sampled(same, Draft([1], same[0][None], [1.0]), Rejecting())
    assert kept == 0 and token in (1, 2)  # drawn from p itself, not from a 0/0 distribution


def test_engine_loads_the_dspark_file_and_warns_on_the_other_checkpoint(paths, tmp_path, caplog):
    engine = Engine.load(paths[0], ctx=CTX, mtp=paths[1], mtp_draft=6)
    assert isinstance(engine.session.mtp, DSpark) and engine.model.taps == (3, 4, 5)
    assert "drafts are accepted less often" not in caplog.text  # both taken for the preview
    named = tmp_path / "DeepSeek-V4-Flash-DSpark-support-0731.gguf"
    named.write_bytes(paths[1].read_bytes())
    with caplog.at_level("WARNING", logger="ds4_mlx.engine"):
        Engine.load(paths[0], ctx=CTX, mtp=named, mtp_draft=6)
    assert "is for the 0731 weights (the file's name says 0731) but the model is preview" in caplog.text


def test_sessions_sharing_a_step_keep_their_drafter_windows(model, drafter):
    from ds4_mlx.session import decode_together

    prompts = [PROMPTS[0], PROMPTS[1]]
    together, alone = [Session(model, CTX, drafter) for _ in prompts], [Session(model, CTX, drafter) for _ in prompts]
    for session, other, prompt in zip(together, alone, prompts):
        session.prefill(prompt)
        other.prefill(prompt)
    decode_together(together, [11, 12])
    decode_together(together, [13, 14])
    for session, other, tokens in zip(together, alone, ([11, 13], [12, 14])):
        for token in tokens:
            other.decode(token)
        assert session.mtp_cache.end == other.mtp_cache.end == len(other.tokens)
        for got, want in zip(session.mtp_cache.rings, other.mtp_cache.rings):
            np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=1e-4)


def test_sampled_speculation_keeps_the_plain_state(monkeypatch, model, drafter, plain_runs):
    """At a temperature this low the model's distributions are its argmax: right drafts are all kept, a wrong one
    is rejected and the token drawn instead is the greedy one; the state is that of feeding the kept tokens."""
    prompt, (generated, _, _) = PROMPTS[2], plain_runs[2]
    oracle(monkeypatch, [*prompt, *generated], wrong=lambda q: q == len(prompt) + 4)
    rng = np.random.default_rng(0)
    session = Session(model, CTX, drafter)
    session.prefill(prompt)
    step, following = session.speculate_sampled(generated[0], 5, temperature=1e-3, rng=rng)
    assert step.tokens == tuple(generated[:4]) and (step.drafted, step.accepted) == (5, 3)
    assert following == generated[4]
    plain = Session(model, CTX)
    plain.prefill([*prompt, *generated[:4]])
    assert session.tokens == plain.tokens and mx.allclose(session.logits, plain.logits, atol=LOGITS_ATOL)
    step, following = session.speculate_sampled(following, 5, temperature=1e-3, rng=rng)
    assert step.tokens == tuple(generated[4:10]) and following == generated[10]


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.8, seed=11),
                                      SamplingParams(temperature=0, presence_penalty=1.0)])
def test_sampled_and_penalised_decoding_keep_drafts_the_stream_takes(monkeypatch, model, tokenizer, drafter, sampling):
    """Target-only matching: the drafts are fed, and kept while the stream's own choices take them, so the tokens
    are plain decoding's, seed for seed."""
    prompt = PROMPTS[0]
    expected = generate(Engine(model, tokenizer, CTX), prompt, max_tokens=16, sampling=sampling)
    oracle(monkeypatch, [*prompt, *expected.token_ids], wrong=lambda q: q % 5 == 0)
    engine = Engine(model, tokenizer, CTX, mtp=drafter, mtp_draft=6)
    done = generate(engine, prompt, max_tokens=16, sampling=sampling)
    assert done.token_ids == expected.token_ids
    assert engine.session.tokens == [*prompt, *expected.token_ids[:-1]]
    assert 0 < done.mtp_accepted < done.mtp_drafted


def test_inspect_counts_the_dspark_file_in(paths, capsys):
    from ds4_mlx.cli import main

    assert main(["inspect", str(paths[0]), "--mtp", str(paths[1]), "--ctx", "256"]) == 0
    out = capsys.readouterr().out
    assert "81 tensors" in out and "dspark" in out
    assert re.search(r"mtp raw ring +24.00 KiB", out)  # 3 stages' windows of 16 rows of 128 floats
