"""The package's layering, as docs/internals.md draws it ("Layers"), checked on the source. Each rule is a
checker function over a source tree (`root`: a folder holding `hf_fsdp2/`), run on the package and, in the
test itself, on a copy of it with a deliberate violation added, so a rule that stops seeing is caught too.

An import is any `import`/`from ... import` anywhere in a module (inside a function, under TYPE_CHECKING: a
dependency all the same). Importing `hf_fsdp2.a.b` runs `hf_fsdp2/a/__init__.py` first, so it counts as an
import of that package too (and of whatever the package's `__init__` imports). The root `hf_fsdp2/__init__.py`
is the public facade at the top: it runs before any module of the package whoever imports it, so it is no
module's dependency and is not followed.
"""

from __future__ import annotations

import ast
import collections
import shutil
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1]  # holds hf_fsdp2/
PACKAGE = SOURCE / "hf_fsdp2"

# docs/internals.md, "Layers": lowest first; a module imports only from its own layer or the ones before it.
LAYERS = [("hf_fsdp2.config",), ("hf_fsdp2.runtime",), ("hf_fsdp2.quantization",), ("hf_fsdp2.sharding",),
          ("hf_fsdp2.planner",), ("hf_fsdp2.shard",), ("hf_fsdp2.checkpoint",), ("hf_fsdp2.integrations",),
          ("hf_fsdp2.tools", "hf_fsdp2.cli"), ("hf_fsdp2.startup",)]


# ---------------------------------------------------------------------------------------------
# The import graph of a source tree


def _modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for every module of `root`/hf_fsdp2 (a package by its own name)."""
    out = {}
    for path in (root / "hf_fsdp2").rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, root: Path = SOURCE) -> set[str]:
    """hf_fsdp2 module names importing `path` runs: each imported module, the packages it is in (their
    `__init__`), and `from package import name` where name is a submodule. The root package left out."""
    modules = _modules(root)
    parts = list(path.relative_to(root).with_suffix("").parts)
    package = parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found |= {module} | {f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in modules}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    this = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    executed = {".".join(m.split(".")[:i]) for m in found if m.startswith("hf_fsdp2.")
                for i in range(2, len(m.split(".")) + 1)}
    return {m for m in executed if m in modules and m != this}


def _graph(root: Path) -> dict[str, set[str]]:
    return {name: _imports(path, root) for name, path in _modules(root).items()}


def _layer(module: str) -> int | None:
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def _chain(graph: dict[str, set[str]], start: str, targets) -> list[str] | None:
    """The shortest import chain from `start` to a module `targets(name)` accepts, or None."""
    previous, queue = {start: None}, collections.deque([start])
    while queue:
        name = queue.popleft()
        if name != start and targets(name):
            chain = [name]
            while previous[chain[-1]] is not None:
                chain.append(previous[chain[-1]])
            return chain[::-1]
        for nxt in sorted(graph.get(name, ())):
            if nxt not in previous:
                previous[nxt] = name
                queue.append(nxt)
    return None


def _under(*prefixes: str):
    return lambda name: any(name == p or name.startswith(p + ".") for p in prefixes)


# ---------------------------------------------------------------------------------------------
# The rules: each returns what breaks it, as {module: why}


def upward_imports(root: Path = SOURCE) -> dict[str, str]:
    """Imports that climb a layer: module -> the higher-layer modules it imports."""
    out = {}
    for name, imported in sorted(_graph(root).items()):
        if name == "hf_fsdp2":
            continue
        up = sorted(m for m in imported if _layer(m) is not None and _layer(m) > _layer(name))
        if up:
            out[name] = ", ".join(up)
    return out


def import_cycles(root: Path = SOURCE) -> dict[str, str]:
    """Modules that reach themselves through other modules (package `__init__` files, which re-export what
    their modules define, are left out as links: a module importing a sibling runs its package's `__init__`)."""
    graph = _graph(root)
    packages = {name for name, path in _modules(root).items() if path.name == "__init__.py"}
    plain = {name: {m for m in imported if m not in packages} for name, imported in graph.items()
             if name not in packages}
    out = {}
    for name in sorted(plain):
        chain = _chain(plain, name, lambda m, name=name: name in plain.get(m, ()))
        if chain:
            out[name] = " -> ".join(chain + [name])
    return out


def reaches(sources: tuple[str, ...], forbidden: tuple[str, ...], root: Path = SOURCE) -> dict[str, str]:
    """Modules under `sources` whose imports, followed through every module and package `__init__` they
    run, reach a module under `forbidden`: module -> the chain."""
    graph = _graph(root)
    out = {}
    for name in sorted(graph):
        if _under(*sources)(name):
            chain = _chain(graph, name, _under(*forbidden))
            if chain:
                out[name] = " -> ".join(chain)
    return out


def planner_reaches_engine(root: Path = SOURCE) -> dict[str, str]:
    return reaches(("hf_fsdp2.planner",), ("hf_fsdp2.sharding.engine", "hf_fsdp2.shard"), root)


def engine_reaches_planner(root: Path = SOURCE) -> dict[str, str]:
    return reaches(("hf_fsdp2.sharding",), ("hf_fsdp2.planner", "hf_fsdp2.shard"), root)


# What recognises a PeftModel or steps from it to what it wraps: attributes (and getattr/hasattr names) and
# PEFT's class itself. sharding/model_parts.py does it once, at the entry; the rest receive `ModelParts`.
PEFT_UNWRAPPING = {"get_base_model", "base_model", "peft_config", "_get_base_model_class"}
PEFT_CLASSES = {"PeftModel", "PeftModelForCausalLM", "PeftMixedModel"}


def peft_unwrapping(root: Path = SOURCE) -> collections.Counter:
    """(file, name) -> how many times a module other than sharding/model_parts.py uses a PEFT unwrapping name:
    `x.get_base_model()`, `x.base_model.model`, `x.peft_config`, getattr/hasattr(x, "peft_config"), `PeftModel`."""
    found = collections.Counter()
    for path in sorted((root / "hf_fsdp2").rglob("*.py")):
        rel = path.relative_to(root / "hf_fsdp2").as_posix()
        if rel == "sharding/model_parts.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if isinstance(node, ast.Attribute) and node.attr in PEFT_UNWRAPPING | PEFT_CLASSES:
                name = node.attr
            elif isinstance(node, ast.Name) and node.id in PEFT_CLASSES:
                name = node.id
            elif isinstance(node, ast.alias) and node.name.split(".")[-1] in PEFT_CLASSES:
                name = node.name.split(".")[-1]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1
                  and isinstance(node.args[1], ast.Constant) and node.args[1].value in PEFT_UNWRAPPING):
                name = node.args[1].value
            if name:
                found[(rel, name)] += 1
    return found


