"""User-facing error types: one per layer, each with a message that says what was expected.

The CLI prints these as one line without a traceback; the server maps them to a 4xx JSON body.
Anything else that escapes is an internal fault.
"""

from __future__ import annotations


class Ds4Error(Exception):
    """Base of every error a user can cause (bad file, bad flag, bad request)."""


class UsageError(Ds4Error):
    """A flag or parameter the command or call cannot take as given (the CLI exits with status 2, as argparse does)."""


class GGUFError(Ds4Error):
    """The file is not a readable GGUF v3 container (bad magic, version, truncation, data past the end)."""


class LayoutError(GGUFError):
    """The GGUF is readable but is not the DeepSeek V4 Flash layout: a key or tensor is missing or wrong.

    The message names the key or tensor and what was expected.
    """


class ModelFileMissing(Ds4Error):
    """No model file at the given path."""

    @classmethod
    def at(cls, path: object) -> ModelFileMissing:
        """The error for an absent model file, saying where to get one (every command says the same)."""
        return cls(f"no model file at {path}: download one with ./download_model.sh ds4f-q2 (or ds4f-q4), "
                   f"or try the built-in tiny model with --demo")

    @classmethod
    def mtp_at(cls, path: object) -> ModelFileMissing:
        """The error for an absent MTP draft file (checked before anything loads, and again by the loader)."""
        return cls(f"no MTP file at {path}: download one with ./download_model.sh ds4f-dspark (0731's DSpark "
                   f"drafter) or mtp (the preview's)")


class ResourceError(Ds4Error):
    """The device does not have room for the weights plus the session state at the requested context."""


class CacheFileError(Ds4Error):
    """A saved session (KV cache) payload that is malformed or was saved for a different model or context."""


class RequestError(Ds4Error):
    """A generation request that cannot be served as given (e.g. prompt longer than the context)."""


class ContextOverflow(RequestError):
    """The prompt does not fit: one free slot after the prompt is required (ds4_server.c)."""

    def __init__(self, n_prompt_tokens: int, n_ctx: int) -> None:
        super().__init__(
            f"Prompt has {n_prompt_tokens} tokens, but the configured context size is {n_ctx} tokens"
        )
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx
