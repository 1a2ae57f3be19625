"""The package's layering, as docs/internals.md draws it, checked on the source: an import that climbs back
up fails here by name."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hf_fsdp2"


def _imports(path: Path) -> set[str]:
    """Absolute hf_fsdp2 module names `path` imports (relative imports resolved, nested ones too)."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found |= {module} | {f"{module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m.startswith("hf_fsdp2")}


def _offenders(folder: str, forbidden: str) -> list[str]:
    return [f"{p.relative_to(PACKAGE.parent)} imports {m}" for p in sorted((PACKAGE / folder).rglob("*.py"))
            for m in sorted(_imports(p)) if m == forbidden or m.startswith(forbidden + ".")]


def test_the_engine_never_imports_the_planner():
    """sharding/ is handed a resolved layout (hf_fsdp2/shard.py plans it first)."""
    assert not _offenders("sharding", "hf_fsdp2.planner")


def test_the_planner_never_imports_the_engine():
    assert not _offenders("planner", "hf_fsdp2.sharding.engine") and not _offenders("planner", "hf_fsdp2.shard")


def test_the_scan_sees_an_import():
    """The scan is not vacuous: relative imports, at module level or inside a function, are resolved."""
    assert "hf_fsdp2.runtime.distributed" in _imports(PACKAGE / "sharding" / "engine.py")
    assert "hf_fsdp2.sharding.record" in _imports(PACKAGE / "planner" / "layout.py")
    assert "hf_fsdp2.sharding.groups" in _imports(PACKAGE / "planner" / "memory.py")
    assert "hf_fsdp2.planner.layout" in _imports(PACKAGE / "shard.py")


def test_the_record_lives_on_one_object():
    """A PeftModel and the model it wraps share one record whichever is passed (issue 50), and a PeftModel
    wrapped around a model after it was sharded is not sharded itself (its adapters are in no group)."""
    from peft import LoraConfig, get_peft_model

    from hf_fsdp2.sharding.record import is_sharded, record_of

    from .common import build_model

    peft_model = get_peft_model(build_model(), LoraConfig(r=2, target_modules=["q_proj"]))
    record = record_of(peft_model, create=True)
    assert record_of(peft_model.get_base_model()) is record and record_of(peft_model) is record
    record.mesh, record.sharded_object = object(), id(peft_model)  # as shard_planned leaves it
    assert is_sharded(peft_model) and is_sharded(peft_model.get_base_model())

    base = build_model()
    record = record_of(base, create=True)
    record.mesh, record.sharded_object = object(), id(base)
    wrapped_after = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"]))
    assert record_of(wrapped_after) is record and is_sharded(base) and not is_sharded(wrapped_after)


def test_peft_is_unwrapped_in_one_module():
    """A PeftModel is recognised and unwrapped by sharding/model_parts.py alone (issue 50): entry points make one
    `ModelParts`, what they call receives the parts; no other module asks for the base model itself."""
    import re

    pattern = re.compile(r"get_base_model\(\)|hasattr\([^)]*[\"']peft_config[\"']|\bunwrap_peft\b")
    offenders = [f"{p.relative_to(PACKAGE.parent)}:{n}" for p in sorted(PACKAGE.rglob("*.py"))
                 if p.name != "model_parts.py"
                 for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not offenders, offenders
    assert pattern.search("base = model.get_base_model()")  # the scan sees a call