def planner_backends(root: Path = SOURCE) -> dict[str, str]:
    """planner/ modules that name a quantization backend: bitsandbytes imported, transformers'
    `BitsAndBytesConfig` used, or a format's own module (quantization/bnb_4bit.py) imported. The planner asks
    quantization/quantized.py for the base an estimate wants (`for_estimate`) and for its bytes."""
    out = {}
    for path in sorted((root / "hf_fsdp2" / "planner").rglob("*.py")):
        found = {m for m in _imports(path, root) if m == "hf_fsdp2.quantization.bnb_4bit"}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.split(".")[0] == "bitsandbytes"}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "bitsandbytes":
                found.add(node.module)
            elif isinstance(node, ast.alias) and node.name == "BitsAndBytesConfig":
                found.add(node.name)
            elif (isinstance(node, ast.Name) and node.id == "BitsAndBytesConfig") or (
                    isinstance(node, ast.Attribute) and node.attr == "BitsAndBytesConfig"):
                found.add("BitsAndBytesConfig")
        if found:
            out[path.relative_to(root / "hf_fsdp2").as_posix()] = ", ".join(sorted(found))
    return out


# A technique is one module (issue 62): what names a technique, and where it may be named. The vocabulary is what
# the code handles, not what a file calls it: the settings, the technique's module, its functions and classes, the
# upstream classes and functions it applies (a file importing `activation_offload as lever` still names it).
TECHNIQUES = {
    "tensor parallelism": ("sharding/tensor_parallel.py", {
        "tp_size", "TP_DIM", "tensor_parallel", "apply_tensor_parallel", "is_tensor_parallel", "plan_with_lora",
        "tp_plan", "_tp_plan", "base_model_tp_plan", "parallelize_module", "ColwiseParallel", "RowwiseParallel"}),
    "context parallelism": ("sharding/context_parallel.py", {
        "cp_size", "CP_DIM", "context_parallel", "enable_cpu_ring_attention", "require_context_parallel",
        "context_parallel_active", "refuse_padding", "_templated_ring_attention", "context_parallel_unshard",
        "maybe_context_parallel"}),
    "expert parallelism": ("sharding/expert_parallel/", {
        "ep_size", "EP_DIM", "EFSDP_DIM", "expert_parallel", "expert_lora", "expert_dispatch", "apply_expert_parallel",
        "shard_experts", "expert_mesh", "experts_mesh", "DISPATCH_STYLE", "ep_plan", "_ep_plan", "base_model_ep_plan",
        "apply_expert_parallelism"}),
    "fp8": ("quantization/fp8.py", {
        "fp8", "float8", "Fp8Conversion", "has_fp8", "gather_float8_as_bytes", "precompute_scales", "Float8Linear",
        "Float8LinearConfig", "convert_to_float8_training", "enable_fsdp_float8_all_gather",
        "precompute_float8_dynamic_scale_for_fsdp"}),
    # and every name with "4bit" in it (Linear4bit, Params4bit, load_in_4bit, bnb_4bit_*, Quant4bitSpec)
    "4-bit": ("quantization/bnb_4bit.py", {"quant_state", "QuantState", "BitsAndBytesConfig"}),
    "activation offload": ("sharding/activation_offload.py", {
        "activation_offload", "apply_activation_offload", "saved_tensor_hooks", "save_on_cpu"}),
    "selective checkpointing": ("sharding/selective_checkpoint.py", {
        "checkpoint_save_matmuls", "save_matmuls", "selective_checkpoint", "SAVED_OPS", "context_fn",
        "checkpoint_kwargs", "without_cache_in_training", "create_selective_checkpoint_contexts"}),
    "compile": ("sharding/compile/", {
        "compile", "compile_layers", "is_compiled", "disable_cache_in_training", "no_cache_in_training",
        "_compiled_call_impl", "compiled_collectives"}),
    "sequence parallelism": ("sharding/sequence_parallel.py", {
        "sp_size", "SP_DIM", "sequence_parallel", "apply_sequence_parallel", "split_batch"}),
    "sequence tiling": ("sharding/sequence_tiling.py", {
        "loss_tile_size", "mlp_tile_size", "sequence_tiling", "apply_sequence_tiling", "TiledMLP",
        "tiled_causal_lm_loss", "refuse_loss_tiling"}),
}
# Besides its module: its config section, its planner cost and the one place that applies techniques in order. A
# quantization format is applied through the format dispatcher (quantization/quantized.py), which the engine calls.
TECHNIQUE_PLACES = ("config.py", "planner/memory.py", "sharding/engine.py")
FORMAT_PLACES = ("config.py", "planner/memory.py", "quantization/quantized.py")
SEAM_TABLE = "runtime/upstream.py"  # its PRIVATE entries declare the private names other modules read


