"""download_model.sh against a local HTTP server that serves fake model files and honours `Range: bytes=N-`."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "download_model.sh"
Q2_FILE = "DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2.gguf"
Q4_FILE = "DeepSeek-V4-Flash-Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2.gguf"
PUBLISHED = {
    "q2": Q2_FILE,
    "q4": Q4_FILE,
    "q2-imatrix": Q2_FILE.removesuffix(".gguf") + "-imatrix.gguf",
    "q4-imatrix": Q4_FILE.removesuffix(".gguf") + "-imatrix.gguf",
    "mtp": "DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf",
    "ds4f-q2": "DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix-0731.gguf",
    "ds4f-q2-q4": "DeepSeek-V4-Flash-Layers37-42Q4KExperts-OtherExpertLayersIQ2XXSGateUp-Q2KDown-AProjQ8-SExpQ8-OutQ8-"
                  "chat-v2-imatrix-fixed-0731.gguf",
    "ds4f-q4": "DeepSeek-V4-Flash-Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2-imatrix-0731.gguf",
    "ds4f-mxfp4": "DeepSeek-V4-Flash-MXFP4Experts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2-mxfp4-"
                  "0731.gguf",
    "ds4f-dspark": "DeepSeek-V4-Flash-DSpark-support-0731.gguf",
}
"""The published file names (antirez/deepseek-v4-gguf; the 0731 ones as the C engine's download script names them)."""


@dataclass
class Request:
    path: str
    range: str | None
    authorization: str | None


@dataclass
class FakeHub:
    """Files served under /repo/<name>, and every request the script made."""

    url: str
    files: dict[str, bytes]
    requests: list[Request] = field(default_factory=list)


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    files = {name: f"{target}:".encode() + os.urandom(50_000) for target, name in PUBLISHED.items()}
    state = FakeHub(url="", files=files)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            state.requests.append(Request(self.path, self.headers["Range"], self.headers["Authorization"]))
            body = state.files.get(self.path.removeprefix("/repo/"))
            if body is None:
                self.send_error(404)
                return
            start = 0
            if self.headers["Range"]:
                start = int(self.headers["Range"].removeprefix("bytes=").removesuffix("-"))
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(len(body) - start))
            self.end_headers()
            self.wfile.write(body[start:])

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}/repo"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()
    thread.join()


