"""Contracts with the upstream code hf_fsdp2 replaces or extends: each fails by name when that code
changes, so a new release of accelerate, transformers, torch or bitsandbytes is judged here, not
refused at import.

Every seam in hf_fsdp2/runtime/upstream.py (`SEAMS`) is recorded in tests/upstream_contracts.json:
the upstream function's signature and the SHA-256 of its source, for each version we checked it on
(`checked_on`). A release that changes one fails `test_every_seam_is_unchanged` naming it: read the
new upstream code, adapt ours, then record it with `python -m tests.test_upstream_contracts --record`
(it adds to the known-good set, keeping the old, so the oldest and newest supported sets both pass).
No module of hf_fsdp2 but upstream.py assigns to another library's attributes, writes private state, an
instance `__dict__` or `sys.meta_path`, or swaps a class (`test_no_replacement_outside_the_seam`); every
private name of another library that a module reads is declared for that module in upstream.py's
`PRIVATE` or `SEAMS` (`test_every_private_name_read_is_declared`). Private names are checked to exist
(a private attribute of instances: named in its class's source), their signatures recorded in
tests/private_contracts.json; the names of private state we write are checked the same way.
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
PRIVATE_RECORD = Path(__file__).with_name("private_contracts.json")  # upstream.PRIVATE's signatures
PACKAGE = Path(__file__).resolve().parents[1] / "hf_fsdp2"
UPSTREAM = ("torch", "accelerate", "transformers", "peft", "bitsandbytes", "torchao", "safetensors", "trl")
OPTIONAL = ("bitsandbytes", "torchao")  # extras: a seam of an extra not installed is not checked

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
        if seam.how in (upstream.PRIVATE_STATE, upstream.IMPORT_HOOK) and seam.reader is None:
            continue  # no function of theirs to record: test_private_state_is_upstream's, test_import_hooks_can_wrap
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


_MUTATORS = {"insert", "append", "extend", "remove", "pop", "popitem", "clear", "update", "setdefault",
             "__setitem__", "__delitem__"}
_MODULE_DICTS = {"_parameters", "_buffers", "_modules", "__dict__"}  # written only through upstream.set_entry


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _root(node):
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _ours(node) -> bool:
    """Rooted at `self`/`cls`: hf_fsdp2's own object's state."""
    return isinstance(_root(node), ast.Name) and _root(node).id in ("self", "cls")


def _is_meta_path(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "meta_path"


def _is_instance_dict(node) -> bool:
    """`x.__dict__`, `vars(x)`, or a private dict of another library's object (`x._parameters`)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars":
        return True
    return isinstance(node, ast.Attribute) and (node.attr in _MODULE_DICTS or (_is_private(node.attr)
                                                                                and not _ours(node)))


def _replacements_in(path: Path, own: set[str] = frozenset()) -> list[str]:
    """Lines of `path` that assign to an attribute of an upstream import, call setattr, set __class__, write
    another object's private attribute (one not in `own`, the names hf_fsdp2 defines), an entry of an instance dict or private dict (`__dict__`,
    `vars(x)`, `_parameters`, ...), or change `sys.meta_path`."""
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
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS and (
                _is_meta_path(node.func.value) or _is_instance_dict(node.func.value)):
            found.append(f"{path.name}:{node.lineno} {ast.unparse(node.func)}")
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "object.__setattr__" and not (
                node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "self"):
            # (on `self`: a frozen dataclass of hf_fsdp2's own setting its parsed fields, config.py)
            found.append(f"{path.name}:{node.lineno} object.__setattr__")
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            line = f"{path.name}:{node.lineno} {ast.unparse(target)}"
            if isinstance(target, ast.Attribute) and target.attr == "__class__":
                found.append(f"{path.name}:{node.lineno} __class__")
            elif isinstance(target, ast.Attribute) and target.attr.startswith("_") and not _ours(target) and \
                    target.attr not in own:
                found.append(line)  # another object's private (or dunder) attribute
            elif isinstance(target, ast.Subscript) and (_is_instance_dict(target.value) or _is_meta_path(target.value)):
                found.append(line)
            elif _is_meta_path(target):
                found.append(line)
            elif isinstance(target, ast.Attribute) and isinstance(_root(target), ast.Name) and \
                    _root(target).id in upstream_names:
                found.append(line)
    return found


