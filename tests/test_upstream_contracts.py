"""Contracts with the upstream code hf_fsdp2 replaces or relies on: each fails by name when that code
changes, so a new release of accelerate, transformers or torch is judged here, not refused at import.

Every function `register()` replaces (Accelerate's and the Trainer's) is recorded in
tests/upstream_contracts.json with its signature and the SHA-256 of its source, for each version we
checked it on. A release that changes one fails `test_replaced_functions_are_unchanged` naming it:
read the new upstream code, adapt the replacement, then record the new source with
`python -m tests.test_upstream_contracts --record` (it adds to the known-good set, keeping the old).
Private torch names we use are checked to exist.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
import sys
from pathlib import Path

RECORD = Path(__file__).with_name("upstream_contracts.json")

# Private names of torch hf_fsdp2 relies on: (module, attribute path, used by).
TORCH_PRIVATE = [
    ("torch.distributed.distributed_c10d", "_get_default_group", "runtime/collectives.py"),
    ("torch.distributed.distributed_c10d", "ProcessGroup._device_types", "runtime/collectives.py"),
    ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset", "checkpoint/tensor_export.py"),
    ("torch.distributed.fsdp._fully_shard._fsdp_collectives", "foreach_all_gather", "quantization/fp8.py"),
]


def replaced_functions() -> dict[str, object]:
    """"owner.name" -> the upstream function `register()` replaces (read while registered)."""
    import hf_fsdp2
    from hf_fsdp2.integrations import accelerate as accelerate_backend
    from hf_fsdp2.integrations import trainer as trainer_backend

    hf_fsdp2.register()
    try:
        out = {(f"{owner.__module__}.{owner.__qualname__}.{name}" if isinstance(owner, type)
                else f"{owner.__name__}.{name}"): fn  # a class, or a module
               for (owner, name), fn in accelerate_backend._originals.items()}
        out.update({f"transformers.Trainer.{name}" if "." not in name else f"transformers.{name}": fn
                    for name, fn in trainer_backend._originals.items()})
    finally:
        hf_fsdp2.unregister()
    return out


def contract(fn) -> dict[str, str]:
    fn = inspect.unwrap(fn)
    signature = re.sub(r" at 0x[0-9a-f]+", "", str(inspect.signature(fn)))  # sentinels' addresses vary
    return {"signature": signature,
            "source_sha256": hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()}


def test_replaced_functions_are_unchanged():
    known = json.loads(RECORD.read_text())
    changed = []
    for target, fn in sorted(replaced_functions().items()):
        now = contract(fn)
        entry = known.get(target)
        if entry is None:
            changed.append(f"{target}: not recorded")
            continue
        for key in ("signature", "source_sha256"):
            if now[key] not in entry[key]:
                changed.append(f"{target}: {key} changed ({now[key][:80]})")
    assert not changed, ("upstream code that hf_fsdp2 replaces has changed; review each and re-record "
                         "(python -m tests.test_upstream_contracts --record):\n" + "\n".join(changed))


def test_private_torch_names_exist():
    import importlib

    missing = []
    for module, path, user in TORCH_PRIVATE:
        obj = importlib.import_module(module)
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is None:
            missing.append(f"{module}.{path} (used by hf_fsdp2/{user})")
    assert not missing, "torch no longer has: " + "; ".join(missing)


def record() -> None:
    known = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    for target, fn in sorted(replaced_functions().items()):
        entry = known.setdefault(target, {"signature": [], "source_sha256": []})
        for key, value in contract(fn).items():
            if value not in entry[key]:
                entry[key].append(value)
    RECORD.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
    print(f"recorded {len(known)} functions in {RECORD}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python -m tests.test_upstream_contracts --record")
    record()
