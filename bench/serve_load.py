"""Several agents on one server: N concurrent streamed requests, per-request time to first token and t/s.

    python bench/serve_load.py --streams 4 -- --synthetic-free-args...   (starts `ds4-mlx serve` with the args after --)
    python bench/serve_load.py --url http://127.0.0.1:8000 --streams 4     (a server already running)

Each request is agent-like: one long system prompt shared by all (`--system-tokens`, the built-in text repeated),
then a user turn of its own, streamed through /v1/chat/completions at temperature 0 without thinking, answering
`--tokens` tokens. With `--join-tokens N`, one more request with an N-token prompt of its own arrives `--join-after`
seconds after the others started: the streams already decoding then wait for its prefill chunks, and the largest
gap between two of their tokens while it prefills is the stall it caused (batch.py caps those chunks).

Per request: time to first token, decode t/s after it, the largest gap between two tokens; in all: the tokens of
every stream over the wall time from the first request to the last token. `--json` prints one object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

TEXT = ("The river came down from the hills in three long bends before it reached the town, and in each bend the "
        "water changed its voice. ")
QUESTIONS = ("List the files you would read first.", "Write a test for the parser.", "Explain the build error.",
             "Rename the module and fix the imports.", "Summarize the design document.", "Find the slow query.",
             "Review the last commit.", "Plan the migration in steps.")


@dataclass
class Stream:
    """One request's timings: when it was sent, when each token arrived."""

    name: str
    sent: float = 0.0
    arrivals: list[float] = field(default_factory=list)
    error: str = ""

    def figures(self) -> dict:
        if not self.arrivals:
            return {"name": self.name, "tokens": 0, "error": self.error or "no tokens"}
        gaps = [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]
        decode = self.arrivals[-1] - self.arrivals[0]
        return {"name": self.name, "tokens": len(self.arrivals), "ttft_s": round(self.arrivals[0] - self.sent, 3),
                "decode_tps": round((len(self.arrivals) - 1) / decode, 2) if decode > 0 else None,
                "max_gap_s": round(max(gaps), 3) if gaps else None, "error": self.error}


def ask(client: httpx.Client, stream: Stream, system: str, user: str, tokens: int) -> None:
    body = {"model": "deepseek-v4-flash", "stream": True, "max_tokens": tokens, "temperature": 0, "think": False,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    stream.sent = time.perf_counter()
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                stream.error = f"HTTP {reply.status_code}: {reply.read()[:200]!r}"
                return
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"] if json.loads(line[6:])["choices"] else {}
                if delta.get("content") or delta.get("reasoning_content"):
                    stream.arrivals.append(time.perf_counter())
    except httpx.HTTPError as e:
        stream.error = str(e)


def wait_ready(url: str, server: subprocess.Popen | None, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server is not None and server.poll() is not None:
            sys.exit(f"serve_load: the server exited with {server.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    sys.exit(f"serve_load: no server answered at {url} within {seconds:.0f} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (else one is started with the arguments after --)")
    p.add_argument("--port", type=int, default=8765, help="the started server's port (default 8765)")
    p.add_argument("--streams", type=int, default=4, help="concurrent requests (default 4)")
    p.add_argument("--system-tokens", type=int, default=2000, help="length of the shared system prompt, about")
    p.add_argument("--tokens", type=int, default=128, help="tokens each request answers (default 128)")
    p.add_argument("--join-tokens", type=int, default=0, help="one more request with a prompt this long, late")
    p.add_argument("--join-after", type=float, default=2.0, help="seconds after the others it arrives")
    p.add_argument("--json", action="store_true")
    args, serve_args = p.parse_known_args()
    serve_args = [a for a in serve_args if a != "--"]
    server = None
    url = args.url or f"http://127.0.0.1:{args.port}"
    if args.url is None:
        server = subprocess.Popen([sys.executable, "-m", "ds4_mlx.cli", "serve", "--port", str(args.port),
                                   "--parallel", str(args.streams + bool(args.join_tokens)), *serve_args],
                                  start_new_session=True)  # a lane for the late request too: it must not queue
    try:
        wait_ready(url, server, 1800)
        system = TEXT * max(1, args.system_tokens // 25)
        streams = [Stream(f"agent {i}") for i in range(args.streams)]
        with httpx.Client(base_url=url, timeout=3600) as client:
            ask(client, Stream("warm"), system, "Say hello.", 4)  # the shared prefix prefilled once, kernels warm
            threads = [threading.Thread(target=ask, args=(client, s, system, QUESTIONS[i % len(QUESTIONS)],
                                                          args.tokens)) for i, s in enumerate(streams)]
            start = time.perf_counter()
            for t in threads:
                t.start()
            joined = None
            if args.join_tokens:
                time.sleep(args.join_after)
                joined = Stream(f"join {args.join_tokens}")
                streams.append(joined)
                threads.append(threading.Thread(target=ask, args=(client, joined, TEXT * (args.join_tokens // 25),
                                                                  "Summarize.", 16)))
                threads[-1].start()
            for t in threads:
                t.join()
        end = max((s.arrivals[-1] for s in streams if s.arrivals), default=start)
        rows = [s.figures() for s in streams]
        total = sum(r["tokens"] for r in rows)
        summary = {"streams": args.streams, "aggregate_tps": round(total / (end - start), 2) if end > start else None,
                   "requests": rows}
        if joined is not None and joined.arrivals:
            during = [b - a for s in streams if s is not joined
                      for a, b in zip(s.arrivals, s.arrivals[1:]) if joined.sent <= b <= joined.arrivals[0]]
            summary["stall_s"] = round(max(during), 3) if during else None
            summary["join_ttft_s"] = rows[-1]["ttft_s"]
        if args.json:
            print(json.dumps(summary))
        else:
            for r in rows:
                print(f"{r['name']:>12}: {r['tokens']} tokens, ttft {r.get('ttft_s')} s, {r.get('decode_tps')} t/s, "
                      f"largest gap {r.get('max_gap_s')} s {r['error']}")
            tps = [r["decode_tps"] for r in rows if r.get("decode_tps")]
            print(f"aggregate {summary['aggregate_tps']} t/s over {args.streams} streams"
                  + (f", median per stream {statistics.median(tps):.2f} t/s" if tps else "")
                  + (f"; the join's prefill stalled the others {summary.get('stall_s')} s at most" if joined else ""))
        return 0 if all(not r["error"] for r in rows) else 1
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGINT)
            server.wait(60)


if __name__ == "__main__":
    sys.exit(main())
