"""DeepSeek V4 byte-level BPE tokenizer, built from the vocabulary stored in the GGUF file.

The GGUF carries only `tokenizer.ggml.tokens` (vocab strings by id) and `tokenizer.ggml.merges` ("A B" strings by
rank); its `tokenizer.ggml.pre = "joyai-llm"` just names the pre-tokenizer. The split rules below are copied from
the `pre_tokenizer` section of the V4 `tokenizer.json` and run, with the BPE merges, inside the Rust `tokenizers`
library.

Special tokens follow ds4, not Hugging Face: in rendered chat text exactly seven strings are specials (BOS, EOS,
`<｜User｜>`, `<｜Assistant｜>`, `<think>`, `</think>`, `｜DSML｜`), wherever they appear. Every other added token of
the HF tokenizer (fim, `<|EOT|>`, `<｜latest_reminder｜>`, `<dsml:`, task tokens, placeholders) is plain text here
and goes through BPE, where HF would emit its single id. The two agree on any text free of those other strings.
Nothing is added implicitly (no BOS): the chat renderer writes BOS as text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from tokenizers import Regex
from tokenizers import Tokenizer as _RustTokenizer
from tokenizers import models, pre_tokenizers

from .errors import LayoutError, RequestError

TOKENS_KEY = "tokenizer.ggml.tokens"
MERGES_KEY = "tokenizer.ggml.merges"

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
SPECIALS: tuple[str, ...] = (BOS, EOS, USER, ASSISTANT, THINK, THINK_END, DSML)

# Vocab strings holding this character (all `<｜…｜>` specials and `｜DSML｜`) are not byte-level encoded: ds4 emits
# them as their literal UTF-8 text.
_LITERAL_MARK = "\uff5c"

# Lone surrogates are valid in a Python str but have no UTF-8 form.
_SURROGATES = re.compile("[\ud800-\udfff]")

# The "joyai-llm" pre-tokenizer: the three splits of the V4 tokenizer.json, then the byte-level mapping.
_DIGIT_RUNS = r"\p{N}{1,3}"
_CJK_RUNS = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"  # CJK ideographs, Hiragana, Katakana
# Alternatives of the word split, byte for byte as in tokenizer.json (whose CR and LF are literal characters).
_WORDS = "|".join(
    [
        r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+""",  # one ASCII punctuation mark + ASCII letters
        "[^\r\n" r"\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+",  # letters/marks, led by at most one other non-newline
        " ?" r"[\p{P}\p{S}]+" "[\r\n]*",  # punctuation/symbol runs with trailing newlines
        r"\s*" "[\r\n]+",  # whitespace ending in newlines
        r"\s+(?!\S)",  # whitespace, leaving the last space to the next word
        r"\s+",
    ]
)


