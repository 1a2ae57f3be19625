"""Training-step benchmark: hf_fsdp2 against Accelerate's FSDP2, FSDP1 with PEFT's policy, and DDP.

One command, one run, side by side: the same model (a Llama built from a `LlamaConfig`, no
download), the same data and the same number of processes, on N gloo ranks on CPU that this script
spawns itself (NCCL and one GPU per rank when CUDA is available), in two modes:

  lora   PEFT LoRA r=8 on q/k/v/o/gate/up/down, frozen base
  full   full fine-tune

CONTESTANTS
  ours        `hf_fsdp2.shard_model(model, FSDP2Config())`: one `fully_shard` group per decoder layer
              (frozen base + LoRA together), [embedding], [final norm, lm_head], root; fp32 reduce.
  accelerate  Accelerate's own FSDP2 path, `accelerate.utils.fsdp_utils.fsdp2_prepare_model(acc, model)`,
              called directly because stock Accelerate does not engage FSDP on CPU. `acc` is a minimal
              stand-in carrying exactly the attributes that function reads:
                state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2,
                    auto_wrap_policy="TRANSFORMER_BASED_WRAP", reshard_after_forward=True,
                    state_dict_type="SHARDED_STATE_DICT", cpu_ram_efficient_loading=False,
                    activation_checkpointing=False)   (layer classes from `_no_split_modules`)
                torch_device_mesh = None   (what `Accelerator()` has without a ParallelismConfig: FSDP2's
                                            default 1-D mesh over the world)
                mixed_precision = "no", is_main_process, device
              This is what `Accelerator._prepare_fsdp2` runs for the model, minus the optimizer
              parameter swap (we build the optimizer after wrapping instead) and minus compile/AC.
  ours_zero2  opt-in (`--contestants ... ours_zero2`), not a peer: ours with reshard_after_forward=False.
  ours_hsdp   opt-in (world >= 4): ours on 2 replicas x world/2 shards (HSDP; each group's reduce-scattered
              gradients all-reduced over the replicas, in place: see its all_reduce line per step).
  ours_bf16   opt-in: ours with param_dtype=bf16 (bf16 all-gather and compute, fp32 masters and reduce).
  ours_fp8    opt-in: ours_bf16 plus FSDP2Config(fp8=True): the decoder layers' linears in torchao float8
              with FP8 all-gather, scales precomputed after each optimizer step (compare its payload
              bytes per step with ours_bf16: the converted weights move 1 byte a value instead of 2).
  ours_auto   opt-in: FSDP2Config(shard_size="auto", plan_batch_size/plan_seq_len = this run's micro-batch)
              with the default budget (CPU: 0.75 x RAM / local ranks; CUDA: 0.85 x device memory): the
              planner's cheapest layout that fits, replication (S=1) whenever the model fits: trained with
              DDP's reducer (sharding/replication.py; the `ddp` contestant's all-reduce hook registered on it so
              its collectives are counted alike).
  ours_auto_fsdp2  opt-in: ours_auto with replication="fsdp2": the same layout on FSDP2 one-rank groups.
  ours_auto_bf16  opt-in: ours_auto with param_dtype=bf16 (Accelerate's `mixed_precision: bf16`): on DDP's
              reducer each group's weights are cast for its forward (sharding/compute_cast.py, FSDP2's numerics).
  ours_auto_bf16_fsdp2  opt-in: ours_auto_bf16 on FSDP2 one-rank groups (replication="fsdp2").
  deepspeed   opt-in peer (needs `pip install deepspeed`, see benchmarks/deepspeed_contestant.py): DeepSpeed
              ZeRO-3, fp32, the same torch AdamW handed to deepspeed.initialize, no gradient clipping.
  ours_compile_model  opt-in: ours with FSDP2Config(compile="model"): the whole training forward compiled with its
              all-gathers/reduce-scatters in the graph, bucketed by inductor (sharding/compile/compiled_collectives.py;
              buckets of one decoder layer by default). The first warm-up step compiles. Compare its
              collectives per step and step time with `ours` (eager) and `ours_compile` (regional).
  ddp_bf16    opt-in: the `ddp` contestant with its forward under torch.autocast(bf16), as Accelerate runs
              DDP with `mixed_precision: bf16` (Accelerator.prepare_model wraps the forward in autocast).
  ours_auto_tight  opt-in: ours_auto with a budget that forces sharding: 1 byte less than the
              leanest replicated layout without checkpointing or offload (read from the plan).
              Its budget, layout and estimated peak are printed beside its measured RSS.
  ours_auto_loaded  opt-in: ours_auto_tight's budget, but the model never exists whole on a rank: the same
              weights saved once (outside the measurement), then `hf_fsdp2.from_pretrained(..., FSDP2Config(
              shard_size="auto", memory_budget=...))`: planned on the meta model, each rank loads its rows (LoRA:
              adapters from `peft_config`, initialised by PEFT on rank 0 and broadcast, so its losses differ
              slightly). Its estimated peak is printed beside its measured RSS, and checked: <= 1.2 x budget.
  ours_auto_accelerate_loaded  opt-in: ours_auto_loaded's budget through Accelerate's own path, as a script under
              `accelerate launch` with `fsdp_cpu_ram_efficient_loading: true` runs it: hf_fsdp2.register(shard_size=
              "auto", memory_budget=...), transformers' `LlamaForCausalLM.from_pretrained(dir)` (deferred by
              hf_fsdp2: the model stays on meta on every rank, integrations/deferred_load.py), PEFT's
              get_peft_model (LoRA), then `Accelerator().prepare(model)`, which shards and reads each rank's rows.
              Checked like ours_auto_loaded: peak RSS Δ <= 1.2 x budget, estimate beside it.
  ours_ac     opt-in: ours with activation_checkpointing=True (every decoder layer recomputed in backward).
  ours_sac    opt-in: ours_ac with checkpoint_save_matmuls=True (op-level selective checkpointing: matmul and
              attention outputs kept, the cheap ops recomputed); compare its RSS and step time with ours_ac/ours.
  ours_compile opt-in: ours with FSDP2Config(compile=True), each decoder layer compiled by inductor
              (regional compilation); the first warm-up step's time (printed) includes compiling.
  replicate   opt-in candidate (issue 35, not a peer): torch's composable `replicate` built on FSDP2's
              machinery (torch.distributed._composable.replicate_with_fsdp), per decoder layer then root.
  ours_plain  opt-in ablation: ours without its CPU schedule (sync all-gathers, no forward prefetch,
              embedding re-gathered in backward).
  fsdp1       `torch.distributed.fsdp.FullyShardedDataParallel(model, use_orig_params=True,
              device_id=<cpu|cuda>, auto_wrap_policy=...)`, FULL_SHARD, torch defaults otherwise.
              lora: `peft.utils.other.fsdp_auto_wrap_policy(model)` (every LoRA Linear its own unit,
              plus each decoder layer): the configuration PEFT's docs and the seeds use.
              full: `transformer_auto_wrap_policy` on the decoder layer class (Accelerate's FSDP1
              TRANSFORMER_BASED_WRAP); `--fsdp1-full-policy peft` uses PEFT's policy there too.
  transformers  opt-in peer: transformers' own FSDP2, `from_pretrained(..., distributed_config=
              DistributedConfig(fsdp_size=world))` on the same weights (saved first); full fine-tune only
              (transformers does not support PEFT with it).
  ddp         `DistributedDataParallel` (default buckets, broadcast_buffers=True) with torch's own
              `default_hooks.allreduce_hook` registered, so its gradient all-reduces go through
              `dist.all_reduce` where they can be counted (the same divide + all-reduce the built-in
              C++ hook does).

PROTOCOL (per world size: one set of processes; per mode: all contestants alive at once)
  1. Build phase, one contestant after the other: gc + malloc_trim, VmRSS baseline, reset VmHWM, build
     the model (same seed), wrap, AdamW(lr, trainable params), then `--warmup` untimed steps. Peak RSS
     = max(VmHWM, 5 ms VmRSS sampler) during build + warm-up, minus the baseline ("RSS delta": the
     contestant's own model, grads, optimizer state, activations and buffers). After each warm-up
     backward, before `optimizer.step`: gradient bytes held for frozen weights.
  2. Timed phase: `--steps` rounds; in each round every contestant does one step (forward, backward,
     optimizer.step, zero_grad), in an order rotated every round so machine drift hits all alike.
     Every step starts after a barrier; its time is the slowest rank's. tokens/s = global tokens per
     step / median step time.
  3. Collectives: `torch.distributed.{all_gather_single, all_gather_into_tensor, all_gather,
     _all_gather_base, reduce_scatter_single, reduce_scatter_tensor, reduce_scatter,
     _reduce_scatter_base, all_reduce, broadcast, _broadcast_coalesced, all_to_all_single}` are
     wrapped during the timed steps only (FSDP1 and FSDP2 call them as `dist.<name>` at run time;
     DDP's gradient all-reduce via the hook above, its per-forward buffer broadcast via
     `_broadcast_coalesced`). Per step: calls, payload bytes (the full, unsharded tensor: output of an
     all-gather, input of a reduce-scatter, the tensor of an all-reduce/broadcast), and wire bytes
     sent per rank for a ring algorithm ((n-1)/n x payload for all-gather/reduce-scatter/broadcast,
     2(n-1)/n for all-reduce).
  4. Losses: every contestant's global-mean loss at every step (warm-up and timed), all-reduced once
     at the end; max |loss - ours| is printed so the comparison is of equivalent work.
  5. `--isolated-memory`: peak RSS delta again with each contestant alone in fresh processes (build +
     warm-up). In the shared process of 1.-2. the heap pages one contestant frees stay resident and are
     reused by the next, which moves RSS deltas by up to ~100 MiB at the "small" size.

  Optimizer: AdamW for every contestant, `--optimizer fused` by default (the Transformers Trainer's
  default `adamw_torch_fused` since torch 2.8); `loop` is torch's CPU default for a hand-built AdamW
  (one dispatch per op per parameter, which costs FSDP2's DTensor parameters ~8x on the full
  fine-tune's optimizer step here), `foreach` in between.

    python benchmarks/train_bench.py --world-size 2 4 --model-size tiny --steps 10
    python benchmarks/train_bench.py --world-size 2 4 --model-size small --steps 5 --warmup 1 --isolated-memory

Results: tables on stdout, `benchmarks/results/train_<timestamp>.json` and `.png` beside it.
On CUDA (not exercised on the CPU machine this was written on) the same code runs with NCCL, one GPU
per rank, and also reports MFU (model FLOPs: 6N per token for full, 4N + 2N_trainable for LoRA, over
`--peak-tflops` per GPU, default from the device name for fp32) and peak CUDA memory per rank.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import harness
from harness import RssSampler, backend_collectives, hwm_bytes, malloc_trim, reset_hwm, rss_bytes, run_ranks

REPO, RESULTS_DIR = harness.REPO, harness.RESULTS_DIR
MiB = 1 << 20
CONTESTANTS = ("ours", "accelerate", "fsdp1", "ddp")
EXTRA = ("ours_zero2", "ours_hsdp", "ours_plain", "ours_bf16", "ours_fp8", "ours_auto", "ours_auto_fsdp2", "ours_auto_tight",
         "ours_auto_bf16", "ours_auto_bf16_fsdp2", "ddp_bf16", "deepspeed", "ours_compile_model",
         "ours_auto_loaded", "ours_auto_accelerate_loaded",
         "ours_ac", "ours_sac", "ours_compile",
         "replicate", "transformers")  # opt-in settings of ours (and torch's replicate, a candidate; transformers'
# own FSDP, a peer run on request since it needs its own load): not in the targets
# The sharding peers `ours` (full sharding) must match; DDP replicates, so it is `ours_auto`'s peer (below).
PEERS = ("accelerate", "fsdp1", "transformers", "deepspeed")
LOADERS = ("ours_auto_loaded", "ours_auto_accelerate_loaded")  # built from saved weights, not from `model`
OPTIMIZERS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}
MODES = ("lora", "full")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Llama shapes: tiny ~5M, small ~60M parameters (untied embeddings).
MODEL_SIZES = {
    "tiny": dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4),
    "small": dict(vocab_size=16384, hidden_size=512, intermediate_size=1376, num_hidden_layers=14,
                  num_attention_heads=8, num_key_value_heads=4),
}
# Default data per size: (global batch, sequence length).
DEFAULT_DATA = {"tiny": (8, 128), "small": (8, 64)}
# Dense fp32 (no TF32) peak per GPU, TFLOP/s, for MFU when --peak-tflops is not given.
FP32_PEAK_TFLOPS = {"H200": 67.0, "H100": 67.0, "A100": 19.5, "L40S": 91.6, "A10": 31.2, "V100": 15.7}

# ---------------------------------------------------------------------------------------------
# Collective accounting


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if t is not None and hasattr(t, "numel") else 0


# name -> (kind, function of (args, kwargs) giving the payload bytes: the full unsharded tensor)
_COLLECTIVES = {
    "all_gather_single": ("all_gather", lambda a, k: _nbytes(a[0] if a else k.get("output_tensor"))),
    "all_gather_into_tensor": ("all_gather", lambda a, k: _nbytes(a[0] if a else k.get("output_tensor"))),
    "_all_gather_base": ("all_gather", lambda a, k: _nbytes(a[0] if a else k.get("output_tensor"))),
    "all_gather": ("all_gather", lambda a, k: sum(_nbytes(t) for t in (a[0] if a else k.get("tensor_list")))),
    "reduce_scatter_single": ("reduce_scatter", lambda a, k: _nbytes(a[1] if len(a) > 1 else k.get("input"))),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, k: _nbytes(a[1] if len(a) > 1 else k.get("input"))),
    "_reduce_scatter_base": ("reduce_scatter", lambda a, k: _nbytes(a[1] if len(a) > 1 else k.get("input"))),
    "reduce_scatter": ("reduce_scatter",
                       lambda a, k: sum(_nbytes(t) for t in (a[1] if len(a) > 1 else k.get("input_list")))),
    "all_reduce": ("all_reduce", lambda a, k: _nbytes(a[0] if a else k.get("tensor"))),
    "broadcast": ("broadcast", lambda a, k: _nbytes(a[0] if a else k.get("tensor"))),
    "_broadcast_coalesced": ("broadcast", lambda a, k: sum(_nbytes(t) for t in a[1])),
    "all_to_all_single": ("all_to_all", lambda a, k: _nbytes(a[1] if len(a) > 1 else k.get("input"))),
}
_WIRE_FACTOR = {"all_gather": 1, "reduce_scatter": 1, "broadcast": 1, "all_to_all": 1, "all_reduce": 2}


class CollectiveCounter:
    """Wraps `torch.distributed.<collective>` while active; attributes calls to `self.current`."""

    def __init__(self, world: int):
        import torch.distributed as dist

        self.dist, self.world = dist, world
        self.current: str | None = None
        self.trace = False  # record (function, payload bytes) of every call, in order
        self.stats: dict[str, dict] = {}
        self._originals: dict = {}

    def _record(self, name: str, args, kwargs) -> None:
        if self.current is None:
            return
        kind, payload_fn = _COLLECTIVES[name]
        try:
            payload = payload_fn(args, kwargs)
        except Exception:  # noqa: BLE001 - an odd call signature must not break the run
            payload = 0
        s = self.stats.setdefault(self.current, {"calls": 0, "payload_bytes": 0, "wire_bytes": 0.0, "by_fn": {},
                                                 "trace": []})
        if self.trace:
            s["trace"].append((name, payload))
        s["calls"] += 1
        s["payload_bytes"] += payload
        s["wire_bytes"] += payload * _WIRE_FACTOR[kind] * (self.world - 1) / self.world
        fn = s["by_fn"].setdefault(name, {"calls": 0, "payload_bytes": 0})
        fn["calls"] += 1
        fn["payload_bytes"] += payload

    def __enter__(self) -> "CollectiveCounter":
        for name in _COLLECTIVES:
            original = getattr(self.dist, name, None)
            if original is None:
                continue
            self._originals[name] = original

            def counted(*args, _name=name, _orig=original, **kwargs):
                self._record(_name, args, kwargs)
                return _orig(*args, **kwargs)

            setattr(self.dist, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(self.dist, name, original)
        self._originals.clear()


# ---------------------------------------------------------------------------------------------
# Models, data, contestants


def llama_config(size: str):
    from transformers import LlamaConfig

    return LlamaConfig(**MODEL_SIZES[size], max_position_embeddings=2048, tie_word_embeddings=False,
                       attention_dropout=0.0, rms_norm_eps=1e-5)


def build_model(size: str, mode: str, seed: int):
    """The same weights (and LoRA A init) for every contestant: seeded before each random init."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(size)).float()
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed + 1)
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS))
    return model


