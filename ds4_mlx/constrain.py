"""Constrained decoding: an answer held to a JSON schema (or to any JSON object), through llguidance.

A request's format and strict tools become one grammar (`OutputFormat`, `Constraint`), checked when the request is
read, so that a schema the library cannot take is the client's 400 before anything is queued. Each generation then
drives a `TokenMask`:

- in thinking mode the reasoning is free; the grammar starts after the `</think>` token;
- before each token is chosen, `apply` sets every logit the grammar refuses to -inf (greedy and sampled decoding
  alike choose from what is left), and `advance` consumes the chosen token;
- the next mask is computed on a helper thread, started by `advance` as soon as the token is known, so that it runs
  on the CPU while the model computes the next logits; `apply` waits for it. llguidance drops the GIL while it works.
  Greedy decoding passes `apply` to `Session.feed_chosen`, which chooses on the device and feeds the token before
  the host reads it back, as free greedy decoding does.

Why llguidance (bench/grammar_libs.py, bench/RESULTS.md): at this vocabulary of 129,280 tokens its mask costs ~17 µs
a token (median), next to 10-100 ms of a decode step; a schema compiles in ~1 ms, so per-request schemas cost
nothing (outlines-core builds an index per schema: ~0.4 s); it has no dependencies and ships abi3 wheels for Linux
x86_64 / aarch64 and macOS arm64 (xgrammar, with the lowest mask cost, ~3 µs, requires torch, triton and
transformers); and it names what it cannot take in a schema, which becomes the 400's message.

With tools offered, the answer is either the formatted answer or a tool-call block (the model chooses). Inside the
block, the calls of tools declared strict are held to their parameters' schemas (toolgrammar.py); without strict
tools the block is not held. Strict tools without a format leave the text before a block free.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
import mlx.core as mx
import numpy as np

from .errors import RequestError
from .tokenizer import ASSISTANT, BOS, EOS, THINK, THINK_END, USER, Tokenizer
from .toolgrammar import BLOCK_START, ToolSpec, lit, regex, tool_rules

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON is written as Python's json.dumps writes it: no free whitespace, which a model could repeat without end."""

_BARE_SPECIALS = (BOS, EOS, USER, ASSISTANT, THINK, THINK_END)
"""Specials llguidance must never let text spell. The DSML marker is not among them: the tool branch spells it."""


