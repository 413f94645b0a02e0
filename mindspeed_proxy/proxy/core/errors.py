"""The one error type of the converter, a message the CLI prints as a single line, and the JSON reader that uses it."""
import json


class ConversionError(ValueError):
    """Bad input or a failed check; nothing has been left in OUT_DIR when it reaches the user."""


def read_json_object(path: str, where: str, expected: str = "a JSON object") -> dict:
    """The JSON object in file `path`; ConversionError "`where`: cannot read JSON (...)" or "`where`: not `expected`"."""
    try:
        with open(path, encoding="utf-8") as fh:
            value = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConversionError(f"{where}: cannot read JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(value, dict):
        raise ConversionError(f"{where}: not {expected}")
    return value
