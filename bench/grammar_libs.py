"""Token-mask cost of three grammar libraries at DeepSeek V4's vocabulary (129,280 tokens).

Each library gets the demo model's real tokenizer (the byte string of every token id), compiles one JSON schema
(nested objects, enums, arrays, optional fields, `$ref`), then walks the same token sequence, a valid document
tokenized as the model would write it: at every step it computes the mask of allowed next tokens and consumes the
token. Reported per library: time to build the tokenizer side, to compile the schema, and the mask computation per
token (median and mean, µs). A library that is not installed is skipped.

    python bench/grammar_libs.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

SCHEMA = {
    "$defs": {
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "home": {"$ref": "#/$defs/address"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "scores": {"type": "array", "items": {"type": "number"}},
        "nickname": {"type": "string"},
    },
    "required": ["name", "age", "role", "home", "tags"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace", "age": 36, "role": "admin",
    "home": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
    "tags": ["mathematics", "analytical engine", "poetry"], "scores": [9.5, 10, 8.25],
}


def vocabulary() -> tuple[list[bytes], int, list[int]]:
    """The demo model's token bytes, its EOS id and the ids of its special tokens."""
    from ds4_mlx.engine import ensure_demo_model
    from ds4_mlx.model.weights import open_weights
    from ds4_mlx.tokenizer import SPECIALS, Tokenizer

    tok = Tokenizer.from_gguf(open_weights(ensure_demo_model()).file.metadata)
    return [tok.token_bytes(i) for i in range(tok.vocab_size)], tok.eos_id, [tok.token_id(s) for s in SPECIALS], tok


def run_llguidance(tokens: list[bytes], eos: int, specials: list[int], walk: list[int], tok) -> dict:
    import llguidance
    import llguidance.numpy as lnp

    class Wrap:
        eos_token_id, bos_token_id = eos, None

        def __init__(self) -> None:
            self.tokens = tokens
            self.special_token_ids = specials

        def __call__(self, s: bytes) -> list[int]:
            return tok.encode(s.decode("utf-8", "replace"), specials=False)

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrap()))
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    matcher = llguidance.LLMatcher(lltok, grammar)
    assert not matcher.is_error(), matcher.get_error()
    t2 = time.perf_counter()
    mask = lnp.allocate_token_bitmask(1, len(tokens))
    times = []
    for token in walk:
        s = time.perf_counter()
        lnp.fill_next_token_bitmask(matcher, mask)
        times.append(time.perf_counter() - s)
        assert (mask[0, token // 32] >> (token % 32)) & 1, "the walk's token is refused"
        assert matcher.consume_token(token), matcher.get_error()
    assert matcher.is_accepting()
    return {"tokenizer_s": t1 - t0, "compile_s": t2 - t1, "mask_us": times}


def run_xgrammar(tokens: list[bytes], eos: int, specials: list[int], walk: list[int], tok) -> dict:
    import xgrammar

    t0 = time.perf_counter()
    info = xgrammar.TokenizerInfo(tokens, xgrammar.VocabType.RAW, vocab_size=len(tokens), stop_token_ids=[eos])
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
    matcher = xgrammar.GrammarMatcher(compiled)
    t2 = time.perf_counter()
    mask = xgrammar.allocate_token_bitmask(1, len(tokens))
    times = []
    for token in walk:
        s = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - s)
        assert matcher.accept_token(token)
    return {"tokenizer_s": t1 - t0, "compile_s": t2 - t1, "mask_us": times}


def run_outlines(tokens: list[bytes], eos: int, specials: list[int], walk: list[int], tok) -> dict:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in enumerate(tokens):
        if i != eos and i not in specials and b:
            by_bytes.setdefault(b, []).append(i)
    vocab = outlines_core.Vocabulary(eos, by_bytes)
    t1 = time.perf_counter()
    regex = build_regex_from_schema(json.dumps(SCHEMA))
    index = outlines_core.Index(regex, vocab)
    guide = outlines_core.Guide(index)
    t2 = time.perf_counter()
    mask = np.zeros((len(tokens) + 31) // 32, dtype=np.int32)
    times = []
    for token in walk:
        s = time.perf_counter()
        guide.write_mask_into(mask.ctypes.data, mask.size, 4)
        times.append(time.perf_counter() - s)
        guide.advance(token)
    return {"tokenizer_s": t1 - t0, "compile_s": t2 - t1, "mask_us": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=["llguidance", "xgrammar", "outlines-core"])
    args = ap.parse_args()
    tokens, eos, specials, tok = vocabulary()
    walk = tok.encode(json.dumps(DOCUMENT), specials=False)  # ", " and ": ", as each library writes JSON
    print(f"vocabulary {len(tokens)} tokens; walk of {len(walk)} tokens")
    runners = {"llguidance": run_llguidance, "xgrammar": run_xgrammar, "outlines-core": run_outlines}
    for name in args.only:
        try:
            results = [runners[name](tokens, eos, specials, walk, tok) for _ in range(args.repeats)]
        except ImportError as exc:
            print(f"{name}: not installed ({exc})")
            continue
        masks = [t * 1e6 for r in results for t in r["mask_us"]]
        print(f"{name}: tokenizer {min(r['tokenizer_s'] for r in results):.2f} s, schema "
              f"{min(r['compile_s'] for r in results) * 1e3:.1f} ms, mask median {statistics.median(masks):.0f} µs, "
              f"mean {statistics.mean(masks):.0f} µs, p95 {np.percentile(masks, 95):.0f} µs")


if __name__ == "__main__":
    main()
