"""Errors raised while finding, reading or prompting a model."""

from ..errors import ApirError


class ModelNotFoundError(ApirError):
    """A model name or path that does not lead to a usable GGUF file."""


class ChatTemplateError(ApirError):
    """A chat template that fails to parse or render."""


class ModelLoadError(ApirError):
    """A GGUF file that cannot be read: missing, not GGUF, truncated, unsupported."""


class TokenizerError(ApirError):
    """A tokenizer the GGUF describes but apir cannot build, or an invalid token id."""