def _names(tree: ast.AST, seam_table: bool = False):
    """Every name a module uses or defines: names, attributes, imported modules and names (each dotted part),
    keywords, parameters, definitions, and string constants that are identifiers (getattr(config, "fp8"), a
    field list). `re.compile` and the like are the regular-expression module's, no technique's; so is the name a
    `Private(...)` entry declares (runtime/upstream.py's table of every private name another module reads, which
    the seams rule requires: the module that reads it names it)."""
    declared = {id(arg) for node in ast.walk(tree) if seam_table and isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name) and node.func.id == "Private" for arg in node.args}
    for node in ast.walk(tree):
        if id(node) in declared:
            continue
        if isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, ast.Attribute):
            if not (isinstance(node.value, ast.Name) and node.value.id == "re"):
                yield node.attr
        elif isinstance(node, ast.alias):
            yield from node.name.split(".")
            if node.asname:
                yield node.asname
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield from node.module.split(".")
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.arg
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, ast.arg):
            yield node.arg
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            yield node.value


def technique_files(root: Path = SOURCE) -> dict[str, set[str]]:
    """technique -> the files of hf_fsdp2/ naming it (the command line, cli.py and tools/, not counted)."""
    out: dict[str, set[str]] = {name: set() for name in TECHNIQUES}
    for path in sorted((root / "hf_fsdp2").rglob("*.py")):
        rel = path.relative_to(root / "hf_fsdp2").as_posix()
        if rel == "cli.py" or rel.startswith("tools/"):
            continue
        names = set(_names(ast.parse(path.read_text()), seam_table=rel == SEAM_TABLE))
        for technique, (_, vocabulary) in TECHNIQUES.items():
            if names & vocabulary or (technique == "4-bit" and any("4bit" in n for n in names)):
                out[technique].add(rel)
    return out