class SchemaError(RequestError):
    """A format the grammar library cannot take; `param` names the request field it came from."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class OutputFormat:
    """What an answer must be: `kind` "json_object" (any JSON object) or "json_schema" (`schema`), `name` as the
    client named it; `rule` is its Lark rule body (`%json {...}`), checked by llguidance when built."""

    kind: str
    schema: dict[str, Any]
    name: str
    rule: str

    @classmethod
    def json_object(cls) -> OutputFormat:
        return cls.build("json_object", {"type": "object"}, "", "response_format")

    @classmethod
    def build(cls, kind: str, schema: Any, name: str, param: str) -> OutputFormat:
        """Compiles `schema` (the client's JSON Schema) and checks it; raises SchemaError naming `param` and the part
        of the schema the library refused."""
        if not isinstance(schema, dict):
            raise SchemaError(f"invalid request: {param} must be a JSON Schema object", param)
        answer = copy.deepcopy(schema)
        answer["x-guidance"] = {**JSON_OPTIONS, **(schema.get("x-guidance") or {})}
        try:
            rule = f"%json {json.dumps(answer, ensure_ascii=False, allow_nan=False)}"
        except ValueError as exc:
            raise SchemaError(f"invalid request: {param}: {exc}", param) from exc
        checked = llguidance.LLMatcher.grammar_from_json_schema(answer)  # its messages quote the schema alone
        _check(checked, schema, param)
        _check(llguidance.LLMatcher.grammar_from_lark(f"start: answer\nanswer: {rule}\n"), schema, param)
        return cls(kind, schema, name, rule)


@dataclass(frozen=True)
class Constraint:
    """What a request's output is held to: the answer's format, the calls of strict tools, or both. `grammar` is
    for a generation with the tools offered, `answer_only` for one without (tool_choice "none" drops them)."""

    answer: OutputFormat | None
    tools: tuple[ToolSpec, ...]
    grammar: str
    answer_only: str | None

    @classmethod
    def make(cls, answer: OutputFormat | None, tools: Sequence[ToolSpec], params: Sequence[str] = ()
             ) -> Constraint | None:
        """None when nothing is held (no format, no strict tool). A strict tool's schema the library cannot take
        raises SchemaError naming the tool and `params[i]` (its field in the request)."""
        tools = tuple(tools)
        strict = [i for i, t in enumerate(tools) if t.parameters is not None]
        if answer is None and not strict:
            return None
        for i in strict:
            where = params[i] if i < len(params) else f"tools[{i}]"
            what = f"the strict tool {tools[i].name!r}"
            schema = {**tools[i].parameters, "x-guidance": JSON_OPTIONS}  # the clean messages of the schema alone
            _check(llguidance.LLMatcher.grammar_from_json_schema(schema), tools[i].parameters, where, what)
            lark = f"start: calls\n{tool_rules([tools[i]])}"
            _check(llguidance.LLMatcher.grammar_from_lark(lark), tools[i].parameters, where, what)
        rules = tool_rules(tools) if strict else ""
        if answer is None:
            lark = f"start: free_text calls | plain\nplain: {_lark_regex('')}\n{rules}"
        elif strict:
            lark = f"start: answer | block\nanswer: {answer.rule}\nblock: {lit(BLOCK_START)} calls\n{rules}"
        elif tools:
            lark = f"start: answer | block\nanswer: {answer.rule}\nblock: {_lark_regex(BLOCK_START)}\n"
        else:
            lark = f"start: answer\nanswer: {answer.rule}\n"
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        _check(grammar, answer.schema if answer else {}, "tools")
        only = None
        if answer is not None:
            only = llguidance.LLMatcher.grammar_from_lark(f"start: answer\nanswer: {answer.rule}\n")
        return cls(answer, tools, grammar, only)

    def start(self, tokenizer: Tokenizer, thinking: bool, tools_active: bool = False) -> TokenMask | None:
        """The per-generation state, free until `</think>` when `thinking`; None when nothing is held (strict tools
        whose offer was withdrawn)."""
        grammar = self.grammar if tools_active else self.answer_only
        return TokenMask(grammar, tokenizer, thinking) if grammar is not None else None


def _check(grammar: str, schema: Any, param: str, what: str = "the schema") -> None:
    """Raises SchemaError when llguidance refuses `grammar`, naming `param`, the part of `schema` and the reason."""
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        message = messages[0] if messages else "refused"
        raise SchemaError(f"invalid request: {param}{_where(schema, message)}: {what} is not supported for "
                          f"constrained decoding: {message}", param)


def _lark_regex(literal: str) -> str:
    """A Lark regex that matches `literal` and then anything (held no further)."""
    return regex(re.escape(literal).replace("\\\n", "\\n") + "(?s:.*)")


def _where(schema: Any, message: str) -> str:
    """` at PATH` for the first part of `schema` that the library's message names (a quoted key, a type after a
    colon, a `$ref` target, a pattern on a line of its own), else "": llguidance says what it refused, not where."""
    words = re.findall(r"[\"'`]([^\"'`\n]+)[\"'`]", message) + re.findall(r": (\S+)$", message.split("\n")[0])
    words += [line.strip() for line in message.splitlines()[1:] if line.strip()]  # a regex quoted on its own line
    for word in words:
        path = _find(schema, word.lstrip("#"), "")
        if path is not None:
            return f" at {path or '/'}"
    return ""


def _find(value: Any, needle: str, path: str) -> str | None:
    """The JSON pointer of the first key or string value equal to `needle` (a `$ref` value ending with it)."""
    if isinstance(value, dict):
        for key, item in value.items():
            here = f"{path}/{key}"
            if key == needle or (isinstance(item, str) and (item == needle or (key == "$ref" and
                                                                                 item.endswith(needle)))):
                return here
            found = _find(item, needle, here)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _find(item, needle, f"{path}/{i}")
            if found is not None:
                return found
    return None


_TOKENIZERS: dict[int, tuple[Tokenizer, llguidance.LLTokenizer]] = {}
_TOKENIZERS_LOCK = threading.Lock()


def grammar_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer` (the bytes of every id; ~0.25 s at 129,280 ids), built once per tokenizer.

    Its encoder is the model's own, which llguidance uses to tokenize text the grammar forces: a forced string is
    then written in the tokens the model itself would use."""
    with _TOKENIZERS_LOCK:
        known = _TOKENIZERS.get(id(tokenizer))
        if known is not None and known[0] is tokenizer:
            return known[1]

        class View:
            eos_token_id = tokenizer.eos_id
            bos_token_id = tokenizer.bos_id
            tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
            special_token_ids = [tokenizer.token_id(s) for s in _BARE_SPECIALS]

            def __call__(self, text: bytes) -> list[int]:
                # specials on: forced DSML tags are spelled with the DSML token, as the model writes them
                return tokenizer.encode(text.decode("utf-8", "replace"), specials=True)

        built = llguidance.LLTokenizer(llguidance.TokenizerWrapper(View()))
        _TOKENIZERS[id(tokenizer)] = (tokenizer, built)
        return built