def test_no_replacement_outside_the_seam():
    own = _own_names()
    found = [line for path in sorted(PACKAGE.rglob("*.py")) if path != PACKAGE / "runtime" / "upstream.py"
             for line in _replacements_in(path, own)]
    assert not found, ("another library's code or state is changed outside hf_fsdp2/runtime/upstream.py (declare "
                       "it in SEAMS and use upstream.replace/scoped/set_class/set_state/set_entry/tag): "
                       + "; ".join(found))


def test_the_scan_sees_a_replacement(tmp_path):
    """The scan above is not vacuous: each form it forbids is found."""
    probe = tmp_path / "probe.py"
    forms = ["dist.destroy_process_group = None", "Trainer.save_model = None", "setattr(Trainer, 'x', 1)",
             "m.__class__ = object", "m._parameters['w'] = None", "del m._buffers['b']", "m._modules['x'] = None",
             "m.__dict__['w'] = None", "vars(m)['w'] = None", "m.__dict__.pop('w')", "m._parameters.pop('w')",
             "state._init_kwargs['x'] = 1", "self._modules['x'] = None", "sys.meta_path.insert(0, f)",
             "sys.meta_path.append(f)", "sys.meta_path.remove(f)", "sys.meta_path = []", "sys.meta_path[0] = f",
             "state._auto_reshard_after_forward = False", "module.__loader__ = None",
             "object.__setattr__(m, 'x', 1)"]
    body = "".join(f"    {form}\n" for form in forms)
    probe.write_text("import sys\nimport torch.distributed as dist\nfrom transformers import Trainer\n"
                     f"def f(m, state, module, self):\n{body}    self._mine = 1\n    self._own[0] = 1\n"
                     "    object.__setattr__(self, 'parsed', 1)\n")
    found = _replacements_in(probe)
    assert len(found) == len(forms), found


# Private names of the standard library (not a release judged here).
STDLIB_PRIVATE = {"_exit": "os._exit", "_SubParsersAction": "argparse's subparsers action, for type hints"}


def _own_names() -> set[str]:
    """Names hf_fsdp2 defines itself: functions, classes, variables, arguments, `self.`/`cls.` attributes."""
    own = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _ours(node):
                own.add(node.attr)
    return own