def technique_spread(root: Path = SOURCE, techniques: dict = TECHNIQUES) -> dict[str, set[str]]:
    """technique -> the files naming it besides its module, config.py, its planner cost and the applying place. A
    module that is a package ("sharding/expert_parallel/") is every file under it."""
    out = {}
    for technique, files in technique_files(root).items():
        module = techniques[technique][0]
        allowed = {*(FORMAT_PLACES if module.startswith("quantization/") and technique != "fp8" else TECHNIQUE_PLACES)}
        out[technique] = {f for f in files - allowed
                          if not (f == module or (module.endswith("/") and f.startswith(module)))}
    return out


# The state is handed along (issue 62): the record of a sharded model and its PEFT parts are looked up from the bare
# model where a model comes in, and handed to what those modules call. The entry modules; and where the lookups
# are defined (sharding/record.py's is_sharded and refusal are lookups for the entries).
STATE_LOOKUPS = {"record_of", "model_parts"}
ENTRY_MODULES = ("shard.py", "sharding/engine.py", "checkpoint/pretrained.py", "checkpoint/loading.py",
                 "checkpoint/state.py", "integrations/", "sharding/record.py", "sharding/model_parts.py")


def state_lookups(root: Path = SOURCE) -> collections.Counter:
    """file -> calls of `record_of(...)` / `model_parts(...)` (by name or as an attribute) outside the entry
    modules."""
    found = collections.Counter()
    for path in sorted((root / "hf_fsdp2").rglob("*.py")):
        rel = path.relative_to(root / "hf_fsdp2").as_posix()
        if rel.startswith(ENTRY_MODULES):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
                if name in STATE_LOOKUPS:
                    found[rel] += 1
    return found


# Every field of the record has one writing module (issue 62). A write: an assignment (plain, augmented, in a tuple,
# or to an item of the field) to `<record>.<field>`, or setattr(<record>, "<field>", ...), where <record> is a call
# of record_of(...) or ShardedModel(...), or a name a function binds to one, or annotates as ShardedModel.
RECORD_CLASS = "ShardedModel"


