"""The versions hf_fsdp2 supports, checked when it is imported.

Two sets are tested (docs/versions.md): the newest, pinned in constraints.txt, and the
oldest, pinned in constraints-min.txt. Older than the oldest is refused (those releases failed tests);
newer than the newest tested is never refused, since a plugin that refuses the release its users just
upgraded to stops their training: it warns once, naming the untested versions, and the contract tests
(tests/test_upstream_contracts.py) are what tell us whether a new release still fits.
"""

from __future__ import annotations

import re
import warnings
from importlib.metadata import PackageNotFoundError, version

# package -> (oldest supported (major, minor), newest tested (major, minor))
SUPPORTED: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "torch": ((2, 11), (2, 15)),  # 2.11: the GPU machine's image (constraints-gpu-image.txt), a CUDA build from PyPI that runs on CPU
    # The oldest: LLaMA-Factory 0.9.5's caps (constraints-min.txt); 4.57 and 5.0 fail tests (docs/versions.md).
    "transformers": ((5, 6), (5, 23)),
    "accelerate": ((1, 11), (1, 15)),
    "peft": ((0, 18), (0, 21)),
}
_warned = False


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
    return f"{package}>={a}.{b} (tested up to {c}.{d})"


def problems(found: dict[str, str | None] | None = None) -> list[str]:
    """`package found X, supported range` for every package missing or older than supported."""
    found = {p: installed(p) for p in SUPPORTED} if found is None else found
    out = []
    for package, (low, _) in SUPPORTED.items():
        text = found.get(package)
        if text is None:
            out.append(f"{package} is not installed (supported: {_range(package)})")
        elif parse(text) < low:
            out.append(f"{package} {text} is installed (supported: {_range(package)})")
    return out


def untested(found: dict[str, str | None] | None = None) -> list[str]:
    """Installed versions newer than the newest tested one."""
    found = {p: installed(p) for p in SUPPORTED} if found is None else found
    return [f"{package} {found[package]} (newest tested: {high[0]}.{high[1]})"
            for package, (_, high) in SUPPORTED.items()
            if found.get(package) is not None and parse(found[package]) > high]


def conflicts(found: dict[str, str | None] | None = None) -> list[str]:
    """Known-bad combinations of supported versions, each with what breaks and the way out."""
    found = {p: installed(p) for p in ("peft", "torchao")} if found is None else found
    out = []
    peft, torchao = found.get("peft"), found.get("torchao")
    if peft and torchao and parse(peft) < (0, 19) and parse(torchao) >= (0, 18):
        out.append(f"peft {peft} with torchao {torchao} cannot create any LoRA model (peft < 0.19 imports "
                   "torchao's LinearActivationQuantizedTensor, which torchao 0.18 removed): install "
                   "'torchao<=0.17' or 'peft>=0.19'")
    return out


def check(found: dict[str, str | None] | None = None) -> None:
    """Raise one `RuntimeError` line naming every missing or too old version and the supported range;
    warn once about versions newer than tested."""
    global _warned
    bad = problems(found)
    if bad:
        raise RuntimeError("hf_fsdp2 does not support the installed versions: " + "; ".join(bad)
                           + ". Install a supported set, e.g. `pip install -c constraints.txt -e .`.")
    for conflict in conflicts(found):
        warnings.warn("hf_fsdp2: " + conflict, stacklevel=2)
    new = untested(found)
    if new and not _warned:
        _warned = True
        warnings.warn("hf_fsdp2 has not been tested with " + ", ".join(new) + "; it runs, and the tests in "
                      "tests/test_upstream_contracts.py tell whether the internals it relies on changed.",
                      stacklevel=2)