def _strings(node, module_level: dict[str, list[str]]) -> list[str] | None:
    """The strings a literal holds ("x", ("x", "y"), ["x"], {"x"}) or a module-level constant names; else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
        return [e.value for e in node.elts]
    if isinstance(node, ast.Name):
        return module_level.get(node.id)
    return None


def _name_values(tree: ast.Module) -> dict[int, dict[str, list[str]]]:
    """id(scope) -> {variable: the strings it can hold} for the module, each function and comprehension: a
    name bound to a string literal (or a tuple of them), or the target of a loop over such a literal or over a
    module-level constant. How `getattr(obj, name)` is resolved (`for name in ("_a", "_b")`, `NAME = "_a"`)."""
    module_level: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            values = _strings(node.value, {})
            if values is not None:
                module_level[node.targets[0].id] = values
    scopes = {id(tree): dict(module_level)}
    scope_types = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.GeneratorExp, ast.ListComp, ast.SetComp,
                   ast.DictComp)
    for scope in [tree] + [n for n in ast.walk(tree) if isinstance(n, scope_types)]:
        bound = scopes.setdefault(id(scope), {})
        loops = [(g.target, g.iter) for g in getattr(scope, "generators", ())]
        for node in ast.walk(scope) if scope is not tree else ():
            if isinstance(node, (ast.For, ast.AsyncFor)):
                loops.append((node.target, node.iter))
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                values = _strings(node.value, module_level)
                if values is not None and isinstance(node.value, ast.Constant):
                    bound.setdefault(node.targets[0].id, []).extend(values)
        for target, iterable in loops:
            values = _strings(iterable, module_level)
            if isinstance(target, ast.Name) and values is not None:
                bound.setdefault(target.id, []).extend(values)
    return scopes


def _private_reads_in(path: Path, own: set[str]) -> list[tuple[str, int]]:
    """(name, line) for each private name of another library `path` reads: an attribute (`x._name`,
    `getattr(x, "_name")`, `getattr(x, name)` with `name` a string constant or looping over string literals) hf_fsdp2
    does not define, a global named by (upstream module, private name) as pickle's `find_class` takes it, or a
    private part of an upstream import."""
    tree = ast.parse(path.read_text())
    scopes, parents = _name_values(tree), {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[id(child)] = node

    def resolve(node) -> list[str]:
        """The strings `node` (a literal, or a variable seen from its innermost binding scope) can be."""
        if not isinstance(node, ast.Name):
            return _strings(node, {}) or []
        scope = node
        while id(scope) in parents:
            scope = parents[id(scope)]
            if node.id in scopes.get(id(scope), {}):
                return scopes[id(scope)][node.id]
        return []

    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "getattr", "hasattr", "delattr") and len(node.args) > 1:
            names = resolve(node.args[1])
        elif isinstance(node, ast.Tuple) and len(node.elts) == 2 and isinstance(node.elts[0], ast.Constant) and \
                isinstance(node.elts[0].value, str) and node.elts[0].value.split(".")[0] in UPSTREAM:
            names = [name for name in resolve(node.elts[1]) if name.isidentifier()]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and \
                node.module.split(".")[0] in UPSTREAM:
            names = node.module.split(".") + [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names = [part for a in node.names if a.name.split(".")[0] in UPSTREAM for part in a.name.split(".")]
        found += [(name, node.lineno) for name in names if _is_private(name) and not name.startswith("_hf_fsdp2")
                  and (name not in own or isinstance(node, (ast.Import, ast.ImportFrom)))]
    return found


def _declared() -> set[tuple[str, str]]:
    """(hf_fsdp2 module, private name) for each private part of a PRIVATE entry or a seam, per user."""
    from hf_fsdp2.runtime import upstream

    pairs = set()
    for dotted, users in [(e.name, e.user) for e in upstream.PRIVATE] + [(s.target, s.user) for s in upstream.SEAMS]:
        for user in users.split(", "):
            pairs |= {(user, part) for part in dotted.split(".") if _is_private(part)}
    return pairs


def _undeclared(modules: dict[str, Path], own: set[str]) -> list[str]:
    """For {hf_fsdp2 module ("sharding/engine.py"): its file}, each private read not declared for it."""
    declared = _declared()
    return [f"hf_fsdp2/{user}:{line} {name}" for user, path in modules.items()
            for name, line in sorted(_private_reads_in(path, own), key=lambda read: read[1])
            if name not in STDLIB_PRIVATE and (user, name) not in declared]


def test_every_private_name_read_is_declared():
    """A private name of another library read anywhere in hf_fsdp2 is declared, for the module that reads it, in
    runtime/upstream.py (PRIVATE, or a seam): so the tests above check it on every version."""
    undeclared = _undeclared({str(p.relative_to(PACKAGE)): p for p in sorted(PACKAGE.rglob("*.py"))}, _own_names())
    assert not undeclared, ("private names of another library read but not declared in hf_fsdp2/runtime/upstream.py "
                            "PRIVATE (module, path, user): " + "; ".join(undeclared))


def test_the_scan_sees_a_private_read(tmp_path):
    """The scan above is not vacuous: each form of private read is found, hf_fsdp2's own names are not, and a
    name declared for one module is not declared for another."""
    probe = tmp_path / "probe.py"
    forms = ["state._mp_policy", "getattr(model, '_no_split_modules', None)", "hasattr(state, '_lazy_init')",
             "from torch.distributed.tensor._utils import compute_local_shape_and_global_offset",
             "from torch.utils import _pytree", "import torch._dynamo",
             # a name held by a variable: a module-level constant, a loop over literals, a (module, name) global
             "getattr(model, PROBE_NAME)", "[getattr(torch.ops.aten, n) for n in ('mm', '_probe_op')]",
             "for attribute in ('public', '_probe_looped'):\n        hasattr(state, attribute)",
             "allowed = {('torch.serialization', '_probe_global')}"]
    probe.write_text("PROBE_NAME = '_probe_constant'\n\n\ndef f(state, model, computed):\n"
                     + "".join(f"    {form}\n" for form in forms)
                     + "    state._fds\n    getattr(state, '_hf_fsdp2_x')\n    getattr(state, computed)\n"
                     + "    allowed = {('our.module', '_not_upstream')}\n")
    found = _undeclared({"runtime/probe.py": probe}, _own_names())
    assert [entry.split(" ", 1)[1] for entry in found] == [
        "_mp_policy", "_no_split_modules", "_lazy_init", "_utils", "_pytree", "_dynamo", "_probe_constant",
        "_probe_op", "_probe_looped", "_probe_global"], found


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
               # installed by the first background save, and when a model is split by expert parallelism
               and s.target not in ("torch.distributed.destroy_process_group", "torch.nn.utils.clip_grad_norm_")
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


def _walk(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part, _ABSENT)  # a class attribute may be None (DDP._active_ddp_module)
    return obj


def _named_in_source(owner, name: str) -> bool:
    """`name` appears in the source of `owner` (a class or module): how an instance attribute or private
    state we write is checked to still be upstream's."""
    try:
        return re.search(rf"\b{re.escape(name)}\b", inspect.getsource(owner)) is not None
    except (TypeError, OSError):  # a builtin (pybind) class: no source
        return False


