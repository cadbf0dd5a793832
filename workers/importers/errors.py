"""Errors the model importers raise; the caller turns them into a clean job failure."""


class ConversionError(ValueError):
    """The source file could not be converted (corrupt, truncated or malformed)."""


class UnsupportedModel(ConversionError):
    """The source file is valid but uses an architecture, tensor type or tokenizer we cannot convert."""
