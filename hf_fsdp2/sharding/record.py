"""What hf_fsdp2 knows about a model it sharded, in one typed record attached in one place.

`shard_model` attaches it; it is read through `record_of` / `is_sharded`, never through attributes of
their own on the user's model: where a model comes in (shard.py, the engine, checkpoint's pretrained / loading /
state, integrations/) it is looked up once, with the model's parts, and handed to what that entry calls (the checks
here take the record and what they compare, not the model). Fields fill in as the model goes through
sharding: the auto layout is chosen before the mesh exists, the mesh and config come with
`fully_shard`. (Per-module facts stay with the module that owns them: a quantized layer's weight,
`quantization.quantized.weights`.)
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Protocol

import torch
import torch.nn as nn

from ..runtime import upstream
from .model_parts import ModelParts, model_parts

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ..config import FSDP2Config


# The shapes of what modules that import this one keep here (importing them back would be a cycle, and planner/
# is a layer above): each a Protocol their object satisfies, naming what is read of it.

class LayoutChoice(Protocol):
    """planner/layout.py's LayoutPlan: the candidates costed and the one chosen."""

    @property
    def candidates(self) -> tuple[Any, ...]: ...

    @property
    def chosen(self) -> Any: ...

    @property
    def smallest_workable_budget(self) -> int: ...

    @property
    def returns_freed_memory(self) -> bool: ...


class ComputeCast(Protocol):
    """sharding/compute_cast.py's casts: the dtype, every group's (module, name, parameter), held for generate()."""

    dtype: torch.dtype
    entries: list[tuple[nn.Module, str, nn.Parameter]]
    held: bool


class ParameterGather(Protocol):
    """sharding/compile/compiled_collectives.py's gather of the stored parameters (compile="model"), which generation
    asks to keep what it gathers."""

    kept: dict[int, torch.Tensor] | None  # inside generation: gathered weights by id

    def gathered_once(self, model: nn.Module, budget: int) -> contextlib.AbstractContextManager[bool]: ...

    def gathered_bytes(self, model: nn.Module) -> int: ...

_ATTRIBUTE = "_hf_fsdp2"  # the one attribute hf_fsdp2 sets on a user's model


@dataclasses.dataclass
class ShardedModel:
    config: FSDP2Config | None = None  # the resolved config it was sharded with
    mesh: DeviceMesh | None = None  # set once fully_shard has run: the model is hf_fsdp2's
    # id() of the object sharded (a PeftModel, or the model itself): a PeftModel wrapped around the model after
    # sharding is not sharded (its adapters are in no group), though it finds the same record.
    sharded_object: int | None = None
    layout: LayoutChoice | None = None  # when shard_size="auto" chose the layout (hf_fsdp2/shard.py keeps it)
    generating: bool = False  # inside generation.gathered_for_generation
    compute_cast: ComputeCast | None = None  # when DDP's reducer trains with a param_dtype cast
    gather: ParameterGather | None = None  # compile="model": the parameters' gather (its generation cache)
    deferred_checkpoint: Path | None = None  # integrations/deferred_load.py: the directory prepare() reads rows from
    # integrations/deferred_load.py, for a model on meta until prepare: values loaded into it (id -> (tensor,
    # value, name)); each meta tensor's version counter when its values were last known (id -> (name, tensor,
    # version)): an in-place change after that is lost on meta. (What prepare writes over the directory's rows is
    # handed to the fill: checkpoint/loading.py's `Deferred.values`.)
    deferred_loaded: dict[int, tuple[torch.Tensor, torch.Tensor, str]] = dataclasses.field(default_factory=dict)
    deferred_versions: dict[int, tuple[str, torch.Tensor, int]] = dataclasses.field(default_factory=dict)
    # the transformers model's parameter names once sharded: one added later is in no group (note_parameters)
    parameter_names: frozenset[str] | None = None


def record_of(model: nn.Module | ModelParts, create: bool = False) -> ShardedModel | None:
    """The model's record (None if it has none and not `create`). It lives on the transformers model: a
    `PeftModel` and the model it wraps share one record, whichever of the two is passed. An entry passes the
    parts it made (nothing unwrapped again) and hands the record on."""
    holder = (model if isinstance(model, ModelParts) else model_parts(model)).base
    record = holder.__dict__.get(_ATTRIBUTE)
    if record is None and create:
        record = ShardedModel()
        upstream.tag(holder, _ATTRIBUTE, record)  # nn.Module.__setattr__ would not register a dataclass anyway
    return record


def is_sharded(model: nn.Module | ModelParts, record: ShardedModel | None = None) -> bool:
    """Sharded by hf_fsdp2 (`shard_model` finished); `record`: the one an entry looked up for these parts."""
    parts = model if isinstance(model, ModelParts) else model_parts(model)
    return sharded(record if record is not None else record_of(parts), id(parts.model), parts.has_peft)


def sharded(record: ShardedModel | None, model_id: int, has_peft: bool) -> bool:
    """`is_sharded` where an entry holds the record and the parts (`id(parts.model)`, `parts.has_peft`): nothing
    looked up again. A PeftModel wrapped around the model after it was sharded is not (its adapters are in no
    group), though it finds the same record."""
    return record is not None and record.mesh is not None and (model_id == record.sharded_object or not has_peft)


# What PEFT puts in the name of a parameter it moves under its wrapper (the same tensor, still in its group).
_PEFT_RENAMES = (".base_layer", ".original_module")


def _unrenamed(name: str) -> str:
    for step in _PEFT_RENAMES:
        name = name.replace(step, "")
    return name


def note_parameters(record: ShardedModel, names: Iterable[str]) -> None:
    """The names of the parameters the model had when it was sharded (those in its groups; the engine hands the
    transformers model's). By name, not identity: FSDP2 registers other tensor objects while a group is
    gathered."""
    record.parameter_names = frozenset(_unrenamed(name) for name in names)


def refuse_parameters_added_after(record: ShardedModel | None, names: Iterable[str], model_name: str) -> None:
    """Parameters that appeared in a model after hf_fsdp2 sharded it (PEFT applied to what
    `hf_fsdp2.from_pretrained` returned: `get_peft_model`, transformers' `add_adapter`) are in none of its groups:
    plain tensors, so each rank would train its own copy, unsynchronised (Accelerate's prepare passed such a model
    through as it was), and LoRA on split experts would fold every expert into each rank's rows. Refused where
    it would be sharded or prepared (`shard_model`, Accelerate's prepare). `record`: the model's (None: none);
    `names`: the transformers model's parameter names now; `model_name`: its class's name."""
    if record is None or record.parameter_names is None:
        return
    added = [name for name in names if _unrenamed(name) not in record.parameter_names]
    if not added:
        return
    name = model_name.removeprefix("FSDP")
    raise NotImplementedError(
        f"{len(added)} parameters appeared in the {name} after hf_fsdp2 sharded it ({', '.join(added[:3])}"
        f"{', ...' if len(added) > 3 else ''}): they are in none of its groups (each rank would train its own copy, "
        "unsynchronised). PEFT comes before sharding: give the adapters to hf_fsdp2 with the model, "
        "hf_fsdp2.from_pretrained(..., peft_config=LoraConfig(...)), then, for a trained adapter, "
        "hf_fsdp2.load_pretrained(model, adapter_dir) (each rank reads its rows); or apply PEFT before "
        "shard_model / prepare.")
