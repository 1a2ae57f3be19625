"""The versions hf_fsdp2 supports, checked when it is imported.

Two sets are tested (README "Supported versions"): the newest, pinned in constraints.txt, and the
oldest, pinned in constraints-min.txt. The ranges below are those sets' major/minor versions up to
the next release we have not tested where we rely on internals (accelerate), or the next major.
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version

# package -> ([min, max) as (major, minor), why the floor)
SUPPORTED: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "torch": ((2, 13), (3, 0)),  # the only torch with a CPU wheel here: older ones are untested, so refused
    "transformers": ((5, 12), (6, 0)),  # 4.57 and 5.0 fail tests (README "Supported versions")
    "accelerate": ((1, 15), (1, 16)),  # the backend and check-config follow Accelerate's internals per release
    "peft": ((0, 20), (1, 0)),  # 0.19 cannot reload a MoE adapter with transformers 5.12
}


def parse(text: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", text).groups()
    return int(major), int(minor)


def installed(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _range(package: str) -> str:
    (a, b), (c, d) = SUPPORTED[package]
    return f"{package}>={a}.{b},<{c}.{d}"


def problems(found: dict[str, str | None] | None = None) -> list[str]:
    """`package found X, supported range` for every package outside its range."""
    found = {p: installed(p) for p in SUPPORTED} if found is None else found
    out = []
    for package, (low, high) in SUPPORTED.items():
        text = found.get(package)
        if text is None:
            out.append(f"{package} is not installed (supported: {_range(package)})")
        elif not low <= parse(text) < high:
            out.append(f"{package} {text} is installed (supported: {_range(package)})")
    return out


def check(found: dict[str, str | None] | None = None) -> None:
    """Raise one `RuntimeError` line naming every unsupported installed version and the supported range."""
    bad = problems(found)
    if bad:
        raise RuntimeError("hf_fsdp2 does not support the installed versions: " + "; ".join(bad)
                           + ". Install a supported set, e.g. `pip install -c constraints.txt -e .`.")