def _record_fields(root: Path) -> set[str]:
    tree = ast.parse((root / "hf_fsdp2" / "sharding" / "record.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == RECORD_CLASS)
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _makes_record(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    return (func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None) in (
        "record_of", RECORD_CLASS)


def _record_names(function: ast.AST) -> set[str]:
    """Names a function binds to a record: parameters or variables annotated as one, or assigned one."""
    names = set()
    for node in ast.walk(function):
        if isinstance(node, ast.arg) and node.annotation is not None and RECORD_CLASS in ast.unparse(node.annotation):
            names.add(node.arg)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and (
                RECORD_CLASS in ast.unparse(node.annotation) or (node.value is not None and _makes_record(node.value))):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign) and _makes_record(node.value):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def record_writers(root: Path = SOURCE) -> dict[str, set[str]]:
    """field of the record (sharding/record.py's ShardedModel) -> the files of hf_fsdp2/ that write it."""
    fields = _record_fields(root)
    out: dict[str, set[str]] = {name: set() for name in fields}
    for path in sorted((root / "hf_fsdp2").rglob("*.py")):
        rel = path.relative_to(root / "hf_fsdp2").as_posix()
        tree = ast.parse(path.read_text())
        for function in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            names = _record_names(function)

            def is_record(node: ast.AST, names=names) -> bool:
                return _makes_record(node) or (isinstance(node, ast.Name) and node.id in names)

            for node in ast.walk(function):
                targets = (node.targets if isinstance(node, ast.Assign) else
                           [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
                for target in [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]:
                    while isinstance(target, ast.Subscript):  # an item of the field: the field changes
                        target = target.value
                    if isinstance(target, ast.Attribute) and target.attr in fields and is_record(target.value):
                        out[target.attr].add(rel)
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                        and len(node.args) > 1 and is_record(node.args[0]) and isinstance(node.args[1], ast.Constant)
                        and node.args[1].value in fields):
                    out[node.args[1].value].add(rel)
    return out


def shared_record_fields(root: Path = SOURCE) -> dict[str, str]:
    """Fields of the record written by more than one module: field -> the modules."""
    return {field: ", ".join(sorted(files)) for field, files in record_writers(root).items() if len(files) > 1}


# ---------------------------------------------------------------------------------------------
# Known violations: each one a fix owed (issue 62), listed so that a new one fails and a fixed one must go.

KNOWN_PEFT_UNWRAPPING = collections.Counter({
    # the tuner (PeftModel.base_model) whose merge methods are refused on split experts (issue 62)
    ("sharding/expert_parallel/lora.py", "base_model"): 1,
})

# Files naming a technique beyond its four places, measured at de2aec5 (73 files of hf_fsdp2/ besides cli.py and
# tools/; files naming it / beyond the four): TP 14 / 10, CP 12 / 8, EP 12 / 8, FP8 13 / 9, 4-bit 4 / 1, activation
# offload 7 / 3, selective checkpointing 8 / 4, compile 9 / 6, sequence parallelism 1 / 1. Mostly other techniques'
# and the integrations' refusals and mappings by field name, the planner's layout and report, the mesh's dimensions.
# 4-bit since: 3 files, none beyond (its module, the format dispatcher, the planner's estimate keywords).
KNOWN_TECHNIQUE_SPREAD = {
    # none since: planner/parallel_shapes.py is tensor_parallel.py's (TP on paper); compile="model" refuses tp_size /
    # cp_size in config.py; check_shard_group needs no tp_size (config.py refuses ep with tp or cp); the report says
    # what memory.py words (MemoryEstimate.model_parallel, shard_of, ...); the layout tries the model-parallel splits
    # memory.parallel_choices lists (a Candidate reads their settings as attributes; plan_layout's tp_sizes / cp_sizes
    # keywords are handed to it as they are); config.py holds TP_DIM and the dimensions that split the model
    # (build_mesh adds FSDP2Config.model_split_dims, data_parallel_mesh leaves MODEL_SPLIT_DIMS out); adopt.py reads
    # back the settings of transformers' mesh dimensions config.py lists (TRANSFORMERS_DIM_SETTINGS); parallel_plans.py
    # returns transformers' plans as it resolves them, the technique takes its own and words its refusal; Accelerate's
    # parallelism_config sizes are mapped by config.ACCELERATE_PARALLEL_SIZES (accelerate_settings.py, accelerate.py)
    "tensor parallelism": set(),
    # none since: Accelerate's prepare asks the engine (refuse_accelerate_settings: a CP backend other than torch's;
    # prepare_accelerator: context_parallel.check_accelerate_context wraps Accelerate's CP context). config.py holds
    # CP_DIM and the refusal of a cp_size no mesh carries (build_mesh asks refuse_unbuilt_dims); presharded.py asks the engine (refuse_another_mesh,
    # context_parallel's check); compile="model" refuses cp_size in config.py; the report says what memory.py words,
    # the layout tries memory.parallel_choices; Accelerate's cp_size mapped by config.ACCELERATE_PARALLEL_SIZES (with
    # its ranks in each shard group); upstream.py's PRIVATE entries (torch's ring attention) are declarations the
    # seams rule requires, not counted (its code is)
    "context parallelism": set(),
    # none since: EP is the package sharding/expert_parallel/ (its __init__.py, the token exchange dispatch.py, LoRA
    # on the split experts lora.py). Before (9 -> 2 -> 0): the layout asks memory.py (EP's planner cost) which
    # offloads and shard sizes the settings allow (offload_choices, shard_size_allowed) and memory.py proposes the EP
    # sizes (expert_parallel_options); the report's EP words come from memory.py (model_parallel's ep_size, a mesh
    # part, exchange_words); generate() asks FSDP2Config.forward_exchanges whether ranks must step together;
    # ShardPlan holds inner groups and the function that shards them (the engine hands EP's shard_experts);
    # adopt.py reads TRANSFORMERS_DIM_SETTINGS; presharded.py skips config.UNSET_AGREES_AT_PREPARE;
    # parallel_plans.py returns transformers' plans unopened
    "expert parallelism": set(),
    # adopt.py, expert_parallel.py, tensor_parallel.py, replication.py no more: config.py holds the fields that
    # decide sharding (SHARDING_FIELDS) and what TP, EP and DDP's reducer are not done with (not_done_with)
    # checkpoint/weights_io.py no more: it asks the engine to recompute what the techniques derive from the weights
    # groups.py no more: the engine and the estimate leave FP8's frozen weights in FSDP2's groups themselves
    # accelerate_settings.py no more: `mixed_precision: fp8` stands for config.ACCELERATE_PRECISIONS' settings.
    # record.py no more: quantization/fp8.py keeps its conversion report itself (fp8.conversion(model)).
    # accelerate.py no more: Accelerate's prepare asks the engine (refuse_accelerate_settings: fp8's
    # refuse_accelerate_backend; prepared_by_accelerate attaches the scales' update to the prepared optimizers)
    "fp8": set(),
    "4-bit": set(),  # the report names a quantized base as its format does (MetaQuantization.name, .storage)
    # none since: the layout tries the activation choices its planner cost lists (memory.activation_choices);
    # adopt.py and expert_parallel.py ask config.py (SHARDING_FIELDS, FSDP2Config.not_done_with)
    "activation offload": set(),
    # none since: the trace and the report count what they are handed (the kept ops, the checkpointed layers and
    # what each keeps) by planner/memory.py, and the layout tries memory.activation_choices
    "selective checkpointing": set(),
    # none since: compile is the package sharding/compile/ (regional compilation in its __init__.py, compile="model"
    # in compiled_collectives.py); adopt.py, expert_parallel.py and tensor_parallel.py ask config.py; generation.py
    # asks the record's `gather` (a ParameterGather) to keep what it gathers; compile/ remembers the models it took
    # the training cache from (no record field)
    "compile": set(),
    # none since: Accelerate's prepare asks the engine: its own sp_size (DeepSpeed's) refused
    # (refuse_accelerate_settings), the prepared model split in forward (prepared_by_accelerate), how many neighbouring
    # ranks its data loader and gather_for_metrics give the same rows (ranks_sharing_rows, refuse_dispatched_rows)
    "sequence parallelism": set(),
    "sequence tiling": set(),  # written in this shape (issue 63): its module, config.py, planner/memory.py, the engine
}

# record_of / model_parts called outside the entry modules, by file: 18 at 37ccd24, 1 since (the engine looks the
# record up once and hands it to compiled_collectives, replication's compute cast, generation; context
# parallelism gets the parts; shard.py keeps the planner's plan; checkpoint's export and weights plan get the parts,
# full_weights the parts and mesh from TRL's entry; groups.py takes the parts from its callers, the engine, the
# planner and tools/config_writer.py, which builds a model from a config: no PEFT; the trace's copy gets the parts
# memory.py knows). Left: the planner's meta model comes in at memory.py (estimate_memory / prepare_meta_model
# take a bare model or a PeftModel: the planner's entry).
KNOWN_STATE_LOOKUPS = collections.Counter({"planner/memory.py": 1})


# ---------------------------------------------------------------------------------------------
# The package


def test_imports_go_only_downward():
    assert upward_imports() == {}


def test_no_import_cycles():
    """quantization/: the formats and the interface both import protocol.py, the interface the formats."""
    assert import_cycles() == {}


def test_the_engine_never_imports_the_planner():
    """sharding/ is handed a resolved layout (hf_fsdp2/shard.py plans it first)."""
    assert engine_reaches_planner() == {}


def test_the_planner_never_imports_the_engine():
    """Followed through sharding/__init__.py: importing sharding.groups runs it, so it re-exports nothing of the
    engine (whoever applies a layout imports sharding.engine itself)."""
    assert planner_reaches_engine() == {}


def test_peft_is_unwrapped_in_one_module():
    """A PeftModel is recognised and unwrapped by sharding/model_parts.py alone (issue 50): entry points make one
    `ModelParts`, what they call receives the parts."""
    assert peft_unwrapping() == KNOWN_PEFT_UNWRAPPING


def test_a_technique_is_named_in_its_own_places():
    """Each technique's names (TECHNIQUES) appear only in its module, config.py, its planner cost
    (planner/memory.py) and the one place that applies techniques in order (sharding/engine.py; a quantization
    format: the dispatcher, quantization/quantized.py), at most 4 files; the files beyond are listed as known, a
    ratchet: a new file naming a technique fails, and one that stops naming it must leave the list."""
    assert technique_spread() == KNOWN_TECHNIQUE_SPREAD


def test_the_state_is_handed_along():
    """A model's record and parts are looked up where the model comes in (shard.py, the engine, checkpoint's
    pretrained/loading/state, integrations/) and handed to what those call; elsewhere a ratchet of known sites."""
    assert state_lookups() == KNOWN_STATE_LOOKUPS


def test_every_field_of_the_record_has_one_writing_module():
    """sharding/record.py's ShardedModel: each field written by one module (the engine: config, mesh, the sharded
    object; integrations/deferred_load.py: the deferred checkpoint and what was loaded before prepare; ...);
    others hand the writer what it writes (presharded.py: engine.keep_async_save; loading.py: the fill's values)."""
    writers = record_writers()
    assert shared_record_fields() == {}
    assert writers["config"] == writers["mesh"] == {"sharding/engine.py"}  # the scan sees a write
    assert writers["deferred_checkpoint"] == {"integrations/deferred_load.py"}


def test_the_planner_knows_no_quantization_backend():
    assert planner_backends() == {}


def test_the_scan_sees_an_import():
    """The scan is not vacuous: relative imports, at module level or inside a function, are resolved."""
    assert "hf_fsdp2.runtime.distributed" in _imports(PACKAGE / "sharding" / "engine.py")
    assert "hf_fsdp2.runtime.host_allocator" in _imports(PACKAGE / "planner" / "layout.py")  # inside a function
    assert {"hf_fsdp2.sharding", "hf_fsdp2.sharding.groups"} <= _imports(PACKAGE / "planner" / "memory.py")
    assert "hf_fsdp2.planner.layout" in _imports(PACKAGE / "shard.py")
    assert "hf_fsdp2.sharding.engine" in _imports(PACKAGE / "shard.py")
    assert "hf_fsdp2.sharding.engine" not in _imports(PACKAGE / "sharding" / "__init__.py")
    assert "hf_fsdp2" not in _imports(PACKAGE / "sharding" / "__init__.py")
    assert all(_layer(m) is not None for m in _modules(SOURCE) if m != "hf_fsdp2")  # every module has a layer


# ---------------------------------------------------------------------------------------------
# Each rule fails on a deliberate violation (a copy of the package with one line added)


def _violated(tmp_path: Path, file: str, line: str) -> Path:
    shutil.copytree(PACKAGE, tmp_path / "hf_fsdp2", ignore=shutil.ignore_patterns("__pycache__"))
    path = tmp_path / "hf_fsdp2" / file
    path.write_text(path.read_text() + "\n\n" + line + "\n")
    return tmp_path


@pytest.mark.parametrize("file, line, rule, offender", [
    ("quantization/fp8.py", "def f():\n    from ..integrations import trainer", upward_imports,
     "hf_fsdp2.quantization.fp8"),
    ("runtime/collectives.py", "from hf_fsdp2.checkpoint.errors import CheckpointError", upward_imports,
     "hf_fsdp2.runtime.collectives"),
    ("sharding/groups.py", "from .engine import shard_planned", import_cycles, "hf_fsdp2.sharding.groups"),
    ("planner/meta_model.py", "def f():\n    from ..sharding.engine import shard_planned", planner_reaches_engine,
     "hf_fsdp2.planner.meta_model"),
    # the package's __init__ re-exporting the engine again: every planner module importing sharding/ reaches it
    ("sharding/__init__.py", "from .engine import shard_planned", planner_reaches_engine, "hf_fsdp2.planner.memory"),
    ("sharding/record.py", "from ..planner import layout", engine_reaches_planner, "hf_fsdp2.sharding.record"),
    ("quantization/protocol.py", "def f():\n    from . import quantized", import_cycles,
     "hf_fsdp2.quantization.protocol"),
    ("planner/memory.py", "def f():\n    from transformers import BitsAndBytesConfig", planner_backends,
     "planner/memory.py"),
    ("planner/layout.py", "def f():\n    import bitsandbytes.functional", planner_backends, "planner/layout.py"),
    ("planner/meta_model.py", "from ..quantization import bnb_4bit", planner_backends, "planner/meta_model.py"),
    ("planner/memory.py", "def f(transformers):\n    return transformers.BitsAndBytesConfig()", planner_backends,
     "planner/memory.py"),
    # a second module writing a field of the record: on a lookup, a name bound to one, an annotated parameter
    ("sharding/grad_clip.py", "def f(model):\n    record_of(model).mesh = None", shared_record_fields, "mesh"),
    ("checkpoint/loading.py", "def f(model):\n    record = record_of(model)\n    record.deferred_checkpoint = None",
     shared_record_fields, "deferred_checkpoint"),
    ("integrations/presharded.py",
     "def f(record: ShardedModel, config):\n    record.layout, record.config = None, config",
     shared_record_fields, "config"),
    ("sharding/generation.py", "def f(model):\n    setattr(record_of(model), 'gather', None)", shared_record_fields,
     "gather"),
])
def test_a_rule_reports_a_new_violation(tmp_path, file, line, rule, offender):
    assert offender not in rule()
    assert offender in rule(_violated(tmp_path, file, line))


@pytest.mark.parametrize("line, name", [
    ("def f(model):\n    return model.get_base_model()", "get_base_model"),
    ("def f(model):\n    return model.base_model.model", "base_model"),
    ("def f(model):\n    return hasattr(model, 'peft_config')", "peft_config"),
    ("def f(model):\n    from peft import PeftModel\n    return isinstance(model, PeftModel)", "PeftModel"),
])
def test_the_peft_rule_reports_a_new_call_site(tmp_path, line, name):
    assert set(peft_unwrapping(_violated(tmp_path, "sharding/engine.py", line)) - KNOWN_PEFT_UNWRAPPING) == {
        ("sharding/engine.py", name)}


@pytest.mark.parametrize("file, line, technique", [
    ("checkpoint/header.py", "def f(config):\n    return config.activation_offload", "activation offload"),
    # renamed on import: the module's name is still there
    ("checkpoint/header.py", "def f():\n    from ..sharding import compile as lever", "compile"),
    ("checkpoint/header.py", "def f(config):\n    return getattr(config, 'tp_size')", "tensor parallelism"),
    ("checkpoint/header.py", "def f(module):\n    return type(module).__name__ == 'Linear4bit'", "4-bit"),
    # the seam table's declarations aside, its code still counts
    ("runtime/upstream.py", "def f(config):\n    return config.cp_size", "context parallelism"),
    # the files issue 62 emptied: Accelerate's prepare, the record, a module outside compile's package
    ("integrations/accelerate.py", "def f(config):\n    return config.sp_size", "sequence parallelism"),
    ("integrations/accelerate.py", "def f(model):\n    from ..quantization import fp8\n    return fp8.has_fp8(model)",
     "fp8"),
    ("sharding/record.py", "def f(record):\n    return record.fp8", "fp8"),
    ("sharding/generation.py", "def f():\n    from .compile import compiled_collectives", "compile"),
])
def test_the_technique_rule_reports_a_new_file(tmp_path, file, line, technique):
    before = technique_spread()[technique]
    assert file not in before
    assert technique_spread(_violated(tmp_path, file, line))[technique] == before | {file}


def test_a_package_is_one_module(tmp_path):
    """A technique's module may be a package: every file under it is the module. EP's package
    (sharding/expert_parallel/: its __init__.py, the token exchange dispatch.py, LoRA on the split experts lora.py)
    leaves EP named nowhere beyond its places; counted as its __init__.py alone, the other two count, and a new
    file naming EP outside the package counts either way."""
    tree = _violated(tmp_path, "checkpoint/header.py", "def f(config):\n    return config.ep_size")
    assert technique_spread(tree)["expert parallelism"] == {"checkpoint/header.py"}
    as_one_file = {**TECHNIQUES, "expert parallelism": ("sharding/expert_parallel/__init__.py",
                                                        TECHNIQUES["expert parallelism"][1])}
    assert technique_spread(tree, as_one_file)["expert parallelism"] == {
        "checkpoint/header.py", "sharding/expert_parallel/dispatch.py", "sharding/expert_parallel/lora.py"}


@pytest.mark.parametrize("line", [
    "def f(model):\n    return record_of(model).config",
    "def f(model):\n    from . import record\n    return record.record_of(model, create=True)",
    "def f(model):\n    return model_parts(model).base",
])
def test_the_state_rule_reports_a_new_call_site(tmp_path, line):
    found = state_lookups(_violated(tmp_path, "sharding/activation_offload.py", line))
    assert found - state_lookups() == collections.Counter({"sharding/activation_offload.py": 1})


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