def joyai_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """The V4 pre-tokenizer: digit runs of 1-3, CJK/kana runs, the word regex, then bytes to the GPT-2 alphabet."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_DIGIT_RUNS), behavior="isolated", invert=False),
            pre_tokenizers.Split(Regex(_CJK_RUNS), behavior="isolated", invert=False),
            pre_tokenizers.Split(Regex(_WORDS), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes map to themselves, the rest to 256+k."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + k) for k, b in enumerate(shifted)})
    return table


BYTE_TO_CHAR = _byte_alphabet()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


class TokenizerJson(NamedTuple):
    """A Hugging Face `tokenizer.json` in GGUF form: tokens by id (added tokens included), merges as "A B"."""

    tokens: list[str]
    merges: list[str]
    added_ids: frozenset[int]


def read_tokenizer_json(path: str | Path) -> TokenizerJson:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    by_id = {i: t for t, i in data["model"]["vocab"].items()}
    added = {a["id"]: a["content"] for a in data["added_tokens"]}
    by_id.update(added)
    if sorted(by_id) != list(range(len(by_id))):
        raise LayoutError(f"{path} does not assign the ids 0..{len(by_id) - 1} without gaps")
    tokens = [by_id[i] for i in range(len(by_id))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return TokenizerJson(tokens, merges, frozenset(added))


def vocab_from_tokenizer_json(path: str | Path) -> tuple[list[str], list[str]]:
    """(tokens, merges) of a `tokenizer.json`, the two lists a GGUF carries."""
    tokens, merges, _ = read_tokenizer_json(path)
    return tokens, merges


def _string_list(metadata: Mapping[str, Any], key: str) -> list[str]:
    if key not in metadata:
        raise LayoutError(f"GGUF metadata lacks {key!r}: expected the tokenizer's string array")
    value = metadata[key]
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise LayoutError(f"GGUF key {key!r} must be an array of strings, got {type(value).__name__}")
    strings = list(value)
    bad = next((i for i, s in enumerate(strings) if not isinstance(s, str)), None)
    if bad is not None:
        raise LayoutError(f"GGUF key {key!r} must be an array of strings; entry {bad} is {type(strings[bad]).__name__}")
    return strings


def _split_merge(rank: int, merge: str) -> tuple[str, str]:
    # Like llama.cpp, split at the first space after the first character, so a left part may itself start with one.
    cut = merge.find(" ", 1)
    if cut < 0:
        raise LayoutError(f"{MERGES_KEY}[{rank}] = {merge!r} is not of the form 'A B'")
    return merge[:cut], merge[cut + 1 :]


class Tokenizer:
    """Encodes text to DeepSeek V4 token ids and back, with ds4's handling of the seven chat specials."""

    def __init__(self, tokens: list[str], merges: list[str]) -> None:
        if not tokens:
            raise LayoutError(f"{TOKENS_KEY} is empty: expected the model's vocabulary")
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != len(tokens):
            dup = next(t for i, t in enumerate(tokens) if vocab[t] != i)
            raise LayoutError(f"{TOKENS_KEY} holds {dup!r} more than once: expected distinct vocab strings")
        missing = [s for s in SPECIALS if s not in vocab]
        if missing:
            raise LayoutError(f"{TOKENS_KEY} lacks the special token(s) {', '.join(map(repr, missing))}")
        lacking_bytes = [b for b, c in BYTE_TO_CHAR.items() if c not in vocab]
        if lacking_bytes:
            raise LayoutError(
                f"{TOKENS_KEY} lacks {len(lacking_bytes)} of the 256 byte-level symbols "
                f"(first: byte 0x{lacking_bytes[0]:02x} = {BYTE_TO_CHAR[lacking_bytes[0]]!r}): "
                "expected a GPT-2 byte-level BPE vocabulary"
            )
        pairs = [_split_merge(rank, m) for rank, m in enumerate(merges)]
        try:
            bpe = models.BPE(vocab=vocab, merges=pairs)
        except Exception as e:  # tokenizers raises a bare Exception for a merge outside the vocab
            raise LayoutError(f"{MERGES_KEY} does not fit {TOKENS_KEY}: {e}") from e
        self._bpe = _RustTokenizer(bpe)
        self._bpe.pre_tokenizer = joyai_pre_tokenizer()

        self._tokens = list(tokens)
        self._bytes = [self._vocab_bytes(t) for t in tokens]
        self._max_bytes = max(map(len, self._bytes))
        self._special_ids = {s: vocab[s] for s in SPECIALS}
        longest_first = sorted(SPECIALS, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, longest_first)))

    @classmethod
    def from_gguf(cls, source: Any) -> Tokenizer:
        """Build from a GGUF file object (anything with `.metadata`) or directly from its metadata mapping."""
        metadata = getattr(source, "metadata", source)
        if not isinstance(metadata, Mapping):
            raise TypeError(f"expected a GGUF file or its metadata mapping, got {type(source).__name__}")
        return cls(_string_list(metadata, TOKENS_KEY), _string_list(metadata, MERGES_KEY))

    @staticmethod
    def _vocab_bytes(token: str) -> bytes:
        if _LITERAL_MARK in token:
            return token.encode("utf-8")
        try:
            return bytes(CHAR_TO_BYTE[c] for c in token)
        except KeyError:  # outside the byte alphabet (no such V4 token lacks U+FF5C): its own UTF-8 text
            return token.encode("utf-8")

    # -- encoding ------------------------------------------------------------------------------------------------

    def encode(self, text: str, specials: bool = True) -> list[int]:
        """Token ids of `text`. With `specials`, the seven chat specials become their ids wherever they occur
        (ds4 does no escaping); without, everything is plain BPE (ds4's system text and CLI prompt path).

        Lone surrogates, which have no UTF-8 form, are encoded as U+FFFD.
        """
        text = _SURROGATES.sub("\ufffd", text)
        if not specials:
            return self._bpe_ids([text])[0]
        pieces, specials_between = [], []
        start = 0
        for m in self._special_re.finditer(text):
            pieces.append(text[start : m.start()])
            specials_between.append(self._special_ids[m.group()])
            start = m.end()
        pieces.append(text[start:])
        ids: list[int] = []
        for piece_ids, special in zip(self._bpe_ids(pieces), [*specials_between, None]):
            ids += piece_ids
            if special is not None:
                ids.append(special)
        return ids

    def _bpe_ids(self, pieces: list[str]) -> list[list[int]]:
        """BPE of each piece, through `encode_batch`, which (unlike `encode`) releases the GIL while it works: a
        long prompt tokenized on one thread must not stall the server's event loop and its other requests."""
        todo = [p for p in pieces if p]
        encoded = iter(self._bpe.encode_batch(todo, add_special_tokens=False) if todo else [])
        return [next(encoded).ids if p else [] for p in pieces]

    # -- decoding ------------------------------------------------------------------------------------------------

    @property
    def max_token_bytes(self) -> int:
        """The most bytes one token spells (128 in V4's vocabulary): a text of B bytes needs at least
        B / max_token_bytes tokens, which bounds a prompt's length before it is tokenized."""
        return self._max_bytes

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (specials: their literal UTF-8 text)."""
        i = int(token_id)
        if not 0 <= i < len(self._bytes):
            raise RequestError(f"token id {i} is outside the vocabulary (0..{len(self._bytes) - 1})")
        return self._bytes[i]

    def token_text(self, token_id: int) -> str:
        """The raw vocab string of a token, in byte-level form (e.g. `Ġthe` for " the")."""
        i = int(token_id)
        if not 0 <= i < len(self._tokens):
            raise RequestError(f"token id {i} is outside the vocabulary (0..{len(self._tokens) - 1})")
        return self._tokens[i]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of a token sequence; bytes that are not valid UTF-8 become U+FFFD."""
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def token_id(self, text: str) -> int | None:
        """The id whose vocab string is exactly `text`, if any."""
        return self._bpe.token_to_id(text)

    # -- vocabulary ----------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def bos_id(self) -> int:
        return self._special_ids[BOS]

    @property
    def eos_id(self) -> int:
        return self._special_ids[EOS]

    @property
    def user_id(self) -> int:
        return self._special_ids[USER]

    @property
    def assistant_id(self) -> int:
        return self._special_ids[ASSISTANT]

    @property
    def think_id(self) -> int:
        return self._special_ids[THINK]

    @property
    def think_end_id(self) -> int:
        return self._special_ids[THINK_END]

    @property
    def dsml_id(self) -> int:
        return self._special_ids[DSML]


