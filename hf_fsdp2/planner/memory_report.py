"""What `estimate_memory` reports: per-rank bytes by kind, per group, and the activations; formatted
as the `estimate-memory` table (the accounting is in memory.py)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Collection, Sequence


@dataclass(frozen=True)
class GroupMemory:
    """One `fully_shard` group, unsharded."""

    name: str
    numel: int
    trainable_numel: int
    gathered_bytes: int  # all-gather output: padded rows, compute dtype
    reduce_scatter_bytes: int  # unsharded grads (compute dtype) + reduce-scatter input (reduce dtype, padded)
    cast_bytes: int = 0  # compute-dtype copies of parameters stored in another dtype (the cast part of a gather)
    # Of each, what comes from glibc's heap, which keeps it when freed: blocks under glibc's largest mmap
    # threshold (runtime/host_allocator.py); larger ones are mmapped and unmapped when freed.
    heap_gathered_bytes: int = 0  # the flat all-gather output (if small) + the small per-parameter tensors
    heap_reduce_scatter_bytes: int = 0
    heap_cast_bytes: int = 0


@dataclass(frozen=True)
class ActivationMemory:
    """Activations of one rank's micro-batch (see the module docstring for what is counted)."""

    batch_size: int
    seq_len: int
    checkpointing: bool
    peak_bytes: int  # what the estimate adds: all saved tensors, or the checkpointed steady state + one layer
    saved_bytes: int  # without checkpointing: every saved storage + the logits
    outside_layers_bytes: int  # saved by the embedding, final norm, lm_head and loss, + the logits
    layer_inputs_bytes: int  # all decoder layers' inputs: what checkpointing keeps per layer
    largest_layer_bytes: int  # one decoder layer's saved activations (recomputed during backward with AC)
    layer_bytes: tuple[int, ...] = ()  # each decoder layer's saved activations, inputs excluded
    checkpoint_every: int = 1
    layer_matmul_bytes: tuple[int, ...] = ()  # each layer's outputs of the ops the estimate asked to count (memory.py)
    kept_outputs: str | None = None  # what each checkpointed layer keeps of them, as the table names it; None: nothing
    offloaded: bool = False
    host_bytes: int = 0  # with activation offload: the layers' saved activations, in host memory
    # Saved by the loss after the head ran (transformers upcasts the logits: their fp32 log-probabilities);
    # part of outside_layers_bytes, freed by the loss's backward before the head's backward.
    loss_saved_bytes: int = 0
    heap_saved_bytes: int = 0  # of saved_bytes, the storages glibc's heap serves (GroupMemory's heap fields)

    def offloaded_to_host(self) -> "ActivationMemory":
        """Activation offload: what the layers save (their inputs too) lives on the host; the device
        holds what the embedding, head and loss save, plus one layer's activations brought back in
        its backward."""
        layers = self.layer_inputs_bytes + sum(self.layer_bytes)
        return dataclasses.replace(self, checkpointing=False, checkpoint_every=1, offloaded=True, host_bytes=layers,
                                   peak_bytes=self.outside_layers_bytes + self.largest_layer_bytes)

    def with_checkpointing(self, checkpointing: bool, every: int = 1, checkpointed: Collection[int] | None = None,
                           kept: Sequence[int] | None = None, kept_outputs: str | None = None) -> "ActivationMemory":
        """The same trace, its peak with or without activation checkpointing: everything outside the
        layers + every layer's inputs + what the layers that are not checkpointed save + one
        checkpointed layer recomputed, or everything saved. `checkpointed`: the indices of the layers
        checkpointing recomputes (default every layer; `every`, the config's checkpoint_every, is recorded
        for the table); `kept`: what each checkpointed layer keeps besides its inputs (its bytes per
        layer, default nothing), named `kept_outputs` in the table (memory.py: the outputs of the ops a
        layer keeps under op-level selective checkpointing)."""
        if not checkpointing:
            return dataclasses.replace(self, checkpointing=False, checkpoint_every=1, kept_outputs=None,
                                       peak_bytes=self.saved_bytes)
        if not self.layer_bytes:  # a trace without per-layer bytes: every layer checkpointed
            held, recomputed = 0, self.largest_layer_bytes
        else:
            kept = tuple(kept) if kept is not None else (0,) * len(self.layer_bytes)
            checkpointed = set(range(len(self.layer_bytes)) if checkpointed is None else checkpointed)
            held = (sum(b for i, b in enumerate(self.layer_bytes) if i not in checkpointed)
                    + sum(kept[i] for i in checkpointed))
            recomputed = max(max(0, self.layer_bytes[i] - kept[i]) for i in checkpointed)
        peak = self.outside_layers_bytes + self.layer_inputs_bytes + held + recomputed
        return dataclasses.replace(self, checkpointing=True, checkpoint_every=every, kept_outputs=kept_outputs,
                                   peak_bytes=peak)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank. `*_per_rank` lists hold the unpadded local shard (`to_local()`) of each of the
    `shard_size` ranks of one replica; the scalar properties are the max over ranks (rank 0), which
    for parameters and gradients is also what every rank allocates (FSDP2 pre-pads shards)."""

    model_type: str
    world_size: int
    replicate_size: int
    shard_size: int
    num_params: int
    num_trainable_params: int
    num_trainable_tensors: int
    storage_dtypes: dict[str, int]  # dtype -> number of parameters stored in it
    trainable_dtypes: dict[str, int]
    param_dtype: str | None
    reduce_dtype: str | None
    cpu_offload: bool
    lora_r: int | None
    lora_targets: tuple[str, ...] | None
    param_bytes_per_rank: tuple[int, ...]
    grad_bytes_per_rank: tuple[int, ...]
    optimizer_bytes_per_rank: tuple[int, ...]  # moments + step scalars
    buffer_bytes: int
    groups: tuple[GroupMemory, ...]
    gather_window: int  # groups in flight at once
    gathered_peak_bytes: int
    gathered_peak_groups: tuple[str, ...]
    reduce_scatter_peak_bytes: int
    activations: ActivationMemory | None
    activations_error: str | None = None
    notes: tuple[str, ...] = field(default=())
    # a quantized base, as its format names it (quantization.MetaQuantization): "4-bit", its rows gathered as "uint8"
    quantized_base: str | None = None
    quantized_storage: str = ""
    double_quant: bool = False
    # estimate_memory's keywords that chose the base, under their own names in the JSON (memory.py's)
    keywords: dict[str, Any] = field(default_factory=dict)
    dequantized_peak_bytes: int = 0  # 4-bit: the largest weight bitsandbytes dequantizes for a matmul
    # The model-parallel sizes the estimate is for, under their config names in the JSON and as attributes, and what
    # the table says of them, worded by memory.py (their planner cost): what the parameters' shard is of, how a
    # rank's activations are narrowed, what the mesh line adds after the ranks.
    model_parallel: dict[str, int] = field(default_factory=dict)
    shard_of: str = ""
    activation_split: str = ""
    mesh_parts: tuple[str, ...] = ()
    # What glibc's heap may keep on CPU beyond the live bytes (runtime/host_allocator.py), not part of the device
    # peak: the heap-served blocks a step allocates and frees again (each gather of the groups' parameters, their
    # unsharded gradients and reduce-scatter buffers, the activations), those under glibc's largest mmap threshold.
    heap_kept_bytes: int = 0
    # The fp32 gradient of the logits as backward starts (memory.py `_loss_backward_bytes`).
    loss_backward_bytes: int = 0
    # The logits' gradient in the compute dtype, what the head's backward receives once the loss's has run.
    head_grad_bytes: int = 0
    # Of gathered_peak_bytes, the flat all-gather output alive only while a group is being gathered.
    copy_out_bytes: int = 0
    # One token exchange's buffers between ranks in a layer's forward (memory.py's word for them: `exchange_words`).
    all_to_all_bytes: int = 0
    exchange_words: str = ""
    # Gradients alive through forward (gradient accumulation, or unknown): the conservative default.
    grads_kept: bool = True
    # Unsharded parameters alive beside the largest reduce-scatter (memory.py `_reduce_scatter_window`); None: the
    # whole all-gather window (estimates made before it was counted apart).
    reduce_scatter_window_bytes: int | None = None

    # ---- max over ranks
    @property
    def param_bytes(self) -> int:
        return max(self.param_bytes_per_rank)

    @property
    def grad_bytes(self) -> int:
        return max(self.grad_bytes_per_rank)

    @property
    def optimizer_bytes(self) -> int:
        return max(self.optimizer_bytes_per_rank)

    @property
    def state_bytes(self) -> int:
        """Persistent training state on one rank: parameters + gradients + optimizer + buffers."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.buffer_bytes

    @property
    def largest_group(self) -> GroupMemory:
        return max(self.groups, key=lambda g: g.gathered_bytes)

    @property
    def activation_bytes(self) -> int:
        return self.activations.peak_bytes if self.activations is not None else 0

    @property
    def _device_grad_bytes(self) -> int:
        return 0 if self.cpu_offload else self.grad_bytes  # offloaded gradients live on the host

    @property
    def loss_step_bytes(self) -> int:
        """Beyond the activations as backward starts, the larger of its two moments: the loss's backward
        (the logits' fp32 gradient, no group being gathered: the all-gather window less its flat copy-out
        buffer) and the head's backward right after it (its group gathered, copy-out included, while the
        loss's saved fp32 tensors and gradient are already freed and the head's input gradient lives).
        Measured on 2 CPU ranks at a 1B LoRA: the head's moment is the peak at 512 tokens; the H200 run's
        8192 tokens made the loss's moment the larger. May be negative: less than the activations."""
        saved = self.activations.loss_saved_bytes if self.activations is not None else 0
        return max(self.loss_backward_bytes - self.copy_out_bytes, self.head_grad_bytes - saved)

    @property
    def backward_start_bytes(self) -> int:
        """What joins the resident state and the all-gather window as backward starts: activations + the
        loss's step (`loss_step_bytes`) (+ gradients kept from the previous micro-batch)."""
        grads = self._device_grad_bytes if self.grads_kept else 0
        return (self.activation_bytes + (self.loss_step_bytes if self.activations is not None else 0) + grads
                + self.all_to_all_bytes)

    @property
    def backward_end_bytes(self) -> int:
        """What joins it as backward ends: every gradient + the reduce-scatter buffers."""
        return self._device_grad_bytes + self.reduce_scatter_peak_bytes

    @property
    def device_bytes(self) -> int:
        """Estimated accelerator peak: parameters, optimizer and buffers + the all-gather window (+ a
        dequantized 4-bit weight) + the larger of the two high points of backward (memory.py's docstring)."""
        resident = 0 if self.cpu_offload else self.param_bytes + self.optimizer_bytes + self.buffer_bytes
        beside_reduce = (self.gathered_peak_bytes if self.reduce_scatter_window_bytes is None
                         else self.reduce_scatter_window_bytes)
        return resident + max(self.gathered_peak_bytes + self.dequantized_peak_bytes + self.backward_start_bytes,
                              beside_reduce + self.dequantized_peak_bytes + self.backward_end_bytes)

    @property
    def host_bytes(self) -> int:
        """Host (CPU) memory for the training state; the process's own RSS is not included."""
        activations = self.activations.host_bytes if self.activations is not None else 0
        return (self.state_bytes if self.cpu_offload else 0) + activations

    def setup(self) -> str:
        """The FSDP2 setup the numbers describe, in one line."""
        storage = " + ".join(f"{d} ({_count(n)} params)" for d, n in self.storage_dtypes.items())
        mp = (f"MixedPrecisionPolicy(param_dtype={self.param_dtype}, reduce_dtype={self.reduce_dtype})"
              if self.param_dtype
              else f"no param_dtype (gathered in the storage dtype), reduce_dtype={self.reduce_dtype}")
        offload = "CPUOffloadPolicy" if self.cpu_offload else "no offload"
        return f"sharded params stored in {storage}; {mp}; AdamW; {offload}"

    def rows(self) -> list[tuple[str, int, int]]:
        """(label, accelerator bytes, host bytes) per line of the table."""
        def place(n: int) -> tuple[int, int]:
            return (0, n) if self.cpu_offload else (n, 0)

        s = f"{self.shard_size}{self.shard_of}"
        storage = "/".join(self.storage_dtypes)
        trainable = "/".join(self.trainable_dtypes) or "-"
        compute = self.param_dtype or storage
        rows = [
            (f"parameters, sharded 1/{s} ({storage})", *place(self.param_bytes)),
            (f"gradients, sharded 1/{s} ({trainable}, trainable only)", *place(self.grad_bytes)),
            (f"AdamW exp_avg + exp_avg_sq ({trainable}) + step", *place(self.optimizer_bytes)),
            ("buffers (replicated)", *place(self.buffer_bytes)),
        ]
        largest = self.largest_group
        compute += f" + {self.quantized_base} {self.quantized_storage}" if self.quantized_base else ""
        rows.append((f"all-gather: {self.gather_window} groups in flight ({compute}; largest "
                     f"{largest.name} {format_bytes(largest.gathered_bytes)})", self.gathered_peak_bytes, 0))
        rows.append((f"reduce-scatter: unsharded grads + {self.reduce_dtype or compute} buffer",
                     self.reduce_scatter_peak_bytes, 0))
        if self.quantized_base:
            rows.append((f"{self.quantized_base}: largest weight dequantized for its matmul", self.dequantized_peak_bytes,
                         0))
        a = self.activations
        if a is not None:
            ac = ("offloaded to the host" if a.offloaded else "no checkpointing" if not a.checkpointing
                  else "with activation checkpointing"
                  + (f" of 1 layer in {a.checkpoint_every}" if a.checkpoint_every > 1 else "")
                  + (f", {a.kept_outputs} kept" if a.kept_outputs else ""))
            rows.append((f"activations: batch {a.batch_size} x seq {a.seq_len}{self.activation_split}, {ac}", a.peak_bytes,
                         a.host_bytes))
            if self.all_to_all_bytes:
                rows.append((self.exchange_words, self.all_to_all_bytes, 0))
            if self.loss_backward_bytes:
                rows.append(("loss backward: the logits' fp32 gradient (tokens x vocab) less the window's copy-out, "
                             "or the head's gradient less the loss's saved fp32", self.loss_step_bytes, 0))
        return rows

    def format_table(self) -> str:
        rows = self.rows()
        width = max(len(r[0]) for r in rows) + 2
        mesh = (f"{self.world_size} ranks = {self.replicate_size} replicas x {self.shard_size} shards (HSDP)"
                if self.replicate_size > 1 else f"{self.world_size} ranks")
        mesh += "".join(f", {part}" for part in self.mesh_parts)
        lora = f", LoRA r={self.lora_r} on {','.join(self.lora_targets or ())}" if self.lora_r else ""
        if self.quantized_base:
            lora += f" over a {self.quantized_base} base{' (double quantization)' if self.double_quant else ''}"
        lines = [
            f"{self.model_type}: {self.num_params / 1e9:.3f} B parameters, {self.num_trainable_params / 1e9:.3f} B "
            f"trainable{lora}; {mesh}; memory per rank (max over ranks)",
            f"setup: {self.setup()}",
            f"{'':{width}}{'GPU':>12}{'CPU':>12}",
        ]
        for label, dev, host in rows:
            lines.append(f"{label:{width}}{_cell(dev):>12}{_cell(host):>12}")
        lines.append(f"{'-' * width}{'-' * 24}")
        lines.append(f"{'persistent state (params + grads + optimizer + buffers)':{width}}"
                     f"{_cell(0 if self.cpu_offload else self.state_bytes):>12}"
                     f"{_cell(self.host_bytes):>12}")
        grads = " + gradients" if self.grads_kept else ""
        lines.append(f"estimated peak = parameters + optimizer + buffers + max(all-gather + activations + loss "
                     f"backward{grads}, gathered beside a reduce-scatter + gradients + reduce-scatter):")
        lines.append(f"{'estimated peak':{width}}"
                     f"{_cell(self.device_bytes):>12}{_cell(self.host_bytes):>12}")
        if self.activations is None and self.activations_error:
            lines.append(f"activations not estimated: {self.activations_error}")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def __getattr__(self, name: str) -> Any:
        """The model-parallel sizes as attributes (`estimate.tp_size`), as the JSON has them."""
        sizes = self.__dict__.get("model_parallel") or {}
        if name in sizes:
            return sizes[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(out.pop("keywords"))
        out.update(out.pop("model_parallel"))
        for worded in ("shard_of", "activation_split", "mesh_parts", "exchange_words"):  # the table's words, not the estimate's
            out.pop(worded)
        out["lora_targets"] = list(self.lora_targets) if self.lora_targets else None
        out["per_rank_max"] = {
            "param_bytes": self.param_bytes, "grad_bytes": self.grad_bytes, "optimizer_bytes": self.optimizer_bytes,
            "buffer_bytes": self.buffer_bytes, "state_bytes": self.state_bytes,
            "gathered_peak_bytes": self.gathered_peak_bytes,
            "reduce_scatter_peak_bytes": self.reduce_scatter_peak_bytes,
            "activation_bytes": self.activation_bytes, "dequantized_peak_bytes": self.dequantized_peak_bytes,
            "loss_backward_bytes": self.loss_backward_bytes, "loss_step_bytes": self.loss_step_bytes,
            "backward_start_bytes": self.backward_start_bytes,
            "backward_end_bytes": self.backward_end_bytes,
            "device_bytes": self.device_bytes,
            "host_bytes": self.host_bytes,
        }
        return out

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


def _cell(n: int) -> str:
    return format_bytes(n) if n else "-"
