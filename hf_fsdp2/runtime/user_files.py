"""Reading the small JSON/YAML files users hand the CLI (a model's config.json, an Accelerate config):
bounded in size, nesting and expanded size, so a hostile or broken file gets one clear error instead of
a RecursionError, a codec traceback or a 300 MB echo of a YAML alias bomb."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MAX_FILE_BYTES = 4 << 20  # configs are kilobytes
MAX_DEPTH = 64  # Accelerate and transformers configs nest a few levels
MAX_VALUES = 100_000  # every value counted as often as it is reached (YAML aliases repeat one node)


class UserFileError(ValueError):
    """A file that cannot be read as the JSON/YAML mapping it should be; the message names the file."""


def read_text(path: str | Path, what: str = "a config file") -> str:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise UserFileError(f"{path}: no such file.") from None
    except OSError as e:
        raise UserFileError(f"{path}: cannot read it ({e}).") from None
    if len(raw) > MAX_FILE_BYTES:
        raise UserFileError(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB; is it really {what}?")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserFileError(f"{path}: not UTF-8 text (byte {e.start}); is it really {what}?") from None


def load_json(path: str | Path, what: str = "a JSON file") -> Any:
    text = read_text(path, what)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserFileError(f"{path}: not valid JSON ({e}).") from None
    except RecursionError:
        raise UserFileError(f"{path}: nested more than Python can parse; is it really {what}?") from None
    check_bounded(data, path)
    return data


def load_yaml(path: str | Path, what: str = "a YAML file") -> Any:
    import yaml

    text = read_text(path, what)
    try:
        data = yaml.safe_load(text)  # what Accelerate uses
    except yaml.YAMLError as e:
        raise UserFileError(f"{path}: not valid YAML ({' '.join(str(e).split())}).") from None
    except RecursionError:
        raise UserFileError(f"{path}: nested more than Python can parse; is it really {what}?") from None
    check_bounded(data, path)
    return data


def check_bounded(data: Any, path: str | Path) -> None:
    """Refuse data nested deeper than MAX_DEPTH or reaching more than MAX_VALUES values (iteratively:
    no recursion, and it stops at the limit however large the expansion would be)."""
    stack, seen = [(data, 1)], 0
    while stack:
        value, depth = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise UserFileError(f"{path}: expands to more than {MAX_VALUES} values (YAML anchors and aliases "
                                "repeat a node each time it is used); a config file is far smaller.")
        if depth > MAX_DEPTH:
            raise UserFileError(f"{path}: nested more than {MAX_DEPTH} levels deep; a config file is far flatter.")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
            stack.extend((k, depth + 1) for k in value.keys() if isinstance(k, (tuple, frozenset)))
        elif isinstance(value, (list, tuple)):
            stack.extend((v, depth + 1) for v in value)


__all__ = ["MAX_DEPTH", "MAX_FILE_BYTES", "MAX_VALUES", "UserFileError", "check_bounded", "load_json", "load_yaml",
           "read_text"]
