"""The 0731 checkpoint's reasoning-effort tiers (model/checkpoint.py, chat.py `effort_prefix`): which checkpoint a
file holds, and each tier's prefix, byte for byte and as tokens, through the CLI and the server."""

from __future__ import annotations

import json

import httpx
import pytest

from ds4_mlx.chat import (ABSOLUTE_MAXIMUM_PREFIX, ASSISTANT, BEYOND_MAXIMUM_PREFIX, BOS, USER, Message, ThinkMode,
                          effort_prefix, render_chat)
from ds4_mlx.cli import main
from ds4_mlx.engine import Engine
from ds4_mlx.model.checkpoint import Checkpoint, detect
from ds4_mlx.model.gguf import GGMLType
from serve_support import ScriptedEngine, live_server

BIG = 393216
PREVIEW, V0731 = Checkpoint.PREVIEW, Checkpoint.V0731


def test_the_prefixes_are_the_published_texts():
    """476 and 528 UTF-8 bytes (the "—" of "Beyond maximum" is U+2014), 79 and 92 tokens of the V4 vocabulary: the
    prompt growth a fork of the C engine measured for 0731's high and max."""
    assert len(ABSOLUTE_MAXIMUM_PREFIX.encode()) == 476 and len(BEYOND_MAXIMUM_PREFIX.encode()) == 528
    assert BEYOND_MAXIMUM_PREFIX.startswith("Reasoning Effort: Beyond maximum \u2014 exhaustive")
    assert BEYOND_MAXIMUM_PREFIX.endswith("no error remains undiscovered.\n\n")
    tokenizer = Engine.demo(ctx=512).tokenizer
    assert [len(tokenizer.encode(p, specials=False)) for p in (ABSOLUTE_MAXIMUM_PREFIX, BEYOND_MAXIMUM_PREFIX)] == [
        79, 92]


@pytest.mark.parametrize("checkpoint, mode, ctx, prefix", [
    (V0731, ThinkMode.LOW, 4096, ""),
    (V0731, ThinkMode.HIGH, 4096, ABSOLUTE_MAXIMUM_PREFIX),
    (V0731, ThinkMode.MAX, BIG, BEYOND_MAXIMUM_PREFIX),
    (V0731, ThinkMode.MAX, BIG - 1, ABSOLUTE_MAXIMUM_PREFIX),  # max needs a 384K context, else high
    (PREVIEW, ThinkMode.LOW, 4096, ""),
    (PREVIEW, ThinkMode.HIGH, 4096, ""),  # the preview's default tier
    (PREVIEW, ThinkMode.MAX, BIG, ABSOLUTE_MAXIMUM_PREFIX),
    (PREVIEW, ThinkMode.MAX, BIG - 1, ""),
])
def test_each_tier_renders_its_checkpoints_prefix(checkpoint, mode, ctx, prefix):
    rendered = render_chat([Message("user", "Hello")], think=mode, ctx=ctx, checkpoint=checkpoint)
    assert rendered == BOS + prefix + USER + "Hello" + ASSISTANT + "<think>"


def test_thinking_off_has_no_prefix_on_either_checkpoint():
    for checkpoint in Checkpoint:
        assert effort_prefix(ThinkMode.NONE, checkpoint) == ""


@pytest.mark.parametrize("metadata, path, types, expected", [
    ({"general.name": "DeepSeek V4 Flash 0731"}, None, (), V0731),
    ({"quantize.imatrix.file": "gguf/DeepSeek-V4-Flash-0731-chat-v2-routed-moe-ds4.dat"}, None, (), V0731),
    ({}, "gguf/DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix-0731.gguf", (), V0731),
    ({"quantize.imatrix.chunks_count": 202100}, None, (), V0731),
    ({"quantize.imatrix.chunks_count": 90042}, None, (), PREVIEW),
    ({"general.name": "DeepSeek V4 Flash"}, "x.gguf", (GGMLType.MXFP4,), V0731),  # MXFP4: published for 0731 only
    ({"general.name": "DeepSeek V4 Flash"}, "ds4flash.gguf", (GGMLType.IQ2_XXS, GGMLType.Q2_K), PREVIEW),
])
def test_the_checkpoint_is_told_from_the_file(metadata, path, types, expected):
    which, basis = detect(metadata, path, types)
    assert which is expected and basis
    if expected is PREVIEW and not metadata.get("quantize.imatrix.chunks_count"):
        assert "assumed" in basis


def _prompt_tokens(tmp_path, *flags: str) -> int:
    out = tmp_path / f"dump{len(list(tmp_path.iterdir()))}.json"
    assert main(["run", "--demo", *flags, "-p", "Hello", "-n", "1", "--dump-logprobs", str(out)]) == 0
    return json.loads(out.read_text(encoding="utf-8"))["prompt_tokens"]


def test_the_cli_renders_the_checkpoint_it_is_told(tmp_path, demo_model):
    low = _prompt_tokens(tmp_path, "--checkpoint", "0731")
    assert _prompt_tokens(tmp_path, "--checkpoint", "0731", "--think-high") == low + 79
    assert _prompt_tokens(tmp_path, "--checkpoint", "preview", "--think-high") == low
    assert _prompt_tokens(tmp_path, "--think-high") == low  # the demo model is told apart as the preview


def test_an_endpoint_renders_the_engines_checkpoint():
    engine = ScriptedEngine()
    engine.checkpoint = V0731
    with live_server(engine) as live, httpx.Client(base_url=live.url, timeout=20) as client:
        for effort, prefix in (("high", ABSOLUTE_MAXIMUM_PREFIX), ("low", ""), ("medium", "")):
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "reasoning_effort": effort, "max_tokens": 4})
            assert r.status_code == 200
            assert engine.requests[-1].prompt.startswith(BOS + prefix + USER + "hi")
