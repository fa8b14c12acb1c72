"""What `/v1/models` says about the served model: limits, thinking, and which DeepSeek V4 Flash checkpoint it is.

The checkpoint is read from the GGUF's metadata, as far as it tells: the preview and 0731 files have the same
tensors and the same keys (no version key exists); they differ in the importance matrix named in
`quantize.imatrix.file` (0731's is `…DeepSeek-V4-Flash-0731-…`) and its `quantize.imatrix.chunks_count` (202,100
for 0731, 90,042 for the preview). A file without those keys (the MXFP4 conversions, a re-quantization, the demo
model) is "unknown", and the card says so rather than guessing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..model.config import FLASH

if TYPE_CHECKING:
    from ..engine import Engine

IMATRIX_FILE = "quantize.imatrix.file"
IMATRIX_CHUNKS = "quantize.imatrix.chunks_count"
CHUNKS = {202100: "0731", 90042: "preview"}
EFFORTS = ("none", "low", "medium", "high", "max")
"""The reasoning efforts a request may ask for (`none` turns thinking off; `max` needs --ctx 393216 or more)."""
THINKING_BY_ALIAS = {"deepseek-chat": False, "deepseek-reasoner": True}
"""What an alias chooses when the request says nothing; any other name thinks."""


@dataclass(frozen=True)
class ModelCard:
    """The served model's facts: its file's name, checkpoint and why, the trained and served context, the output
    limit of a request that sets none."""

    name: str
    checkpoint: str
    checkpoint_basis: str
    trained_context: int
    ctx: int
    max_output: int

    @property
    def max_completion_tokens(self) -> int:
        return min(self.max_output, self.ctx)


def checkpoint(metadata: Mapping[str, Any]) -> tuple[str, str]:
    """("0731" | "preview" | "unknown", what told it) from a GGUF's metadata."""
    name = str(metadata.get("general.name", ""))
    imatrix = str(metadata.get(IMATRIX_FILE, ""))
    if "0731" in name or "0731" in imatrix:
        return "0731", f"{'general.name' if '0731' in name else IMATRIX_FILE} names 0731"
    chunks = metadata.get(IMATRIX_CHUNKS)
    if chunks in CHUNKS:
        return CHUNKS[chunks], f"{IMATRIX_CHUNKS} = {chunks}"
    return "unknown", "the GGUF has no key that tells the preview from 0731 (no importance-matrix record)"


def model_card(engine: Engine) -> ModelCard:
    """The card of the engine's model; a model without a file (a test double) has an unknown checkpoint."""
    metadata = engine.file_facts
    config = getattr(engine.model, "config", None)
    trained = (getattr(config, "context_length", 0) or FLASH.context_length)
    which, basis = checkpoint(metadata)
    return ModelCard(str(metadata.get("general.name", "DeepSeek V4 Flash")), which, basis, trained, engine.ctx,
                     engine.default_max_tokens)
