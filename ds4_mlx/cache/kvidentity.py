"""Which model a disk KV checkpoint belongs to: a fingerprint of the model and of the settings that change the state.

Two models of the same shape produce payloads that load into each other without complaint, and the saved logits
would even give the other model's first token. So every checkpoint carries, in a fixed-size footer at the very end
of the file (after ds4's optional KTM trailer, which ds4 expects right after the payload):

    "KID", u8 version (2), 16-byte core digest, 16-byte routed-experts digest, u32 KTM bytes, u32 CRC-32 of the
    KTM, u32 drafter-rows bytes, u32 CRC-32 of the drafter rows

The drafter rows (kvdrafter.py) sit between the KTM trailer and the footer. Version 1 footers (no drafter fields,
8 bytes shorter) are still read.

The core digest covers what makes the model the model apart from the quantization of its routed experts: every
metadata key outside `general.*` and `quantize.*` (so hyperparameters and tokenizer; those two hold names, file
types and imatrix notes that differ between the q2 and q4 files of one model), the directory (name, shape, type) of
every other tensor and the SHA-256 of all of its bytes (tensordigest.py: computed once per file and cached, so a
fine-tune or requantization that changes a single value is another model), plus the activation simulation setting
(`--no-quant-sim`), which changes every KV row. The experts digest covers the routed-expert tensors likewise. A
checkpoint is loaded only with the same core digest; the experts digest must also match with
`--kv-cache-reject-different-quant`, else a checkpoint of the same model with other routed-expert quantization is
shared, as ds4 shares 2-bit and 4-bit checkpoints.

A rank of a model split across ranks (model/shard.py) writes its own state, so its core digest also covers the
split: its kind, the number of ranks, the rank and the slices it holds (`Split.identity`); a file of another split,
share or rank is never loaded. The tensor digests stay the whole file's, not the rank's slices': every rank maps
the whole file, whose digests are computed once and cached for any split (tensordigest.py), while digests of slices
would be computed again for every split and shares and read about as much (a column slice touches every row of its
tensor); the whole file's digests and the slices' bounds name the bytes a rank holds exactly.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CacheFileError
from ..model.weights import ModelWeights
from .tensordigest import tensor_digests

if TYPE_CHECKING:
    from ..model.shard import Split

FOOTER_MAGIC = b"KID"
FOOTER_VERSION = 2
FOOTER = struct.Struct("<3sB16s16sIIII")
FOOTER_V1 = struct.Struct("<3sB16s16sII")
"""The footer before drafter rows were saved: still read."""
_ROUTED = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
_NOT_THE_MODEL = ("general.", "quantize.")
"""Metadata about the file and how it was quantized; the quantized bytes themselves are hashed."""
_DIGEST = 16


@dataclass(frozen=True)
class ModelIdentity:
    core: bytes
    experts: bytes

    def accepts(self, other: ModelIdentity, same_experts: bool) -> bool:
        """Whether a checkpoint written by `other` holds the state this model would compute."""
        return other.core == self.core and (not same_experts or other.experts == self.experts)


@dataclass(frozen=True)
class Footer:
    identity: ModelIdentity
    ktm_bytes: int
    ktm_crc: int
    drafter_bytes: int = 0
    drafter_crc: int = 0
    size: int = FOOTER.size
    """Its own size in the file (a version 1 footer is shorter)."""

    def pack(self) -> bytes:
        return FOOTER.pack(FOOTER_MAGIC, FOOTER_VERSION, self.identity.core, self.identity.experts, self.ktm_bytes,
                           self.ktm_crc, self.drafter_bytes, self.drafter_crc)

    @classmethod
    def unpack(cls, data: bytes) -> Footer:
        """The footer that `data` (a file's last bytes) ends with: version 2, else version 1."""
        for layout, version in ((FOOTER, FOOTER_VERSION), (FOOTER_V1, 1)):
            if len(data) >= layout.size:
                magic, found, core, experts, *fields = layout.unpack(data[-layout.size:])
                if magic == FOOTER_MAGIC and found == version:
                    return cls(ModelIdentity(core, experts), *(*fields, 0, 0)[:4], size=layout.size)
        raise CacheFileError("no model identity footer (a file of ds4 or of another ds4-mlx version)")

    @property
    def trailing(self) -> int:
        """Bytes after the payload: the KTM trailer, the drafter rows and this footer."""
        return self.ktm_bytes + self.drafter_bytes + self.size


def feed_value(h: Any, key: str, value: Any) -> None:
    """One metadata value, unambiguously: numeric arrays by dtype, shape and bytes, string arrays joined (the
    tokenizer's 129280 strings in one update), nested arrays item by item, scalars by repr."""
    h.update(key.encode() + b"\0")
    if isinstance(value, np.ndarray):
        h.update(f"{value.dtype.str}{value.shape}".encode() + value.tobytes())
    elif isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        h.update(b"[%d]" % len(value) + "\0".join(value).encode("utf-8", "surrogatepass"))
    elif isinstance(value, (list, tuple)):
        h.update(b"[%d]" % len(value))
        for item in value:
            feed_value(h, "", item)
    else:
        h.update(repr(value).encode())
    h.update(b"\0")


def model_identity(weights: ModelWeights, simulate_quant: bool, digests: dict[str, bytes] | None = None,
                   split: Split | None = None) -> ModelIdentity:
    """The fingerprint of a loaded model file and its state-changing settings (see the module docstring).
    `digests`: the file's `tensor_digests`, when the caller computed them already (beside the load); `split`:
    this rank's share of a split model."""
    file = weights.file
    if digests is None:
        digests = tensor_digests(file)
    core = hashlib.blake2b(digest_size=_DIGEST, person=b"ds4-mlx kv core")
    experts = hashlib.blake2b(digest_size=_DIGEST, person=b"ds4-mlx kv exps")
    core.update(b"simulate_quant=%d\0" % bool(simulate_quant))
    if split is not None:
        core.update(split.identity() + b"\0")
    for key in sorted(file.metadata):
        if not key.startswith(_NOT_THE_MODEL):
            feed_value(core, key, file.metadata[key])
    for name, info in sorted(file.tensors.items()):
        h = experts if name.endswith(_ROUTED) else core
        h.update(f"{name}\0{info.shape}\0{info.ggml_type.name}\0".encode() + digests[name])
    return ModelIdentity(core.digest(), experts.digest())

