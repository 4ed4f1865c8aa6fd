"""The data layer's one error type."""

__all__ = ["DataError"]


class DataError(ValueError):
    """Data that cannot be read as asked (a file that is not what its name or
    ``data.format`` says, a record without its text, a token id the model cannot embed,
    a changed corpus at resume). The message is one line naming the file, and what to do."""
