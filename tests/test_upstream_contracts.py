"""Contracts with the upstream code hf_fsdp2 replaces or extends: each fails by name when that code
changes, so a new release of accelerate, transformers, torch or bitsandbytes is judged here, not
refused at import.

Every seam in hf_fsdp2/runtime/upstream.py (`SEAMS`) is recorded in tests/upstream_contracts.json:
the upstream function's signature and the SHA-256 of its source, for each version we checked it on
(`checked_on`). A release that changes one fails `test_every_seam_is_unchanged` naming it: read the
new upstream code, adapt ours, then record it with `python -m tests.test_upstream_contracts --record`
(it adds to the known-good set, keeping the old, so the oldest and newest supported sets both pass).
No module of hf_fsdp2 but upstream.py assigns to another library's attributes or swaps a class
(`test_no_replacement_outside_the_seam`). Private torch names we use are checked to exist.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import re
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

pytestmark = pytest.mark.oldest  # CI runs this file on every older version set too

RECORD = Path(__file__).with_name("upstream_contracts.json")
PRIVATE_RECORD = Path(__file__).with_name("torch_private_contracts.json")  # TORCH_PRIVATE's signatures
PACKAGE = Path(__file__).resolve().parents[1] / "hf_fsdp2"
UPSTREAM = ("torch", "accelerate", "transformers", "peft", "bitsandbytes", "torchao", "safetensors", "trl")
OPTIONAL = ("bitsandbytes", "torchao")  # extras: a seam of an extra not installed is not checked

# Private names of torch hf_fsdp2 relies on without replacing them: (module, attribute path, used by[, the
# oldest torch (major, minor) that has it, where hf_fsdp2 branches on it]). A callable's signature is recorded
# per torch version in torch_private_contracts.json (oldest supported: 2.11).
CC = "sharding/compiled_collectives.py"
TORCH_PRIVATE = [
    ("torch.distributed.distributed_c10d", "_get_default_group", "runtime/collectives.py"),
    ("torch.distributed.distributed_c10d", "ProcessGroup._device_types", "runtime/collectives.py"),
    ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset", "checkpoint/tensor_export.py"),
    ("torch.distributed.fsdp._fully_shard._fsdp_collectives", "foreach_all_gather", "quantization/fp8.py"),
    ("torch.distributed.tensor.experimental._context_parallel._attention", "_templated_ring_attention",
     "sharding/context_parallel.py"),
    ("torch.distributed.tensor.experimental._context_parallel._attention", "_templated_ring_attention_backward",
     "sharding/context_parallel.py"),
    ("torch.distributed.tensor", "DTensor._op_dispatcher._custom_op_handlers", "sharding/context_parallel.py"),
    ("torch.distributed.tensor", "DTensor._op_dispatcher.unwrap_to_op_info", "sharding/context_parallel.py"),
    ("torch.distributed.tensor._dtensor_spec", "TensorMeta", "sharding/context_parallel.py"),
    ("torch.distributed._composable.replicate", "_ReplicateState.lazy_init", "sharding/replication.py"),
    ("torch.distributed._composable.replicate", "DDP", "checkpoint/key_conversion.py"),
    ("torch.distributed._composable.contract", "_get_registry", "sharding/replication.py"),
    ("torch.nn.parallel", "DistributedDataParallel._active_ddp_module", "sharding/replication.py"),
    ("torch._C", "_current_graph_task_id", "sharding/replication.py"),
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState._lazy_init", "sharding/generation.py"),
    # runtime/fsdp_state.py: FSDP2's casts are methods from torch 2.13; before, its helpers are called directly.
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState._cast_forward_inputs", "runtime/fsdp_state.py",
     (2, 13)),
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState._cast_output_dtype", "runtime/fsdp_state.py",
     (2, 13)),
    ("torch.distributed.fsdp._fully_shard._fsdp_common", "_cast_fp_tensor", "runtime/fsdp_state.py"),
    ("torch.distributed.utils", "_apply_to_tensors", "runtime/fsdp_state.py"),
    *[("torch._functorch.config", name, CC) for name in ("joint_custom_pass", "enable_autograd_cache",
                                                       "enable_remote_autograd_cache")],
    *[("torch._inductor.config", name, CC) for name in (
        "bucket_all_gathers_fx", "bucket_reduce_scatters_fx", "bucket_all_reduces_fx",
        "bucket_all_gathers_fx_bucket_size_determinator", "bucket_reduce_scatters_fx_bucket_size_determinator",
        "bucket_all_reduces_fx_bucket_size_determinator")],
    *[("torch._inductor.fx_passes.bucketing", name, CC)
      for name in ("is_fsdp_all_gather", "is_wait_tensor", "is_all_gather_into_tensor")],
    ("torch._inductor.compile_fx", "compile_fx", CC),
    ("torch.utils._ordered_set", "OrderedSet", CC),  # is_fsdp_all_gather's ancestor sets on torch 2.11/2.12
]


def upstream_function(target: str):
    """The upstream code at `target`, the original while we have it patched."""
    from hf_fsdp2.runtime import upstream

    return upstream.original(target) if target in upstream.installed() else upstream.lookup(target)


def contract(fn) -> dict[str, str]:
    fn = inspect.unwrap(fn)
    signature = re.sub(r" at 0x[0-9a-f]+", "", str(inspect.signature(fn)))  # sentinels' addresses vary
    return {"signature": signature,
            "source_sha256": hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()}


def checked_seams():
    """(target, upstream function, 'package version') for every seam whose package is installed."""
    from hf_fsdp2.runtime import upstream

    out = []
    for seam in upstream.SEAMS:
        package = seam.target.split(".")[0]
        if seam.where_present and not upstream.present(seam.target):
            continue  # newer than this version set (e.g. TRL's VLLMGeneration)
        try:
            fn = upstream_function(seam.reader or seam.target)
        except ImportError:
            if package in OPTIONAL:
                continue
            raise
        out.append((seam.target, fn, f"{package} {version(package)}"))
    return out


def test_every_seam_is_unchanged():
    known = json.loads(RECORD.read_text())
    changed = []
    for target, fn, _ in checked_seams():
        now = contract(fn)
        entry = known.get(target)
        if entry is None:
            changed.append(f"{target}: not recorded")
            continue
        for key in ("signature", "source_sha256"):
            if now[key] not in entry[key]:
                changed.append(f"{target}: {key} changed ({now[key][:80]}); checked on {entry['checked_on']}")
    assert not changed, ("upstream code that hf_fsdp2 replaces or extends has changed; review each against "
                         "hf_fsdp2/runtime/upstream.py and re-record (python -m tests.test_upstream_contracts "
                         "--record):\n" + "\n".join(changed))


def test_every_recorded_target_is_a_seam():
    from hf_fsdp2.runtime import upstream

    stale = set(json.loads(RECORD.read_text())) - {s.target for s in upstream.SEAMS}
    assert not stale, f"recorded in {RECORD.name} but no longer in SEAMS: {sorted(stale)}"


def _replacements_in(path: Path) -> list[str]:
    """Lines of `path` that assign to an attribute of an upstream import, call setattr, or set __class__."""
    tree = ast.parse(path.read_text())
    upstream_names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            upstream_names |= {(a.asname or a.name).split(".")[0] for a in node.names
                               if a.name.split(".")[0] in UPSTREAM}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in UPSTREAM:
            upstream_names |= {a.asname or a.name for a in node.names}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            found.append(f"{path.name}:{node.lineno} setattr")
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and target.attr == "__class__":
                found.append(f"{path.name}:{node.lineno} __class__")
            root = target
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(target, ast.Attribute) and isinstance(root, ast.Name) and root.id in upstream_names:
                found.append(f"{path.name}:{node.lineno} {ast.unparse(target)}")
    return found


def test_no_replacement_outside_the_seam():
    found = [line for path in sorted(PACKAGE.rglob("*.py")) if path != PACKAGE / "runtime" / "upstream.py"
             for line in _replacements_in(path)]
    assert not found, ("another library's code is replaced outside hf_fsdp2/runtime/upstream.py (declare it in "
                       "SEAMS and use upstream.replace/scoped/set_class): " + "; ".join(found))


def test_the_scan_sees_a_replacement(tmp_path):
    """The scan above is not vacuous: each form it forbids is found."""
    probe = tmp_path / "probe.py"
    probe.write_text("import torch.distributed as dist\nfrom transformers import Trainer\n"
                     "dist.destroy_process_group = None\nTrainer.save_model = None\nsetattr(Trainer, 'x', 1)\n"
                     "def f(m):\n    m.__class__ = object\n")
    assert len(_replacements_in(probe)) == 4


def test_register_installs_and_unregister_restores_every_patched_seam():
    import hf_fsdp2
    from hf_fsdp2.runtime import upstream

    import types

    import trl.models.utils  # TRL's seam is installed once TRL is imported
    import transformers.trainer  # noqa: F401 - the Trainer's, once the Trainer is (test_trainer_seams_wait_...)

    # A module that bound the name at import, as TRL's trainers do (`from ..models.utils import prepare_fsdp`).
    dpo = types.ModuleType("trl._hf_fsdp2_probe")
    dpo.prepare_fsdp = trl.models.utils.prepare_fsdp
    sys.modules[dpo.__name__] = dpo

    patched = [s.target for s in upstream.SEAMS if s.how == upstream.PATCHED
               and s.target != "torch.distributed.destroy_process_group"  # installed by the first background save
               and (not s.where_present or upstream.present(s.target))]
    before = {t: upstream.lookup(t) for t in patched}
    hf_fsdp2.register()
    try:
        installed = upstream.installed("accelerate") + upstream.installed("trainer") + upstream.installed("trl")
        assert sorted(installed) == sorted(patched)
        assert all(upstream.lookup(t) is not before[t] for t in patched)
        assert dpo.prepare_fsdp is upstream.lookup("trl.models.utils.prepare_fsdp")  # rebound where TRL imported it
    finally:
        hf_fsdp2.unregister()
    assert {t: upstream.lookup(t) for t in patched} == before
    assert dpo.prepare_fsdp is before["trl.models.utils.prepare_fsdp"]
    assert upstream.installed() == []
    del sys.modules[dpo.__name__]


def test_undeclared_or_misused_seams_are_refused():
    from hf_fsdp2.runtime import upstream

    with pytest.raises(AssertionError, match="not declared"):
        upstream.replace("torch.save", lambda *a: None, "x")
    with pytest.raises(AssertionError, match="declared patched inside a with-block"):
        upstream.replace("torch.nn.Module.register_parameter", lambda *a: None, "x")


_ABSENT = object()


def private_torch_names():
    """(name, the object or _ABSENT, used by) for every TORCH_PRIVATE entry this torch should have."""
    import importlib

    import torch

    from hf_fsdp2.runtime.versions import parse

    out = []
    for module, path, user, *since in TORCH_PRIVATE:
        if since and parse(torch.__version__) < since[0]:
            continue  # hf_fsdp2 takes another branch on this torch
        obj = importlib.import_module(module)
        for part in path.split("."):
            obj = getattr(obj, part, _ABSENT)  # a class attribute may be None (DDP._active_ddp_module)
        out.append((f"{module}.{path}", obj, user))
    return out


def private_signature(obj) -> str | None:
    """A callable's signature as recorded (None for a value, e.g. a config flag)."""
    if not callable(obj):
        return None
    try:
        return re.sub(r" at 0x[0-9a-f]+", "", str(inspect.signature(inspect.unwrap(obj))))
    except (TypeError, ValueError):  # a builtin without a signature
        return "<no signature>"


