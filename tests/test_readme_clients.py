"""The README's OpenAI and Anthropic SDK snippets, run as written against a live server over the demo model (what
`ds4-mlx serve --demo` serves): each must finish by itself and print the answer, whether or not reasoning came."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ds4_mlx.engine import Engine
from serve_support import live_server

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
DEFAULT_URL = "http://127.0.0.1:8000"


def sdk_snippets(text: str = README) -> dict[str, str]:
    """The Python blocks of a document that use an SDK, by the SDK they import."""
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    found = {}
    for block in blocks:
        for sdk in ("openai", "anthropic"):
            if f"from {sdk} import" in block:
                found[sdk] = block
    return found


@pytest.fixture(scope="module")
def live(demo_model):
    with live_server(lambda: Engine.load(demo_model, ctx=4096)) as live:
        yield live


def test_the_readme_shows_both_sdks():
    snippets = sdk_snippets()
    assert set(snippets) == {"openai", "anthropic"}
    for block in snippets.values():
        assert DEFAULT_URL in block and "max_tokens=" in block  # the demo model never stops by itself


def test_the_server_reference_shows_the_same_snippets():
    """docs/server.md's client set-ups repeat the README's snippets: what is tested here is what both show."""
    assert sdk_snippets((ROOT / "docs" / "server.md").read_text(encoding="utf-8")) == sdk_snippets()


@pytest.mark.parametrize("sdk", ["openai", pytest.param("anthropic", marks=pytest.mark.slow)])
def test_sdk_snippet_runs_as_written(sdk, live, capsys):
    """Only the server's address changes (the test server listens on a free port)."""
    block = sdk_snippets()[sdk].replace(DEFAULT_URL, live.url)
    namespace: dict = {}
    exec(compile(block, f"README.md ({sdk} snippet)", "exec"), namespace)
    printed = capsys.readouterr().out
    assert printed.strip()
    if sdk == "openai":
        message = namespace["r"].choices[0].message
        assert namespace["r"].usage.completion_tokens <= 256
        assert message.content in printed
    else:
        m = namespace["m"]
        assert m.usage.output_tokens <= 256
        assert m.content and all((b.thinking if b.type == "thinking" else b.text) in printed for b in m.content)
