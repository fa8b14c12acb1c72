"""What `/v1/models` says about the served model: limits, thinking, and which DeepSeek V4 Flash checkpoint it is.

The checkpoint is the engine's (model/checkpoint.py: told from the file or given by `--checkpoint`), with what
told it, so that a client sees when it was assumed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..model.config import FLASH

if TYPE_CHECKING:
    from ..engine import Engine

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


def model_card(engine: Engine) -> ModelCard:
    """The card of the engine's model."""
    metadata = engine.file_facts
    config = getattr(engine.model, "config", None)
    trained = (getattr(config, "context_length", 0) or FLASH.context_length)
    return ModelCard(str(metadata.get("general.name", "DeepSeek V4 Flash")), engine.checkpoint.value,
                     engine.checkpoint_basis, trained, engine.ctx, engine.default_max_tokens)