def test_private_torch_names_exist():
    missing = [f"{name} (used by hf_fsdp2/{user})" for name, obj, user in private_torch_names() if obj is _ABSENT]
    assert not missing, "torch no longer has: " + "; ".join(missing)


def test_private_torch_signatures_are_recorded():
    """A private torch function whose signature is not one we checked fails by name, as a seam does."""
    import torch

    known = json.loads(PRIVATE_RECORD.read_text())
    changed = []
    for name, obj, user in private_torch_names():
        signature = private_signature(obj)
        if obj is _ABSENT or signature is None:
            continue
        entry = known.get(name)
        if entry is None or signature not in entry["signature"]:
            changed.append(f"{name} (used by hf_fsdp2/{user}) on torch {torch.__version__}: {signature[:100]}; "
                           f"recorded on {entry['checked_on'] if entry else 'none'}")
    assert not changed, ("private torch signatures not reviewed for this version; read the code that uses each, "
                         "then record (python -m tests.test_upstream_contracts --record):\n" + "\n".join(changed))


def record() -> None:
    import torch

    private = json.loads(PRIVATE_RECORD.read_text()) if PRIVATE_RECORD.exists() else {}
    for name, obj, _ in private_torch_names():
        signature = private_signature(obj)
        if obj is _ABSENT or signature is None:
            continue
        entry = private.setdefault(name, {"signature": [], "checked_on": []})
        for key, value in (("signature", signature), ("checked_on", f"torch {torch.__version__}")):
            if value not in entry[key]:
                entry[key].append(value)
    PRIVATE_RECORD.write_text(json.dumps(private, indent=1, sort_keys=True) + "\n")
    known = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    for target, fn, checked_on in checked_seams():
        entry = known.setdefault(target, {"signature": [], "source_sha256": [], "checked_on": []})
        entry.setdefault("checked_on", [])
        for key, value in [*contract(fn).items(), ("checked_on", checked_on)]:
            if value not in entry[key]:
                entry[key].append(value)
    RECORD.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
    print(f"recorded {len(known)} targets in {RECORD}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python -m tests.test_upstream_contracts --record")
    record()


