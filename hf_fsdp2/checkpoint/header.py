"""A safetensors header's JSON, parsed exactly as safetensors (serde_json) parses it.

`parse_header` returns the `__metadata__` value and one `(name, dtype, shape, begin, end)` tuple per
tensor, with every shape entry and offset an int in [0, 2**64). It accepts what serde_json accepts:
UTF-8 only (`json.loads(bytes)` would also guess UTF-16/32), no NaN/Infinity, no duplicate keys in a
map, no lone surrogates, "-0" read as the float -0.0 (no size or offset), no leading zeros.

Two paths, one result. Headers as writers produce them (safetensors, transformers and us: compact
JSON, `__metadata__` first, entry keys in the order dtype/shape/data_offsets, names without escapes)
are matched by one regular expression and read without building a dict per tensor: a 400,000-tensor
header then parses about as fast as `safe_open` does (benchmarks/header_bench.py). Anything else —
whitespace, other key orders, escapes, extra keys, duplicates — takes the exact path through
`json.loads` with strict hooks. tests/test_safetensors_io.py checks both paths agree on fuzzed input.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .errors import CheckpointError

Entry = tuple  # (name: str, dtype: str, shape: tuple[int, ...], begin: int, end: int)
LIMIT = 2**64  # sizes and offsets are u64/usize in safetensors

# ---- the fast path: the canonical compact form -----------------------------------------------------
_STR = rb'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*+"'  # any JSON string
_UINT = rb"(?:0|[1-9][0-9]*+)"  # JSON forbids leading zeros; "-0" never matches
_ENTRY = (rb'"([^"\\\x00-\x1f]*+)":\{"dtype":"([A-Z0-9_]++)","shape":\[((?:%s(?:,%s)*+)?)\],'
          rb'"data_offsets":\[(%s),(%s)\]\}') % (_UINT, _UINT, _UINT, _UINT)
_ENTRY_BARE = re.sub(rb"\((?!\?)", b"(?:", _ENTRY)  # same pattern without capture groups
_METADATA = re.compile(rb'\{"__metadata__":(\{(?:%s:%s(?:,%s:%s)*+)?\}|null)(,|\})' % ((_STR,) * 4))
_ENTRIES = re.compile(_ENTRY)
_BODY = re.compile(rb"(?:%s(?:,%s)*+)?\}[ \t\n\r]*+" % (_ENTRY_BARE, _ENTRY_BARE))


def _parse_canonical(raw: bytes) -> tuple[object, list[Entry]] | None:
    """The header's metadata and entries if `raw` is in the canonical form (UTF-8 checked by the
    caller), else None. Never raises for a header the exact path would accept."""
    metadata, start = None, 1
    if raw.startswith(b'{"__metadata__":'):
        m = _METADATA.match(raw)
        if m is None:
            return None
        metadata = _parse_exact(b"{\"m\":" + m.group(1) + b"}")["m"]  # small: strings and their escapes
        start = m.end() if m.group(2) == b"," else m.end() - 1
        if m.group(2) == b"," and raw[start:start + 1] == b"}":
            return None  # a trailing comma: let the exact path say so
    elif not raw.startswith(b"{"):
        return None
    if _BODY.fullmatch(raw, start) is None:
        return None
    found = _ENTRIES.findall(raw, start)
    if not found:
        return metadata, []
    names, dtypes, shapes, begins, ends = zip(*found)  # column-wise: C-speed conversions below
    if max(map(len, begins)) > 19 or max(map(len, ends)) > 19 or max(map(len, shapes)) > 19 and any(
            len(d) > 19 for s in shapes for d in s.split(b",")):
        return None  # maybe >= 2**64: the exact path words the error
    shape_of = {s: tuple(map(int, s.split(b","))) if s else () for s in set(shapes)}
    entries = list(zip(map(bytes.decode, names), map(bytes.decode, dtypes), map(shape_of.__getitem__, shapes),
                       map(int, begins), map(int, ends)))
    names = {e[0] for e in entries}
    if len(names) != len(entries) or "__metadata__" in names:
        return None  # a duplicate (named by the exact path), or a tensor called __metadata__
    return metadata, entries


# ---- the exact path ----------------------------------------------------------------------------------
def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"key {key!r} appears twice")
            seen.add(key)
    return out


def _refuse_constant(text: str) -> object:
    raise ValueError(f"{text} is not JSON")


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _parse_exact(raw: bytes) -> object:
    value = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys, parse_constant=_refuse_constant,
                       parse_int=lambda t: -0.0 if t == "-0" else int(t))
    if b"\\u" in raw and _SURROGATE_ESCAPE.search(raw):
        json.dumps(value, ensure_ascii=False).encode("utf-8")  # raises on a lone surrogate
    return value


def _is_uint(x: object) -> bool:
    return type(x) is int and 0 <= x < LIMIT


def _entries_of(header: dict, path: Path) -> list[Entry]:
    """Type-check a parsed header's tensor entries (values are checked by the caller)."""
    entries = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if type(entry) is not dict or "dtype" not in entry or "shape" not in entry or "data_offsets" not in entry:
            raise CheckpointError(f"{path}: tensor {name!r}: malformed header entry {entry!r}; needs `dtype`, "
                                  "`shape` and `data_offsets`.")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if type(shape) is not list or not all(_is_uint(d) for d in shape):
            raise CheckpointError(f"{path}: tensor {name!r}: shape {shape!r} is not a list of non-negative integers.")
        if type(offsets) is not list or len(offsets) != 2 or not all(_is_uint(o) for o in offsets):
            raise CheckpointError(f"{path}: tensor {name!r}: data_offsets {offsets!r} is not a pair of "
                                  "non-negative integers.")
        entries.append((name, dtype, tuple(shape), offsets[0], offsets[1]))
    return entries


def parse_header(raw: bytes, path: Path, *, fast: bool = True) -> tuple[object, list[Entry]]:
    """`(metadata, entries)` of a header; `CheckpointError` naming `path` for anything safetensors refuses
    at the JSON level. `fast=False` forces the exact path (tests compare the two)."""
    try:
        raw.decode("utf-8")
        parsed = _parse_canonical(raw) if fast else None
        if parsed is not None:
            return parsed
        header = _parse_exact(raw)
    except (UnicodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{path}: header is not valid JSON ({e}).") from None
    except RecursionError:
        raise CheckpointError(f"{path}: header JSON is nested too deeply.") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object.")
    return header.get("__metadata__"), _entries_of(header, path)
