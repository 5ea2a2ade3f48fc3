"""Errors the converters raise for bad input (the CLI prints them and exits with 2)."""


class ConversionError(ValueError):
    """The input or the requested output is unusable; the message says what and where."""