def private_names():
    """(name, the object, _ABSENT, or None for an instance attribute found in its class's source, used by,
    package version) for every upstream.PRIVATE entry this version set should have."""
    import importlib

    from hf_fsdp2.runtime import upstream
    from hf_fsdp2.runtime.versions import parse

    out = []
    for entry in upstream.PRIVATE:
        package = entry.module.split(".")[0]
        try:
            installed = version(package)
        except Exception:  # noqa: BLE001 - an extra not installed
            if package in OPTIONAL:
                continue
            raise
        if entry.since and parse(installed) < entry.since:
            continue  # hf_fsdp2 takes another branch on this version
        module = importlib.import_module(entry.module)
        if entry.instance:
            owner_path, _, name = entry.path.rpartition(".")
            owner = _walk(module, owner_path)
            obj = None if owner is not _ABSENT and _named_in_source(owner, name) else _ABSENT
        else:
            obj = _walk(module, entry.path)
        if obj is _ABSENT and entry.optional:
            continue  # hf_fsdp2 copes without it
        out.append((entry.name, obj, entry.user, f"{package} {installed}"))
    return out


def private_signature(obj) -> str | None:
    """A callable's signature as recorded (None for a value, e.g. a config flag)."""
    if not callable(obj):
        return None
    try:
        return re.sub(r" at 0x[0-9a-f]+", "", str(inspect.signature(inspect.unwrap(obj))))
    except (TypeError, ValueError):  # a builtin without a signature
        return "<no signature>"


def test_private_names_exist():
    missing = [f"{name} (used by hf_fsdp2/{user})" for name, obj, user, _ in private_names() if obj is _ABSENT]
    assert not missing, "no longer upstream: " + "; ".join(missing)


def test_private_signatures_are_recorded():
    """A private function whose signature is not one we checked fails by name, as a seam does."""
    known = json.loads(PRIVATE_RECORD.read_text())
    changed = []
    for name, obj, user, checked_on in private_names():
        signature = private_signature(obj)
        if obj is _ABSENT or signature is None:
            continue
        entry = known.get(name)
        if entry is None or signature not in entry["signature"]:
            changed.append(f"{name} (used by hf_fsdp2/{user}) on {checked_on}: {signature[:100]}; "
                           f"recorded on {entry['checked_on'] if entry else 'none'}")
    assert not changed, ("private signatures not reviewed for this version; read the code that uses each, "
                         "then record (python -m tests.test_upstream_contracts --record):\n" + "\n".join(changed))


def test_private_state_is_upstream():
    """Each piece of private state we write (PRIVATE_STATE) is still named in its owner's source."""
    from hf_fsdp2.runtime import upstream

    gone = []
    for seam in upstream.SEAMS:
        if seam.how != upstream.PRIVATE_STATE or seam.target.split(".")[0] in OPTIONAL:
            continue
        owner_path, _, name = seam.target.rpartition(".")
        owner, _ = upstream.resolve(owner_path)
        owner = getattr(owner, owner_path.rsplit(".", 1)[1])
        if name != "__dict__" and not _named_in_source(owner, name):
            gone.append(f"{seam.target} (written by hf_fsdp2/{seam.user})")
    assert not gone, "private state hf_fsdp2 writes is no longer upstream's: " + "; ".join(gone)


def test_import_hooks_can_wrap():
    """Each module whose loader import_hooks wraps is still loaded by a loader with exec_module (else the
    hook would not run and the Trainer's seams would never be installed)."""
    import importlib.util

    from hf_fsdp2.runtime import upstream

    for seam in upstream.SEAMS:
        if seam.how == upstream.IMPORT_HOOK:
            spec = importlib.util.find_spec(seam.target)
            assert spec is not None and hasattr(spec.loader, "exec_module"), seam.target


def record() -> None:
    private = json.loads(PRIVATE_RECORD.read_text()) if PRIVATE_RECORD.exists() else {}
    for name, obj, _, checked_on in private_names():
        signature = private_signature(obj)
        if obj is _ABSENT or signature is None:
            continue
        entry = private.setdefault(name, {"signature": [], "checked_on": []})
        for key, value in (("signature", signature), ("checked_on", checked_on)):
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
    assert lines == ["[] []", "['transformers.TrainingArguments.__post_init__']", "9 SourceFileLoader []",
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