def test_trainer_seams_wait_for_the_trainer_import():
    """register() does not import the Trainer (about 2 s a process: peft, datasets, pandas): its seams
    are installed when the script imports transformers.training_args / transformers.trainer, and
    unregister() before then cancels them (a fresh interpreter: this one has the Trainer loaded)."""
    import subprocess

    script = (
        "import sys\n"
        "import hf_fsdp2, accelerate\n"
        "from hf_fsdp2.runtime import upstream, import_hooks\n"
        "hf_fsdp2.register()\n"
        "from transformers import LlamaForCausalLM\n"
        "print(sorted(m for m in ('transformers.trainer', 'transformers.training_args', 'datasets', 'peft') "
        "if m in sys.modules), upstream.installed('trainer'))\n"
        "from transformers import TrainingArguments\n"
        "print(upstream.installed('trainer'))\n"
        "from transformers import Trainer\n"
        "import transformers.trainer as module\n"
        "print(len(upstream.installed('trainer')), type(module.__loader__).__name__, import_hooks.pending())\n"
        "hf_fsdp2.unregister(); hf_fsdp2.register(); hf_fsdp2.unregister()\n"
        "print(upstream.installed(), import_hooks.pending(), Trainer.save_model.__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines == ["[] []", "['transformers.TrainingArguments.__post_init__']", "8 SourceFileLoader []",
                     "[] [] transformers.trainer"]


