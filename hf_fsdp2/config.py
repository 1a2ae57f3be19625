"""`FSDP2Config`: every sharding knob, validated once at construction.

Nothing here touches torch.distributed; the sharding engine turns a config into FSDP2 policies.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Literal, Mapping

import torch

SP_DIM = "sp"  # the mesh dimension of Ulysses sequence parallelism (Accelerate's name)
TP_DIM = "tp"  # the mesh dimension of tensor parallelism: its ranks hold the same batch (model_split_dims)
MODEL_SPLIT_DIMS = (TP_DIM,)  # mesh dimensions whose ranks hold the same batch and split the model
EP_DIM = "ep"  # the expert mesh's dimension of expert parallelism (sharding/expert_parallel/ builds that mesh)
# The setting each mesh dimension's size is, by the names transformers' DistributedConfig gives its dimensions (a dense
# mesh, and an expert one with "ep"): sharding/adopt.py reads them back from a model transformers sharded at load
TRANSFORMERS_DIM_SETTINGS = {"dp_replicate": "replicate_size", TP_DIM: "tp_size", EP_DIM: "ep_size"}
CP_DIM = "cp"  # the mesh dimension of context parallelism: Accelerate's parallelism_config builds it; hf_fsdp2 only
# with sp_size (ring attention across cp, Ulysses within: sequence_split_dims)


def no_cp_mesh(cp_size: int, mesh: Any = None) -> str:
    """The refusal of a `cp_size` no mesh carries: hf_fsdp2 builds no "cp" dimension of its own (build_mesh asks
    `FSDP2Config.refuse_unbuilt_dims`, the engine checks a given mesh)."""
    where = f"the mesh {dict(zip(mesh.mesh_dim_names or (), mesh.shape))} has none" if mesh is not None else \
        "hf_fsdp2.build_mesh builds one only with sp_size (Ulysses within, ring attention across)"
    return (f"`cp_size`={cp_size} needs a device mesh with a 'cp' dimension and {where}: let Accelerate's "
            f"parallelism_config (cp_size) build it, as accelerate_configs/fsdp2_cp.yaml does.")

_DTYPE_ALIASES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(value: Any, field_name: str) -> torch.dtype | None:
    """`None`, a `torch.dtype` or a name such as "bf16" -> a floating `torch.dtype` (or None)."""
    if value is None or isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in ("", "none", "no"):
            return None
        if key not in _DTYPE_ALIASES:
            raise ValueError(
                f"`{field_name}`={value!r} is not a dtype; use one of {sorted(_DTYPE_ALIASES)} or None."
            )
        dtype = _DTYPE_ALIASES[key]
    else:
        raise TypeError(f"`{field_name}` must be a torch.dtype, a dtype name or None, got {type(value).__name__}.")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"`{field_name}`={dtype} must be a floating-point dtype.")
    return dtype


def parse_bool(value: Any, field_name: str) -> bool:
    """Booleans as they arrive from yaml, env vars and CLI flags."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"`{field_name}`={value!r} is not a boolean; use true or false.")


def _parse_compile(value: Any) -> bool | str:
    """False, True (regional: each decoder layer) or "model" (the whole forward, collectives traced)."""
    if isinstance(value, str) and value.strip().lower() in ("model", "regional"):
        return "model" if value.strip().lower() == "model" else True
    try:
        return parse_bool(value, "compile")
    except ValueError:
        raise ValueError(f"`compile`={value!r} is not one of true (regional: each decoder layer compiled), "
                         "'model' (the whole forward with its collectives, bucketed by inductor) or false.") from None