def make_batches(n: int, batch: int, seq: int, vocab: int, seed: int):
    """Learnable sequences (each token = previous + a per-row stride), identical on every rank."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        stride = torch.randint(1, 8, (batch, 1), generator=g)
        out.append((start + stride * torch.arange(seq)) % vocab)
    return out


def wrap_ours(model, ctx):
    from hf_fsdp2 import FSDP2Config, shard_model

    return shard_model(model, FSDP2Config())  # defaults: reduce_dtype fp32, reshard_after_forward True


def wrap_accelerate(model, ctx):
    from types import SimpleNamespace

    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    model.to(ctx["device"])  # Accelerator.prepare_model moves the model to its device first
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP", reshard_after_forward=True,
        state_dict_type="SHARDED_STATE_DICT", cpu_ram_efficient_loading=False, activation_checkpointing=False)
    acc = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None, parallelism_config=None,
                          mixed_precision="no", is_main_process=ctx["rank"] == 0, device=ctx["device"])
    return fsdp2_prepare_model(acc, model)


def wrap_fsdp1(model, ctx):
    import functools

    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    if ctx["mode"] == "lora" or ctx["fsdp1_full_policy"] == "peft":
        from peft.utils.other import fsdp_auto_wrap_policy

        policy = fsdp_auto_wrap_policy(model)
    else:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    device_id = ctx["device"] if ctx["device"].type == "cuda" else torch.device("cpu")
    return FullyShardedDataParallel(model, auto_wrap_policy=policy, use_orig_params=True, device_id=device_id)


def wrap_ddp(model, ctx):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    model.to(ctx["device"])
    ddp = DistributedDataParallel(model, device_ids=[ctx["device"].index] if ctx["device"].type == "cuda" else None)
    ddp.register_comm_hook(state=None, hook=default_hooks.allreduce_hook)
    return ddp


def wrap_ours_compile_model(model, ctx):
    from hf_fsdp2 import FSDP2Config, shard_model

    return shard_model(model, FSDP2Config(compile="model"))


def wrap_deepspeed(model, ctx):
    from deepspeed_contestant import wrap_deepspeed as wrap

    return wrap(model, ctx)


def wrap_ddp_bf16(model, ctx):
    """DDP under bf16 autocast, as Accelerate prepares it (`Accelerator.prepare_model`: the forward wrapped in
    `torch.autocast`, then DistributedDataParallel)."""
    import torch

    model.forward = torch.autocast(ctx["device"].type, dtype=torch.bfloat16)(model.forward)
    return wrap_ddp(model, ctx)


def wrap_ours_hsdp(model, ctx):
    """ours on an HSDP mesh: 2 replicas x world/2 shards (FSDP2's all-reduce of each group's reduce-scattered
    gradients over the replicas: the branch torch's own composable `replicate` also runs)."""
    import torch.distributed as dist

    from hf_fsdp2 import FSDP2Config, shard_model

    world = dist.get_world_size()
    if world < 4 or world % 2:
        raise ValueError(f"ours_hsdp needs an even world size of 4 or more (2 replicas x shards), not {world}")
    return shard_model(model, FSDP2Config(replicate_size=2, shard_size=world // 2))


def wrap_ours_zero2(model, ctx):
    """ours with `reshard_after_forward=False`: layers stay gathered from forward to backward (no
    re-gather in backward; more memory), for users whose model fits that way."""
    from hf_fsdp2 import FSDP2Config, shard_model

    return shard_model(model, FSDP2Config(reshard_after_forward=False))


def wrap_ours_plain(model, ctx):
    """ours without its CPU schedule (the ablation): synchronous all-gathers, no forward prefetch,
    the embedding all-gathered again in backward, as plain FSDP2 does."""
    from hf_fsdp2 import FSDP2Config, shard_model
    from hf_fsdp2.sharding import model_parts

    model = shard_model(model, FSDP2Config(forward_prefetch=0))
    model._set_unshard_async_op(False)
    embedding = model_parts(model).base.get_input_embeddings()
    if hasattr(embedding, "set_unshard_in_backward"):
        embedding.set_unshard_in_backward(True)
    return model


def wrap_ours_bf16(model, ctx):
    from hf_fsdp2 import FSDP2Config, shard_model

    return shard_model(model, FSDP2Config(param_dtype="bf16"))


def wrap_ours_fp8(model, ctx):
    from hf_fsdp2 import FSDP2Config, shard_model

    return shard_model(model, FSDP2Config(param_dtype="bf16", fp8=True))


def _auto_config(ctx, **extra):
    from hf_fsdp2 import FSDP2Config

    return FSDP2Config(shard_size="auto", plan_batch_size=ctx["micro_batch"], plan_seq_len=ctx["seq"], **extra)


def _count_like_ddp(model):
    """On a model hf_fsdp2 replicated with DDP's reducer (sharding/replication.py), the same Python
    all-reduce hook as the `ddp` contestant, so its all-reduces are counted the same way."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from hf_fsdp2.sharding.replication import is_replicated

    if is_replicated(model):
        model.register_comm_hook(state=None, hook=default_hooks.allreduce_hook)
    return model


def wrap_ours_auto(model, ctx):
    from hf_fsdp2 import shard_model

    return _count_like_ddp(shard_model(model, _auto_config(ctx)))


def wrap_ours_auto_fsdp2(model, ctx):
    """ours_auto's layout on FSDP2 one-rank groups (`replication="fsdp2"`), the path before DDP's reducer."""
    from hf_fsdp2 import shard_model

    return shard_model(model, _auto_config(ctx, replication="fsdp2"))


def wrap_ours_auto_bf16(model, ctx):
    from hf_fsdp2 import shard_model

    return _count_like_ddp(shard_model(model, _auto_config(ctx, param_dtype="bf16")))


def wrap_ours_auto_bf16_fsdp2(model, ctx):
    from hf_fsdp2 import shard_model

    return shard_model(model, _auto_config(ctx, param_dtype="bf16", replication="fsdp2"))


def _tight_budget(model, ctx) -> int:
    """A budget the replicated layouts (without checkpointing or offload) miss: the planner has to shard."""
    import torch.distributed as dist

    from hf_fsdp2.planner.layout import plan_layout
    from hf_fsdp2.planner.memory import prepare_meta_model

    config = _auto_config(ctx)
    plan = plan_layout(prepare_meta_model(model, config), dist.get_world_size(), config, budget_bytes=1 << 50,
                       device_type=ctx["device"].type, batch_size=ctx["micro_batch"], seq_len=ctx["seq"])
    # Below every replicated layout short of checkpointing/offload (with LoRA, replication can need
    # less than S=2 without resharding: its frozen weights are never gathered).
    return min(c.needed_bytes for c in plan.candidates
               if c.shard_size == 1 and not (c.activation_checkpointing or c.cpu_offload)) - 1


def wrap_ours_auto_tight(model, ctx):
    from hf_fsdp2 import shard_model

    return shard_model(model, _auto_config(ctx, memory_budget=_tight_budget(model, ctx)))


def _loaded_budget(ctx):
    """(ours_auto_tight's budget for the saved model, the LoRA config or None): planned on a meta copy."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    lora = None
    with torch.device("meta"):
        probe = LlamaForCausalLM(LlamaConfig.from_pretrained(ctx["saved"]))
    if ctx["mode"] == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS)
        probe = get_peft_model(probe, lora)
    return _tight_budget(probe, ctx), lora


def wrap_ours_auto_loaded(model, ctx):
    """`model` is None: the weights come from `ctx["saved"]` (see `save_weights`), each rank its rows."""
    import torch
    from transformers import LlamaForCausalLM

    from hf_fsdp2 import from_pretrained

    budget, peft_config = _loaded_budget(ctx)
    return from_pretrained(LlamaForCausalLM, ctx["saved"], _auto_config(ctx, memory_budget=budget),
                           torch_dtype=torch.float32, peft_config=peft_config)


def wrap_ours_auto_accelerate_loaded(model, ctx):
    """`model` is None: Accelerate's prepare path with the deferred load (see the contestant's note). The
    environment `accelerate launch` would set and hf_fsdp2's seams hold only while the model is built and
    prepared, so the other contestants in these processes are untouched."""
    import torch
    from accelerate import Accelerator
    from transformers import LlamaForCausalLM

    import hf_fsdp2

    budget, lora = _loaded_budget(ctx)
    launched = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
                "FSDP_SYNC_MODULE_STATES": "true", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
                "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT", "ACCELERATE_MIXED_PRECISION": "no"}
    before = {k: os.environ.get(k) for k in launched}
    os.environ.update(launched)
    hf_fsdp2.register(shard_size="auto", memory_budget=budget, plan_batch_size=ctx["micro_batch"],
                      plan_seq_len=ctx["seq"])
    try:
        model = LlamaForCausalLM.from_pretrained(ctx["saved"], dtype=torch.float32)
        if lora is not None:
            from peft import get_peft_model

            model = get_peft_model(model, lora)
        # Accelerate's FSDP2 path wants an optimizer alongside the model (it re-maps its parameters onto
        # the shards); the run's own optimizer is built on the prepared model afterwards, as for the others.
        prepared, _ = Accelerator().prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
        return prepared
    finally:
        hf_fsdp2.unregister()
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def save_weights(job: dict, rank: int) -> str:
    """build_model's base weights saved once by rank 0 (before any measurement); the directory."""
    import tempfile

    import torch.distributed as dist

    directory = [tempfile.mkdtemp(prefix="train_bench-weights-") if rank == 0 else None]
    dist.broadcast_object_list(directory)
    if rank == 0:
        build_model(job["model_size"], "full", job["seed"]).save_pretrained(directory[0])
    dist.barrier()
    return directory[0]


def wrap_replicate(model, ctx):
    """torch's composable `replicate` on FSDP2's machinery (torch.distributed._composable.replicate_with_fsdp,
    torch >= 2.10): each decoder layer, then the root, as `fully_shard` would be applied, with replicated
    (not sharded) parameters and all-reduced gradients: the candidate for hf_fsdp2's S=1 path (issue 35)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    from hf_fsdp2.sharding import model_parts

    model.to(ctx["device"])
    for layer in model_parts(model).base.model.layers:
        replicate(layer)
    return replicate(model)


def wrap_transformers(model, ctx):
    """transformers' own FSDP2 (>= 5.2x): the same weights saved, then `from_pretrained(...,
    distributed_config=DistributedConfig(fsdp_size=world))`, which applies `fully_shard` per its
    model's FSDP plan at load (transformers/distributed/fsdp.py). Full fine-tune only: transformers'
    FSDP is not made to work with PEFT (its own TODO there), so LoRA reports "not supported"."""
    import tempfile

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    if hasattr(model, "peft_config"):
        raise NotImplementedError("transformers' distributed_config FSDP with PEFT: not supported by transformers")
    directory = [tempfile.mkdtemp(prefix="train_bench-") if ctx["rank"] == 0 else None]
    dist.broadcast_object_list(directory)
    if ctx["rank"] == 0:
        model.save_pretrained(directory[0])
    dist.barrier()
    sharded = AutoModelForCausalLM.from_pretrained(
        directory[0], dtype=next(model.parameters()).dtype,
        distributed_config=DistributedConfig(fsdp_size=dist.get_world_size()))
    dist.barrier()
    if ctx["rank"] == 0:
        import shutil

        shutil.rmtree(directory[0], ignore_errors=True)
    return sharded


def wrap_ours_ac(model, ctx):
    from hf_fsdp2 import FSDP2Config, shard_model

    return shard_model(model, FSDP2Config(activation_checkpointing=True))


def wrap_ours_sac(model, ctx):
    from hf_fsdp2 import FSDP2Config, shard_model

    return shard_model(model, FSDP2Config(activation_checkpointing=True, checkpoint_save_matmuls=True))


def wrap_ours_compile(model, ctx):
    from hf_fsdp2 import FSDP2Config, shard_model

    return shard_model(model, FSDP2Config(compile=True))


WRAPPERS = {"ours": wrap_ours, "accelerate": wrap_accelerate, "fsdp1": wrap_fsdp1, "ddp": wrap_ddp,
            "ours_zero2": wrap_ours_zero2, "ours_hsdp": wrap_ours_hsdp, "ours_plain": wrap_ours_plain, "ours_bf16": wrap_ours_bf16,
            "ours_fp8": wrap_ours_fp8, "ours_auto": wrap_ours_auto, "ours_auto_fsdp2": wrap_ours_auto_fsdp2,
            "ours_auto_tight": wrap_ours_auto_tight, "ours_auto_bf16": wrap_ours_auto_bf16,
            "ours_auto_bf16_fsdp2": wrap_ours_auto_bf16_fsdp2, "ddp_bf16": wrap_ddp_bf16, "deepspeed": wrap_deepspeed, "ours_compile_model": wrap_ours_compile_model,
            "ours_auto_loaded": wrap_ours_auto_loaded,
            "ours_auto_accelerate_loaded": wrap_ours_auto_accelerate_loaded, "ours_ac": wrap_ours_ac, "ours_sac": wrap_ours_sac,
            "ours_compile": wrap_ours_compile, "replicate": wrap_replicate, "transformers": wrap_transformers}


def make_optimizer(model, lr: float, kind: str):
    import torch

    from hf_fsdp2.quantization import fp8

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, **OPTIMIZERS[kind])
    if hasattr(model, "adopt_optimizer"):  # deepspeed: ZeRO-3 takes the optimizer over (its step is the engine's)
        return model.adopt_optimizer(optimizer)
    fp8.attach_to_optimizer(model, optimizer)  # ours_fp8: the FP8 scales after every step (no-op otherwise)
    return optimizer


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def grad_bytes(model) -> dict:
    """Gradient bytes this rank holds after backward: for trainable and for frozen weights.

    Frozen: `.grad` of requires_grad=False parameters, plus, for FSDP1, the share of each
    FlatParameter's gradient that covers frozen original parameters (FSDP1 keeps one flat gradient
    per unit; with `use_orig_params=True` a unit mixing frozen and trainable weights grads them all).
    """
    frozen = trainable = 0
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        if p.requires_grad:
            trainable += _nbytes(_local(g))
        else:
            frozen += _nbytes(_local(g))
    flat_frozen = flat_total = 0
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        units = FullyShardedDataParallel.fsdp_modules(model)
    except Exception:  # noqa: BLE001
        units = []
    for unit in units:
        handle = getattr(unit, "_handle", None)
        flat = getattr(handle, "flat_param", None) if handle is not None else None
        if flat is None:
            continue
        g = flat.grad if flat.grad is not None else getattr(flat, "_saved_grad_shard", None)
        if g is None:
            continue
        params = getattr(flat, "_params", None) or []
        numels = list(getattr(flat, "_numels", [p.numel() for p in params]))
        total = sum(numels) or 1
        frozen_numel = sum(n for p, n in zip(params, numels) if not p.requires_grad)
        flat_total += _nbytes(g)
        flat_frozen += int(_nbytes(g) * frozen_numel / total)
    if units:  # with use_orig_params the .grad of original params are views of the flat gradient
        trainable = flat_total - flat_frozen
    return {"frozen_grad_bytes": frozen + flat_frozen, "frozen_param_grad_bytes": frozen,
            "frozen_flat_grad_bytes": flat_frozen, "trainable_grad_bytes": trainable}


def param_counts(model) -> tuple[int, int]:
    """(total, trainable) global parameter counts (sharded DTensors report their global numel)."""
    seen, total, trainable = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return total, trainable


# ---------------------------------------------------------------------------------------------
# One rank


def prime(job: dict, rank: int, device) -> None:
    """One step of every contestant on a 1-layer model, discarded: imports, lazy module and
    process-group state and thread pools are paid for here, not by whichever contestant is built
    first in the measured build phase."""
    import torch

    ids = torch.randint(0, 256, (1, 16), device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mode in job["modes"]:
            for name in job["contestants"]:
                torch.manual_seed(0)
                from transformers import LlamaConfig, LlamaForCausalLM

                base = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                                    num_hidden_layers=1, num_attention_heads=4,
                                                    num_key_value_heads=2, tie_word_embeddings=False))
                if mode == "lora":
                    from peft import LoraConfig, get_peft_model

                    base = get_peft_model(base, LoraConfig(r=8, target_modules=LORA_TARGETS))
                try:
                    model = WRAPPERS[name](base, {"rank": rank, "device": device, "mode": mode, "seq": 16,
                                                  "micro_batch": 1, "fsdp1_full_policy": job["fsdp1_full_policy"]})
                    opt = make_optimizer(model, 1e-3, job["optimizer"])
                    model(input_ids=ids, labels=ids).loss.backward()
                    opt.step()
                except Exception:  # noqa: BLE001 - the measured build reports failures
                    pass
    model = opt = base = None
    gc.collect()
    malloc_trim()


def run_rank(rank: int, world: int, job: dict) -> dict:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")

    cuda = job["cuda"]
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    cfg = llama_config(job["model_size"])
    batch, seq = job["batch"], job["seq"]
    assert batch % world == 0, "global batch must divide by the world size"
    per = batch // world
    nsteps = job["warmup"] + job["steps"]
    batches = [b[rank * per:(rank + 1) * per].to(device)
               for b in make_batches(nsteps, batch, seq, cfg.vocab_size, job["seed"] + 7)]
    counter = CollectiveCounter(world)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    out = {"rank": rank, "modes": {}}
    saved = save_weights(job, rank) if set(LOADERS) & set(job["contestants"]) else None
    prime(job, rank, device)
    for mode in job["modes"]:
        live, res = {}, {}
        # 1. build + warm-up, one contestant after the other
        for name in job["contestants"]:
            r = res[name] = {"losses": [], "step_s": [], "error": None}
            gc.collect()
            malloc_trim()
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            dist.barrier()
            base = rss_bytes()
            hwm_ok = reset_hwm()
            error = None
            with RssSampler(job["sample_interval"]) as sampler, warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    t0 = time.perf_counter()
                    model = WRAPPERS[name](None if name in LOADERS else
                                           build_model(job["model_size"], mode, job["seed"]),
                                           {"rank": rank, "device": device, "mode": mode, "seq": seq, "saved": saved,
                                            "micro_batch": per, "fsdp1_full_policy": job["fsdp1_full_policy"]})
                    opt = make_optimizer(model, job["lr"], job["optimizer"])
                    r["wrap_s"] = time.perf_counter() - t0
                    r["params_total"], r["params_trainable"] = param_counts(model)
                    # Build peak (the whole model exists on every rank before sharding), then the
                    # steps' own peak: VmHWM and the sampler restart from the current RSS.
                    r["rss_peak_build"] = max(hwm_bytes() if hwm_ok else 0, sampler.max)
                    hwm_ok = reset_hwm() and hwm_ok
                    sampler.max = 0
                    grads = []
                    from hf_fsdp2.sharding import record_of

                    plan = getattr(record_of(model), "layout", None)
                    if plan is not None and plan.chosen is not None:
                        r["layout"] = {"budget_bytes": plan.budget_bytes, "chosen": plan.chosen.describe(),
                                       "estimated_peak_bytes": plan.chosen.needed_bytes,
                                       "returns_freed_memory": plan.returns_freed_memory}
                    t_first = time.perf_counter()
                    for i in range(job["warmup"]):
                        if i == 1:
                            sync()
                            r["first_step_s"] = time.perf_counter() - t_first
                        # The last warm-up step profiled: the collectives as the backend received them,
                        # counting those inside compiled graphs (functional collectives bypass the counter).
                        with backend_collectives(r) if i == job["warmup"] - 1 else contextlib.nullcontext():
                            loss = model(input_ids=batches[i], labels=batches[i]).loss
                            loss.backward()
                            grads.append(grad_bytes(model))
                            opt.step()
                            opt.zero_grad(set_to_none=True)
                        r["losses"].append(loss.item())
                    sync()
                    r["grads"] = {k: max(g[k] for g in grads) for k in grads[0]} if grads else {}
                except Exception:  # noqa: BLE001 - reported as this contestant's error
                    error = traceback.format_exc()
            # All ranks agree on dropping a contestant (otherwise the others would wait in its collectives).
            flag = torch.tensor([1.0 if error else 0.0], device=device)
            dist.all_reduce(flag)
            if flag.item() > 0:
                r["error"] = error or "failed on another rank"
                res[name] = r
                model = opt = None
                continue
            r["warnings"] = sorted({str(w.message).strip().split("\n")[0][:300] for w in caught})
            r["rss_base"] = base
            r["rss_peak_steps"] = max(hwm_bytes() if hwm_ok else 0, sampler.max, rss_bytes())
            r["rss_peak"] = max(r["rss_peak_build"], r["rss_peak_steps"])
            r["rss_delta"] = r["rss_peak"] - base
            r["rss_delta_build"] = r["rss_peak_build"] - base
            r["rss_delta_steps"] = r["rss_peak_steps"] - base
            r["hwm_reset"] = hwm_ok
            if cuda:
                r["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device)
            live[name] = (model, opt)
            model = opt = None

        # 2. timed rounds, order rotated every round
        names = list(live)
        with counter:
            for k in range(job["steps"]):
                ids = batches[job["warmup"] + k]
                order = names[k % len(names):] + names[:k % len(names)] if names else []
                for name in order:
                    model, opt = live[name]
                    dist.barrier()
                    counter.current = name
                    counter.trace = k == 0
                    t0 = time.perf_counter()
                    loss = model(input_ids=ids, labels=ids).loss
                    t1 = time.perf_counter()
                    loss.backward()
                    t2 = time.perf_counter()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    value = loss.item()
                    sync()
                    t3 = time.perf_counter()
                    res[name]["step_s"].append(t3 - t0)
                    # Phases are host-side times: exact on CPU, launch/queue times only on CUDA.
                    res[name].setdefault("phases_s", []).append((t1 - t0, t2 - t1, t3 - t2))
                    counter.current = None
                    res[name]["losses"].append(value)
        model = opt = None
        for name in names:
            res[name]["collectives"] = counter.stats.get(name, {"calls": 0, "payload_bytes": 0, "wire_bytes": 0.0,
                                                                "by_fn": {}})
        counter.stats = {}
        # 3. global-mean losses and slowest-rank step times, one collective each
        for name in names:
            losses = torch.tensor(res[name]["losses"], dtype=torch.float64, device=device)
            dist.all_reduce(losses)
            res[name]["global_losses"] = (losses / world).tolist()
            times = torch.tensor(res[name]["step_s"], dtype=torch.float64, device=device)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            res[name]["step_s_max"] = times.tolist()
        live.clear()
        gc.collect()
        malloc_trim()
        out["modes"][mode] = res
    if saved is not None and rank == 0:
        import shutil

        shutil.rmtree(saved, ignore_errors=True)
    return out


def run_world(world: int, job: dict, timeout: float) -> list[dict]:
    return run_ranks(run_rank, world, job, timeout, threads=job["threads"], backend="nccl" if job["cuda"] else "gloo",
                     pg_timeout=_dt.timedelta(minutes=20))


# ---------------------------------------------------------------------------------------------
# Aggregation and report


def summarize(ranks: list[dict], mode: str, name: str, job: dict, world: int, peak_tflops: float | None) -> dict:
    per = [r["modes"][mode][name] for r in ranks]
    r0 = per[0]
    if r0["error"]:
        real = [p["error"] for p in per if p["error"] and p["error"] != "failed on another rank"]
        return {"error": real[0] if real else r0["error"]}
    times = r0["step_s_max"]
    med = statistics.median(times)
    tokens = job["batch"] * job["seq"]
    s = {
        "step_s_median": med, "step_s": times,
        "step_s_iqr": (statistics.quantiles(times, n=4)[0], statistics.quantiles(times, n=4)[2])
        if len(times) >= 2 else (med, med),
        "tokens_per_s": tokens / med,
        "wrap_s_max": max(p["wrap_s"] for p in per),
        "params_total": r0["params_total"], "params_trainable": r0["params_trainable"],
        "collectives_per_step": r0["collectives"]["calls"] / job["steps"],
        "collectives_per_step_per_rank": [p["collectives"]["calls"] / job["steps"] for p in per],
        "payload_bytes_per_step": r0["collectives"]["payload_bytes"] / job["steps"],
        "wire_bytes_per_rank_per_step": max(p["collectives"]["wire_bytes"] for p in per) / job["steps"],
        "phases_ms_median_rank0": dict(zip(("forward", "backward", "optimizer"),
                                           (statistics.median(x[i] for x in r0["phases_s"]) * 1e3 for i in range(3)))),
        "collectives_trace_first_step": r0["collectives"].get("trace", []),
        "collectives_by_fn_per_step": {fn: {"calls": v["calls"] / job["steps"],
                                            "payload_bytes": v["payload_bytes"] / job["steps"]}
                                       for fn, v in r0["collectives"]["by_fn"].items()},
        "rss_peak_per_rank": [p["rss_peak"] for p in per],
        "rss_delta_per_rank": [p["rss_delta"] for p in per],
        "rss_base_per_rank": [p["rss_base"] for p in per],
        "rss_delta_max": max(p["rss_delta"] for p in per),
        "rss_delta_build_per_rank": [p["rss_delta_build"] for p in per],
        "rss_delta_steps_per_rank": [p["rss_delta_steps"] for p in per],
        "rss_delta_steps_max": max(p["rss_delta_steps"] for p in per),
        "frozen_grad_bytes_max": max(p["grads"].get("frozen_grad_bytes", 0) for p in per),
        "frozen_grad_detail_rank0": r0["grads"],
        "trainable_grad_bytes_per_rank": [p["grads"].get("trainable_grad_bytes", 0) for p in per],
        "losses": r0["global_losses"],
        "warnings_rank0": r0.get("warnings", []),
        "first_step_s_max": max(p.get("first_step_s", float("nan")) for p in per),
        "layout": r0.get("layout"),
        "backend_collectives_last_warmup_step": r0.get("backend_collectives", {}),
    }
    if "cuda_peak_bytes" in r0:
        s["cuda_peak_bytes_per_rank"] = [p["cuda_peak_bytes"] for p in per]
        n, nt = r0["params_total"], r0["params_trainable"]
        flops_per_token = 6 * n if mode == "full" else 4 * n + 2 * nt
        s["model_flops_per_step"] = flops_per_token * tokens
        if peak_tflops:
            s["mfu"] = s["model_flops_per_step"] / med / (peak_tflops * 1e12 * world)
    return s


def isolated_memory(world: int, job: dict, contestants: list[str], timeout: float) -> dict:
    """Peak RSS delta per rank with each contestant alone in fresh processes (build + warm-up only).

    In the main run all contestants share a process, so the allocator state one leaves behind (freed
    but resident heap pages) changes the next one's RSS delta by ~+-100 MiB at the "small" size."""
    out: dict = {}
    for mode in job["modes"]:
        for name in contestants:
            ranks = run_world(world, {**job, "modes": [mode], "contestants": [name], "steps": 0}, timeout)
            r = [x["modes"][mode][name] for x in ranks]
            out.setdefault(mode, {})[name] = (
                {"error": r[0]["error"]} if r[0]["error"] else
                {"rss_delta_per_rank": [x["rss_delta"] for x in r], "rss_peak_per_rank": [x["rss_peak"] for x in r],
                 "rss_delta_build_per_rank": [x["rss_delta_build"] for x in r],
                 "rss_delta_steps_per_rank": [x["rss_delta_steps"] for x in r],
                 "rss_delta_steps_max": max(x["rss_delta_steps"] for x in r),
                 "rss_base_per_rank": [x["rss_base"] for x in r], "rss_delta_max": max(x["rss_delta"] for x in r),
                 **({"cuda_peak_bytes_per_rank": [x["cuda_peak_bytes"] for x in r]} if "cuda_peak_bytes" in r[0]
                    else {})})
    return out


def _rss_pairs(s: dict) -> str:
    return " ".join(f"{b / MiB:.0f}/{t / MiB:.0f}"
                    for b, t in zip(s["rss_delta_build_per_rank"], s["rss_delta_steps_per_rank"]))


def mib(n: float) -> str:
    return f"{n / MiB:.1f}"


def report(res: dict) -> list[str]:
    world, lines = res["world_size"], []
    cuda = res["cuda"]
    for mode, table in res["modes"].items():
        ours = table.get("ours", {})
        lines.append(f"\n== {res['model_size']} Llama ({ours.get('params_total', 0) / 1e6:.2f}M params, "
                     f"{ours.get('params_trainable', 0) / 1e6:.3f}M trainable), mode={mode}, {world} ranks "
                     f"({'NCCL/CUDA' if cuda else 'gloo/CPU'}, {res['threads']} threads/rank), "
                     f"{res['tokens_per_step']} tokens/step, {res['steps']} timed steps after {res['warmup']} ==")
        head = (f"{'contestant':<11}{'tok/s':>8}{'vs ours':>8}{'step ms (IQR)':>20}{'fwd/bwd/opt ms':>16}"
                f"{'coll/step':>10}{'vs ours':>8}{'payload MiB':>12}{'wire MiB/rank':>14}{'RSSΔ steps MiB':>15}"
                f"{'frozen grad B':>14}{'|Δloss| max':>12}")
        if cuda:
            head += f"{'MFU':>7}{'CUDA peak MiB':>15}"
        lines.append(head)
        for name, s in table.items():
            if "error" in s:
                first = [ln for ln in s["error"].strip().splitlines() if ln.strip()][-1][:110]
                lines.append(f"{name:<11}{'n/a':>9}   ({first})")
                continue
            tps_ratio = s["tokens_per_s"] / ours["tokens_per_s"] if "tokens_per_s" in ours else float("nan")
            coll_ratio = (s["collectives_per_step"] / ours["collectives_per_step"]
                          if ours.get("collectives_per_step") else float("nan"))
            iqr = f"{s['step_s_median'] * 1e3:.0f} ({s['step_s_iqr'][0] * 1e3:.0f}-{s['step_s_iqr'][1] * 1e3:.0f})"
            dl = s.get("max_abs_loss_diff_vs_ours")
            phases = "/".join(f"{v:.0f}" for v in s["phases_ms_median_rank0"].values())
            line = (f"{name:<11}{s['tokens_per_s']:>8.0f}{tps_ratio:>7.2f}x{iqr:>20}{phases:>16}"
                    f"{s['collectives_per_step']:>10.0f}{coll_ratio:>7.2f}x{mib(s['payload_bytes_per_step']):>12}"
                    f"{mib(s['wire_bytes_per_rank_per_step']):>14}{mib(s['rss_delta_steps_max']):>15}"
                    f"{s['frozen_grad_bytes_max']:>14}{'-' if dl is None else f'{dl:.2e}':>12}")
            if cuda:
                line += f"{s.get('mfu', float('nan')) * 100:>6.1f}%{mib(max(s['cuda_peak_bytes_per_rank'])):>15}"
            lines.append(line)
        iso = res.get("isolated_memory", {}).get(mode)
        if iso:
            lines.append("  peak RSS Δ per rank, build / steps, each contestant alone in fresh processes (MiB): "
                         + "; ".join(f"{name}: " + (_rss_pairs(s) if "error" not in s else "n/a")
                                     for name, s in iso.items()))
        for name, s in table.items():
            if "error" not in s and s.get("layout"):
                lay = s["layout"]
                lines.append(f"  {name}: budget {mib(lay['budget_bytes'])} MiB/rank -> {lay['chosen']}; estimated "
                             f"peak {mib(lay['estimated_peak_bytes'])} MiB, measured peak RSS Δ (build / steps) "
                             f"{_rss_pairs(s)} MiB"
                             + ("; its plan made glibc return freed blocks, process-wide: every contestant's timed "
                                "steps in these processes ran with it" if lay.get("returns_freed_memory") else ""))
        lines.append("  first warm-up step (s, slowest rank; compiled contestants compile here): " + "; ".join(
            f"{name}: {s['first_step_s_max']:.2f}" for name, s in table.items() if "error" not in s))
        lines.append("  peak RSS Δ per rank, build / steps, in this run (MiB): " + "; ".join(
            f"{name}: " + _rss_pairs(s) for name, s in table.items() if "error" not in s))
        if "losses" in ours:
            lines.append(f"  global-mean loss (ours), step 1 -> {len(ours['losses'])}: {ours['losses'][0]:.5f} -> "
                         f"{ours['losses'][-1]:.5f}; |Δloss| max = max over all steps of |loss - ours| (same data, "
                         "same init)")
        lines.append("  collectives per step, by function: " + "; ".join(
            f"{name}: " + ", ".join(f"{fn}={v['calls']:.0f} ({mib(v['payload_bytes'])} MiB)"
                                    for fn, v in sorted(s["collectives_by_fn_per_step"].items()))
            for name, s in table.items() if "error" not in s))
        lines.append("  process-group ops of the last warm-up step (torch.profiler; compiled graphs' collectives "
                     "included; gloo runs a reduce-scatter as an all-reduce): " + "; ".join(
                         f"{name}: " + ", ".join(f"{op}={n}" for op, n in sorted(
                             s.get("backend_collectives_last_warmup_step", {}).items()))
                         for name, s in table.items() if "error" not in s))
    return lines


def _budget_peak(name: str, shared: dict, isolated: dict) -> tuple[float, str]:
    """(peak RSS Δ of a budgeted contestant, where measured): alone in fresh processes when measured, since
    in the shared run the other contestants' heap pages (and, when a plan makes glibc return freed blocks,
    that process-wide setting) mix in."""
    alone = isolated.get(name, {}).get("rss_delta_per_rank")
    return max(alone or shared["rss_delta_per_rank"]), "alone" if alone else "in the shared run"


def targets(res: dict) -> list[tuple[bool | None, str]]:
    world, out = res["world_size"], []
    for mode, table in res["modes"].items():
        ours = table.get("ours")
        if not ours or "error" in ours:
            out.append((False, f"{mode}, {world} ranks: ours did not run"))
            continue
        ran = {n: s for n, s in table.items() if n in PEERS and "error" not in s}
        if ran:
            best = max(ran, key=lambda n: ran[n]["tokens_per_s"])
            overlap = ours["step_s_iqr"][0] <= ran[best]["step_s_iqr"][1] and \
                ran[best]["step_s_iqr"][0] <= ours["step_s_iqr"][1]
            ok = ours["tokens_per_s"] >= ran[best]["tokens_per_s"] or overlap  # within noise counts, as below
            out.append((ok, f"{mode}, {world} ranks: throughput >= every sharding peer ({', '.join(sorted(ran))}; "
                            f"within noise = step-time IQRs overlap): ours {ours['tokens_per_s']:.0f} tok/s "
                            f"vs best peer {best} {ran[best]['tokens_per_s']:.0f} tok/s "
                            f"({ours['tokens_per_s'] / ran[best]['tokens_per_s']:.2f}x"
                            f"{'; step-time IQRs overlap' if overlap else ''})"))
        auto, tight, ddp = table.get("ours_auto"), table.get("ours_auto_tight"), table.get("ddp")
        auto_bf16, ddp_bf16 = table.get("ours_auto_bf16"), table.get("ddp_bf16")
        for mine, other, what in ((auto, ddp, "ours_auto >= ddp"), (tight, ours, "ours_auto_tight >= ours"),
                                  (auto_bf16, ddp_bf16, "ours_auto_bf16 >= ddp_bf16")):
            if mine and other and "error" not in mine and "error" not in other:
                overlap = mine["step_s_iqr"][0] <= other["step_s_iqr"][1] and \
                    other["step_s_iqr"][0] <= mine["step_s_iqr"][1]
                out.append((mine["tokens_per_s"] >= other["tokens_per_s"] or overlap,
                            f"{mode}, {world} ranks: {what} (tokens/s, median step; within noise = step-time IQRs "
                            f"overlap): {mine['tokens_per_s']:.0f} vs {other['tokens_per_s']:.0f} "
                            f"({mine['tokens_per_s'] / other['tokens_per_s']:.2f}x{'; IQRs overlap' if overlap else ''})"))
        iso = res.get("isolated_memory", {}).get(mode, {})
        lay = (tight or {}).get("layout")
        if lay and "error" not in tight:
            peak, where = _budget_peak("ours_auto_tight", tight, iso)
            out.append((peak <= lay["budget_bytes"], f"{mode}, {world} ranks: ours_auto_tight peak RSS Δ "
                        f"{where} {mib(peak)} MiB <= its budget {mib(lay['budget_bytes'])} MiB"))
        for loader in LOADERS:
            loaded = table.get(loader)
            if loaded and "error" not in loaded and loaded.get("layout"):
                lay = loaded["layout"]
                peak, where = _budget_peak(loader, loaded, iso)
                heap = "; glibc returns freed blocks" if lay.get("returns_freed_memory") else ""
                out.append((peak <= 1.2 * lay["budget_bytes"], f"{mode}, {world} ranks: {loader} (meta + per-rank "
                            f"load) peak RSS Δ {where} {mib(peak)} MiB <= 1.2 x its budget {mib(lay['budget_bytes'])} "
                            f"MiB ({peak / lay['budget_bytes']:.2f}x; estimated peak "
                            f"{mib(lay['estimated_peak_bytes'])} MiB{heap})"))
        if mode == "lora":
            f1 = table.get("fsdp1")
            if f1 and "error" not in f1:
                ok = ours["collectives_per_step"] <= 0.5 * f1["collectives_per_step"]
                out.append((ok, f"lora, {world} ranks: collectives/step <= half of FSDP1+PEFT policy: ours "
                                f"{ours['collectives_per_step']:.0f} vs fsdp1 {f1['collectives_per_step']:.0f} "
                                f"(limit {0.5 * f1['collectives_per_step']:.0f})"))
            else:
                out.append((None, f"lora, {world} ranks: collectives vs FSDP1: n/a (FSDP1 not run or failed)"))
            ok = ours["frozen_grad_bytes_max"] == 0
            out.append((ok, f"lora, {world} ranks: gradient bytes for frozen weights = 0: ours "
                            f"{ours['frozen_grad_bytes_max']} B (max over ranks and warm-up steps)"))
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(r, mode) for r in results for mode in r["modes"]]
    labels = [f"{mode}\n{r['world_size']} ranks" for r, mode in groups]
    panels = [("tokens/s (median step)", "tokens_per_s", 1), ("collectives per step", "collectives_per_step", 1),
              ("wire bytes sent per rank per step (MiB)", "wire_bytes_per_rank_per_step", MiB),
              ("peak RSS delta per rank during the steps, max (MiB; alone if --isolated-memory)", "rss_delta_steps_max", MiB)]
    fig, axes = plt.subplots(2, 2, figsize=(max(12, 2.6 * len(groups) + 4), 9))
    names = list(dict.fromkeys(n for r, mode in groups for n in r["modes"][mode]))
    width = 0.8 / len(names)
    for ax, (title, key, scale) in zip(axes.flat, panels):
        for j, name in enumerate(names):
            vals, err = [], [[], []]
            for r, mode in groups:
                s = r["modes"][mode].get(name)
                ok = s is not None and "error" not in s
                if key == "rss_delta_steps_max" and r.get("isolated_memory"):  # the unbiased number when measured
                    s = r["isolated_memory"][mode].get(name)
                    ok = s is not None and "error" not in s
                vals.append(s[key] / scale if ok else 0)
                if key == "tokens_per_s" and ok:  # IQR of the step times as error bars
                    err[0].append(vals[-1] - r["tokens_per_step"] / s["step_s_iqr"][1])
                    err[1].append(r["tokens_per_step"] / s["step_s_iqr"][0] - vals[-1])
                else:
                    err[0].append(0)
                    err[1].append(0)
            xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(groups))]
            ax.bar(xs, vals, width, label=name, yerr=err if key == "tokens_per_s" else None, capsize=3)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(labels)
        ax.set_title(title, fontsize=10)
        if key == "collectives_per_step":
            ax.set_yscale("log")
        ax.legend(fontsize=7)
    r0 = results[0]
    fig.suptitle(f"hf_fsdp2 training-step benchmark: {r0['model_size']} Llama, "
                 f"{'NCCL/CUDA' if r0['cuda'] else 'gloo/CPU'}, {r0['tokens_per_step']} tokens/step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, nargs="+", default=[2, 4], help="ranks (one run per value)")
    ap.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="tiny")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--contestants", nargs="+", choices=CONTESTANTS + EXTRA, default=list(CONTESTANTS),
                    help="ours always runs (the reference); ours_zero2 / ours_plain are opt-in settings of ours")
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="fused",
                    help="AdamW implementation for every contestant (fused: the Trainer's default)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per contestant (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per contestant first (>= 1)")
    ap.add_argument("--batch", type=int, default=None, help="global batch (sequences per step)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per rank (default: CPU cores // world size, at least 1)")
    ap.add_argument("--fsdp1-full-policy", choices=("transformer", "peft"), default="transformer",
                    help="FSDP1 wrap policy for full fine-tune (lora always uses PEFT's fsdp_auto_wrap_policy)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="per-GPU peak for MFU (CUDA only)")
    ap.add_argument("--no-cuda", action="store_true", help="gloo on CPU even when CUDA is available")
    ap.add_argument("--isolated-memory", action="store_true",
                    help="also measure peak RSS with each contestant alone in fresh processes (build + warm-up; "
                         "unbiased by the allocator state of the others; one spawn per mode and contestant)")
    ap.add_argument("--sample-ms", type=float, default=5.0, help="VmRSS sampling interval")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the ranks, per world size")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be >= 1")
    import torch

    cuda = torch.cuda.is_available() and not args.no_cuda
    batch = args.batch or DEFAULT_DATA[args.model_size][0]
    seq = args.seq or DEFAULT_DATA[args.model_size][1]
    for w in args.world_size:
        if batch % w:
            ap.error(f"--batch {batch} must be divisible by every --world-size (got {w})")
        if cuda and w > torch.cuda.device_count():
            ap.error(f"--world-size {w} needs {w} GPUs; {torch.cuda.device_count()} visible")
    peak_tflops = args.peak_tflops
    if cuda and peak_tflops is None:
        name = torch.cuda.get_device_name(0)
        peak_tflops = next((v for k, v in FP32_PEAK_TFLOPS.items() if k in name), None)

    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    contestants = ["ours"] + [c for c in args.contestants if c != "ours"]  # ours is the reference
    meta = {"timestamp": stamp, "argv": sys.argv[1:], "git": harness.git_state(), "python": platform.python_version(),
            "torch": torch.__version__, "cpus": os.cpu_count(), "platform": platform.platform(),
            "cuda": cuda, "cuda_device": torch.cuda.get_device_name(0) if cuda else None,
            "peak_tflops_per_gpu": peak_tflops, "load_average_at_start": os.getloadavg(),
            "versions": {}, "model_config": {**MODEL_SIZES[args.model_size]}}
    for mod in ("transformers", "accelerate", "peft"):
        meta["versions"][mod] = __import__(mod).__version__
    print(f"train_bench: {args.model_size} Llama {MODEL_SIZES[args.model_size]}, batch {batch} x seq {seq}, "
          f"{args.steps} timed steps after {args.warmup} warm-up, AdamW {args.optimizer}, "
          f"{'NCCL/CUDA' if cuda else 'gloo/CPU'}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    results, verdicts = [], []
    for world in args.world_size:
        threads = args.threads or max(1, (os.cpu_count() or 1) // world)
        job = {"model_size": args.model_size, "modes": args.modes, "contestants": contestants, "steps": args.steps,
               "warmup": args.warmup, "batch": batch, "seq": seq, "lr": args.lr, "seed": args.seed,
               "optimizer": args.optimizer, "threads": threads, "cuda": cuda, "fsdp1_full_policy": args.fsdp1_full_policy,
               "sample_interval": args.sample_ms / 1000}
        t0 = time.perf_counter()
        ranks = run_world(world, job, args.timeout)
        res = {"world_size": world, "model_size": args.model_size, "cuda": cuda, "threads": threads,
               "optimizer": args.optimizer,
               "tokens_per_step": batch * seq, "batch": batch, "seq": seq, "steps": args.steps,
               "warmup": args.warmup, "wall_s": time.perf_counter() - t0, "modes": {}}
        for mode in args.modes:
            table = {name: summarize(ranks, mode, name, job, world, peak_tflops) for name in contestants}
            ref = table["ours"].get("losses")
            for name, s in table.items():
                if ref and "losses" in s:
                    s["max_abs_loss_diff_vs_ours"] = max(abs(a - b) for a, b in zip(s["losses"], ref))
            res["modes"][mode] = table
        if args.isolated_memory:
            res["isolated_memory"] = isolated_memory(world, job, contestants, args.timeout)
        results.append(res)
        for line in report(res):
            print(line, flush=True)
        verdicts.extend(targets(res))
        print(f"  ({world} ranks: {res['wall_s']:.0f} s wall)", flush=True)

    print("\nTargets:")
    for ok, text in verdicts:
        print(f"  {'PASS' if ok else ('n/a ' if ok is None else 'FAIL')}  {text}")
    meta["verdicts"] = [{"pass": ok, "text": text} for ok, text in verdicts]
    json_path = args.out_dir / f"train_{stamp}.json"
    png_path = args.out_dir / f"train_{stamp}.png"
    json_path.write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    try:
        plot(results, png_path)
    except Exception as e:  # noqa: BLE001 - the JSON is the record; a chart failure must not lose it
        print(f"(chart not written: {e})")
    print(f"\nwrote {json_path.relative_to(REPO) if json_path.is_relative_to(REPO) else json_path} and .png")
    return 0 if all(ok is not False for ok, _ in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
