"""The model split across ranks of MLX's ring backend on the CPU (model/shard.py) against one process.

Each launch runs tests/split_script.py under `mlx.launch --backend ring` on local processes. The bound is 1e-5 on
logits of magnitude ~5 with the activation quantisation simulation off: a split sums each layer's attention and MoE
outputs rank by rank (partial products of float32, then one sum), where one process sums the same products in one
matmul, so the results differ by float32 rounding in the order of the additions (~1e-6 here); every rank gets the
same sum, so the ranks agree bit for bit. With the simulation on, that rounding can move a value across an FP8/FP4
rounding boundary or an indexer top-k tie, which then differs by the quantisation step: those runs are compared
between ranks only (slow). A pipeline (`layers`) adds nothing up in another order: it equals one process exactly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from ds4_mlx.model.dspark_file import write_dspark_model
from ds4_mlx.model.factory import write_model, write_mtp_model
from ds4_mlx.model.shard import ShardedWeights, Split, SplitError, shares
from ds4_mlx.model.weights import open_weights

SCRIPT = Path(__file__).with_name("split_script.py")
LAUNCH = Path(sys.executable).with_name("mlx.launch")
BOUND = 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny layout with MXFP4 experts: hidden columns in blocks of 32, so they split over up to 8 ranks."""
    return write_model(tmp_path_factory.mktemp("split") / "tiny.gguf", "tiny", experts="mxfp4")


