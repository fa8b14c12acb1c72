"""Which DeepSeek V4 Flash checkpoint a GGUF holds: the April preview or the 0731 post-training.

The two have the same architecture, the same 1,328 tensors and the same metadata keys; no key names the version.
What differs is the prompt: 0731 moved the reasoning-effort tiers down one step (chat.py `effort_prefix`), so a file
must be known before its first prompt is rendered. The rule, first match wins:

1. `--checkpoint preview|0731` (the user knows best);
2. "0731" in `general.name`, in the importance matrix's file name (`quantize.imatrix.file`, 0731's is
   `…DeepSeek-V4-Flash-0731-…`) or in the file's name (every published 0731 file ends `-0731.gguf`);
3. `quantize.imatrix.chunks_count`: 202,100 for 0731's importance matrix, 90,042 for the preview's;
4. MXFP4 routed experts: only 0731 was published that way (the lossless repacking of its released FP4 weights);
5. otherwise the preview, the checkpoint of every file published before 0731 (the start-up log says so, and how to
   override it).

Sources: the published file names and keys as the C engine's download script and readers give them
(github.com/antirez/ds4), DeepSeek's 0731 encoding notes for the tiers.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .gguf import GGMLType

IMATRIX_FILE = "quantize.imatrix.file"
IMATRIX_CHUNKS = "quantize.imatrix.chunks_count"
FACT_KEYS = ("general.name", IMATRIX_FILE, IMATRIX_CHUNKS)
"""The metadata keys the rule reads (kept by the engine for the model card)."""
_CHUNKS = {202100: "0731", 90042: "preview"}


class Checkpoint(enum.Enum):
    PREVIEW = "preview"
    V0731 = "0731"


def detect(metadata: Mapping[str, Any], path: str | Path | None = None,
           expert_types: tuple[GGMLType, ...] = ()) -> tuple[Checkpoint, str]:
    """The checkpoint a file holds by the rule above (without the flag), and what told it."""
    name = str(metadata.get("general.name", ""))
    imatrix = str(metadata.get(IMATRIX_FILE, ""))
    if "0731" in name:
        return Checkpoint.V0731, "general.name names 0731"
    if "0731" in imatrix:
        return Checkpoint.V0731, f"{IMATRIX_FILE} names 0731"
    if path is not None and "0731" in Path(path).name:
        return Checkpoint.V0731, "the file's name says 0731"
    chunks = metadata.get(IMATRIX_CHUNKS)
    if chunks in _CHUNKS:
        return Checkpoint(_CHUNKS[chunks]), f"{IMATRIX_CHUNKS} = {chunks}"
    if GGMLType.MXFP4 in expert_types:
        return Checkpoint.V0731, "MXFP4 routed experts (published for 0731 only)"
    return Checkpoint.PREVIEW, "nothing in the file tells; assumed the preview (--checkpoint 0731 says otherwise)"