_POOL = ThreadPoolExecutor(1, thread_name_prefix="ds4-mlx-mask")
"""Computes masks beside the model's step. One thread: the engine decodes one stream at a time."""


class TokenMask:
    """One generation's grammar state: which tokens may come next, and the tokens chosen so far."""

    def __init__(self, grammar: str, tokenizer: Tokenizer, thinking: bool) -> None:
        self.matcher = llguidance.LLMatcher(grammar_tokenizer(tokenizer), grammar, log_level=0)
        self.think_end = tokenizer.think_end_id
        self.eos = tokenizer.eos_id
        self.active = not thinking
        self.words = (tokenizer.vocab_size + 31) // 32
        self.seconds = 0.0
        """Time spent computing masks (on the helper thread)."""
        self.masks = 0
        self._next: Future[np.ndarray] | None = None
        if self.active:
            self._start()

    def _start(self) -> None:
        self._next = _POOL.submit(self._compute)

    def _compute(self) -> np.ndarray:
        t0 = time.perf_counter()
        bits = np.zeros(self.words, dtype=np.int32)
        if self.matcher.is_error():
            bits[self.eos // 32] = 1 << (self.eos % 32)  # a grammar that cannot go on ends the answer
        else:
            self.matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        self.seconds += time.perf_counter() - t0
        self.masks += 1
        return bits

    def allowed(self) -> np.ndarray | None:
        """The bitmask (one bit per token id, little-endian in int32 words) of what may come next; None while free."""
        if not self.active:
            return None
        if self._next is None:
            self._start()
        bits, self._next = self._next.result(), None
        return bits

    def apply(self, logits: mx.array) -> mx.array:
        """`logits` with every refused token at -inf (unchanged while the reasoning runs)."""
        bits = self.allowed()
        if bits is None:
            return logits
        logits = logits.reshape(-1)
        keep = (mx.array(bits)[:, None] >> mx.arange(32, dtype=mx.int32)) & 1
        keep = keep.reshape(-1)[: logits.size]
        if keep.size < logits.size:  # ids beyond the tokenizer's vocabulary (padding) are never allowed
            keep = mx.concatenate([keep, mx.zeros(logits.size - keep.size, dtype=keep.dtype)])
        return mx.where(keep.astype(mx.bool_), logits, -mx.inf)

    def advance(self, token: int) -> None:
        """Consumes the chosen token and starts computing the next mask; `</think>` starts the grammar."""
        if not self.active:
            if token == self.think_end:
                self.active = True
                self._start()
            return
        if self._next is not None:  # never used: let it finish before the matcher moves on
            self._next.result()
            self._next = None
        self.matcher.consume_token(token)
        self._start()
