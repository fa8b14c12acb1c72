"""The model card of `/v1/models`: the limits under the names clients read, thinking, and the checkpoint."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from ds4_mlx.engine import Engine
from serve_support import MODEL, ScriptedEngine, live_server


@pytest.fixture(scope="module")
def live():
    with live_server(ScriptedEngine(ctx=4096)) as live:
        yield live


def test_openai_card_fields(live):
    with httpx.Client(base_url=live.url) as client:
        card = client.get(f"/v1/models/{MODEL}").json()
        listed = client.get("/v1/models").json()["data"]
    assert card["context_length"] == card["max_model_len"] == card["context_window"] == 4096
    assert card["top_provider"] == {"context_length": 4096, "max_completion_tokens": 4096, "is_moderated": False}
    assert card["max_output_tokens"] == 4096 and card["max_context_length"] == 1048576  # trained context
    assert card["thinking"]["supported"] and card["checkpoint"] == "preview" and "assumed" in card["checkpoint_basis"]
    assert "response_format" in card["supported_parameters"] and "reasoning" in card["supported_parameters"]
    thinks = {m["id"]: m["thinking"]["default"] for m in listed}
    assert thinks == {MODEL: True, "deepseek-chat": False, "deepseek-reasoner": True}
    sdk = openai.OpenAI(base_url=live.url + "/v1", api_key="local", max_retries=0)
    model = sdk.models.retrieve("deepseek-chat")  # the SDK keeps the extra fields
    assert model.context_length == 4096 and model.top_provider["max_completion_tokens"] == 4096


def test_anthropic_card_fields(live):
    model = anthropic.Anthropic(base_url=live.url, api_key="local", max_retries=0).models.retrieve(MODEL)
    assert model.max_input_tokens == 4095 and model.max_tokens == 4096
    assert model.capabilities.thinking.supported and model.capabilities.structured_outputs.supported
    assert not model.capabilities.image_input.supported


def test_the_demo_models_card(demo_model):
    engine = Engine.load(demo_model, 1024, default_max_tokens=300)
    with live_server(engine) as live, httpx.Client(base_url=live.url) as client:
        card = client.get("/v1/models/deepseek-reasoner").json()
    assert card["max_output_tokens"] == 300 and card["context_length"] == 1024
    assert card["checkpoint"] == "preview" and card["gguf_name"].startswith("DeepSeek V4 Flash tiny")
