"""The one error type of the converter: a message the CLI prints as a single line."""


class ConversionError(ValueError):
    """Bad input or a failed check; nothing has been left in OUT_DIR when it reaches the user."""