def run_script(cwd: Path, hub: FakeHub, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run the script in `cwd` with a clean environment: no real HF token or token cache can leak in."""
    base_env = {"PATH": os.environ["PATH"], "HOME": str(cwd / "home"), "DS4_DOWNLOAD_BASE_URL": hub.url}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=cwd, env={**base_env, **env}, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("target", ["q2", "q4-imatrix", "ds4f-q2", "ds4f-q2-q4", "ds4f-q4", "ds4f-mxfp4"])
def test_full_download_links_ds4flash(tmp_path: Path, hub: FakeHub, target: str) -> None:
    result = run_script(tmp_path, hub, target)
    assert result.returncode == 0, result.stderr
    name = PUBLISHED[target]
    assert (tmp_path / "gguf" / name).read_bytes() == hub.files[name]
    assert not (tmp_path / "gguf" / f"{name}.part").exists()
    link = tmp_path / "ds4flash.gguf"
    assert link.is_symlink() and os.readlink(link) == f"gguf/{name}"
    assert link.read_bytes() == hub.files[name]
    assert [r.path for r in hub.requests] == [f"/repo/{name}"]
    assert hub.requests[0].authorization is None


def test_resumes_a_partial_download(tmp_path: Path, hub: FakeHub) -> None:
    name = PUBLISHED["q2-imatrix"]
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / f"{name}.part").write_bytes(hub.files[name][:12_345])
    result = run_script(tmp_path, hub, "q2-imatrix")
    assert result.returncode == 0, result.stderr
    assert [r.range for r in hub.requests] == ["bytes=12345-"]
    assert (tmp_path / "gguf" / name).read_bytes() == hub.files[name]


@pytest.mark.parametrize("target", ["mtp", "ds4f-dspark"])
def test_drafters_do_not_touch_the_model_link(tmp_path: Path, hub: FakeHub, target: str) -> None:
    result = run_script(tmp_path, hub, target)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "gguf" / PUBLISHED[target]).read_bytes() == hub.files[PUBLISHED[target]]
    assert not (tmp_path / "ds4flash.gguf").exists()


def test_switching_models_repoints_the_link_and_skips_finished_files(tmp_path: Path, hub: FakeHub) -> None:
    assert run_script(tmp_path, hub, "q2").returncode == 0
    assert run_script(tmp_path, hub, "q4").returncode == 0
    assert os.readlink(tmp_path / "ds4flash.gguf") == f"gguf/{Q4_FILE}"
    again = run_script(tmp_path, hub, "q2")
    assert again.returncode == 0 and "Already downloaded" in again.stdout
    assert os.readlink(tmp_path / "ds4flash.gguf") == f"gguf/{Q2_FILE}"
    assert len(hub.requests) == 2


def test_token_flag_sends_authorization(tmp_path: Path, hub: FakeHub) -> None:
    result = run_script(tmp_path, hub, "q2", "--token", "hf_flag", HF_TOKEN="hf_env")
    assert result.returncode == 0, result.stderr
    assert hub.requests[0].authorization == "Bearer hf_flag"


def test_hf_token_env_sends_authorization(tmp_path: Path, hub: FakeHub) -> None:
    result = run_script(tmp_path, hub, "q4", HF_TOKEN="hf_env")
    assert result.returncode == 0, result.stderr
    assert hub.requests[0].authorization == "Bearer hf_env"


def test_token_cache_sends_authorization(tmp_path: Path, hub: FakeHub) -> None:
    cache = tmp_path / "home" / ".cache" / "huggingface"
    cache.mkdir(parents=True)
    (cache / "token").write_text("hf_cached\n")
    result = run_script(tmp_path, hub, "mtp")
    assert result.returncode == 0, result.stderr
    assert hub.requests[0].authorization == "Bearer hf_cached"


def test_unknown_target_is_a_usage_error(tmp_path: Path, hub: FakeHub) -> None:
    result = run_script(tmp_path, hub, "q3")
    assert result.returncode == 2
    assert ("unknown target 'q3'; expected one of: ds4f-q2 ds4f-q2-q4 ds4f-q4 ds4f-mxfp4 ds4f-dspark q2 q4 "
            "q2-imatrix q4-imatrix mtp") in result.stderr
    assert hub.requests == [] and not (tmp_path / "gguf").exists()


def test_help_lists_every_target(tmp_path: Path, hub: FakeHub) -> None:
    result = run_script(tmp_path, hub, "--help")
    assert result.returncode == 0
    for target in PUBLISHED:
        assert f"\n  {target} " in result.stdout
    assert hub.requests == []


def test_failed_download_leaves_no_file_or_link(tmp_path: Path, hub: FakeHub) -> None:
    del hub.files[Q2_FILE]
    result = run_script(tmp_path, hub, "q2")
    assert result.returncode != 0
    assert f"download of {Q2_FILE} failed" in result.stderr
    assert not (tmp_path / "gguf" / Q2_FILE).exists()
    assert not (tmp_path / "ds4flash.gguf").exists()


def test_refuses_to_replace_a_real_ds4flash_file(tmp_path: Path, hub: FakeHub) -> None:
    (tmp_path / "ds4flash.gguf").write_bytes(b"my own model")
    result = run_script(tmp_path, hub, "q2")
    assert result.returncode == 1
    assert "ds4flash.gguf exists and is not a symlink" in result.stderr
    assert (tmp_path / "ds4flash.gguf").read_bytes() == b"my own model"
    assert hub.requests == []