def _parse_names(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        names = [n.strip() for n in value.split(",")]
    elif isinstance(value, (list, tuple, set)):
        names = [str(n).strip() for n in value]
    else:
        raise TypeError(
            f"`layer_cls_names` must be a list of class names or a comma-separated string, got {type(value).__name__}."
        )
    names = [n for n in names if n]
    if not names:
        raise ValueError("`layer_cls_names` is empty; give at least one class name or leave it None "
                         "to use the model's `_no_split_modules`.")
    return tuple(dict.fromkeys(names))


# Accelerate's names (FSDP_AUTO_WRAP_POLICY) and ours.
_WRAP_POLICIES = {"transformer": "transformer", "transformer_based_wrap": "transformer", "size": "size",
                  "size_based_wrap": "size", "none": "none", "no_wrap": "none"}


def _parse_wrap_policy(value: Any) -> str:
    key = str(value).strip().lower() if isinstance(value, str) else None
    if key not in _WRAP_POLICIES:
        raise ValueError(f"`wrap_policy`={value!r} is not one of transformer (TRANSFORMER_BASED_WRAP), "
                         "size (SIZE_BASED_WRAP), none (NO_WRAP).")
    return _WRAP_POLICIES[key]


def _parse_pattern(value: Any) -> str | None:
    """`ignored_modules`: a regular expression of module names, or None."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"`ignored_modules` must be a regular expression string, got {value!r}.")
    if not value:
        raise ValueError("`ignored_modules` is empty: give a regular expression of module names, or leave it unset.")
    try:
        re.compile(value)
    except re.error as e:
        raise ValueError(f"`ignored_modules`={value!r} is not a regular expression ({e}).") from None
    return value


def _parse_replication(value: Any) -> str:
    key = value.strip().lower() if isinstance(value, str) else value
    if key not in ("ddp", "fsdp2"):
        raise ValueError(f"`replication`={value!r} is not one of 'ddp' (torch's replicate, DDP's reducer) "
                         "or 'fsdp2' (FSDP2 with one-rank shard groups).")
    return key


FP8_EXPERT_MODES = ("rowwise", "mxfp8", "mxfp8_emulated")  # sharding/expert_parallel/low_precision.py's


def _parse_fp8_experts(value: Any) -> str | None:
    key = value.strip().lower() if isinstance(value, str) else value
    if key in (None, "", "none", "no", "false", "0"):
        return None
    if key not in FP8_EXPERT_MODES:
        raise ValueError(f"`fp8_experts`={value!r} is not one of {', '.join(map(repr, FP8_EXPERT_MODES))} or None.")
    return key


def _parse_shard_size(value: Any) -> int | str | None:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    return None if value is None else _parse_int(value, "shard_size", 1)


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


MAX_BYTES = 2 ** 63  # sizes travel as int64 (a budget is agreed over ranks)


def parse_bytes(value: Any, field_name: str) -> int:
    """An integer of bytes or a size such as "80GB", "12.5GiB", "512MiB" (GB = 10^9, GiB = 2^30)."""
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        unit = match.group(2).lower() if match else None
        if unit not in _BYTE_UNITS:
            raise ValueError(f"`{field_name}`={value!r} is not a size; use bytes or e.g. \"80GB\", \"12GiB\", \"512MiB\".")
        number = float(match.group(1)) * _BYTE_UNITS[unit]
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = value
    else:
        raise TypeError(f"`{field_name}` must be a number of bytes or a size string such as \"80GB\", got {value!r}.")
    if not math.isfinite(number) or number >= MAX_BYTES:
        raise ValueError(f"`{field_name}`={value!r} is not a finite size below 8 EiB; use bytes or e.g. \"80GB\".")
    if int(number) <= 0:
        raise ValueError(f"`{field_name}`={value!r} must be at least one byte.")
    return int(number)


def _parse_int(value: Any, field_name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"`{field_name}` must be an integer, got {value!r}.")
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"`{field_name}`={value!r} is not an integer.") from None
    if number < minimum:
        raise ValueError(f"`{field_name}`={number} must be >= {minimum}.")
    return number


# The fields that decide how a model is sharded: they cannot change once transformers sharded it at load
# (sharding/adopt.py refuses any of them set on such a model).
SHARDING_FIELDS = ("wrap_policy", "min_num_params", "ignored_modules", "param_dtype", "reduce_dtype", "output_dtype",
                   "reshard_after_forward", "forward_prefetch", "backward_prefetch", "activation_checkpointing",
                   "checkpoint_every", "activation_offload", "cpu_offload", "frozen_dtype", "fp8", "compile",
                   "memory_budget", "fp8_experts")

# Accelerate's settings that stand for settings here (integrations/accelerate_settings.py maps them, for prepare and
# check-config alike): its ParallelismConfig sizes of the same names, each with whether its ranks are part of every
# FSDP2 shard group (Accelerate's dp_shard_size leaves them out: FSDP2 shards over dp_shard x cp), and what each
# `mixed_precision` value sets (gradients are reduced in fp32 whatever it is, where Accelerate would reduce in bf16;
# fp8: the layers' linears in FP8 through torchao, the rest in bf16).
ACCELERATE_PARALLEL_SIZES = {"tp_size": False, "cp_size": True}
ACCELERATE_PRECISIONS = {"bf16": {"param_dtype": "bf16"}, "fp16": {"param_dtype": "fp16"},
                         "fp8": {"param_dtype": "bf16", "fp8": True}}

# Settings Accelerate has none of its own for (HF_FSDP2_* variables or register() set them): left unset there, they
# agree with whatever a model sharded before prepare has (integrations/presharded.py)
UNSET_AGREES_AT_PREPARE = ("ep_size", "fp8_experts")

# What a technique is not done with yet, refused by name where it is applied (`FSDP2Config.not_done_with`, from
# sharding/tensor_parallel.py, expert_parallel.py; replication.py keeps FSDP2 for them instead of DDP's reducer): its
# field -> (setting, how the refusal names it).
_NOT_DONE_WITH = {
    "replication": (("fp8", "`fp8` (FP8 all-gather is FSDP2's)"),
                    ("cpu_offload", "`cpu_offload` (FSDP2's CPU offload)")),
    "tp_size": (("fp8", "`fp8`"), ("compile", "`compile` (regional compilation)")),
    "ep_size": (("fp8", "`fp8`"), ("compile", "`compile`"), ("cpu_offload", "`cpu_offload`"),
                ("activation_offload", "`activation_offload`")),
}


@dataclass(frozen=True)
class FSDP2Config:
    """How `shard_model` shards a model. Every field is validated in `__post_init__`.

    Each field is described by the string right below it (an attribute docstring: the docs site's
    `FSDP2Config` reference is generated from them, and a field without one fails tests/test_readme.py).
    Construction also takes the raw forms yaml, environment variables (`HF_FSDP2_<FIELD>`) and CLI flags carry.
    """

    # Typed as they are after parsing; construction also takes the raw forms yaml, environment variables and
    # CLI flags carry (dtype names such as "bf16", "true"/"false", sizes such as "80GB", comma strings),
    # normalised once in `__post_init__`. Frozen: `replace` gives a changed copy.
    wrap_policy: Literal["transformer", "size", "none"] = "transformer"
    """How modules are grouped, as Accelerate's `fsdp_auto_wrap_policy`: "transformer" (TRANSFORMER_BASED_WRAP:
    one group per `layer_cls_names` module, i.e. per decoder layer, plus the input embedding and [final norm,
    head]), "size" (SIZE_BASED_WRAP: groups by `min_num_params`, bottom-up) or "none" (NO_WRAP: the root group
    only, so any `nn.Module` can be sharded)."""
    layer_cls_names: tuple[str, ...] | None = None
    """Classes that each become one `fully_shard` group (a list or a comma string). None: the model's
    `_no_split_modules`. Used by the "transformer" policy."""
    min_num_params: int = 0
    """The "size" policy's threshold (Accelerate's `fsdp_min_num_params`): the parameters a group collects
    before it closes (every module with more than this many parameters, bottom-up)."""
    ignored_modules: str | None = None
    """A regular expression; modules whose full name matches it are left out of FSDP (replicated, not sharded,
    gradients not reduced), as Accelerate's `fsdp_ignored_modules`."""
    param_dtype: torch.dtype | None = None
    """Dtype parameters are all-gathered and computed in (mixed precision); None keeps theirs."""
    reduce_dtype: torch.dtype | None = torch.float32
    """Dtype gradients are reduce-scattered in. float32 by default: unlike Accelerate, which reduces in bf16
    under `mixed_precision: bf16`, a bf16 `param_dtype` does not silently reduce gradients in bf16."""
    output_dtype: torch.dtype | None = None
    """Dtype of the root module's floating outputs; None leaves them as computed."""
    reshard_after_forward: bool | int = True
    """True frees gathered params after forward (ZeRO-3), False keeps them (ZeRO-2), an int N reshards to
    groups of N ranks (must divide the shard size)."""
    forward_prefetch: int | None = None
    """How many following groups (embedding, layers, [norm, head]) each group prefetches in forward (0: none).
    None (default): 1 on CPU, where FSDP2 has no communication stream and an all-gather only overlaps compute
    when it is issued ahead and asynchronously; 0 on accelerators, where FSDP2's implicit prefetch already
    overlaps on its own stream."""
    backward_prefetch: int = 1
    """How many preceding layers each layer prefetches in backward (FSDP2's default is 1)."""
    activation_checkpointing: bool = False
    """Recompute decoder layers' activations in backward (a non-reentrant checkpoint of each decoder layer)."""
    checkpoint_every: int = 1
    """With `activation_checkpointing`, checkpoint every k-th decoder layer (layers 0, k, 2k, ...; torchtitan's
    selective layer checkpointing, its `selective_ac_option`): 1, every layer; 2 keeps half the layers'
    activations for half the recomputation. The layout planner tries 2 between none and every layer."""
    checkpoint_save_matmuls: bool = False
    """With `activation_checkpointing`, op-level selective checkpointing (sharding/selective_checkpoint.py,
    torchtitan's op-level selective AC through torch's `create_selective_checkpoint_contexts`): a checkpointed
    layer keeps its matmuls' and attention's outputs and recomputes only the cheap ops. The layout planner
    tries it before whole-layer checkpointing."""
    activation_offload: bool = False
    """Move what each decoder layer saves for backward to host memory in forward and back in backward
    (sharding/activation_offload.py; pinned on CUDA; nothing moves on a CPU device). An alternative to
    `activation_checkpointing` (it replaces it): no recomputation, two copies. A layout planner candidate on
    accelerators."""
    cpu_offload: bool = False
    """Keep sharded params, grads and optimizer states in CPU memory."""
    replicate_size: int = 1
    """HSDP replicas (1 = plain FSDP): the mesh is replicate_size x shard_size."""
    shard_size: int | Literal["auto"] | None = None
    """Ranks each replica shards over; None: world_size // replicate_size.

    "auto": the layout planner (planner/layout.py) picks, before anything is allocated, the cheapest layout
    whose estimated peak fits `memory_budget` per rank: the smallest shard group S (HSDP with world/S
    replicas; S=1 is replication, trained with DDP's reducer: `replication`), then `reshard_after_forward`,
    then `activation_checkpointing` (every other layer, then every layer), then `cpu_offload`. With "auto"
    those four are the planner's (a True `activation_checkpointing` or `cpu_offload` you set is kept);
    `replicate_size` must stay 1. `tp_size` (and Accelerate's cp_size) are kept and counted: the planner
    costs the layout with them."""
    tp_size: int = 1
    """Tensor parallelism (sharding/tensor_parallel.py): the model's own TP plan (transformers'
    `base_model_tp_plan`) applied on a "tp" mesh dimension of this many ranks, FSDP2 over the data-parallel
    ranks on top; world size = replicate_size x shard_size x tp_size."""
    cp_size: int = 1
    """Context parallelism (sharding/context_parallel.py): this many of the shard ranks split every sequence
    (torch's `context_parallel`, entered by Accelerate's `maybe_context_parallel`); FSDP2 shards over
    dp_shard x cp. Set from Accelerate's `parallelism_config` (whose mesh has the "cp" dimension); hf_fsdp2
    builds no cp mesh of its own (refused by name without one). Must divide the shard size."""
    sp_size: int = 1
    """Ulysses sequence parallelism (sharding/sequence_parallel.py): this many of the shard ranks each hold
    1/sp_size of every sequence; around the model's own attention an all-to-all turns sequence shards into head
    shards and back; the loss is summed over the valid tokens of all sp ranks and divided by their count. FSDP2
    shards over dp_shard x sp. Must divide the shard size and the model's attention heads; its key/value heads
    must be a multiple of sp_size or divide it (fewer are replicated, as DeepSpeed's ALST does). The batch is split
    along the sequence by `hf_fsdp2.local_batch` in a plain loop; under Accelerate and the Trainer
    (`HF_FSDP2_SP_SIZE`; Accelerate's own parallelism_config sp_size is DeepSpeed's, refused) the prepared data
    loader gives an sp group's ranks the same rows and the model's training forward splits them. With cp_size
    (FSDP2Config / hf_fsdp2.build_mesh, or HF_FSDP2_CP_SIZE / register(cp_size=...) under Accelerate and the
    Trainer, not Accelerate's parallelism_config cp_size: a dp_shard x cp x sp mesh, sp neighbours within a
    machine, cp across, a cp x sp group's ranks loading the same rows there) each rank holds 1/(sp x cp) of every sequence, Ulysses within the sp group, torch's ring attention over the cp
    ranks (sdpa, no padding). Not with tp_size, ep_size, compile or shard_size="auto" (refused by name);
    `hf-fsdp2 estimate-memory` counts it."""
    loss_tile_size: int | None = None
    """Sequence tiling of the loss (sharding/sequence_tiling.py): in a training forward with labels the lm_head and
    cross-entropy run over this many tokens at a time, their gradients computed as each tile goes, so the logits
    of the whole sequence never exist (the forward's `logits` are the last position's only). None: off, unless
    shard_size="auto" turns it on as what fits (docs/planner.md; a size you set is kept). Usable with or without
    sp_size, under cp_size, and under tp_size (each rank computes its vocabulary rows of the colwise head)."""
    mlp_tile_size: int | None = None
    """Sequence tiling of each decoder layer's MLP (sharding/sequence_tiling.py): this many tokens at a time, each
    tile recomputed in backward, so one tile's intermediate activations live at once. None: off, unless
    shard_size="auto" turns it on as what fits (docs/planner.md; a size you set is kept)."""
    ep_size: int = 1
    """Expert parallelism for mixture-of-experts models (sharding/expert_parallel/): the model's own EP plan
    (transformers' `base_model_ep_plan`), each layer's experts split over `ep_size` ranks of the shard group
    (tokens sent to them by all-to-all) and FSDP-sharded over the shard size / ep_size ranks that hold the
    same ones; the rest sharded as without EP. Must divide the shard size; not with HSDP, TP, CP, 4-bit, fp8,
    compile or offload (refused by name)."""
    frozen_dtype: torch.dtype | None = None
    """Dtype frozen (requires_grad=False) parameters are stored in, e.g. bf16 base weights under fp32 LoRA
    adapters; None leaves them as they are."""
    async_save: bool = False
    """The integrations' checkpoints (Accelerate's `save_state`, the Trainer's) save with `blocking=False`:
    they return once each rank's rows are copied to host memory and commit in the background
    (checkpoint/async_save.py); `register(async_save=True)` or HF_FSDP2_ASYNC_SAVE=1."""
    fp8: bool = False
    """FP8 training with FP8 all-gather (torchao float8, quantization/fp8.py): the decoder layers' linears
    compute in float8 and their weights are all-gathered in float8 (1 byte a value); weights stay in their
    dtype, checkpoints are unchanged. `register(fp8=True)`, HF_FSDP2_FP8=1, or Accelerate's
    `mixed_precision: fp8` with the AO backend."""
    fp8_experts: Literal["rowwise", "mxfp8", "mxfp8_emulated"] | None = None
    """The experts' grouped matmuls in FP8 through torchao's MoE training (sharding/expert_parallel/low_precision.py):
    each projection of the local experts quantizes its rows and weights dynamically and runs one scaled grouped
    matmul (forward, input gradient, weight gradient); weights, adapters, optimizer states and checkpoints stay in
    their dtype. "rowwise": FP8 with rowwise scales (`torch._scaled_grouped_mm`, CUDA compute capability >= 9.0:
    H100/H200); "mxfp8": MXFP8, blocks of 32 (compute capability >= 10.0); "mxfp8_emulated": MXFP8's numbers computed
    by dequantizing into a bf16 grouped matmul (any device, slow: for CPU tests and debugging). Transformers'
    `grouped_mm` experts, with `ep_size` >= 2 in the EP dispatch's grouped matmuls, at ep_size 1 in the same ones on
    whole experts; LoRA on the experts keeps its factors in their dtype beside the FP8 base (frozen or not). Refused
    by name where the device or torchao (>= 0.17) cannot run it, another experts implementation, dimensions that are
    not multiples of 16 (rowwise) or 32 (MXFP8), fp16 weights, a model without experts, `compile` and `tp_size`.
    `register(fp8_experts="rowwise")` or HF_FSDP2_FP8_EXPERTS=rowwise."""
    memory_budget: int | None = None
    """Bytes per rank the auto layout must fit (an int or "80GB", "12GiB"); None: the device's memory x 0.85
    (CUDA), or the machine's RAM x 0.75 / local ranks (CPU). Needs shard_size="auto"."""
    plan_batch_size: int = 1
    """The micro-batch per rank (sequences) the auto layout is planned for (activations)."""
    plan_seq_len: int | None = None
    """The sequence length the auto layout is planned for (activations); None: the model's
    max_position_embeddings, at most 2048."""
    compile: bool | Literal["model"] = False
    """True: regional compilation (sharding/compile/): each decoder layer is compiled with torch.compile
    before `fully_shard`, so FSDP2's hooks stay outside the graphs and layers of one class share the compiled
    code. `register(compile=True)`, HF_FSDP2_COMPILE=1, or Accelerate's `dynamo_config` with
    `dynamo_use_regional_compilation: true`.

    "model": the whole training forward compiled with its all-gathers and reduce-scatters in the graph,
    bucketed by inductor (sharding/compile/compiled_collectives.py; parameters stored as dim-0 DTensors, names and
    checkpoints unchanged); activation checkpointing and reshard_after_forward become recompute tags of the
    graph. Not with fp8, cpu_offload, activation_offload, output_dtype, shard_size="auto", an integer
    reshard_after_forward, 4-bit weights or TP/CP (refused by name). `register(compile="model")`,
    HF_FSDP2_COMPILE=model."""
    replication: Literal["ddp", "fsdp2"] = "ddp"
    """How a layout with one-rank shard groups (`shard_size`=1 with replicas, as the auto layout picks when the
    model fits) trains: "ddp" (default; sharding/replication.py) with torch's composable `replicate`, DDP's
    bucketed all-reduce over plain parameters (no per-step copies); "fsdp2" keeps FSDP2 with one-rank groups.
    A compute cast (`param_dtype`) is applied per group as FSDP2 applies it (sharding/compute_cast.py). What
    only FSDP2 provides (fp8, cpu_offload, a `reduce_dtype` or `output_dtype` other than the gradients',
    tensor/context parallelism) keeps FSDP2 either way, said on rank 0."""
    find_unused_parameters: bool = False
    """DDP's own setting under "ddp" replication (Accelerate's `DistributedDataParallelKwargs`, the Trainer's
    `ddp_find_unused_parameters`)."""
    bucket_cap_mb: int | None = None
    """DDP's bucket size in MiB under "ddp" replication (Accelerate's `DistributedDataParallelKwargs`, the Trainer's
    `ddp_bucket_cap_mb`; None: DDP's 25). Also caps compile="model"'s collective buckets (default there: one
    decoder layer's gathered bytes)."""

    def __post_init__(self) -> None:
        for name, value in self._parsed().items():
            object.__setattr__(self, name, value)  # frozen: the parsed values are set once, here
        self._check_activations()
        self._check_needs_layer_groups()
        self._check_layout()
        self._check_compile()
        self._check_sequence()

    def _parsed(self) -> dict[str, Any]:
        """Every field in its type, each value checked on its own (one parser per kind of value)."""
        optional_int = {name: None if getattr(self, name) is None else _parse_int(getattr(self, name), name, low)
                        for name, low in (("forward_prefetch", 0), ("bucket_cap_mb", 1), ("plan_seq_len", 1),
                                            ("loss_tile_size", 1), ("mlp_tile_size", 1))}
        return {
            "wrap_policy": _parse_wrap_policy(self.wrap_policy),
            "layer_cls_names": _parse_names(self.layer_cls_names),
            "ignored_modules": _parse_pattern(self.ignored_modules),
            **{name: parse_dtype(getattr(self, name), name)
               for name in ("param_dtype", "reduce_dtype", "output_dtype", "frozen_dtype")},
            "reshard_after_forward": self._parse_reshard(self.reshard_after_forward),
            **{name: _parse_int(getattr(self, name), name, low)
               for name, low in (("min_num_params", 0), ("backward_prefetch", 0), ("checkpoint_every", 1),
                                 ("replicate_size", 1), ("tp_size", 1), ("cp_size", 1), ("sp_size", 1), ("ep_size", 1),
                                 ("plan_batch_size", 1))},
            **optional_int,
            **{name: parse_bool(getattr(self, name), name)
               for name in ("activation_checkpointing", "checkpoint_save_matmuls", "activation_offload", "cpu_offload",
                            "async_save", "fp8", "find_unused_parameters")},
            "shard_size": _parse_shard_size(self.shard_size),
            "memory_budget": None if self.memory_budget is None else parse_bytes(self.memory_budget, "memory_budget"),
            "compile": _parse_compile(self.compile),
            "replication": _parse_replication(self.replication),
            "fp8_experts": _parse_fp8_experts(self.fp8_experts),
        }

    def _check_activations(self) -> None:
        if self.checkpoint_every > 1 and not self.activation_checkpointing:
            raise ValueError(f"`checkpoint_every`={self.checkpoint_every} picks which layers activation checkpointing "
                             "recomputes, but `activation_checkpointing` is off; turn it on, or leave "
                             "checkpoint_every at 1.")
        if self.checkpoint_save_matmuls and not self.activation_checkpointing:
            raise ValueError("`checkpoint_save_matmuls` chooses what activation checkpointing keeps, but "
                             "`activation_checkpointing` is off; turn it on, or leave checkpoint_save_matmuls off.")
        if self.activation_offload and (self.activation_checkpointing or self.wrap_policy != "transformer"):
            raise ValueError("`activation_offload` moves each decoder layer's saved activations to the host: it needs "
                             "`wrap_policy`='transformer' and replaces `activation_checkpointing` (a checkpointed "
                             "layer saves only its inputs); set one of the two.")

    def _check_needs_layer_groups(self) -> None:
        """What works per decoder layer needs the decoder layers as groups."""
        if self.fp8 and self.wrap_policy != "transformer":
            raise ValueError(f"`fp8` converts the decoder layers' linears: it needs `wrap_policy`='transformer', "
                             f"not {self.wrap_policy!r}.")
        if self.activation_checkpointing and self.wrap_policy != "transformer":
            raise ValueError(f"`activation_checkpointing` recomputes each decoder layer: it needs "
                             f"`wrap_policy`='transformer', not {self.wrap_policy!r}.")
        if self.tp_size > 1 and self.wrap_policy != "transformer":
            raise ValueError(f"`tp_size`={self.tp_size} applies the model's tensor-parallel plan per decoder layer: "
                             f"it needs `wrap_policy`='transformer', not {self.wrap_policy!r}.")
        if self.ep_size > 1 and self.wrap_policy != "transformer":
            raise ValueError(f"`ep_size`={self.ep_size} makes each decoder layer's experts a group of their own: "
                             f"it needs `wrap_policy`='transformer', not {self.wrap_policy!r}.")

    def _check_layout(self) -> None:
        if self.fp8_experts is not None and (self.compile or self.tp_size > 1):
            other = f"`compile`={self.compile!r}" if self.compile else f"`tp_size`={self.tp_size}"
            raise ValueError(f"`fp8_experts`={self.fp8_experts!r} with {other} is not done in hf_fsdp2 (torchao's "
                             "grouped matmuls take whole local expert weights, not compiled here, not TP DTensors).")
        if self.ep_size > 1 and (self.tp_size > 1 or self.cp_size > 1):
            raise ValueError(f"`ep_size`={self.ep_size} with `{'tp_size' if self.tp_size > 1 else 'cp_size'}`="
                             f"{self.tp_size if self.tp_size > 1 else self.cp_size} is not done in hf_fsdp2: expert "
                             "parallelism splits the experts within one data-parallel shard group only.")
        if self.shard_size == "auto" and self.replicate_size != 1:
            raise ValueError(f"`shard_size`='auto' picks the replicas too; leave `replicate_size` at 1 "
                             f"(got {self.replicate_size}).")
        if self.memory_budget is not None and self.shard_size != "auto":
            raise ValueError("`memory_budget` is what the auto layout must fit; set `shard_size`='auto' "
                             "with it, or remove it.")

    def _check_compile(self) -> None:
        if self.compile != "model":
            return
        conflicts = [f"`{field}`" for field in ("fp8", "cpu_offload", "activation_offload") if getattr(self, field)]
        conflicts += ["`output_dtype`"] if self.output_dtype is not None else []
        conflicts += [f"`reshard_after_forward`={self.reshard_after_forward}"] if not isinstance(
            self.reshard_after_forward, bool) else []
        conflicts += ["`shard_size`='auto'"] if self.shard_size == "auto" else []
        if conflicts:
            raise ValueError(f"`compile`='model' (collectives in the compiled graph) cannot honour "
                             f"{', '.join(conflicts)}: those need FSDP2's groups (the auto layout costs "
                             "them). Use compile=True (regional) with them, or drop them.")
        # a mesh's model-parallel dimensions (the engine sets these sizes from the mesh before applying anything)
        split = [f"`{field}`={getattr(self, field)}" for field in ("tp_size", "cp_size") if getattr(self, field) > 1]
        if split:
            raise ValueError(f"`compile`='model' (collectives in the compiled graph) cannot honour {', '.join(split)}: "
                             "its collectives are data-parallel only. Use compile=True (regional) or drop the setting.")

    def _check_sequence(self) -> None:
        """Sequence parallelism and tiling: what they are not done with, refused by name."""
        if self.sp_size > 1:
            others = [f"`{name}`={getattr(self, name)}" for name in ("tp_size", "ep_size") if getattr(self, name) > 1]
            others += [f"`compile`={self.compile!r}"] if self.compile else []
            # the layout planner's candidate shard sizes do not know sp yet
            others += ["`shard_size`='auto'"] if self.shard_size == "auto" else []
            if others:
                raise ValueError(f"`sp_size`={self.sp_size} with {', '.join(others)} is not done in hf_fsdp2: Ulysses "
                                 "sequence parallelism composes with FSDP2 (dp_shard, HSDP), LoRA, activation "
                                 "checkpointing, ring context parallelism (cp_size) and sequence tiling only.")
        tiled = [name for name in ("loss_tile_size", "mlp_tile_size") if getattr(self, name) is not None]
        if tiled and self.compile == "model":
            raise ValueError(f"`{tiled[0]}` with `compile`='model' is not done in hf_fsdp2: the tiles run outside the "
                             "compiled graph; use compile=True (regional) or no compile.")
        if self.mlp_tile_size is not None and self.wrap_policy != "transformer":
            raise ValueError(f"`mlp_tile_size` tiles each decoder layer's MLP: it needs `wrap_policy`='transformer', "
                             f"not {self.wrap_policy!r}.")

    @staticmethod
    def _parse_reshard(value: Any) -> bool | int:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and not value.strip().isdigit():
            return parse_bool(value, "reshard_after_forward")
        number = _parse_int(value, "reshard_after_forward", 1)
        # FSDP2 treats 1 as "reshard to 1 rank", i.e. keep everything: that is False by another name.
        if number == 1:
            raise ValueError("`reshard_after_forward`=1 is ambiguous; use False to keep parameters gathered "
                             "after forward, or an integer > 1 to reshard to groups of that many ranks.")
        return number

    @property
    def is_auto_layout(self) -> bool:
        return self.shard_size == "auto"

    def not_done_with(self, field: str) -> list[str]:
        """The settings of this config the technique of `field` ("tp_size", "ep_size", "replication") is not
        done with yet, each as a refusal names it, in the table's order (empty when none)."""
        return [words for name, words in _NOT_DONE_WITH[field] if getattr(self, name)]

    def forward_exchanges(self) -> str | None:
        """What makes every forward exchange data with ranks that hold other batches, as a refusal names it (None
        when nothing does): expert parallelism's token exchange in each MoE layer (sharding/expert_parallel/), so
        every rank must run as many forwards as the slowest (generate()'s `synced_gpus`, sharding/generation.py)."""
        return f"expert parallelism (`ep_size`={self.ep_size})" if self.ep_size > 1 else None

    def mesh_shape(self, world_size: int) -> tuple[int, int]:
        """(replicate, shard) for `world_size` ranks (the data-parallel ones: world_size / tp_size);
        raises if the shape does not fit."""
        if self.is_auto_layout:
            raise ValueError("`shard_size`='auto' is resolved by the layout planner (hf_fsdp2.planner.layout."
                             "resolve_auto_layout, which shard_model calls) before a mesh is built.")
        if world_size % self.tp_size:
            raise ValueError(f"`tp_size`={self.tp_size} does not divide the world size {world_size}.")
        world_size //= self.tp_size
        if world_size % self.replicate_size:
            raise ValueError(
                f"`replicate_size`={self.replicate_size} does not divide the world size {world_size}; "
                f"choose a replicate_size that divides {world_size}."
            )
        shard = self.shard_size if self.shard_size is not None else world_size // self.replicate_size
        if shard * self.replicate_size != world_size:
            raise ValueError(
                f"HSDP shape `replicate_size` x `shard_size` = {self.replicate_size} x {shard} = "
                f"{self.replicate_size * shard} does not match the world size {world_size}."
            )
        if shard % self.cp_size:
            raise ValueError(f"`cp_size`={self.cp_size} must divide the shard size {shard}: FSDP2 shards over "
                             "dp_shard x cp, so the cp ranks are part of each shard group.")
        if shard % self.sp_size:
            raise ValueError(f"`sp_size`={self.sp_size} must divide the shard size {shard}: FSDP2 shards over "
                             "dp_shard x sp, so the sp ranks are part of each shard group.")
        if shard % (self.cp_size * self.sp_size):
            raise ValueError(f"`cp_size` x `sp_size`={self.cp_size} x {self.sp_size} must divide the shard size {shard}: "
                             "FSDP2 shards over dp_shard x cp x sp.")
        if self.ep_size > 1:
            if self.replicate_size > 1:
                raise ValueError(f"`ep_size`={self.ep_size} with HSDP (`replicate_size`={self.replicate_size}) is not "
                                 "done in hf_fsdp2: the experts are split within one shard group; leave "
                                 "replicate_size at 1.")
            if shard % self.ep_size:
                raise ValueError(f"`ep_size`={self.ep_size} must divide the shard size {shard}: the experts are split "
                                 "over ep ranks and FSDP-sharded over the shard size / ep ranks holding the same ones.")
        if isinstance(self.reshard_after_forward, int) and not isinstance(self.reshard_after_forward, bool):
            if shard % self.reshard_after_forward:
                raise ValueError(
                    f"`reshard_after_forward`={self.reshard_after_forward} must divide the shard size {shard}."
                )
        return self.replicate_size, shard

    def refuse_unbuilt_dims(self) -> None:
        """Refuses by name the mesh dimensions this config asks for that hf_fsdp2.build_mesh does not build."""
        if self.cp_size > 1 and self.sp_size == 1:
            raise ValueError(no_cp_mesh(self.cp_size))

    def model_split_dims(self) -> tuple[tuple[str, int], ...]:
        """Mesh dimensions after the data-parallel ones whose ranks hold the same batch and split the model
        (build_mesh puts them last, neighbouring ranks; FSDP2 shards over none: data_parallel_mesh): ("tp", tp_size)
        with tensor parallelism."""
        return ((TP_DIM, self.tp_size),) if self.tp_size > 1 else ()

    def sequence_split_dims(self) -> tuple[tuple[str, int], ...]:
        """Mesh dimensions the shard ranks split into after "dp_shard", ranks that hold slices of the same sequences
        (FSDP2 shards over all of them): ("sp", sp_size) under Ulysses (Accelerate's dimension name), after ("cp",
        cp_size) with context parallelism too (sp neighbours within a machine, cp across)."""
        if self.sp_size == 1:
            return ()
        return ((CP_DIM, self.cp_size),) * (self.cp_size > 1) + ((SP_DIM, self.sp_size),)

    def replace(self, **changes: Any) -> "FSDP2Config":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "config") -> "FSDP2Config":
        """Build from a mapping (yaml, env vars, Trainer args); unknown keys raise naming `source`."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            import difflib

            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, known, n=1)
                hints.append(f"`{key}`" + (f" (did you mean `{close[0]}`?)" if close else ""))
            raise ValueError(f"Unknown FSDP2Config field(s) in {source}: {', '.join(hints)}. "
                             f"Valid fields: {', '.join(sorted(known))}.")
        return cls(**dict(values))

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly view (dtypes as strings)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.dtype):
                value = str(value).removeprefix("torch.")
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out


__all__ = ["FSDP2Config", "parse_bool", "parse_bytes", "parse_dtype"]