def utf8(text: str) -> bytes:
    """The UTF-8 bytes the tokenizer sees for `text` (lone surrogates, which have none, as U+FFFD)."""
    return _SURROGATES.sub("\ufffd", text).encode("utf-8")


def _pending_prefix(buf: bytes) -> int:
    """How many trailing bytes of `buf` are a proper prefix of a well-formed UTF-8 character (0 to 3).

    Uses the exact second-byte ranges of Unicode's table of well-formed sequences, so a tail such as ED A0 (a
    surrogate) or F4 90 (past U+10FFFF), which no further byte can complete, is not held back.
    """
    for n in (1, 2, 3):
        if len(buf) < n:
            return 0
        lead = buf[-n]
        if 0x80 <= lead <= 0xBF:
            continue
        need = 2 if 0xC2 <= lead <= 0xDF else 3 if 0xE0 <= lead <= 0xEF else 4 if 0xF0 <= lead <= 0xF4 else 1
        if need <= n:
            return 0
        if n >= 2:
            low, high = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}.get(
                lead, (0x80, 0xBF)
            )
            if not low <= buf[-n + 1] <= high:
                return 0
        return n
    return 0


class StreamDecoder:
    """Turns token ids, one at a time, into text that is safe to show.

    A character whose UTF-8 bytes span several tokens is emitted once complete. Bytes that no continuation could
    make valid are emitted as U+FFFD as soon as that is certain, so a bad byte never holds back later text. The
    concatenation of every `feed` and the final `flush` equals `Tokenizer.decode` of the whole sequence.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._pending = b""

    def feed(self, token_id: int) -> str:
        """Text completed by this token (possibly empty)."""
        buf = self._pending + self._tokenizer.token_bytes(token_id)
        cut = len(buf) - _pending_prefix(buf)
        self._pending = buf[cut:]
        return buf[:cut].decode("utf-8", errors="replace")

    def flush(self) -> str:
        """End of stream: an unfinished character becomes U+FFFD. The decoder is then ready for a new stream."""
        text = self._pending.decode("utf-8", errors="replace")
        self._pending = b""
        return text