def launch(model: Path, out: Path, ranks: int, kind: str, quant: str = "exact", share: str | None = None
           ) -> list[dict[str, np.ndarray]]:
    """Runs the script on `ranks` local processes; each rank's logits."""
    args = [str(model), str(out), kind, quant, *([share] if share else [])]
    done = subprocess.run([str(LAUNCH), "--backend", "ring", "-n", str(ranks), "--python", sys.executable, "--",
                           str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    saved = [Path(f"{out}.{rank}.npz") for rank in range(ranks)]
    assert done.returncode == 0 and all(p.exists() for p in saved), done.stdout + done.stderr  # the launcher exits 0
    return [dict(np.load(p)) for p in saved]


def single(model: Path, out: Path, quant: str = "exact") -> dict[str, np.ndarray]:
    subprocess.run([sys.executable, str(SCRIPT), str(model), str(out), "tensor", quant], check=True, timeout=300)
    return dict(np.load(f"{out}.single.npz"))


def assert_same(runs: list[dict[str, np.ndarray]], reference: dict[str, np.ndarray], bound: float) -> None:
    """Every rank's logits equal the first rank's bit for bit and the reference's within `bound`."""
    for run in runs:
        for key, logits in reference.items():
            assert np.array_equal(run[key], runs[0][key]), key
            assert np.max(np.abs(run[key] - logits)) <= bound, (key, np.max(np.abs(run[key] - logits)))


def test_tensor_split_uneven_equals_one_process(tiny: Path, tmp_path: Path):
    reference = single(tiny, tmp_path / "one")
    runs = launch(tiny, tmp_path / "two", 2, "tensor", share="3,5")
    assert_same(runs, reference, BOUND)
    # a decode step: 2 sums a layer of n_embd floats, one gather of the logits (512 ids as 192 + 320, padded to 320)
    for run in runs:
        assert run["exchanges"].tolist() == [2 * 6 + 1, 2 * 6 * 256 * 4 + 320 * 4]


def test_layer_split_equals_one_process(tiny: Path, tmp_path: Path):
    runs = launch(tiny, tmp_path / "two", 2, "layers")
    assert_same(runs, single(tiny, tmp_path / "one"), 0.0)
    # a decode step: the streams handed on (4 x 256 floats, sent by rank 0, received by rank 1), the logits' sum
    for run in runs:
        assert run["exchanges"].tolist() == [2, 4 * 256 * 4 + 512 * 4]


def test_a_failing_rank_ends_the_others(tiny: Path, tmp_path: Path):
    """The launcher ends every rank once one exits with an error: the others, waiting in a sum, do not hang (it
    terminates them, SIGTERM, where the ring backend has not seen the peer's socket close first and exited with
    status 1; mlx.launch 0.32 itself then exits 0, its warnings name the ranks)."""
    start = time.monotonic()
    done = subprocess.run([str(LAUNCH), "--backend", "ring", "-n", "2", "--python", sys.executable, "--", str(SCRIPT),
                           str(tiny), str(tmp_path / "x"), "tensor", "fail"], capture_output=True, text=True,
                          timeout=120)
    assert "rank 1 exited with code 3" in done.stderr
    assert "rank 0 exited with code -15" in done.stderr or "rank 0 exited with code 1" in done.stderr
    assert time.monotonic() - start < 60
    assert not list(tmp_path.glob("x.*.npz"))


def test_a_hung_rank_ends_the_others_with_one_line(tiny: Path, tmp_path: Path):
    """A rank that hangs past its first decode steps: the other, waiting in its next sum, writes one line and exits
    within the deadline (model/watchdog.py), and the launcher ends the hung one."""
    start = time.monotonic()
    done = subprocess.run([str(LAUNCH), "--backend", "ring", "-n", "2", "--python", sys.executable, "--", str(SCRIPT),
                           str(tiny), str(tmp_path / "x"), "tensor", "hang"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "DS4_MLX_SPLIT_TIMEOUT": "3"})
    line = "error: rank 0: no answer from the other ranks for 3 s (a rank hung or the link is down)"
    assert done.stderr.count(line) == 1 and "rank 0 exited with code 1" in done.stderr, done.stderr
    assert "rank 1 exited with code -15" in done.stderr
    assert time.monotonic() - start < 60
    assert not list(tmp_path.glob("x.*.npz"))


MTP_SCRIPT = SCRIPT.with_name("split_mtp_script.py")


@pytest.fixture(scope="module")
def plain_greedy(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where tests/split_mtp_script.py saved one process's plain greedy tokens (OUT.single.json): OUT."""
    out = tmp_path_factory.mktemp("plain") / "spec"
    subprocess.run([sys.executable, str(MTP_SCRIPT), str(tiny), str(out)], check=True, timeout=300)
    return out


@pytest.mark.parametrize("kind", [pytest.param("mtp", marks=pytest.mark.slow), "dspark"])
def test_speculative_greedy_under_a_split_equals_plain_greedy(tiny: Path, plain_greedy: Path, kind: str):
    """The drafter whole on both ranks (its guesses an oracle's, some wrong: tests/split_mtp_script.py): every
    rank emits one process's plain greedy tokens, having verified drafts and kept some of them."""
    out = plain_greedy
    drafter = (write_mtp_model(out.with_name("mtp.gguf"), "tiny") if kind == "mtp"
               else write_dspark_model(out.with_name("dspark.gguf"), "tiny"))
    plain = json.loads(Path(f"{out}.single.json").read_text())["tokens"]
    done = subprocess.run([str(LAUNCH), "--backend", "ring", "-n", "2", "--python", sys.executable, "--",
                           str(MTP_SCRIPT), str(tiny), str(out), str(drafter)], capture_output=True, text=True,
                          timeout=300)
    for rank in range(2):
        path = Path(f"{out}.{rank}.json")
        assert path.exists(), done.stdout + done.stderr
        run = json.loads(path.read_text())
        path.unlink()
        assert run["tokens"] == plain and 0 < run["accepted"] < run["drafted"], run


def test_mtp_with_a_pipeline_is_one_line(tiny: Path, tmp_path: Path):
    cli = Path(sys.executable).with_name("ds4-mlx")
    done = subprocess.run([str(LAUNCH), "--backend", "ring", "-n", "2", "--python", sys.executable, "--", str(cli),
                           "run", "-m", str(tiny), "-p", "hi", "--split", "layers", "--mtp",
                           str(write_mtp_model(tmp_path / "mtp.gguf", "tiny")), "--mtp-draft", "2"],
                          capture_output=True, text=True, timeout=120)
    assert "error: --mtp runs with --split tensor, not --split layers" in done.stderr, done.stderr


@pytest.mark.parametrize("kind", ["tensor", pytest.param("layers", marks=pytest.mark.slow)])
def test_run_under_the_launcher_answers_as_one_process(tiny: Path, kind: str):
    """`ds4-mlx run` on two ranks prints what one process prints (rank 0 alone prints; sampling with a seed)."""
    cli = Path(sys.executable).with_name("ds4-mlx")
    args = ["run", "-m", str(tiny), "-p", "hello", "-n", "12", "--temp", "0.8", "--seed", "3", "--no-quant-sim",
            "--nothink", "-q"]
    one = subprocess.run([str(cli), *args], capture_output=True, text=True, timeout=300, check=True)
    two = subprocess.run([str(LAUNCH), "--backend", "ring", "-n", "2", "--python", sys.executable, "--", str(cli),
                          *args, "--split", kind], capture_output=True, text=True, timeout=300)
    assert one.stdout and two.stdout == one.stdout, two.stderr
    assert two.stderr.count("generation 12 tokens") == 1  # rank 1's stats line is not repeated


def test_split_outside_the_launcher_is_one_line(tiny: Path):
    done = subprocess.run([str(Path(sys.executable).with_name("ds4-mlx")), "run", "-m", str(tiny), "-p", "hi",
                           "--split", "tensor"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("ds4-mlx run: error: --split and --split-weights need")


@contextmanager
def _server(argv: list[str], port: int, idle: float = 0.0) -> Iterator[Callable[[str, dict], dict]]:
    """Starts `argv` (a server on `port`, alone or under the launcher, in a process group of its own), leaves it
    `idle` seconds, and gives a function that posts a JSON body to a path and returns the answer; then ends it with
    SIGINT, as Ctrl+C would."""
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, server.stderr.read().decode()
                time.sleep(0.5)
        time.sleep(idle)

        def post(path: str, body: dict) -> dict:
            request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            return json.loads(urllib.request.urlopen(request, timeout=120).read())

        yield post
        os.killpg(server.pid, signal.SIGINT)
        server.wait(timeout=60)  # every rank ends: rank 0's worker tells the others it stops
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)


def _serve_answers(argv: list[str], port: int) -> list[str]:
    """Asks a server for four completions (three with a seed, one without), then three at once."""
    with _server(argv, port) as post:
        def complete(prompt: str, seed: int | None) -> str:
            body = {"prompt": prompt, "max_tokens": 10, "temperature": 0.8, **({"seed": seed} if seed else {})}
            return post("/v1/completions", body)["choices"][0]["text"]

        texts = [complete(prompt, seed) for prompt, seed in (("hello there", 5), ("hello there, again", 5),
                                                             ("hi", None), ("hello", 5))]
        with ThreadPoolExecutor(3) as pool:  # at once: lanes decoding in shared steps (their order is the server's)
            assert all(pool.map(lambda p: complete(p, 7), ["one", "two", "three"]))
    return texts[:2] + texts[3:]  # not the unseeded one (each run draws its seed); the one after it shows that
    # the ranks drew the same tokens for it (a rank that had not would have left its cache apart from rank 0's)


def _serve_held(argv: list[str], port: int) -> list[str]:
    """A chat answer held to a JSON schema (response_format), sampled with a seed, and a free one after it."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"]}
    with _server(argv, port) as post:
        def chat(text: str, **extra) -> str:
            body = {"messages": [{"role": "user", "content": text}], "model": "deepseek-chat", "max_tokens": 12,
                    "temperature": 0.8, "seed": 4, **extra}
            return post("/v1/chat/completions", body)["choices"][0]["message"]["content"]

        return [chat("Describe a thing.", response_format={"type": "json_schema", "json_schema": {
            "name": "thing", "schema": schema}}), chat("And another?")]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tensor", "layers"])
def test_serve_under_the_launcher_answers_as_one_process(tiny: Path, kind: str):
    cli = Path(sys.executable).with_name("ds4-mlx")
    args = ["serve", "-m", str(tiny), "--no-quant-sim", "--ctx", "512"]
    one = _serve_answers([str(cli), *args, "--port", "18471"], 18471)
    two = _serve_answers([str(LAUNCH), "--backend", "ring", "-n", "2", "--python", sys.executable, "--", str(cli),
                          *args, "--port", "18472", "--split", kind], 18472)
    assert one and two == one


@pytest.mark.slow
def test_serve_under_the_launcher_holds_an_answer_to_a_schema(tiny: Path):
    """A structured-output request on a split server: token for token the one process's answer."""
    cli = Path(sys.executable).with_name("ds4-mlx")
    args = ["serve", "-m", str(tiny), "--no-quant-sim", "--ctx", "512"]
    one = _serve_held([str(cli), *args, "--port", "18473"], 18473)
    two = _serve_held([str(LAUNCH), "--backend", "ring", "-n", "2", "--python", sys.executable, "--", str(cli),
                       *args, "--port", "18474"], 18474)
    assert one[0].startswith("{") and two == one


def run_state(model: Path, out: Path, kv: Path, kind: str = "tensor", ranks: int = 1) -> list[dict[str, np.ndarray]]:
    """split_script.py's engine run (`state`) on one process or on `ranks` local ones; each one's records."""
    args = [str(SCRIPT), "state", str(model), str(out), kind, str(kv)]
    if ranks == 1:
        subprocess.run([sys.executable, *args], check=True, timeout=300)
        return [dict(np.load(f"{out}.single.npz"))]
    done = subprocess.run([str(LAUNCH), "--backend", "ring", "-n", str(ranks), "--python", sys.executable, "--",
                           *args], capture_output=True, text=True, timeout=300)
    saved = [Path(f"{out}.{rank}.npz") for rank in range(ranks)]
    assert all(p.exists() for p in saved), done.stdout + done.stderr
    return [dict(np.load(p)) for p in saved]


@pytest.mark.parametrize("kind", ["tensor", pytest.param("layers", marks=pytest.mark.slow)])
def test_kept_states_and_held_answers_under_a_split(tiny: Path, tmp_path: Path, kind: str):
    """RAM checkpoints taken, restored and dropped for memory on one rank, disk checkpoints written and loaded by a
    new engine, a request held to a JSON schema relayed from rank 0: every rank keeps and answers the same, and as
    one process does. Rank 1 has half the memory (the RAM budget is its) and lost one disk file (no rank loads it)."""
    one = run_state(tiny, tmp_path / "one", tmp_path / "kv1")[0]
    runs = run_state(tiny, tmp_path / "two", tmp_path / "kv2", kind, ranks=2)
    for key in runs[0]:
        if key != "budget":
            assert np.array_equal(runs[0][key], runs[1][key]), key
    budgets = [run["budget"] for run in runs]  # [the agreed budget, the rank's own spare memory]
    assert budgets[0][0] == budgets[1][0] == budgets[1][1] < budgets[0][1]
    assert [str(one[f"{name}.reuse"]) for name in ("fox", "other", "fox_again", "fox_disk", "other_disk")] == [
        "none", "none", "ram", "disk", "disk"]
    assert str(runs[0]["other_disk.reuse"]) == "none" and runs[0]["relayed"]  # rank 1 had lost that file
    assert one["drops"] == runs[0]["drops"] == 1  # rank 0 had the memory, but dropped the checkpoint rank 1 did
    for name in ("fox", "other", "fox_again", "fox_disk", "held"):
        for what in ("tokens", "reuse", "kept")[: 2 if name == "held" else 3]:  # held: after other_disk's miss
            assert np.array_equal(runs[0][f"{name}.{what}"], one[f"{name}.{what}"]), (name, what)
        gap = np.max(np.abs(runs[0][f"{name}.logits"] - one[f"{name}.logits"]))
        assert gap <= (BOUND if kind == "tensor" else 0.0), (name, gap)
    for rank in range(2):  # each rank's own files
        assert list((tmp_path / "kv2" / f"split-{kind}-2-rank{rank}").glob("*.kv"))


def test_a_checkpoint_of_another_split_or_rank_is_refused(tiny: Path, tmp_path: Path):
    """A disk checkpoint loads only where its identity names the same split, shares and rank."""
    from ds4_mlx.cache.kvidentity import model_identity
    from ds4_mlx.cache.kvstore import KvCacheOptions, KvStore, SaveReason
    from ds4_mlx.engine import Engine, GenerationRequest
    from ds4_mlx.sampling import SamplingParams

    engine = Engine.load(tiny, 256, simulate_quant=False, kv_ram_budget=0)
    prompt = "The quick brown fox jumps over the lazy dog. "
    list(engine.generate(GenerationRequest(prompt, 1, SamplingParams(temperature=0))))
    session = engine.session
    text = engine._text_bytes(session.tokens)
    with open_weights(tiny) as weights:
        identities = {"one process": model_identity(weights, False)}
        for name, kind, rank, share in (("tensor 0", "tensor", 0, None), ("tensor 1", "tensor", 1, None),
                                        ("tensor 0 at 3,5", "tensor", 0, [3, 5]), ("layers 0", "layers", 0, None)):
            split = Split.plan(kind, Group(rank, 2), weights, share)
            identities[name] = model_identity(weights, False, split=split)
    for i, (writer, identity) in enumerate(identities.items()):
        options = KvCacheOptions(tmp_path / str(i), min_tokens=1)
        assert KvStore(options, 4, identity).save(text, session.cache, session.tokens, session.logits,
                                                  SaveReason.COLD)
        for reader, other in identities.items():
            found = KvStore(options, 4, other).candidates(text, 256)
            assert len(found) == (reader == writer), (writer, reader)


def test_a_pipeline_ranks_payload_holds_its_own_layers(tiny: Path):
    """A pipeline rank's disk payload has the rows of its own layers only and reads back to the same state."""
    import io

    import mlx.core as mx

    from ds4_mlx.cache.kvstore import payload_nbytes
    from ds4_mlx.model.cache import LayerState, SessionCache, read_payload, write_payload

    with open_weights(tiny) as weights:
        config = weights.config
    rng = np.random.default_rng(0)
    whole = SessionCache(config, 64)
    whole.n_tokens = 37
    whole.layers = [LayerState.from_arrays([mx.array(rng.standard_normal(a.shape).astype(np.float32))
                                            for a in state.arrays()]) for state in whole.layers]
    sizes = []
    for held in (range(config.n_layer), range(2, 4)):
        cache = SessionCache(config, 64)
        cache.n_tokens, cache.held = whole.n_tokens, held
        cache.layers = [state if i in held else LayerState.empty(config, i, 1) for i, state in enumerate(whole.layers)]
        out = io.BytesIO()
        write_payload(out, cache, list(range(37)), mx.zeros(config.n_vocab))
        assert len(out.getvalue()) == payload_nbytes(cache)
        sizes.append(len(out.getvalue()))
        back, tokens, _ = read_payload(io.BytesIO(out.getvalue()), config, 64, held)
        assert tokens == list(range(37)) and back.held == held
        again = io.BytesIO()
        write_payload(again, back, tokens, mx.zeros(config.n_vocab))
        assert again.getvalue() == out.getvalue()
        shapes = [[a.shape for state in c.layers for a in state.arrays()] for c in (back, cache)]
        assert shapes[0] == shapes[1]  # the other ranks' layers: placeholders, as Model.new_cache leaves them
    assert sizes[1] < sizes[0]


def test_a_held_request_is_relayed_whole():
    """What serve hands the other ranks makes the same request, its Constraint (format, strict tools) included."""
    from ds4_mlx.constrain import Constraint, OutputFormat
    from ds4_mlx.engine import GenerationRequest
    from ds4_mlx.sampling import SamplingParams
    from ds4_mlx.serve.relay import _fields, _request
    from ds4_mlx.toolgrammar import ToolSpec

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    tools = [ToolSpec("count", {"type": "object", "properties": {"to": {"type": "integer"}}}), ToolSpec("free")]
    for output in (Constraint.make(OutputFormat.build("json_schema", schema, "n", "response_format"), tools),
                   Constraint.make(None, tools), None):
        request = GenerationRequest("hi", 5, SamplingParams(temperature=0.5, seed=3), ("x",), False, True, output)
        assert _request(json.loads(json.dumps(_fields(request)))) == request


@pytest.mark.slow
def test_an_idle_server_outlives_a_short_deadline(tiny: Path, monkeypatch: pytest.MonkeyPatch):
    """Idle for several deadlines, a split server's ranks stay up (rank 0's empty rounds: serve/relay.py)."""
    monkeypatch.setenv("DS4_MLX_SPLIT_TIMEOUT", "2")
    cli = Path(sys.executable).with_name("ds4-mlx")
    with _server([str(LAUNCH), "--backend", "ring", "-n", "2", "--python", sys.executable, "--", str(cli), "serve",
                  "-m", str(tiny), "--no-quant-sim", "--ctx", "512", "--port", "18475"], 18475, idle=10) as post:
        assert post("/v1/completions", {"prompt": "hello", "max_tokens": 4})["choices"][0]["text"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tensor", "layers"])
def test_three_ranks_equal_one_process(tiny: Path, tmp_path: Path, kind: str):
    assert_same(launch(tiny, tmp_path / "three", 3, kind), single(tiny, tmp_path / "one"),
                BOUND if kind == "tensor" else 0.0)


@pytest.mark.slow
def test_simulated_quantisation_ranks_agree(tiny: Path, tmp_path: Path):
    runs = launch(tiny, tmp_path / "two", 2, "tensor", quant="simulated")
    assert_same(runs, runs[0], 0.0)


@pytest.mark.slow
def test_small_layout_tensor_split(tmp_path: Path):
    model = write_model(tmp_path / "small.gguf", "small", experts="mxfp4", vocab="small")
    assert_same(launch(model, tmp_path / "two", 2, "tensor"), single(model, tmp_path / "one"), BOUND)


@dataclass
class Group:
    """A stand-in for an mx.distributed group: a rank and a size."""

    at: int
    n: int

    def rank(self) -> int:
        return self.at

    def size(self) -> int:
        return self.n


def test_shares_follow_weights_and_leave_none_empty():
    assert shares(8, [3, 5], "blocks") == [(0, 3), (3, 8)]
    assert shares(2, [3, 5], "groups") == [(0, 1), (1, 2)]
    assert shares(4, [1, 1, 1], "heads") == [(0, 1), (1, 2), (2, 4)]
    with pytest.raises(SplitError, match="2 groups do not split over 3 ranks"):
        shares(2, [1, 1, 1], "groups")


def test_plan_refuses_what_does_not_split(tiny: Path, tmp_path: Path):
    with open_weights(tiny) as weights:
        with pytest.raises(SplitError, match="needs 2 positive numbers"):
            Split.plan("tensor", Group(0, 2), weights, [1, 2, 3])
        with pytest.raises(SplitError, match="--split must be one of"):
            Split.plan("rows", Group(0, 2), weights)
    q2 = write_model(tmp_path / "q2.gguf", "tiny", experts="q2")
    with open_weights(q2) as weights:  # 256 hidden columns of Q2_K down projections: one block of 256
        with pytest.raises(SplitError, match="1 blocks of 256 expert hidden columns do not split over 2 ranks"):
            Split.plan("tensor", Group(1, 2), weights)


def test_a_rank_reads_its_slices_of_the_file(tiny: Path):
    with open_weights(tiny) as weights:
        for rank in range(3):
            split = Split.plan("tensor", Group(rank, 3), weights)
            sharded = ShardedWeights(weights, split)
            for name, cut in split.cuts().items():
                whole = np.array(weights.array(name))
                if cut.out is not None:
                    whole = whole[..., cut.out[0] : cut.out[1], :] if whole.ndim > 1 else whole
                if cut.cols is not None:
                    whole = whole[..., cut.cols[0] : cut.cols[1]]
                assert np.array_equal(np.array(sharded.array(name)), whole), name
            assert sharded.nbytes < weights.nbytes


def test_prefill_chunks_take_the_shortest_of_the_ranks(monkeypatch):
    """Under a split, every rank prefills a chunk of the length the most constrained rank found (memory.py)."""
    from ds4_mlx import memory
    from ds4_mlx.model.factory import preset_config

    config = preset_config("tiny")
    found: list[int] = []
    monkeypatch.setattr(memory, "_agree", None)
    assert memory.fit_chunk(config, 2048, 0, 1 << 40) == 2048
    memory.agree_chunks(lambda size: found.append(size) or 256)  # another rank has room for 256 tokens only
    try:
        assert memory.fit_chunk(config, 2048, 0, 1 << 40) == 256
    finally:
        memory.agree_chunks(None)
    assert found == [2048]

