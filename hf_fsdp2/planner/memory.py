"""Per-rank memory of training a Hugging Face causal LM with `shard_model`, computed without any rank.

The model is built on the meta device (from a config, a config.json, a model directory, or a meta
copy of a module), LoRA is added with peft, and the *same* `plan_groups` that `shard_model` uses
decides the `fully_shard` groups. Every number then follows what FSDP2 allocates, per parameter:

Persistent, on each of the S ranks of one replica (HSDP: every replica holds the same):

* parameters: each parameter's dim-0 shard in its **storage dtype** (fp32 master weights in
  mixed-precision training; `frozen_dtype` for frozen ones). FSDP2 splits dim 0 like
  `torch.chunk`: `ceil(rows / S)` rows per rank, trailing ranks may hold fewer or none. It pre-pads
  every rank's shard to rank 0's size, so the max over ranks (rank 0) is what *every* rank allocates;
  `DTensor.to_local()` shows the unpadded rows (the per-rank lists).
* gradients: trainable parameters only, same shard, in the **storage dtype**: FSDP2 casts the
  reduce-scattered gradient back to the parameter's dtype, whatever `param_dtype`/`reduce_dtype` are.
* optimizer: AdamW's `exp_avg` and `exp_avg_sq` are `zeros_like(param)`, i.e. the unpadded local
  shard in the storage dtype, plus one 4-byte fp32 `step` scalar per trainable tensor (kept on the
  CPU by non-fused, non-capturable AdamW; counted in the optimizer row, it is negligible).
* buffers (e.g. rotary `inv_freq`): not sharded, one full copy per rank.

So with fp32 storage and `param_dtype=bf16`, a trainable parameter costs 4 + 4 + 8 = 16 bytes / S.
The ZeRO paper's mixed-precision accounting, 2 (fp16 params) + 2 (fp16 grads) + 12 (fp32 master +
two moments) = 16, reaches the same total by another split: in FSDP2 the fp32 master copy *is* the
sharded parameter, and the bf16 copy exists only while a group is all-gathered.

Transient, on the accelerator:

* all-gather: a group's unsharded parameters in the compute dtype (`param_dtype`, else the storage
  dtype), padded to S x `ceil(rows / S)` rows. FSDP2 keeps the next group in flight (implicitly in
  forward, `backward_prefetch=1` in backward), so the peak is the largest sum over a window of
  1 + max(1, forward_prefetch, backward_prefetch) consecutive groups in execution order, plus
  the groups still unsharded from forward (`reshard_after_forward=False` keeps all; hf_fsdp2 never
  reshards the last layer and the untied [norm, lm_head] group, which backward needs first), plus
  one more copy of the window's largest group: FSDP2 gathers into one flat buffer and copies out into
  per-parameter tensors allocated while that buffer is alive (`foreach_all_gather_copy_out`; at a 1B
  LoRA the tied [embedding, norm, head] group alone is 501 MiB in bf16, found under the peak).
* reduce-scatter: one group's unsharded gradients in the compute dtype plus the reduce-scatter
  input, padded, in `reduce_dtype` (the largest trainable group).
* activations: measured, not guessed. One forward with `labels` runs on the meta device under
  `torch.autograd.graph.saved_tensors_hooks`; the activations are the storages autograd saves for
  backward (deduplicated, parameters excluded) plus the returned logits. Attention is counted as a
  fused kernel (flash / memory-efficient SDPA) that saves q, k, v, the output and an fp32
  log-sum-exp, never the seq x seq scores; models that run eager attention are traced as they run.
  With activation checkpointing (hf_fsdp2 wraps each decoder layer) what stays alive is everything
  outside the layers, each layer's inputs, and, during backward, one layer's recomputed activations
  (the largest). Activation gradients and kernels' workspaces are not counted.

4-bit base weights (QLoRA, `load_in_4bit=True`): the meta model gets the layout
`from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))` builds
(quantization/bnb_4bit.py: transformers' quantizer picks the linears, LoRA is added, then each
`Linear4bit` gets its row layout), so the per-parameter rules above apply unchanged. Each quantized
[out, in] weight is two frozen uint8 parameters sharded by row: the packed values (in/2 bytes a row)
and the absmax (4 bytes per 64-value block, 1 byte with double quantization): 0.5625, or 0.515625,
bytes per weight / S. They have no gradients or optimizer states, `frozen_dtype` does not touch
them, and `param_dtype` does not cast them: they are gathered as their own bytes. The code books
and double quantization's second level (fp32, 1/16384 of the weights) are non-persistent buffers,
replicated like any buffer. Parameter counts report quantized weights as out x in. One more
transient: bitsandbytes dequantizes a weight before its matmul (and again for the input gradient),
so the largest quantized weight in its dequantized dtype (plus its fp32 absmax when double
quantized) is added as its own row.

The estimated peak follows a step's two high points: as backward starts, the persistent state + the
all-gather window + the activations + the larger of two moments: the loss's backward, which makes the
fp32 gradient of the logits first ([tokens, vocab], not a saved tensor) while no group is being copied
out, and the head's backward right after it, whose group is gathered again (copy-out buffer included)
once the loss's saved fp32 log-probabilities and that gradient are freed, the logits' gradient in the
compute dtype alive (2 CPU ranks, 1B LoRA, 512 tokens: the live bytes glibc counts peaked at 0.97x this
estimate; counting both moments at once was 1.11x too high); as backward ends, the persistent state + every
gradient + the reduce-scatter buffers, the activations freed, beside what is gathered during a reduce-scatter:
FSDP2 reshards a group before reducing its gradients, so with tied embeddings, groups kept unsharded after
forward or expert groups that is forward's whole window, otherwise the kept last layer, the prefetched one and
its copy-out buffer (`_reduce_scatter_window`; pairing an untied head's reduce-scatter with forward's whole
window over-counted: 1.27x the live peak at Llama-3.1-8B's shape on 64 ranks, `hf-fsdp2 simulate`). Gradients set to None after each
optimizer step (`zero_grad()`'s default) are not alive in forward; with gradient accumulation (or when it
is unknown, as for the layout planner) they are, and count in the first point too. Measured on an H200
(benchmarks/gpu_check.py, 1B Llama, batch 4 x 2048): not counting the CUDA caching allocator's
fragmentation, the CUDA context or NCCL buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
import torch.nn as nn

from ..config import FSDP2Config
from ..quantization import fp8, quantized
from ..runtime.host_allocator import HEAP_BLOCK_LIMIT
from .activation_trace import trace_activations
from ..sharding import expert_parallel, replication, selective_checkpoint, sequence_parallel, sequence_tiling
from ..sharding.groups import ShardPlan, apply_frozen_dtype, plan_groups, replicated_frozen_parameters
from ..sharding.model_parts import ModelParts, model_parts
from ..sharding.tensor_parallel import narrow_for_trace, tp_local_shapes
from .memory_report import ActivationMemory, GroupMemory, MemoryEstimate
from .meta_model import DEFAULT_LORA_TARGETS, add_lora, build_meta_model, meta_copy, meta_parts

ADAM_STATES = ("exp_avg", "exp_avg_sq")
STEP_BYTES = 4  # AdamW's `step`: a 0-dim fp32 tensor per trainable parameter
# ---------------------------------------------------------------------------------------------
# Sharding arithmetic


def shard_rows(rows: int, shard_size: int, shard_rank: int) -> int:
    """Rows of a dim-0 shard, `torch.chunk` semantics: `ceil(rows / shard_size)` per rank, the last
    non-empty rank takes the remainder and the ranks after it hold 0 rows."""
    chunk = -(-rows // shard_size)
    return max(0, min(chunk, rows - shard_rank * chunk))


def _rows_and_row_numel(shape: torch.Size) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    rows = shape[0]
    return rows, (math.prod(shape[1:]) if rows else 0)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        dtype, str(dtype).removeprefix("torch."))


# ---------------------------------------------------------------------------------------------
# The estimate


def estimate_memory(
    model_or_config: Any,
    world_size: int,
    fsdp_config: FSDP2Config | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    lora_r: int | None = None,
    lora_targets: Sequence[str] | str = DEFAULT_LORA_TARGETS,
    batch_size: int | None = 1,
    seq_len: int | None = 2048,
    load_in_4bit: bool = False,
    bnb_4bit_use_double_quant: bool = False,
    cp_size: int | None = None,
    gradient_accumulation_steps: int | None = 1,
) -> MemoryEstimate:
    """Per-rank memory of training `model_or_config` with `shard_model(model, fsdp_config)` and AdamW
    on `world_size` ranks. Pure: no process group, no real tensor is allocated.

    `dtype`: storage dtype of the parameters before sharding (see `build_meta_model`); `lora_r`: wrap
    the model with peft LoRA on `lora_targets` first; `batch_size` x `seq_len` tokens per rank for the
    activation estimate (`batch_size=None` skips it). `load_in_4bit`: QLoRA, the linears transformers
    quantizes become bitsandbytes 4-bit (NF4) weights as `from_pretrained(..., quantization_config=
    BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=...))` shards them, quantized from
    `dtype`; needs `lora_r` and bitsandbytes. `fsdp_config.tp_size` > 1: tensor parallelism with the
    model's own TP plan, `cp_size` > 1 (None: the config's): context parallelism over `cp_size` of the shard ranks
    (sharding/tensor_parallel.py, on paper). `gradient_accumulation_steps` > 1 keeps the sharded gradients alive
    through the next micro-batch's forward; None (unknown, as the layout planner costs) counts them so.
    See the module docstring for the accounting.
    """
    config = fsdp_config if fsdp_config is not None else FSDP2Config()
    if not isinstance(config, FSDP2Config):
        raise TypeError(f"`fsdp_config` must be an FSDP2Config, got {type(config).__name__}.")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"`world_size`={world_size!r} must be a positive integer.")
    config.mesh_shape(world_size)  # the HSDP shape fits, or a clear error
    if batch_size is not None:
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}`={value!r} must be a positive integer (or batch_size=None "
                                 f"to skip the activation estimate).")
    if isinstance(lora_targets, str):
        lora_targets = [t for t in lora_targets.split(",")]
    if gradient_accumulation_steps is not None and (isinstance(gradient_accumulation_steps, bool) or not isinstance(
            gradient_accumulation_steps, int) or gradient_accumulation_steps < 1):
        raise ValueError(f"`gradient_accumulation_steps`={gradient_accumulation_steps!r} must be a positive integer "
                         "(or None: unknown).")
    # the quantizer reads its own keywords (quantization/quantized.py); the planner knows no format
    quantization = quantized.for_estimate(load_in_4bit=load_in_4bit,
                                          bnb_4bit_use_double_quant=bnb_4bit_use_double_quant)
    if quantization is not None:
        if lora_r is None:
            raise ValueError(f"`{quantization.argument}` freezes the quantized base weights, so there is nothing to "
                             "train without LoRA: set `lora_r` (QLoRA).")
        quantization.check_available()  # the ImportError says how to install it
        if isinstance(model_or_config, nn.Module) and quantized.has_quantized_layers(model_or_config):
            raise ValueError("`model` is already quantized; pass its config (or the unquantized model) with "
                             f"`{quantization.argument}=True`.")

    prepared = _prepare(model_or_config, config, dtype, lora_r, lora_targets, quantization)
    return prepared.estimate(world_size, config, batch_size=batch_size, seq_len=seq_len, cp_size=cp_size,
                             gradient_accumulation_steps=gradient_accumulation_steps)


@dataclass
class MetaTrainingModel:
    """The model as `shard_model` would see it, on the meta device (4-bit layout, LoRA, frozen dtype
    applied, groups planned), built once so several layouts can be costed without rebuilding it
    (the layout planner costs up to 4 x the divisors of the world size). Layouts may differ in
    shard/replicate size, `reshard_after_forward`, `activation_checkpointing`, `cpu_offload` and the
    prefetch depths; dtypes, wrapping and FP8 are fixed by the config it was prepared with."""

    model: nn.Module  # as shard_model would receive it (a PeftModel with `lora_r`)
    base: nn.Module  # the transformers model under PEFT (sharding/model_parts.py)
    plan: ShardPlan
    quantized: dict[int, tuple[str, int]]
    fp8_weights: set[int]
    lora_r: int | None
    lora_targets: tuple[str, ...] | None
    quantization: quantized.MetaQuantization | None  # a quantized base (estimate_memory's load_in_4bit)
    _activations: dict = field(default_factory=dict)
    _tp_shapes: dict = field(default_factory=dict)

    def expert_params(self, shard_size: int, ep_size: int) -> dict[int, int]:
        """id(param) -> ep_size for the expert tensors the model's EP plan splits (sharding/expert_parallel/)."""
        if ep_size == 1:
            return {}
        from ..sharding import expert_parallel

        expert_parallel.require_available(ep_size)
        expert_parallel.check_shard_group(FSDP2Config(ep_size=ep_size), shard_size)
        named = dict(self.base.named_parameters())
        plan = expert_parallel.resolved_plan(self.base, shard_size, ep_size)
        return {id(named[name]): ep_size for name in plan if name in named}

    def tp_shapes(self, tp_size: int) -> dict[int, tuple[torch.Size, bool]]:
        """id(param) -> its TP rank-0 block's shape (tensor_parallel.tp_local_shapes), once per size."""
        if tp_size not in self._tp_shapes:
            self._tp_shapes[tp_size] = tp_local_shapes(self.base, tp_size)
        return self._tp_shapes[tp_size]

    def activations(self, batch_size: int, seq_len: int, compute_dtype: torch.dtype | None,
                    checkpointing: bool, every: int = 1, offload: bool = False, tp_size: int = 1,
                    cp_size: int = 1, save_matmuls: bool = False,
                    tiling: FSDP2Config | None = None) -> tuple[ActivationMemory | None, str | None]:
        """One meta trace per (batch, tokens per rank, dtype, tp, tiles) on a copy (the trace casts the model,
        and narrows the TP-split layers to one rank's block); both the plain and the checkpointed
        peak follow from it. With CP (or Ulysses SP: `cp_size` is then the product of both) a rank holds
        seq_len / cp_size tokens of each sequence. `tiling`: a config with loss_tile_size / mlp_tile_size, applied
        to the copy as shard_model applies it (sharding/sequence_tiling.py), so the trace sees what the tiles save."""
        tiles = (tiling.loss_tile_size, tiling.mlp_tile_size) if tiling is not None else (None, None)
        key = (batch_size, seq_len // cp_size, compute_dtype, tp_size, tiles)
        if key not in self._activations:
            names = {id(m): n for n, m in self.model.named_modules()}
            copy_ = meta_copy(self.model)
            layers = [copy_.get_submodule(names[id(layer)]) for layer in self.plan.layers]
            base = copy_.get_submodule(names[id(self.base)])
            head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
            if tp_size > 1:
                by_name = {n: self.tp_shapes(tp_size).get(id(p)) for n, p in self.model.named_parameters()}
                narrow_for_trace(copy_, {id(p): by_name[n] for n, p in copy_.named_parameters() if by_name.get(n)})
            if tiles != (None, None):
                sequence_tiling.apply_sequence_tiling(ModelParts(copy_, base), layers, tiling)  # the copy's parts
            # LoRA on fused experts runs inside the grouped matmuls where hf_fsdp2 shards the model (no merged weight
            # per forward: sharding/expert_parallel/grouped.py, and the EP dispatch's the same way); PEFT's fold
            # would also not trace on meta ("unsupported scalarType")
            expert_parallel.apply_grouped_lora(ModelParts(copy_, base))
            try:
                self._activations[key] = (trace_activations(copy_, layers, batch_size, seq_len // cp_size,
                                                            compute_dtype=compute_dtype, head=head,
                                                            kept_ops=selective_checkpoint.SAVED_OPS), None)
            except Exception as e:  # noqa: BLE001 - an architecture the meta trace cannot run; report why
                self._activations[key] = (None, f"{type(e).__name__}: {e}")
        traced, error = self._activations[key]
        if traced is None:
            return None, error
        if offload:
            return traced.offloaded_to_host(), None
        # the engine's rule for which layers are checkpointed, and op-level selective checkpointing's kept outputs
        checkpointed = selective_checkpoint.checkpointed_layers(range(len(traced.layer_bytes)), every)
        if save_matmuls:
            return traced.with_checkpointing(checkpointing, every, checkpointed, traced.layer_matmul_bytes,
                                             "matmul outputs"), None
        return traced.with_checkpointing(checkpointing, every, checkpointed), None

    def estimate(self, world_size: int, config: FSDP2Config, *, batch_size: int | None = 1,
                 seq_len: int | None = 2048, cp_size: int | None = None,
                 gradient_accumulation_steps: int | None = None) -> MemoryEstimate:
        """Per-rank memory of this model sharded with `config` on `world_size` ranks (`cp_size` of
        each shard group's ranks splitting the sequences; `gradient_accumulation_steps` None: unknown,
        gradients counted as kept through forward)."""
        return _estimate(self, world_size, config, batch_size, seq_len, config.cp_size if cp_size is None else cp_size,
                         gradient_accumulation_steps)


def prepare_meta_model(model_or_config: Any, config: FSDP2Config, *, dtype: torch.dtype | str | None = None,
                       lora_r: int | None = None, lora_targets: Sequence[str] = DEFAULT_LORA_TARGETS,
                       **quantization: Any) -> MetaTrainingModel:
    """Build the meta model `estimate_memory` costs (arguments as there, already validated; `quantization`: its
    quantization keywords, read by the quantizer)."""
    return _prepare(model_or_config, config, dtype, lora_r, lora_targets, quantized.for_estimate(**quantization))


def _prepare(model_or_config: Any, config: FSDP2Config, dtype: torch.dtype | str | None, lora_r: int | None,
             lora_targets: Sequence[str], quantization: quantized.MetaQuantization | None) -> MetaTrainingModel:
    if isinstance(model_or_config, ModelParts):  # an entry's parts (hf_fsdp2/shard.py's plan): copied as they are
        parts = meta_parts(model_or_config, dtype=dtype)
        model = parts.model
    else:
        model = build_meta_model(model_or_config, dtype=dtype)
        # built from a config: a transformers model, no PEFT around it; a caller's own module comes in here
        parts = model_parts(model) if isinstance(model_or_config, nn.Module) else ModelParts(model, model)
    quantized_from = None
    if quantization is not None:  # as hf_fsdp2.from_pretrained(..., quantization_config=...) builds it
        quantized_from = next(p.dtype for p in model.parameters() if p.is_floating_point())
        quantization.quantize_on_meta(model, quantized_from, config.param_dtype or quantized_from)
    if lora_r is not None:
        if parts.has_peft:
            raise ValueError("`lora_r` is set but the model is already a PeftModel; pass the base model.")
        model = add_lora(model, lora_r, lora_targets)
        parts = ModelParts(model, parts.base)  # the PeftModel just built around it
    if quantization is not None:  # after PEFT, which reads the quantized layers to pick its LoRA layer class
        quantization.prepare(model, quantized_from)
    apply_frozen_dtype(model, config.frozen_dtype)  # as shard_model does, before sharding (floating only)
    plan = plan_groups(parts, config)
    fp8_weights: set[int] = set()
    if config.fp8:  # the weights shard_model converts are all-gathered in float8 (quantization/fp8.py)
        fp8_weights = {id(m.weight) for m in fp8.plan(model, plan.layers)[0].values()}
    return MetaTrainingModel(
        model=model, base=parts.base, plan=plan, quantized=_quantized_params(model), fp8_weights=fp8_weights, lora_r=lora_r,
        lora_targets=tuple(t.strip() for t in lora_targets if t.strip()) if lora_r else None,
        quantization=quantization)


def _estimate(prepared: MetaTrainingModel, world_size: int, config: FSDP2Config, batch_size: int | None,
              seq_len: int | None, cp_size: int = 1, accumulation: int | None = None) -> MemoryEstimate:
    model, plan, quantized, fp8_weights = prepared.model, prepared.plan, prepared.quantized, prepared.fp8_weights
    replicate, shard = config.mesh_shape(world_size)
    _check_cp(cp_size, shard, seq_len if batch_size is not None else None)
    sp = config.sp_size  # Ulysses: each rank holds seq_len / sp of each sequence, as under CP
    if batch_size is not None and seq_len % sp:
        raise ValueError(f"`sp_size`={sp} must divide `seq_len`={seq_len}: each rank holds an equal slice of every "
                         "sequence (hf_fsdp2.local_batch refuses the rest).")
    quantization = prepared.quantization
    if config.tp_size > 1 and (quantization is not None or config.fp8):
        what = quantization.argument if quantization is not None else "fp8"
        raise ValueError(f"`tp_size`={config.tp_size} with `{what}` is not done in hf_fsdp2 (shard_model refuses "
                         "it); estimate with tp_size=1.")
    tp_shapes = prepared.tp_shapes(config.tp_size)
    params = list(model.parameters())  # deduplicated: a tied weight counts once
    storage_dtypes: dict[str, int] = {}
    trainable_dtypes: dict[str, int] = {}
    param_rank = [0] * shard
    grad_rank = [0] * shard
    opt_rank = [0] * shard
    for p in params:
        rows, row_numel = _rows_and_row_numel(_local_shape(p, tp_shapes))
        size = p.element_size()
        kind = quantized[id(p)][0] if id(p) in quantized else _dtype_name(p.dtype)
        storage_dtypes[kind] = storage_dtypes.get(kind, 0) + _numel(p, quantized)
        if p.requires_grad:
            trainable_dtypes[_dtype_name(p.dtype)] = trainable_dtypes.get(_dtype_name(p.dtype), 0) + p.numel()
        for r in range(shard):
            local = shard_rows(rows, shard, r) * row_numel * size
            param_rank[r] += local
            if p.requires_grad:
                grad_rank[r] += local
                opt_rank[r] += len(ADAM_STATES) * local + STEP_BYTES
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())

    # Frozen weights of a one-rank shard group stay out of FSDP (groups.replicated_frozen_parameters):
    # stored as above, never all-gathered; not under FP8, whose weights FSDP2 gathers in float8 (as the engine).
    outside = set() if config.fp8 else replicated_frozen_parameters(model, config, shard)
    # EP: an expert tensor's rank holds rows / ep of it, FSDP-sharded over shard / ep ranks: the same bytes per
    # rank at rest (rows / shard), but its group gathers only the rank's experts (sharding/expert_parallel/).
    if config.ep_size > 1 and (config.tp_size > 1 or cp_size > 1):  # as sharding/expert_parallel/ refuses it
        raise ValueError(f"`ep_size`={config.ep_size} with {'`tp_size`' if config.tp_size > 1 else '`cp_size`'} > 1 "
                         "is not done in hf_fsdp2 (expert parallelism within one data-parallel shard group only).")
    experts = prepared.expert_params(shard, config.ep_size)
    groups = _group_memory(model, plan, config, shard, quantized, fp8_weights, outside, tp_shapes=tp_shapes,
                           experts=experts)
    dequantized = _dequantized_peak(model, config.param_dtype)
    window = 1 + max(1, config.forward_prefetch or 0, config.backward_prefetch)
    gathered_peak, peak_names, copy_out = _gathered_peak(groups, plan, config, window)
    reduce_scatter_peak = max((g.reduce_scatter_bytes for g in groups), default=0)
    ddp_reducer = (replication.trains_on_reducer(replicate, shard, config.tp_size * cp_size * sp, config)
                   and not replication.fsdp_only_reasons(model, config))
    if ddp_reducer:  # sharding/replication.py: parameters used in place, gradients all-reduced in their buckets
        gathered_peak, peak_names = _cast_peak(groups, _checkpointed_names(model, plan, config))
        copy_out = 0
        reduce_scatter_peak = 0
        heap_kept = sum(g.heap_cast_bytes for g in groups)  # gradients are views of the buckets, kept
        end_window = gathered_peak
    else:  # each group gathered in forward, again in backward when resharded after forward (the root: once),
        # and its unsharded gradients + reduce-scatter input once
        heap_kept = sum(g.heap_gathered_bytes * (1 if g.name == "<root>" or config.reshard_after_forward is False else 2)
                        + g.heap_reduce_scatter_bytes for g in groups)
        end_window = _reduce_scatter_window(groups, plan, config, gathered_peak)

    activations, act_error = None, None
    if batch_size is not None:
        activations, act_error = prepared.activations(batch_size, seq_len, config.param_dtype,
                                                      config.activation_checkpointing, config.checkpoint_every,
                                                      config.activation_offload, config.tp_size, cp_size * sp,
                                                      config.checkpoint_save_matmuls, tiling=config)

    if activations is not None and activations.saved_bytes:  # the heap-served share of what the step saves
        heap_kept += activations.peak_bytes * activations.heap_saved_bytes // activations.saved_bytes
    loss_backward = (_loss_backward_bytes(prepared.base, batch_size, seq_len, cp_size * sp, config.loss_tile_size,
                                          tp_shapes) if activations is not None else 0)
    all_to_all = (_all_to_all_bytes(prepared, batch_size, seq_len // cp_size, config.param_dtype, config.ep_size)
                  if experts and batch_size is not None else 0)
    # The head's own backward receives the logits' gradient in the logits' (compute) dtype.
    head_grad = loss_backward * _itemsize(config.param_dtype) // 4 if config.param_dtype else loss_backward

    trainable = [p for p in params if p.requires_grad]
    notes = [
        "parameters and gradients: every rank allocates the rank-0 (padded) shard; optimizer moments "
        "follow the unpadded local shard, so trailing ranks may use slightly less.",
        "16 bytes per trainable fp32 parameter = 4 (param, the fp32 master) + 4 (grad) + 8 (two moments) / "
        "shard size; the ZeRO split 2 + 2 + 12 has the same total. A bf16 copy exists only while gathered.",
    ]
    if config.cpu_offload:
        notes.append("offload: sharded params, grads and optimizer states live in CPU memory and AdamW steps on "
                     "the CPU; the GPU holds only gathered groups, unsharded grads and activations.")
    if ddp_reducer:
        notes.append(f"replication with DDP's reducer over {replicate} ranks: no all-gather or reduce-scatter buffers; "
                     "gradients are views of DDP's buckets (`gradient_as_bucket_view`), all-reduced in place."
                     + (" The `param_dtype` copies autograd keeps for backward are the 'gathered' peak (one "
                        "checkpointed layer's at a time)." if gathered_peak else ""))
    elif replicate > 1:
        notes.append(f"HSDP: shards over {shard} ranks; the {replicate} replicas each hold the same shards.")
    if config.tp_size > 1:
        notes.append(f"TP: {len(tp_shapes)} parameters split over {config.tp_size} ranks by the model's TP plan, "
                     f"FSDP shards each rank's block; per-rank numbers are TP rank 0's. Each TP layer pair "
                     f"all-reduces its output in forward and its input gradient in backward (batch x seq x hidden "
                     f"per layer pair, not counted here).")
    if cp_size > 1:
        notes.append(f"CP: each rank holds seq_len / {cp_size} tokens; ring attention passes K/V blocks among the "
                     f"{cp_size} ranks (one block in flight, not counted here); FSDP shards over dp_shard x cp.")
    if sp > 1 and batch_size is not None:
        # with ring CP around it, an sp group holds its cp rank's seq_len / cp: the all-to-alls carry that part
        part = "the whole sequence" if cp_size == 1 else f"its cp rank's seq_len / {cp_size} tokens"
        notes.append(f"SP (Ulysses): each rank holds seq_len / {sp * cp_size} tokens and, around attention, {part} "
                     f"for 1/{sp} of the heads; per decoder layer each rank sends "
                     f"{_ulysses_bytes(prepared, batch_size, seq_len // cp_size, sp, config.param_dtype) / 2**20:.1f} "
                     "MiB in forward's all-to-alls (q, k, v, output) and as much in backward (transient, not counted "
                     f"here); FSDP shards over dp_shard x {'cp x ' if cp_size > 1 else ''}sp.")
    if config.loss_tile_size is not None or config.mlp_tile_size is not None:
        notes.append("sequence tiling: " + ", ".join(
            f"{what} {size} tokens at a time" for what, size in (("the loss", config.loss_tile_size),
                                                                 ("each MLP", config.mlp_tile_size)) if size)
            + " (traced with the tiles; the tiled loss keeps the head's weight gradient from forward to backward).")
    if config.fp8:
        notes.append(f"FP8: {len(fp8_weights)} decoder-layer linear weights are all-gathered in float8 (1 byte a "
                     "value); they stay stored, and their gradients and AdamW states kept, in the storage dtype.")
    if quantization is not None:
        notes.append(quantization.bytes_note)
    return MemoryEstimate(
        model_type=getattr(getattr(prepared.base, "config", None), "model_type", type(model).__name__),
        world_size=world_size, replicate_size=replicate, shard_size=shard,
        num_params=sum(_numel(p, quantized) for p in params),
        num_trainable_params=sum(p.numel() for p in trainable), num_trainable_tensors=len(trainable),
        storage_dtypes=storage_dtypes, trainable_dtypes=trainable_dtypes,
        param_dtype=_dtype_name(config.param_dtype) if config.param_dtype else None,
        reduce_dtype=_dtype_name(config.reduce_dtype) if config.reduce_dtype else None,
        cpu_offload=config.cpu_offload, lora_r=prepared.lora_r, lora_targets=prepared.lora_targets,
        param_bytes_per_rank=tuple(param_rank), grad_bytes_per_rank=tuple(grad_rank),
        optimizer_bytes_per_rank=tuple(opt_rank), buffer_bytes=buffer_bytes,
        groups=tuple(groups), gather_window=window, gathered_peak_bytes=gathered_peak,
        gathered_peak_groups=tuple(peak_names), reduce_scatter_peak_bytes=reduce_scatter_peak,
        activations=activations, activations_error=act_error, notes=tuple(notes),
        quantized_base=quantization.name if quantization is not None else None,
        quantized_storage=quantization.storage if quantization is not None else "",
        double_quant=quantization is not None and quantization.double_quant,
        keywords={"load_in_4bit": quantization is not None},
        dequantized_peak_bytes=dequantized,
        **_model_parallel_words(config.tp_size, cp_size, config.ep_size, shard), heap_kept_bytes=heap_kept,
        loss_backward_bytes=loss_backward, head_grad_bytes=head_grad, all_to_all_bytes=all_to_all,
        copy_out_bytes=copy_out, grads_kept=accumulation is None or accumulation > 1,
        reduce_scatter_window_bytes=end_window,
    )


def _model_parallel_words(tp: int, cp: int, ep: int, shard: int) -> dict[str, Any]:
    """The report's model-parallel fields (planner/memory_report.py words none of them): the sizes, what the
    parameters' shard is of (TP rank 0's block, the largest), how the activations are narrowed (TP: the heads and MLP
    features; CP: the trace runs at seq_len / cp already), the mesh line's parts (EP: the experts' own mesh) and the
    row of EP's token exchange."""
    return {"model_parallel": {"tp_size": tp, "cp_size": cp, "ep_size": ep},
            "shard_of": f" of the 1/{tp} TP block" if tp > 1 else "",
            "activation_split": f", the heads and MLP features 1/{tp}" if tp > 1 else "",
            "mesh_parts": tuple([f"tensor parallel over {tp}"] * (tp > 1)
                                + [f"context parallel over {cp} (in the {shard} shards)"] * (cp > 1)
                                + [f"experts over ep {ep} x efsdp {shard // ep} (in the {shard} shards)"] * (ep > 1)),
            "exchange_words": f"EP dispatch: one layer's gathered tokens, pair rows and summed rows (ep {ep})"}


def _ulysses_bytes(prepared: MetaTrainingModel, batch_size: int, seq_len: int, sp: int,
                   compute: torch.dtype | None) -> int:
    """What one rank sends in one decoder layer's forward under Ulysses (sharding/sequence_parallel.py): its q, k, v
    shards (key/value heads fewer than sp repeated to sp) and the attention output, each but the 1/sp it keeps."""
    heads, kv = sequence_parallel.heads(prepared.base.config)
    text = prepared.base.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    itemsize = _itemsize(compute) if compute is not None else 4
    values = batch_size * (seq_len // sp) * head_dim * (2 * heads + 2 * max(kv, sp))
    return values * itemsize * (sp - 1) // sp


def _loss_backward_bytes(base: nn.Module, batch_size: int, seq_len: int, cp_size: int,
                         tile: int | None = None, split_shapes: dict | None = None) -> int:
    """The fp32 gradient of the logits, [tokens, vocab], made as backward starts while the saved fp32
    log-probabilities still live: transformers' causal-LM loss upcasts the logits (`ForCausalLMLoss`:
    `logits = logits.float()`). Not a saved tensor, so the meta trace cannot see it; on the first GPU run it
    was the 1B LoRA peak's missing 3.9 GiB (benchmarks/results/gpu_check-20261127T1830Z-H200.json)."""
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is None:
        return 0
    tokens = batch_size * (seq_len // cp_size)
    if tile is not None:  # sharding/sequence_tiling.py: one tile's fp32 logits and their softmax gradient at a time,
        # of this rank's vocabulary rows where the model's plan splits the head (`split_shapes`: its local shapes)
        rows = (split_shapes or {}).get(id(weight), (weight.shape,))[0][0]
        return 2 * min(tile, tokens) * rows * 4
    return tokens * weight.shape[0] * 4


def _all_to_all_bytes(prepared: MetaTrainingModel, batch_size: int, tokens: int, compute: torch.dtype | None,
                      ep_size: int) -> int:
    """One EP layer's token dispatch (sharding/expert_parallel/dispatch.py): the tokens gathered from the ep ranks, the rows
    summed back (each ep x tokens), and the pair rows the experts read (ep x tokens x min(top-k, E/ep): the dropless
    bound they are sized by, whatever the routing), of the hidden size in the compute dtype."""
    config = getattr(prepared.base, "config", None)
    top_k = getattr(config, "num_experts_per_tok", None) or 1
    experts = next((getattr(config, name) for name in ("num_experts", "num_local_experts", "n_routed_experts")
                    if getattr(config, name, None)), ep_size)
    hidden = getattr(config, "hidden_size", 0)
    itemsize = _itemsize(compute) if compute is not None else next(
        (p.element_size() for p in prepared.model.parameters() if p.is_floating_point()), 4)
    return ep_size * batch_size * tokens * (2 + min(top_k, experts // ep_size)) * hidden * itemsize


def _check_cp(cp_size: int, shard: int, seq_len: int | None) -> None:
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"`cp_size`={cp_size!r} must be a positive integer.")
    if shard % cp_size:
        raise ValueError(f"`cp_size`={cp_size} must divide the shard size {shard}: FSDP2 shards over "
                         "dp_shard x cp, so the cp ranks are part of each shard group.")
    if seq_len is not None and seq_len % cp_size:
        raise ValueError(f"`cp_size`={cp_size} must divide `seq_len`={seq_len}: each rank holds an equal slice "
                         f"of every sequence (2 x cp_size = {2 * cp_size} for load-balanced causal attention).")


def _local_shape(p: torch.Tensor, tp_shapes: dict[int, tuple[torch.Size, bool]]) -> torch.Size:
    """The tensor FSDP2 shards on this rank: the TP rank-0 block of a TP-split parameter, else all of it."""
    entry = tp_shapes.get(id(p))
    return entry[0] if entry is not None else p.shape


def _quantized_params(model: nn.Module) -> dict[int, tuple[str, int]]:
    """id(param) -> (quant type, weights it stands for) for the uint8 parameters of 4-bit linears:
    the packed weight stands for out x in weights, its absmax for none."""
    out = {}
    for weight in quantized.weights(model).values():
        out[id(weight.packed)] = (weight.kind, weight.out_features * weight.in_features)
        out.update({id(p): (weight.kind, 0) for p in weight.side})
    return out


def _numel(p: torch.Tensor, quantized: dict[int, tuple[str, int]]) -> int:
    """Parameters `p` holds: a 4-bit weight counts its out x in weights, its absmax none."""
    return quantized[id(p)][1] if id(p) in quantized else p.numel()


def _dequantized_peak(model: nn.Module, param_dtype: torch.dtype | None) -> int:
    """The largest transient of a quantized matmul (`QuantizedWeight.transient_bytes`: bitsandbytes
    dequantizes the whole [out, in] weight, quantization/bnb_4bit.py)."""
    return max((weight.transient_bytes(param_dtype) for weight in quantized.weights(model).values()), default=0)


def _group_memory(model: nn.Module, plan: ShardPlan, config: FSDP2Config, shard: int,
                  quantized: dict[int, tuple[str, int]] | None = None,
                  fp8_weights: set[int] = frozenset(), outside: set = frozenset(), *,
                  tp_shapes: dict, experts: dict[int, int] | None = None) -> list[GroupMemory]:
    """Unsharded sizes of each `fully_shard` group, in forward order: [embedding], layers, head, root."""
    names = {id(m): n or "<root>" for n, m in model.named_modules()}
    members: list[tuple[str, list[nn.Module]]] = []
    if plan.embedding:
        members.append((names[id(plan.embedding[0])], list(plan.embedding)))
    members += [(names[id(layer)], [layer]) for layer in plan.layers]
    if plan.head:
        members.append(("+".join(names[id(m)] for m in plan.head), plan.head))
    seen: set[int] = {id(p) for p in outside}
    groups = []
    for name, modules in members:
        ps = []
        for p in (p for m in modules for p in m.parameters()):
            if id(p) not in seen:  # a tied weight is one parameter, in one group, once
                seen.add(id(p))
                ps.append(p)
        groups.append(_one_group(name, ps, config, shard, quantized or {}, fp8_weights, tp_shapes, experts or {}))
    rest = [p for p in model.parameters() if id(p) not in seen]
    if rest:
        groups.append(_one_group("<root>", rest, config, shard, quantized or {}, fp8_weights, tp_shapes, experts or {}))
    return groups


def _one_group(name: str, params: Iterable[nn.Parameter], config: FSDP2Config, shard: int,
               quantized: dict[int, tuple[str, int]], fp8_weights: set[int], tp_shapes: dict,
               experts: dict[int, int]) -> GroupMemory:
    """A layer's experts (their own FSDP2 group under EP, gathered while the layer is) are counted with it."""
    numel = trainable = gathered = grads = rs_input = cast = 0
    heap_params = heap_grads = heap_cast = 0  # per-parameter tensors glibc's heap serves

    def heap(nbytes: int) -> int:
        return nbytes if nbytes < HEAP_BLOCK_LIMIT else 0

    for p in params:
        local = _local_shape(p, tp_shapes)
        group_shard = shard
        if id(p) in experts:  # this rank's experts, FSDP-sharded over the efsdp ranks
            local, group_shard = torch.Size((local[0] // experts[id(p)], *local[1:])), shard // experts[id(p)]
        rows, row_numel = _rows_and_row_numel(local)
        padded = -(-rows // group_shard) * group_shard * row_numel
        # FSDP2 (_fsdp_param.init_dtype_attrs): param_dtype applies to floating params of another dtype;
        # 4-bit weights (uint8 packed values and absmax) are gathered as their own bytes.
        compute = config.param_dtype if (config.param_dtype is not None and p.is_floating_point()) else p.dtype
        # FP8 all-gather: torchao's pre-all-gather hook casts the shard to float8, 1 byte a value.
        gathered += padded * (1 if id(p) in fp8_weights else _itemsize(compute))
        unsharded = local.numel() * _itemsize(compute)  # FSDP2's per-parameter tensor, copied out of the flat one
        heap_params += heap(unsharded)
        if compute != p.dtype:
            cast += unsharded
            heap_cast += heap(unsharded)
        numel += _numel(p, quantized)
        if p.requires_grad:
            trainable += p.numel()
            grads += unsharded
            heap_grads += heap(unsharded)
            rs_input += padded * _itemsize(config.reduce_dtype or compute)
    return GroupMemory(name=name, numel=numel, trainable_numel=trainable, gathered_bytes=gathered,
                       reduce_scatter_bytes=grads + rs_input, cast_bytes=cast,
                       heap_gathered_bytes=heap(gathered) + heap_params,
                       heap_reduce_scatter_bytes=heap_grads + heap(rs_input), heap_cast_bytes=heap_cast)


def _cast_peak(groups: list[GroupMemory], checkpointed: set[str]) -> tuple[int, list[str]]:
    """Compute-dtype copies under DDP's reducer (sharding/compute_cast.py): autograd keeps each group's
    casts until backward, except a checkpointed layer's, which live only while it (re)computes."""
    kept = [g for g in groups if g.cast_bytes and g.name not in checkpointed]
    recomputed = max((g for g in groups if g.cast_bytes and g.name in checkpointed),
                     key=lambda g: g.cast_bytes, default=None)
    names = [g.name for g in kept] + ([recomputed.name] if recomputed else [])
    return sum(g.cast_bytes for g in kept) + (recomputed.cast_bytes if recomputed else 0), names


def _checkpointed_names(model: nn.Module, plan: ShardPlan, config: FSDP2Config) -> set[str]:
    if not config.activation_checkpointing:
        return set()
    names = {id(m): n for n, m in model.named_modules()}
    return {names[id(layer)] for layer in selective_checkpoint.checkpointed_layers(plan.layers, config.checkpoint_every)}


def _reduce_scatter_window(groups: list[GroupMemory], plan: ShardPlan, config: FSDP2Config, gathered_peak: int) -> int:
    """Unsharded parameters alive beside a reduce-scatter. FSDP2 reshards a group before it reduce-scatters the
    group's gradients (`FSDPParamGroup.post_backward`: `reshard()`, then `foreach_reduce`), and forward's copy-out
    buffers are long gone; what is gathered then is the layer hf_fsdp2 keeps unsharded after forward (the last),
    the one backward prefetches and that one's flat copy-out buffer: three of the largest decoder layer's, plus the
    root group. Measured on CPU under the fake group (hf-fsdp2 simulate, vocab 128256, 4 untied layers, 16 ranks):
    pairing the head's reduce-scatter with forward's whole window over-counted the step's peak by 0.8 GiB (2.30 vs
    1.52 GiB live). The whole window, as before, where more stays gathered: tied embeddings (the tied group runs
    first and last, gathered through all of backward: 2.23 GiB counted so, 2.26 live at the same shape tied), groups
    kept unsharded after forward (`reshard_after_forward` not True), expert groups, a model without decoder layers."""
    if (config.reshard_after_forward is not True or plan.tied or not plan.layers or plan.inner_groups
            or not plan.in_forward_order):
        return gathered_peak  # tied weights, expert groups, irregular stacks: the whole window (see the docstring)
    root = sum(g.gathered_bytes for g in groups if g.name == "<root>")
    order = [g for g in groups if g.name != "<root>"]  # [embedding], layers, [norm + head], as _group_memory builds it
    first_layer = 1 if plan.embedding else 0
    layers = order[first_layer:first_layer + len(plan.layers)]
    return min(gathered_peak, root + 3 * max(g.gathered_bytes for g in layers))


def _gathered_peak(groups: list[GroupMemory], plan: ShardPlan, config: FSDP2Config,
                   window: int) -> tuple[int, list[str], int]:
    """Largest unsharded-parameter footprint: a window of groups in flight, plus groups that forward
    left unsharded and backward has not reached yet (those earlier in execution order); and of it, the
    flat all-gather output of the group being copied out, which exists only while a group is gathered."""
    root = [g for g in groups if g.name == "<root>"]
    order = [g for g in groups if g.name != "<root>"]
    if plan.tied and order:
        order = [order[-1], *order]  # the tied [embedding, norm, head] group runs first and last
    reshard = config.reshard_after_forward
    n_layers = len(plan.layers)
    first_layer = 1 if (plan.embedding or plan.tied) else 0

    def resident(i: int) -> int:
        g = order[i]
        if reshard is False:
            return g.gathered_bytes
        if reshard is True:
            # hf_fsdp2 keeps the last layer and an untied head unsharded after forward (sharding.apply_fsdp)
            last_layer = bool(n_layers) and i == first_layer + n_layers - 1
            untied_head = bool(plan.head) and not plan.tied and i == len(order) - 1
            kept = last_layer or untied_head
            return g.gathered_bytes if kept else 0
        return g.gathered_bytes // reshard  # resharded to groups of `reshard` ranks

    root_bytes = sum(g.gathered_bytes for g in root)  # the root group stays gathered through forward
    best, best_names, best_flat = root_bytes, [g.name for g in root], 0
    for start in range(max(1, len(order) - window + 1)):
        win = order[start:start + window]
        # + the flat all-gather output of the group being copied out: FSDP2 allocates the per-parameter
        # unsharded tensors while that buffer is alive (_fsdp_collectives.foreach_all_gather_copy_out).
        flat = max((g.gathered_bytes for g in win), default=0)
        total = root_bytes + sum(g.gathered_bytes for g in win) + flat + sum(resident(i) for i in range(start))
        if total > best:
            best, best_names, best_flat = total, [g.name for g in win] + [g.name for g in root], flat
    return best, best_names, best_flat


@dataclass(frozen=True)
class ParallelChoice:
    """A model-parallel split the layout planner tries, TP x CP (their planner cost, here: planner/layout.py knows
    neither): its settings (read as attributes of a candidate, `candidate.tp_size`), the ranks each data-parallel
    position spans (TP's group), the multiple every shard group is (the CP ranks are part of each), its mark in
    `hf-fsdp2 plan`'s table and its words in a layout's description."""
    settings: tuple[tuple[str, int], ...]
    group_ranks: int
    shard_multiple: int

    def setting(self, name: str) -> int:
        return dict(self.settings)[name]

    @property
    def splits(self) -> bool:
        return self.group_ranks > 1 or self.shard_multiple > 1

    @property
    def mark(self) -> str:
        return f"{self.group_ranks} x {self.shard_multiple}"

    @property
    def description(self) -> str:
        return "".join(f", {name}={size}" for name, size in self.settings if size > 1)


def parallel_choice(tp_size: int = 1, cp_size: int = 1) -> ParallelChoice:
    return ParallelChoice((("tp_size", tp_size), ("cp_size", cp_size)), tp_size, cp_size)


def parallel_choices(world_size: int, tp_sizes: Iterable[int], cp_sizes: Iterable[int]) -> list[ParallelChoice]:
    """The (tp, cp) splits of `world_size` ranks from the sizes given, in cost order: neither, CP, TP, both (each
    by size)."""
    options = [(t, c) for t in sorted(set(tp_sizes)) for c in sorted(set(cp_sizes)) if world_size % (t * c) == 0]
    return [parallel_choice(t, c) for t, c in sorted(options, key=lambda tc: (tc[0] > 1, tc[0], tc[1]))]


def kept_parallel_sizes(config: FSDP2Config) -> dict[str, tuple[int, ...]]:
    """The sizes the layout keeps for a run (`shard_size="auto"`: the run's tp_size and cp_size), as
    `plan_layout`'s keywords."""
    return {"tp_sizes": (config.tp_size,), "cp_sizes": (config.cp_size,)}


def parallel_sizes_words(tp_sizes: Iterable[int], cp_sizes: Iterable[int]) -> str:
    return f"tp_size={tuple(tp_sizes)} and cp_size={tuple(cp_sizes)}"


def parallel_sizes(prepared: MetaTrainingModel, world_size: int, seq_len: int) -> tuple[list[int], list[int]]:
    """(TP sizes, CP sizes) worth costing: TP sizes (8 at most, one machine) dividing the world and
    the model's attention and KV heads, when the model has a TP plan and no 4-bit or FP8 layers (not
    done with TP); CP sizes dividing the world and half the sequence (load-balanced causal attention
    splits it into 2 x cp chunks)."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    text = getattr(prepared.base, "config", None)
    text = text.get_text_config() if hasattr(text, "get_text_config") else text
    heads = [getattr(text, k, None) for k in ("num_attention_heads", "num_key_value_heads")]
    tp_sizes = [1]
    tp_ready = prepared.quantization is None and not prepared.fp8_weights
    if tp_ready and getattr(prepared.base, "tp_plan", None) and all(isinstance(h, int) for h in heads):
        tp_sizes += [t for t in divisors if 1 < t <= 8 and all(h % t == 0 for h in heads)]
    cp_sizes = [c for c in divisors if seq_len % (2 * c) == 0 or c == 1]
    return tp_sizes, cp_sizes


def offload_choices(config: FSDP2Config, device_type: str) -> list[bool]:
    """The `cpu_offload` values the layout planner tries: the one `config` sets when True; on CPU, where host and
    device are one memory, none; else without, then with. Expert parallelism: never (one shard group over every
    rank, no offload: sharding/expert_parallel/ refuses it)."""
    if config.ep_size > 1:
        return [False]
    return [True] if config.cpu_offload else ([False] if device_type == "cpu" else [False, True])


def shard_size_allowed(config: FSDP2Config, shard: int, data_parallel: int) -> bool:
    """Whether the settings of `config` take a shard group of `shard` of the `data_parallel` ranks: expert
    parallelism splits the experts over ep ranks of one shard group spanning every data-parallel rank."""
    return config.ep_size == 1 or (shard == data_parallel and shard % config.ep_size == 0)


def expert_parallel_options(prepared: MetaTrainingModel, plan: Any, base: FSDP2Config, *,
                            batch_size: int, seq_len: int) -> list[tuple[int, MemoryEstimate]]:
    """For a mixture-of-experts model, `plan`'s chosen layout (a planner/layout.py LayoutPlan) again with each
    ep_size that could split its experts (dividing the shard group and the expert count; one replica, no TP, CP or
    offload: what EP does), each with its estimate: what `hf-fsdp2 plan` proposes. Empty for a dense model or a
    layout EP does not combine with."""
    chosen = plan.chosen
    if chosen is None or base.ep_size > 1 or chosen.replicate_size > 1 or chosen.parallel.splits or chosen.cpu_offload:
        return []
    config = getattr(prepared.base, "config", None)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or getattr(
        config, "n_routed_experts", None)
    if not experts or not (getattr(config, "base_model_ep_plan", None) or {}):
        return []
    out = []
    for ep in range(2, chosen.shard_size + 1):
        if chosen.shard_size % ep == 0 and experts % ep == 0:
            try:
                layout = plan.config(base).replace(ep_size=ep)
                if chosen.activations not in activation_choices(layout, plan.device_type, prepared=prepared,
                                                                 seq_len=seq_len):
                    return []  # what EP does not do with activations (activation_choices)
                out.append((ep, prepared.estimate(plan.world_size, layout, batch_size=batch_size, seq_len=seq_len)))
            except ValueError:  # transformers without its EP machinery, a model without an EP plan
                return []
    return out


@dataclass(frozen=True)
class ActivationChoice:
    """One thing the layout planner may do with activations: the config settings it sets (planner/layout.py
    applies them as they are), its marks in the plan's table (`label`; `tiles`: the sequence tiles, "-" for none)
    and its words in a layout's description."""

    settings: tuple[tuple[str, Any], ...]
    label: str
    description: str
    tiles: str = "-"

    def setting(self, name: str) -> Any:
        return dict(self.settings)[name]


# The tile the auto layout tiles the loss and the MLPs with, in tokens (sharding/sequence_tiling.py): fixed, as a
# GEMM of 1024 rows ([tile, hidden] x [hidden, vocab or intermediate]) already runs at full speed, so a smaller tile
# would add loop steps and smaller kernels for memory that no longer grows with the sequence (the loss's tile is
# 2 x 1024 x vocab x 4 bytes of fp32 logits and their gradient: 1 GiB at a 128k vocabulary), and a larger one would
# only cost memory. Offered where a rank holds more tokens than one tile; with fewer, a tile is the whole sequence.
AUTO_TILE_SIZE = 1024


def _activation_choice(checkpointing: bool, every: int, save_matmuls: bool, offload: bool,
                       tiles: tuple[int | None, int | None] = (None, None)) -> ActivationChoice:
    loss, mlp = tiles
    settings = (("activation_checkpointing", checkpointing), ("checkpoint_every", every),
                ("checkpoint_save_matmuls", save_matmuls), ("activation_offload", offload),
                ("loss_tile_size", loss), ("mlp_tile_size", mlp))
    label = ("host" if offload else "False" if not checkpointing else "ops" if save_matmuls
             else "True" if every == 1 else f"1/{every}")
    description = (f"activation_checkpointing={checkpointing}"
                   + (f" (checkpoint_every={every})" if every > 1 else "")
                   + (" (checkpoint_save_matmuls=True)" if save_matmuls else "")
                   + (", activation_offload=True" if offload else "")
                   + (f", loss_tile_size={loss}" if loss is not None else "")
                   + (f", mlp_tile_size={mlp}" if mlp is not None else ""))
    marks = [f"loss {loss}" if loss is not None else "", f"mlp {mlp}" if mlp is not None else ""]
    return ActivationChoice(settings, label, description, " ".join(m for m in marks if m) or "-")


def _auto_tiles(config: FSDP2Config, prepared: MetaTrainingModel | None, seq_len: int | None, tp_size: int,
                cp_size: int) -> tuple[int | None, int | None]:
    """(loss tile, MLP tile) the auto layout may turn on for `prepared` at `seq_len` (None: not offered): where a
    rank holds more than AUTO_TILE_SIZE tokens and sequence tiling computes what the model computes
    (sequence_tiling.refuse_loss_tiling; a dense `mlp` per decoder layer). Not with TP or CP (the tiled loss is
    written for a whole lm_head over the rank's tokens; those combinations are not tested), nor for a model that
    adds a router's auxiliary loss to its loss (the tiled loss adds it as the model does, tested in one process;
    the planner's cost of that combination is not)."""
    if prepared is None or seq_len is None or tp_size > 1 or cp_size > 1:
        return None, None
    if seq_len // (cp_size * config.sp_size) <= AUTO_TILE_SIZE:
        return None, None
    text = getattr(prepared.base, "config", None)
    text = text.get_text_config() if hasattr(text, "get_text_config") else text
    if getattr(text, "output_router_logits", False):
        return None, None
    try:
        sequence_tiling.refuse_loss_tiling(ModelParts(prepared.model, prepared.base))
        loss = AUTO_TILE_SIZE
    except ValueError:
        loss = None
    dense = config.wrap_policy == "transformer" and bool(prepared.plan.layers) and all(
        isinstance(getattr(layer, "mlp", None), nn.Module) and not hasattr(layer.mlp, "experts")
        for layer in prepared.plan.layers)
    return loss, AUTO_TILE_SIZE if dense else None


def activation_choices(config: FSDP2Config, device_type: str, fixed: bool = False, *,
                       prepared: MetaTrainingModel | None = None, seq_len: int | None = None, tp_size: int = 1,
                       cp_size: int = 1) -> list[ActivationChoice]:
    """What the layout planner tries for activations, cheapest first: keep them; checkpoint every layer but
    keep its matmul and attention outputs (op-level selective checkpointing: only the cheap ops are
    recomputed); checkpoint every other layer (half the recomputation of every layer); every layer; or, on an
    accelerator, move them to the host (activation offload: on a CPU host and device are one memory; not with
    expert parallelism, sharding/expert_parallel/). Checkpointing or offload `config` sets (or layers
    already wrapped, `fixed`: every one) is kept as it is.

    Sequence tiling (sharding/sequence_tiling.py), given the meta model and the planned `seq_len` (per rank: / cp):
    the tiled loss recomputes nothing (each tile's gradients are made in forward; the same FLOPs, in tiles of
    AUTO_TILE_SIZE rows), so each choice above is followed by itself with the loss tiled, before the next choice
    that recomputes more: at equal compute the untiled one comes first, as its forward keeps whole `logits` (the
    tiled forward returns the last position's). The tiled MLP recomputes each MLP's forward in backward (a
    non-reentrant checkpoint per tile; inside a checkpointed layer, a second time), about two thirds of a Llama
    layer's forward at short sequences: more than any checkpointing choice but the whole layer's, so it comes once,
    with the loss tiled, on the leanest checkpointing choice (what ALST runs: checkpointing, tiled loss and MLP),
    before offload. Tiles `config` sets are kept as given, on every choice."""
    if fixed:
        options = [(True, 1, False, False)]
    elif config.activation_checkpointing:
        options = [(True, config.checkpoint_every, config.checkpoint_save_matmuls, False)]
    elif config.activation_offload:
        options = [(False, 1, False, True)]
    else:
        options = [(False, 1, False, False), (True, 1, True, False), (True, 2, False, False), (True, 1, False, False)]
        if device_type != "cpu":
            options.append((False, 1, False, True))
    if config.ep_size > 1:
        options = [o for o in options if not o[3]]
    given = (config.loss_tile_size, config.mlp_tile_size)
    if given != (None, None):  # a user's tiles, kept as given
        return [_activation_choice(*o, given) for o in options]
    loss, mlp = _auto_tiles(config, prepared, seq_len, tp_size, cp_size)
    mlp = None if fixed else mlp  # layers already wrapped for checkpointing: their MLPs are not tiled (not tested)
    kept = [o for o in options if not o[3]]  # offload moves what is saved to the host: tiles are not tried with it
    choices = []
    for o in options:
        choices.append(_activation_choice(*o))
        if loss is not None and not o[3]:
            choices.append(_activation_choice(*o, (loss, None)))
        if mlp is not None and kept and o == kept[-1]:
            choices.append(_activation_choice(*o, (loss, mlp)))
    return choices


__all__ = [
    "AUTO_TILE_SIZE", "ActivationChoice", "ActivationMemory", "GroupMemory", "MemoryEstimate", "MetaTrainingModel",
    "activation_choices", "estimate_memory", "prepare_meta_model", "shard_rows",
]