def test_reloading_the_trainer_modules_keeps_the_seams_until_unregister():
    """Issue 48: `importlib.reload(transformers.trainer)` defined a new Trainer class without our methods, silently
    (checkpoints would gather again). The reloaded classes get the same replacements; unregister() takes them off
    both the old and the new classes, and a reload after it is transformers' own (a fresh interpreter)."""
    import subprocess

    code = (
        "import importlib\n"
        "import hf_fsdp2\n"
        "hf_fsdp2.register()\n"
        "import transformers.trainer as t, transformers.training_args as ta\n"
        "from hf_fsdp2.runtime import upstream\n"
        "ours = upstream.installed_replacement('transformers.Trainer.save_model')\n"
        "ours_args = upstream.installed_replacement('transformers.TrainingArguments.__post_init__')\n"
        "first = t.Trainer\n"
        "importlib.reload(t); importlib.reload(ta)\n"
        "print(t.Trainer is not first, t.Trainer.save_model is ours, ta.TrainingArguments.__post_init__ is ours_args)\n"
        "hf_fsdp2.unregister()\n"
        "print(t.Trainer.save_model is ours, first.save_model is ours, ta.TrainingArguments.__post_init__ is ours_args)\n"
        "importlib.reload(t)\n"
        "print(t.Trainer.save_model is ours)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-3:] == ["True True True", "False False False", "False"]
