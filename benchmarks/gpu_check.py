"""The GPU check: one command on a GPU machine, one JSON and one table of what hf_fsdp2 does there.

    python3 benchmarks/gpu_check.py --out $OUT                  # one H100/H200, about 5 minutes (H200)
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu     # CPU, gloo, tiny shapes (tests/test_gpu_check.py)

World size 1 on NCCL (every training step still goes through the real hooks, collectives and I/O paths
with CUDA tensors), sections in this order, each on its own (one that fails is recorded with its
traceback and the rest go on) and each skipped once the time budget (--budget-s) is spent:

  equality     a small Llama trained 3 steps by plain PyTorch and by hf_fsdp2 (its default at world size 1,
               DDP's reducer, and FSDP2 groups), fp32 and bf16 mixed precision: losses and weights.
  checkpoint   on CUDA tensors: save_pretrained full / PEFT adapter / merged LoRA, save_state + load_state
               sync and async, hf_fsdp2.from_pretrained with a LoRA config; everything reloaded with stock
               transformers / PEFT and compared.
  simulate     one rank of an 8-rank job on this GPU (`hf-fsdp2 simulate`, torch's fake process group), ranks 0
               and 7: Llama 3.1 8B full fine-tune (1 x 8192) and Qwen3-30B-A3B LoRA with ep 8 (1 x 4096): peak
               CUDA memory per rank vs the estimate, and a PREDICTED tokens/s per GPU beside the published
               8 x H100 numbers (torchtitan, NeMo AutoModel); Llama 3.1 70B QLoRA (1 x 4096; needs the carried
               bitsandbytes wheel, else said not done); the 8B shape under shard_size="auto" with a 48 GiB budget:
               the layout the planner picks and the measured peak over the budget.
  throughput   a 1B Llama-shaped model (Llama 3.2 1B's shape, random init, bf16 compute, fp32 master weights),
               seq 2048: tokens/s, MFU and peak CUDA memory of plain PyTorch (autocast), hf_fsdp2 (default and
               FSDP2 groups) and Accelerate's own FSDP2 prepare, full fine-tune and LoRA, side by side; peak
               memory vs hf_fsdp2's estimate (`hf-fsdp2 estimate-memory`) for the same setup.
  save_load    that model saved with save_pretrained and read back with load_pretrained: GB/s vs the disk's
               own write+fsync (and read) of the same bytes.
  generate     generate() of the sharded model vs the unsharded one, 16 and 128 new tokens: tokens/s.
  variants     regional compile, compile="model", FP8 (torchao, where installed and supported; eager and under
               regional compile), activation checkpointing (whole layer and op-level), activation offload vs
               eager: tokens/s, peak memory.
  two_process  2 processes on the one GPU: NCCL (which refuses two ranks on one device), then gloo with
               a CUDA model (which shard_model refuses by name); what happened is reported either way.
  local_ranks  2 and 4 ranks on the one GPU as threads (torch's threaded process group, hf_fsdp2/tools/
               local_ranks.py): a small Llama trained like one process, each rank saving and loading its rows
               from CUDA memory, EP at 2 on a small Qwen3-MoE (benchmarks/local_ranks_check.py); equal or not.
  memory_phases  one step after warm-up, plain / ours / Accelerate, LoRA and full: peak and live bytes per
               phase (forward, backward, optimizer), what autograd saved, the allocation sites live at the peak.
  fp8_large    FP8 vs bf16 under regional compile on 6 of Llama 3.1 8B's layers (where float8 matmuls pay).
  moe          (after simulate) issue 64 at world size 1 on a Qwen3-30B-A3B-shaped model (8 of its 48 layers):
               tokens/s of hf_fsdp2's experts (LoRA inside the grouped matmuls) against transformers' default
               experts implementation (PEFT's fold for LoRA), LoRA and full; FP8 rowwise experts (torchao) against
               bf16 on its MoE layers. Needs transformers >= 5.23 and torchao carried (below).

The throughput contestants run twice, in alternating order (--rounds), the faster run of each kept.
Results so far: benchmarks/results/gpu_check-*-H200.json, summed up in docs/gpu.md ("What has run where").

Targets (issue 53), as ratios from this one run: hf_fsdp2 >= 0.97x plain PyTorch's tokens/s at world size 1;
>= Accelerate's FSDP2; peak CUDA memory within 5% of the estimate; >= 40% MFU for the 1B model; FP8 >= 1.2x
bf16. A missed target says by how much, and the step's profile (top CUDA kernels) is in the JSON.

On the GPU machine (torch 2.11, transformers 5.17, accelerate 1.15, peft, safetensors; no datasets, trl,
bitsandbytes or torchao; nothing can be downloaded there) hf_fsdp2 runs from the checkout (this script puts
it on sys.path). FP8 needs torchao, carried as a wheel (3 MiB), the 70B QLoRA simulation bitsandbytes (39 MiB; and
torch >= 2.13, so on the image's 2.11 it says not done), EP (the ep 8 simulation, local_ranks' EP, moe)
transformers >= 5.23 (13 MiB; the image's 5.17 has no EP module). Rehearsed on CPU in the image's versions
(`bash benchmarks/oldest_versions.sh gpu-image`'s venv, the three wheels installed to a --target folder on
PYTHONPATH): `--dry-run` runs every section there;
here, from the repository root:
    echo /.whl/ >> .git/info/exclude   # .gitignore has it too
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \\
        -d .whl torchao==0.17.0 bitsandbytes==0.50.0 transformers==5.23.0
and on the machine (device tool: carry [".whl"]):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; \\
    PYTHONPATH=/tmp/site python3 benchmarks/gpu_check.py --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.util
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # hf_fsdp2 from this checkout, installed or not
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are built from configs; no hub there
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# Llama 3.2 1B's shape (1.24B parameters, tied embeddings); the dry run's is tiny.
SHAPES = {
    "big": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "small": dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense, SXM
TARGETS = {"overhead_vs_plain": 0.97, "vs_accelerate": 1.0, "estimate_within": 0.05, "mfu": 0.40, "fp8_speedup": 1.2}


# ---------------------------------------------------------------------------------------------
# Process, device, timing


class Run:
    """What every section needs: device, shapes, the time budget, a scratch directory."""

    def __init__(self, args):
        self.dry = args.dry_run
        self.device = torch.device("cuda", 0) if (torch.cuda.is_available() and not self.dry) else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.big = SHAPES["tiny" if self.dry else "big"]
        self.small = SHAPES["tiny" if self.dry else "small"]
        self.seq = 32 if self.dry else args.seq_len
        self.batch = 2 if self.dry else args.batch_size
        self.steps = 2 if self.dry else args.steps
        self.warmup = 1 if self.dry else 2
        self.deadline = time.monotonic() + args.budget_s
        self.rounds = getattr(args, "rounds", 1)
        self.variants = {v.strip() for v in getattr(args, "variants", "").split(",") if v.strip()}
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu_check_", dir=args.tmp))
        self.peak_flops = args.peak_tflops * 1e12 if args.peak_tflops else None
        if self.peak_flops is None and self.cuda:
            name = torch.cuda.get_device_name(0)
            self.peak_flops = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reset_memory(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def memory(self) -> dict:
        if not self.cuda:
            return {}
        return {"max_allocated": torch.cuda.max_memory_allocated(), "max_reserved": torch.cuda.max_memory_reserved()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_world_one(device: torch.device) -> None:
    """A process group of one rank (NCCL on a GPU, gloo on CPU), as torchrun would set it up."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    import hf_fsdp2

    hf_fsdp2.init_distributed()


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for p in ("torch", "transformers", "accelerate", "peft", "safetensors", "torchao", "triton"):
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = None
    return out


def device_info(run: Run) -> dict:
    info = {"type": run.device.type, "cpus": os.cpu_count()}
    if run.cuda:
        p = torch.cuda.get_device_properties(0)
        info.update(name=p.name, memory=p.total_memory, capability=f"{p.major}.{p.minor}",
                    multiprocessors=p.multi_processor_count, cuda=torch.version.cuda)
        try:
            v = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # noqa: BLE001 - information only
            info["nccl"] = f"unknown ({type(e).__name__})"
    return info


# ---------------------------------------------------------------------------------------------
# Models and training


def llama(shape: dict, device, seed: int = 0, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**shape, max_position_embeddings=4096, rms_norm_eps=1e-5, attention_dropout=0.0,
                         attn_implementation="sdpa")
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype)


def with_lora(model, seed: int = 1, r: int = 16):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=LORA_TARGETS))


def batches(run: Run, vocab: int, n: int, batch: int | None = None, seq: int | None = None) -> list:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (batch or run.batch, seq or run.seq), generator=g).to(run.device)
            for _ in range(n)]


def shard(model, **fields):
    from hf_fsdp2 import FSDP2Config, shard_model

    return shard_model(model, FSDP2Config(**fields))


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the host (a DTensor gathered)."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu()


def named_full(model) -> dict:
    from hf_fsdp2.sharding import canonical_name

    return {canonical_name(n): full(p) for n, p in model.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max(((a[k] - b[k]).abs().max().item() for k in a), default=0.0)


def train(model, optimizer, data, *, autocast: bool = False, on_step=None) -> list[float]:
    losses = []
    for ids in data:
        with torch.autocast(ids.device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if on_step is not None:
            on_step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def flops_per_token(shape: dict, seq: int, lora: bool) -> float:
    """torchtitan's count (its published MFU uses it): 6 x non-embedding parameters + attention's 12·L·H·s;
    LoRA: 4 x (no weight gradients of the frozen base), adapters neglected."""
    h, inter, layers, vocab = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"], shape["vocab_size"]
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    per_layer = h * h * 2 + 2 * h * kv + 3 * h * inter
    dense = layers * per_layer + h * vocab  # the head's matmul counts even when tied
    return (4 if lora else 6) * dense + (8 if lora else 12) * layers * h * seq


# ---------------------------------------------------------------------------------------------
# Sections


def section_equality(run: Run) -> dict:
    """Plain PyTorch vs hf_fsdp2 on the same weights and batches: fp32, and bf16 mixed precision (fp32
    master weights, bf16 compute copies, fp32 gradients: what FSDP2's MixedPrecisionPolicy does, written
    out by hand for the plain model)."""
    data = batches(run, run.small["vocab_size"], 3, batch=2, seq=64 if not run.dry else 16)
    out, ok = {}, True
    for precision in ("fp32", "bf16"):
        ref = llama(run.small, run.device)
        start = copy.deepcopy(ref.state_dict())
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        if precision == "fp32":
            ref_losses = train(ref, opt, data)
        else:
            compute = copy.deepcopy(ref)
            for p in compute.parameters():
                p.data = p.data.to(torch.bfloat16)
            ref_losses = []
            for ids in data:
                for pc, pm in zip(compute.parameters(), ref.parameters()):
                    pc.data.copy_(pm.data)
                loss = compute(input_ids=ids, labels=ids).loss
                loss.backward()
                for pc, pm in zip(compute.parameters(), ref.parameters()):
                    pm.grad, pc.grad = pc.grad.float(), None
                opt.step()
                opt.zero_grad(set_to_none=True)
                ref_losses.append(loss.item())
        ref_weights = named_full(ref)
        del ref, opt
        for variant, fields in (("default", {}), ("fsdp2_groups", {"replication": "fsdp2"})):
            model = llama(run.small, run.device)
            model.load_state_dict(start)
            if precision == "bf16":
                fields = {**fields, "param_dtype": torch.bfloat16}
            model = shard(model, **fields)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            losses = train(model, opt, data)
            loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
            weight_diff = max_diff(named_full(model), ref_weights)
            tol = (1e-5, 1e-5) if precision == "fp32" else (2e-3, 1e-4)
            passed = loss_diff <= tol[0] and weight_diff <= tol[1]
            ok &= passed
            out[f"{precision}/{variant}"] = {"losses": losses, "plain_losses": ref_losses, "max_loss_diff": loss_diff,
                                             "max_weight_diff": weight_diff, "tolerance": tol, "ok": passed,
                                             "path": _path_of(model)}
            del model, opt
    return {"ok": ok, "cases": out}


def _path_of(model) -> str:
    from hf_fsdp2.sharding import replication

    return "ddp_reducer" if replication.is_replicated(model) else "fsdp2"


def section_checkpoint(run: Run) -> dict:
    """Every save/load surface on device tensors, reloaded with stock transformers / PEFT."""
    import hf_fsdp2
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    d = run.tmp / "checkpoint"
    data = batches(run, run.small["vocab_size"], 2, batch=2, seq=32)
    checks = {}

    def check(name, diff, tol=0.0):
        checks[name] = {"max_diff": diff, "ok": diff <= tol}

    # Full model, FSDP2 groups (DTensors on the device).
    model = shard(llama(run.small, run.device), replication="fsdp2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, data[:1])
    hf_fsdp2.save_pretrained(model, d / "full")
    stock = AutoModelForCausalLM.from_pretrained(d / "full", dtype=torch.float32)
    check("save_pretrained/full -> transformers", max_diff(named_full(stock), named_full(model)))
    handle = hf_fsdp2.save_pretrained(model, d / "full_async", blocking=False)
    handle.wait()
    stock = AutoModelForCausalLM.from_pretrained(d / "full_async", dtype=torch.float32)
    check("save_pretrained(blocking=False) -> transformers", max_diff(named_full(stock), named_full(model)))

    # Training state, sync and async, into a fresh model and optimizer.
    hf_fsdp2.save_state(d / "state_sync", model, opt, step=1)
    hf_fsdp2.save_state(d / "state_async", model, opt, step=1, blocking=False).wait()
    for kind in ("sync", "async"):
        fresh = shard(llama(run.small, run.device, seed=7), replication="fsdp2")
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        train(fresh, fresh_opt, data[1:])  # an optimizer state of its own, to be overwritten
        step, _ = hf_fsdp2.load_state(d / f"state_{kind}", fresh, fresh_opt)
        moments = max(max_diff({str(i): full(s["exp_avg"]) for i, s in enumerate(fresh_opt.state.values())},
                               {str(i): full(s["exp_avg"]) for i, s in enumerate(opt.state.values())}), 0.0)
        check(f"save_state/load_state ({kind}): weights", max_diff(named_full(fresh), named_full(model)))
        check(f"save_state/load_state ({kind}): exp_avg", moments)
        checks[f"save_state/load_state ({kind}): step"] = {"value": step, "ok": step == 1}
        del fresh, fresh_opt
    del model, opt

    # LoRA: adapter, merged, and from_pretrained with a LoRA config.
    # The base weights as built on the device: CUDA's generator is not the CPU's, so the same seed on
    # another device is another model (the first GPU run compared a merge with the wrong base: 0.147).
    base = llama(run.small, run.device)
    base_weights = {k: v.detach().cpu().clone() for k, v in base.state_dict().items()}
    peft_model = with_lora(base, r=8)
    peft_model = shard(peft_model, replication="fsdp2")
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    train(peft_model, opt, data)
    hf_fsdp2.save_pretrained(peft_model, d / "adapter")
    hf_fsdp2.save_pretrained(peft_model, d / "merged", merge_adapters=True)
    base = llama(run.small, "cpu")
    base.load_state_dict(base_weights)
    stock_peft = PeftModel.from_pretrained(base, d / "adapter")
    ours = {k: v for k, v in named_full(peft_model).items() if "lora_" in k}
    theirs = {k: v for k, v in named_full(stock_peft).items() if "lora_" in k}
    check("save_pretrained/adapter -> PeftModel.from_pretrained", max_diff(ours, theirs))
    merged_ref = stock_peft.merge_and_unload()
    stock = AutoModelForCausalLM.from_pretrained(d / "merged", dtype=torch.float32)
    check("save_pretrained(merge_adapters=True) -> transformers vs PEFT's merge_and_unload",
          max_diff(named_full(stock), named_full(merged_ref)), tol=1e-5)
    del peft_model, opt

    loaded = hf_fsdp2.from_pretrained(LlamaForCausalLM, d / "full", hf_fsdp2.FSDP2Config(replication="fsdp2"),
                                      peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS))
    stock = AutoModelForCausalLM.from_pretrained(d / "full", dtype=torch.float32).to(run.device)
    ids = data[0]
    with torch.no_grad():
        diff = (loaded(input_ids=ids).logits.float() - stock(input_ids=ids).logits.float()).abs().max().item()
    check("hf_fsdp2.from_pretrained(peft_config) logits vs transformers (B=0)", diff, tol=1e-4)
    del loaded, stock
    return {"ok": all(c["ok"] for c in checks.values()), "checks": checks}


def _accelerator():
    """A stock Accelerator with FSDP2 (bf16) in this one-rank process group, as `accelerate launch` with
    accelerate_configs/fsdp2.yaml would make it; hf_fsdp2 is not registered."""
    os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2", FSDP_AUTO_WRAP_POLICY="TRANSFORMER_BASED_WRAP",
                      FSDP_TRANSFORMER_CLS_TO_WRAP="LlamaDecoderLayer", FSDP_RESHARD_AFTER_FORWARD="true",
                      FSDP_STATE_DICT_TYPE="SHARDED_STATE_DICT", FSDP_CPU_RAM_EFFICIENT_LOADING="false")
    from accelerate import Accelerator

    return Accelerator(mixed_precision="bf16")


def _accelerate_prepare(model, run: Run, state: dict):
    """(model, optimizer, backward, how): the real Accelerator where it takes the FSDP path (on a GPU);
    on CPU, where Accelerate picks no distributed type for one process, its own fsdp2_prepare_model."""
    trainable = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    if "accelerator" not in state:
        state["accelerator"] = _accelerator()
    acc = state["accelerator"]
    from accelerate.utils import DistributedType

    if acc.distributed_type == DistributedType.FSDP:
        acc._models.clear()
        acc._optimizers.clear()
        opt = torch.optim.AdamW(trainable(model), lr=1e-5)
        model, opt = acc.prepare(model, opt)
        return model, opt, acc.backward, "Accelerator.prepare (FSDP2)"
    from types import SimpleNamespace

    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
                                            reshard_after_forward=True, cpu_ram_efficient_loading=False)
    plugin.set_mixed_precision("bf16")
    shim = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None, parallelism_config=None,
                           mixed_precision="bf16", is_main_process=True, device=run.device)
    model = fsdp2_prepare_model(shim, model)
    return model, torch.optim.AdamW(trainable(model), lr=1e-5), lambda loss: loss.backward(), \
        f"fsdp2_prepare_model (Accelerator chose {acc.distributed_type} here)"


def _contestant(run: Run, name: str, mode: str, state: dict, **ours_fields):
    """(model, optimizer, step function, notes) for one throughput contestant, built from the same seed."""
    model = llama(run.big, run.device)
    if mode == "lora":
        model = with_lora(model)
    notes = {}
    if name == "plain":
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        backward, autocast = (lambda loss: loss.backward()), True
    elif name == "accelerate":
        model, opt, backward, notes["how"] = _accelerate_prepare(model, run, state)
        autocast = False
    else:
        fields = {"param_dtype": torch.bfloat16, **ours_fields}
        if name == "ours_fsdp2":
            fields["replication"] = "fsdp2"
        model = shard(model, **fields)
        notes["path"] = _path_of(model)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        backward, autocast = (lambda loss: loss.backward()), False

    def forward(ids):
        with torch.autocast(run.device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            return model(input_ids=ids, labels=ids).loss

    def step(ids):
        loss = forward(ids)
        backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    step.forward, step.backward = forward, backward  # the phases, for section_memory_phases
    return model, opt, step, notes


def measure_training(run: Run, name: str, mode: str, state: dict, *, profile: bool = False, **ours_fields) -> dict:
    run.reset_memory()
    t0 = time.perf_counter()
    model, opt, step, notes = _contestant(run, name, mode, state, **ours_fields)
    data = batches(run, run.big["vocab_size"], run.warmup + run.steps)
    first = time.perf_counter()
    for ids in data[:run.warmup]:
        loss = step(ids)
    run.sync()
    warm = time.perf_counter()
    for ids in data[run.warmup:]:
        loss = step(ids)
    run.sync()
    elapsed = time.perf_counter() - warm
    tokens = run.steps * run.batch * run.seq
    tps = tokens / elapsed
    flops = flops_per_token(run.big, run.seq, mode == "lora") * tps
    out = {"tokens_per_s": tps, "step_s": elapsed / run.steps, "build_s": first - t0, "warmup_s": warm - first,
           "loss": loss.item(), "achieved_tflops": flops / 1e12,
           "mfu": flops / run.peak_flops if run.peak_flops else None, **notes, **run.memory()}
    if profile:
        out["profile"] = profile_steps(run, step, data[:2])
    del model, opt, step
    release_accelerator(state)
    run.reset_memory()
    return out


def release_accelerator(state: dict) -> None:
    """The Accelerator keeps what it prepared (`_models`, `_optimizers`) until told: without this the first
    GPU run measured every contestant after Accelerate's with its 13.8 GiB model and AdamW states still alive."""
    if "accelerator" in state:
        state["accelerator"].free_memory()


def profile_steps(run: Run, step, data) -> list:
    """The top 15 kernels/ops of two steps by device time (CPU time on CPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.cuda else [])
    with profile(activities=activities) as prof:
        for ids in data:
            step(ids)
        run.sync()
    key = "device_time_total" if run.cuda else "cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0) or 0, reverse=True)[:15]
    return [{"name": e.key[:80], "count": e.count, "ms": (getattr(e, key, 0) or 0) / 1e3} for e in events]


def estimate(run: Run, mode: str, **fields) -> int | None:
    from transformers import LlamaConfig

    from hf_fsdp2 import FSDP2Config
    from hf_fsdp2.planner.memory import estimate_memory

    config = LlamaConfig(**run.big, max_position_embeddings=4096)
    est = estimate_memory(config, 1, FSDP2Config(param_dtype=torch.bfloat16, **fields), dtype=torch.float32,
                          lora_r=16 if mode == "lora" else None, lora_targets=LORA_TARGETS,
                          batch_size=run.batch, seq_len=run.seq, gradient_accumulation_steps=1)
    return est.device_bytes


def section_throughput(run: Run) -> dict:
    state, out = {}, {}
    names = ("plain", "ours", "ours_fsdp2", "accelerate")
    for mode in ("full", "lora"):
        results = {}
        # --rounds 2: the contestants again in reverse order, the faster of each one's runs kept (the first GPU
        # runs saw the contestant right after plain PyTorch 4-5% slower whoever it was).
        for round_ in range(run.rounds):
            for name in (names if round_ % 2 == 0 else names[::-1]):
                if run.left() < 20:
                    results.setdefault(name, {"skipped": "out of time"})
                    continue
                try:
                    r = measure_training(run, name, mode, state)
                except Exception as e:  # one contestant failing leaves the others measured
                    results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
                    run.reset_memory()
                    continue
                previous = results.get(name, {})
                runs = previous.get("tokens_per_s_runs", []) + [r["tokens_per_s"]]
                if previous.get("tokens_per_s", 0) > r["tokens_per_s"]:
                    r = {**previous, "max_allocated": max(previous.get("max_allocated") or 0, r.get("max_allocated") or 0)}
                elif previous.get("max_allocated"):
                    r["max_allocated"] = max(previous["max_allocated"], r.get("max_allocated") or 0)
                results[name] = {**r, "tokens_per_s_runs": runs}
        for name, fields in (("ours", {}), ("ours_fsdp2", {"replication": "fsdp2"})):
            r = results.get(name, {})
            if "tokens_per_s" in r:
                try:
                    r["estimate_bytes"] = estimate(run, mode, **fields)
                    if r.get("max_allocated"):
                        r["measured_over_estimate"] = r["max_allocated"] / r["estimate_bytes"]
                except Exception as e:
                    r["estimate_error"] = f"{type(e).__name__}: {e}"
        out[mode] = results
    return {"ok": None, **out}


def section_save_load(run: Run) -> dict:
    """save_pretrained / load_pretrained of the 1B model (FSDP2 groups) vs the disk's write+fsync and read."""
    import hf_fsdp2
    from hf_fsdp2 import FSDP2Config, shard_model

    model = shard(llama(run.big, run.device), replication="fsdp2")
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    d = run.tmp / "big"
    run.sync()
    t = time.perf_counter()
    hf_fsdp2.save_pretrained(model, d)  # durable: fsynced before the commit
    save_s = time.perf_counter() - t
    on_disk = sum(f.stat().st_size for f in d.iterdir())
    evicted = _evict(d)
    fresh = llama(run.big, "meta")
    fresh = shard_model(fresh, FSDP2Config(replication="fsdp2"), init_weights=False)
    run.sync()
    t = time.perf_counter()
    hf_fsdp2.load_pretrained(fresh, d)
    run.sync()
    load_s = time.perf_counter() - t
    equal = max_diff(named_full(fresh), named_full(model)) == 0.0
    del model, fresh
    run.reset_memory()
    raw = d.parent / "raw.bin"
    write_s, read_s = _disk_baseline(raw, on_disk)
    gb = on_disk / 1e9
    out = {"ok": equal, "bytes": on_disk, "param_bytes": nbytes, "save_s": save_s, "load_s": load_s,
           "save_GBps": gb / save_s, "load_GBps": gb / load_s, "disk_write_fsync_GBps": gb / write_s,
           "disk_read_GBps": gb / read_s, "page_cache_evicted_before_reads": evicted,
           "save_vs_disk": write_s / save_s, "load_vs_disk": read_s / load_s, "reloaded_equal": equal}
    raw.unlink(missing_ok=True)
    return out


def _evict(path: Path) -> bool:
    """Drop `path`'s files from the page cache (so a read measures the disk); False where it cannot."""
    try:
        for f in (path.iterdir() if path.is_dir() else [path]):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return True
    except (OSError, AttributeError):
        return False


def _disk_baseline(path: Path, nbytes: int) -> tuple[float, float]:
    import harness  # benchmarks/harness.py, beside this script

    write_s = harness.write_fsync(path, nbytes)
    _evict(path)
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass
    return write_s, time.perf_counter() - t


def section_generate(run: Run) -> dict:
    """generate() of the sharded model vs the same weights unsharded (bf16, greedy, batch 1)."""
    plain = llama(run.big, run.device, dtype=torch.bfloat16).eval()
    ours = shard(copy.deepcopy(plain), replication="fsdp2").eval()
    prompt = batches(run, run.big["vocab_size"], 1, batch=1, seq=32)[0]
    out = {"ok": True}
    for new in ((4, 8) if run.dry else (16, 128)):
        row = {}
        tokens = {}
        for name, model in (("plain", plain), ("ours", ours)):
            kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
            with torch.no_grad():
                model.generate(prompt, **kwargs)  # warm-up
                run.sync()
                t = time.perf_counter()
                result = model.generate(prompt, **kwargs)
                run.sync()
            row[f"{name}_tokens_per_s"] = new / (time.perf_counter() - t)
            tokens[name] = result
        row["ours_vs_plain"] = row["ours_tokens_per_s"] / row["plain_tokens_per_s"]
        row["same_tokens"] = bool(torch.equal(tokens["plain"], tokens["ours"]))
        out[f"{new}_new_tokens"] = row
    del plain, ours
    run.reset_memory()
    return out


def section_variants(run: Run, state: dict) -> dict:
    """One knob at a time on the 1B full fine-tune (FSDP2 groups, bf16): tokens/s and peak memory vs eager."""
    variants = [
        ("eager", {}),
        ("activation_checkpointing", {"activation_checkpointing": True}),
        ("op_level_checkpointing", {"activation_checkpointing": True, "checkpoint_save_matmuls": True}),
        ("activation_offload", {"activation_offload": True}),
        ("regional_compile", {"compile": True}),
        ("fp8", {"fp8": True}),
        ("fp8_regional_compile", {"fp8": True, "compile": True}),  # torchao: float8 training is fast under compile
        ("compile_model", {"compile": "model"}),
    ]
    if run.variants:
        variants = [v for v in variants if v[0] in run.variants]
    out = {}
    for name, fields in variants:
        if run.left() < (90 if "compile" in name and not run.dry else 20):
            out[name] = {"skipped": "out of time"}
            continue
        if name.startswith("fp8"):
            why = _fp8_unavailable(run)
            if why:
                out[name] = {"skipped": why}
                continue
        out[name] = measure_variant(run, state, fields)
    eager = out.get("eager", {}).get("tokens_per_s")
    for name, r in out.items():
        if eager and "tokens_per_s" in r:
            r["vs_eager"] = r["tokens_per_s"] / eager
            if out["eager"].get("max_allocated") and r.get("max_allocated"):
                r["memory_vs_eager"] = r["max_allocated"] / out["eager"]["max_allocated"]
    return {"ok": None, **out}


def measure_variant(run: Run, state: dict, fields: dict) -> dict:
    """The full fine-tune on FSDP2 groups with `fields` set; an error is recorded, the others go on."""
    try:
        return measure_training(run, "ours_fsdp2", "full", state, **fields)
    except Exception as e:
        run.reset_memory()
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}


# Llama 3.1 8B's layer shape (6 of its 32 layers; at 4 its bf16 lm_head was 38% of the matmul work): torchao's
# float8 gains are documented for matmuls of this size; at the 1B shape (hidden 2048) the scaling work outweighs
# them (second GPU run: 0.96x under compile).
FP8_LARGE = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=6,
                 num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)


def section_fp8_large(run: Run, state: dict) -> dict:
    """FP8 vs bf16 under regional compile on 8B-shaped layers (full fine-tune, FSDP2 groups)."""
    why = _fp8_unavailable(run)
    if why:
        return {"ok": None, "skipped": why}
    saved = run.big
    run.big = SHAPES["tiny"] if run.dry else FP8_LARGE
    out = {}
    try:
        for name, fields in (("regional_compile", {"compile": True}), ("fp8_regional_compile", {"fp8": True, "compile": True})):
            if run.left() < (20 if run.dry else 60):
                out[name] = {"skipped": "out of time"}
                continue
            out[name] = measure_variant(run, state, fields)
    finally:
        run.big = saved
    bf16, fp8 = (out.get(k, {}).get("tokens_per_s") for k in ("regional_compile", "fp8_regional_compile"))
    if bf16 and fp8:
        out["fp8_speedup"] = fp8 / bf16
    return {"ok": None, "shape": "tiny" if run.dry else "Llama 3.1 8B layers x 6", **out}


def _fp8_unavailable(run: Run) -> str | None:
    try:
        import torchao  # noqa: F401
    except ImportError:
        return "torchao is not installed (carry its wheel: see this script's docstring)"
    if run.cuda and torch.cuda.get_device_capability(0) < (8, 9):
        return "float8 matmuls need compute capability >= 8.9"
    return None


WORKER = r"""
import os, sys, json, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
backend, device = sys.argv[2], sys.argv[3]
import hf_fsdp2
from transformers import LlamaConfig, LlamaForCausalLM
if device == "cuda":
    torch.cuda.set_device(0)
hf_fsdp2.init_distributed(backend=backend)
torch.manual_seed(0)
with torch.device(device):
    model = LlamaForCausalLM(LlamaConfig(**json.loads(sys.argv[4])))
model = hf_fsdp2.shard_model(model, hf_fsdp2.FSDP2Config(replication="fsdp2"))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
losses = []
for step in range(2):
    ids = torch.randint(0, 64, (2, 32), device=device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward(); opt.step(); opt.zero_grad()
    losses.append(loss.item())
print("LOSSES", json.dumps(losses), flush=True)
dist.destroy_process_group()
"""


def section_two_process(run: Run) -> dict:
    """Two ranks on one device: NCCL (expected to refuse: one GPU per rank) and gloo with CUDA tensors."""
    device = "cuda" if run.cuda else "cpu"
    attempts = [("nccl", "cuda"), ("gloo", "cuda")] if run.cuda else [("gloo", "cpu")]
    out = {"ok": None}
    for backend, dev in attempts:
        port = str(free_port())
        procs = []
        for rank in range(2):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank), "WORLD_SIZE": "2",
                   "LOCAL_RANK": "0" if dev == "cuda" else str(rank), "LOCAL_WORLD_SIZE": "2"}
            procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(REPO), backend, dev, json.dumps(run.small)],
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs, codes = [], []
        for p in procs:
            try:
                text, _ = p.communicate(timeout=max(30.0, min(150.0, run.left())))
            except subprocess.TimeoutExpired:
                p.kill()
                text = (p.communicate()[0] or "") + "\n[killed: timed out]"
            logs.append(text)
            codes.append(p.returncode)
        losses = [next((json.loads(line[7:]) for line in t.splitlines() if line.startswith("LOSSES ")), None)
                  for t in logs]
        out[f"{backend}_{dev}"] = {"returncodes": codes, "losses": losses, "ran": all(c == 0 for c in codes),
                                   # gloo with a CUDA model: shard_model refuses it (runtime/distributed.py)
                                   "refused_by_name": any("hf_fsdp2 shards on the CPU" in t for t in logs),
                                   "log_tail": [t[-1500:] for t in logs]}
    del device
    return out


def section_local_ranks(run: Run) -> dict:
    """Several ranks on the one GPU with real data (issue 61): ranks as threads under torch's threaded process group
    (hf_fsdp2/tools/local_ranks.py) at 2 and 4 ranks train a small Llama like one process, each saves and loads its
    rows from CUDA memory, and EP at 2 trains a small Qwen3-MoE like one process (benchmarks/local_ranks_check.py).
    A fresh interpreter: this one holds a process group and CUDA, and the threads need CUDA_LAUNCH_BLOCKING=1 from
    CUDA's start (the threaded group copies on rank 0's stream). The dry run: 2 ranks and EP on the CPU."""
    if run.left() < 45 and not run.dry:  # the dry run covers every section, however slow the CPU
        return {"skipped": "out of time", "ok": None}
    device = "cuda" if run.cuda else "cpu"
    # about 30 s on a GPU (tiny models; blocking launches); the dry run's 40 s on 2 shared cores may take minutes
    limit = 300.0 if run.dry else max(30.0, min(150.0, run.left()))
    command = [sys.executable, str(REPO / "benchmarks" / "local_ranks_check.py"), "--device", device,
               "--worlds", "2" if run.dry else "2,4", "--json", "--tmp", str(run.tmp), "--timeout-s", str(limit)]
    launch = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # init_world_one's
    env = {**{k: v for k, v in os.environ.items() if k not in launch}, "CUDA_LAUNCH_BLOCKING": "1"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=limit)
    except subprocess.TimeoutExpired as e:
        return {"ok": False, "error": f"timed out after {limit:.0f} s", "log_tail": str(e.stdout or "")[-2000:]}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"ok": False, "error": (done.stderr or done.stdout)[-3000:], "returncode": done.returncode}
    results = json.loads(lines[-1])
    return {"ok": results.pop("ok"), "device": results.pop("device"), "steps": results.pop("steps"),
            "results": results}


# One rank of an 8-rank job on this one GPU (issue 61): `hf-fsdp2 simulate` under torch's fake process group, each
# case a fresh interpreter (this one holds a process group and CUDA, and simulate forks a process per rank).
# The shapes users ask about, with the published 8-GPU numbers they would compare against.
SIMULATIONS = {
    # torchtitan's Llama 3.1 8B on 8 x H100: FSDP, bf16 compute over fp32 master weights, AdamW, selective (op)
    # activation checkpointing, batch 1 x 8192: 5,762 tokens/s/GPU eager, 6,667 compiled (its README's table).
    "llama31_8b_full": dict(
        config=dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                    max_position_embeddings=8192, tie_word_embeddings=False),
        flags=["--world-size", "8", "--dtype", "fp32", "--param-dtype", "bf16", "--reduce-dtype", "fp32",
               "--activation-checkpointing", "--checkpoint-save-matmuls", "--batch-size", "1", "--seq-len", "8192"],
        published={"torchtitan 8 x H100 eager": 5762, "torchtitan 8 x H100 compiled": 6667}),
    # Qwen3-30B-A3B, LoRA on attention, experts split 8 ways: NeMo AutoModel 11,340-12,040 tokens/s/GPU on 8 x H100,
    # Transformers v5 3,075 (Hugging Face / NVIDIA, June 2026); their sequence length assumed 4096.
    "qwen3_30b_a3b_lora_ep8": dict(
        config=dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                    moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, num_hidden_layers=48,
                    num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=4096,
                    tie_word_embeddings=False),
        flags=["--world-size", "8", "--ep-size", "8", "--dtype", "bf16", "--param-dtype", "bf16", "--lora-r", "16",
               "--lora-targets", "q_proj,k_proj,v_proj,o_proj", "--activation-checkpointing", "--batch-size", "1",
               "--seq-len", "4096"],
        published={"NeMo AutoModel 8 x H100": 11340, "Transformers v5 8 x H100": 3075}),
    # Llama-3.1-70B QLoRA on 8 GPUs (the issue's "70B QLoRA on 8 GPUs?"): NF4 base from bf16, LoRA r 16 on every
    # projection, bf16 compute, checkpointed layers, 1 x 4096. Needs bitsandbytes, which the GPU image lacks: carry
    # its wheel (39 MiB, this script's docstring), else the case says so.
    "llama31_70b_qlora": dict(
        config=dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                    num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, rope_theta=500000.0,
                    max_position_embeddings=8192, tie_word_embeddings=False),
        flags=["--world-size", "8", "--dtype", "bf16", "--param-dtype", "bf16", "--lora-r", "16",
               "--lora-targets", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "--load-in-4bit",
               "--activation-checkpointing", "--batch-size", "1", "--seq-len", "4096"],
        needs="bitsandbytes", needs_torch=(2, 13), published={}),
    # shard_size="auto" at the 8B shape with a budget below what the default layout needs (issue 61: the layout the
    # planner picks fits the budget it was given, measured): the planner chooses, the run measures the peak.
    "llama31_8b_auto_48gib": dict(
        config=dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                    max_position_embeddings=8192, tie_word_embeddings=False),
        flags=["--world-size", "8", "--dtype", "fp32", "--param-dtype", "bf16", "--reduce-dtype", "fp32",
               "--memory-budget", "48GiB", "--replication", "fsdp2", "--batch-size", "1", "--seq-len", "8192"],
        budget="48GiB", dry_budget="64MiB", published={}),
}
# Not run, and why (said in the results rather than left out).
SIMULATIONS_NOT_DONE: dict[str, str] = {}
TINY_SIMULATIONS = {  # the dry run's: the same route on CPU, 4 ranks
    "llama31_8b_full": dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "qwen3_30b_a3b_lora_ep8": dict(model_type="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=128,
                                   moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "llama31_70b_qlora": dict(model_type="llama", vocab_size=256, hidden_size=128, intermediate_size=256,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "llama31_8b_auto_48gib": dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
}


def section_simulate(run: Run) -> dict:
    """`hf-fsdp2 simulate` of ranks 0 and 7 of 8 at 8B and 30B-A3B shapes: measured per rank vs the estimate, and
    the predicted tokens/s per GPU beside the published 8-GPU numbers (a prediction, labelled so)."""
    out: dict = {"ok": True, "not_done": SIMULATIONS_NOT_DONE}
    for name, case in SIMULATIONS.items():
        if run.left() < 60:
            out[name] = {"skipped": "out of time"}
            continue
        if case.get("needs") and importlib.util.find_spec(case["needs"]) is None:
            out[name] = {"not_done": f"{case['needs']} is not installed here (carry its wheel: this script's "
                                     "docstring)"}
            continue
        if case.get("needs_torch") and torch.__version__ < case["needs_torch"]:
            out[name] = {"not_done": f"torch {torch.__version__}: 4-bit base weights sharded by FSDP2 need torch >= "
                                     f"{'.'.join(map(str, case['needs_torch']))} (quantization/bnb_4bit.py refuses it: "
                                     "its fully_shard makes every parameter require gradients, uint8 ones too)"}
            continue
        path = run.tmp / f"{name}.json"
        config = TINY_SIMULATIONS[name] if run.dry else case["config"]
        path.write_text(json.dumps(config))
        flags = list(case["flags"])
        if run.dry:  # tiny: 4 ranks, short sequences, CPU
            flags[flags.index("--world-size") + 1] = "4"
            flags[flags.index("--seq-len") + 1] = "32"
            if "--ep-size" in flags:
                flags[flags.index("--ep-size") + 1] = "4"
            if "--memory-budget" in flags:
                flags[flags.index("--memory-budget") + 1] = case["dry_budget"]
        command = [sys.executable, "-m", "hf_fsdp2.cli", "simulate", "--model", str(path), *flags, "--steps", "2" if run.dry else "3",
                   "--json"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        t = time.monotonic()
        try:
            done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO,
                                  timeout=max(30.0, min(300.0, run.left())))
        except subprocess.TimeoutExpired as e:
            out[name] = {"error": "timed out", "log_tail": str(e.stdout or "")[-2000:]}
            out["ok"] = False
            continue
        if done.returncode != 0:
            out[name] = {"error": (done.stderr or done.stdout)[-3000:], "command": command}
            out["ok"] = False
            continue
        reports = json.loads(done.stdout)
        first = reports[0]
        peaks = [r["measured_peak"] for r in reports]
        out[name] = {
            "seconds": time.monotonic() - t, "command": command[3:], "ranks": reports,
            "measured_over_estimate": [r["estimate_ratio"] for r in reports],
            "first_vs_last_rank": max(peaks) / min(peaks) if min(peaks) else None,
            "predicted_tokens_per_s_per_gpu": first["prediction"]["tokens_per_s_per_gpu"],
            "published_tokens_per_s_per_gpu": case["published"],
        }
        if "budget" in case:  # the auto layout's choice (in the notes) and the measured peaks against its budget
            from hf_fsdp2.config import parse_bytes

            limit = parse_bytes(case["dry_budget"] if run.dry else case["budget"], "memory_budget")
            out[name]["measured_over_budget"] = [p / limit for p in peaks]
            out[name]["chosen"] = [n for n in first["notes"] if n.startswith("shard_size='auto' chose")]
    return out


# Mixture-of-experts at world size 1 (issue 64): transformers' default experts implementation (grouped_mm, PEFT's fold
# of the experts' LoRA) against hf_fsdp2's (the adapters inside the grouped matmuls), LoRA and full, on a
# Qwen3-30B-A3B-shaped model (benchmarks/moe_bench.py `world_one`); FP8 experts (torchao's rowwise grouped FP8,
# `fp8_experts="rowwise"`) against bf16 experts on its MoE layers (benchmarks/moe_fp8.py `run`). Both need the carried
# transformers >= 5.23 (the image's 5.17 has no experts implementations interface for EP; its grouped_mm path differs)
# and, for FP8, torchao.
MOE_TARGETS = {"vs_transformers": 1.5, "fp8_vs_bf16": 1.2}


def section_moe(run: Run) -> dict:
    """tokens/s of hf_fsdp2's experts against transformers' default and of FP8 against bf16 experts, world size 1."""
    if run.left() < 90 and not run.dry:
        return {"skipped": "out of time", "ok": None}
    sys.path.insert(0, str(REPO / "benchmarks"))
    import moe_bench
    import moe_fp8

    out: dict = {"ok": None, "targets": MOE_TARGETS}
    device = "cuda" if run.cuda else "cpu"
    try:  # 8 of its 48 layers: 4.8B parameters, bf16 AdamW states in the full fine-tune (about 40 GiB)
        out["world_one"] = moe_bench.world_one(layers=8, batch=1, seq=4096, steps=4, warmup=2, rounds=1,
                                               dry_run=run.dry, device=device)
    except Exception as e:  # noqa: BLE001 - recorded; the FP8 part still runs
        out["world_one"] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        out["ok"] = False
    run.reset_memory()
    if not run.dry and run.left() < 60:
        out["fp8_experts"] = {"skipped": "out of time"}
        return out
    try:
        if importlib.util.find_spec("torchao") is None:
            out["fp8_experts"] = {"not_done": "torchao is not installed here (carry its wheel: this script's docstring)"}
        else:
            out["fp8_experts"] = moe_fp8.run(device, tiny=run.dry, lora=False, layers=2, batch=4, seq=4096, steps=4,
                                             warmup=2)
    except Exception as e:  # noqa: BLE001
        out["fp8_experts"] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        out["ok"] = False
    run.reset_memory()
    return out


# Where a step's memory goes, by phase and by the code that allocated it: plain / ours / Accelerate, LoRA and
# full. Why: the first GPU run's LoRA peak was 1.78x the estimate and 1.26x Accelerate's, full fine-tunes equal.
SITE_PACKAGES = ("transformers/", "peft/", "hf_fsdp2/", "accelerate/", "torch/distributed/", "torch/nn/", "torchao/")


def _site(frames: list) -> str:
    """The innermost frame in a library we care about, as file:line:function."""
    for f in frames:
        name = f.get("filename", "")
        for pkg in SITE_PACKAGES:
            if pkg in name:
                return f"{pkg}{name.split(pkg, 1)[1]}:{f.get('line')}:{f.get('name')}"
    return "other" if not frames else f"{frames[0].get('filename', '?').rsplit('/', 1)[-1]}:{frames[0].get('line')}"


def peak_sites(trace: list, top: int = 12) -> dict:
    """Replays a CUDA allocator trace (`torch.cuda.memory._snapshot()["device_traces"][0]`): the highest point
    of the bytes allocated during it, and what was live there, summed by allocation site."""
    live, current, peak, at = {}, 0, 0, -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            current += e["size"]
        elif e["action"] in ("free_requested", "free_completed") and e["addr"] in live:
            current -= live.pop(e["addr"])
        if current > peak:
            peak, at = current, i
    live_at = {}
    for e in trace[:at + 1]:
        if e["action"] == "alloc":
            live_at[e["addr"]] = e
        elif e["action"] in ("free_requested", "free_completed"):
            live_at.pop(e["addr"], None)
    sites: dict[str, int] = {}
    for e in live_at.values():
        key = _site(e.get("frames", []))
        sites[key] = sites.get(key, 0) + e["size"]
    ranked = sorted(sites.items(), key=lambda kv: -kv[1])[:top]
    return {"peak_during_step": peak, "at_event": at, "events": len(trace),
            "sites": [{"site": k, "bytes": v} for k, v in ranked]}


def _saved_by_forward(forward, ids) -> tuple[object, dict]:
    """The forward's loss, and what autograd saved for backward: unique storages, bytes by dtype."""
    storages: dict[int, tuple[int, str]] = {}

    def pack(t):
        try:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = (storage.nbytes(), str(t.dtype))
        except Exception:  # a tensor subclass without one storage
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward(ids)
    by_dtype: dict[str, int] = {}
    for size, dtype in storages.values():
        by_dtype[dtype] = by_dtype.get(dtype, 0) + size
    return loss, {"saved_bytes": sum(by_dtype.values()), "saved_by_dtype": by_dtype}


def section_memory_phases(run: Run, state: dict) -> dict:
    """One step after warm-up, phase by phase (forward, backward, optimizer): peak and live bytes, what
    autograd saved, and on CUDA the allocation sites live at the step's peak."""
    out = {}
    for mode, names in (("lora", ("plain", "ours_fsdp2", "accelerate")), ("full", ("ours_fsdp2", "accelerate"))):
        for name in names:
            if run.left() < 20:
                out[f"{mode}/{name}"] = {"skipped": "out of time"}
                continue
            try:
                run.reset_memory()
                model, opt, step, notes = _contestant(run, name, mode, state)
                data = batches(run, run.big["vocab_size"], 2)
                step(data[0])  # optimizer states exist from here on, as in training
                run.sync()
                row = {"live_before": torch.cuda.memory_allocated() if run.cuda else None, **notes}
                recording = run.cuda and hasattr(torch.cuda.memory, "_record_memory_history")
                if recording:
                    torch.cuda.memory._record_memory_history(max_entries=500000, stacks="python")
                phases = {}
                for phase in ("forward", "backward", "optimizer"):
                    if run.cuda:
                        torch.cuda.reset_peak_memory_stats()
                    if phase == "forward":
                        loss, saved = _saved_by_forward(step.forward, data[1])
                        row.update(saved)
                    elif phase == "backward":
                        step.backward(loss)
                    else:
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                    run.sync()
                    if run.cuda:
                        phases[phase] = {"peak": torch.cuda.max_memory_allocated(), "live_after": torch.cuda.memory_allocated()}
                row["phases"] = phases
                if recording:
                    snapshot = torch.cuda.memory._snapshot()
                    torch.cuda.memory._record_memory_history(enabled=None)
                    traces = snapshot.get("device_traces") or [[]]
                    row["peak_sites"] = peak_sites(traces[torch.cuda.current_device()] if len(traces) > 1 else traces[0])
                out[f"{mode}/{name}"] = row
                del model, opt, step, loss
                release_accelerator(state)
            except Exception as e:
                out[f"{mode}/{name}"] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
                if run.cuda and hasattr(torch.cuda.memory, "_record_memory_history"):
                    torch.cuda.memory._record_memory_history(enabled=None)
            run.reset_memory()
    return {"ok": None, **out}


SECTIONS = ["equality", "checkpoint", "simulate", "moe", "throughput", "save_load", "generate", "variants", "two_process",
            "local_ranks", "memory_phases", "fp8_large"]


def targets(result: dict) -> list[dict]:
    """Each target of issue 53 from this run: the value, the bar, met or not and by how much."""
    rows = []
    tp = result["sections"].get("throughput", {})
    var = result["sections"].get("variants", {})

    def add(name, value, bar, higher=True):
        if value is None:
            rows.append({"target": name, "value": None, "bar": bar, "met": None})
            return
        met = value >= bar if higher else value <= bar
        rows.append({"target": name, "value": value, "bar": bar, "met": met,
                     "missed_by": None if met else (bar - value if higher else value - bar)})

    def tps(mode, name):
        return tp.get(mode, {}).get(name, {}).get("tokens_per_s")

    for mode in ("full", "lora"):
        plain, ours, fsdp2, acc = (tps(mode, n) for n in ("plain", "ours", "ours_fsdp2", "accelerate"))
        add(f"{mode}: ours / plain tokens/s", ours / plain if ours and plain else None, TARGETS["overhead_vs_plain"])
        add(f"{mode}: ours (FSDP2 groups) / plain tokens/s", fsdp2 / plain if fsdp2 and plain else None,
            TARGETS["overhead_vs_plain"])
        add(f"{mode}: ours / Accelerate FSDP2 tokens/s", ours / acc if ours and acc else None, TARGETS["vs_accelerate"])
        for name in ("ours", "ours_fsdp2"):
            ratio = tp.get(mode, {}).get(name, {}).get("measured_over_estimate")
            add(f"{mode}: {name} |peak / estimate - 1|", abs(ratio - 1) if ratio else None, TARGETS["estimate_within"],
                higher=False)
    add("full: ours MFU", tp.get("full", {}).get("ours", {}).get("mfu"), TARGETS["mfu"])
    fp8, eager = var.get("fp8", {}).get("tokens_per_s"), var.get("eager", {}).get("tokens_per_s")
    add("fp8 / bf16 tokens/s (eager)", fp8 / eager if fp8 and eager else None, TARGETS["fp8_speedup"])
    fp8c, compiled = (var.get(k, {}).get("tokens_per_s") for k in ("fp8_regional_compile", "regional_compile"))
    add("fp8 / bf16 tokens/s (regional compile)", fp8c / compiled if fp8c and compiled else None, TARGETS["fp8_speedup"])
    add("full: ours MFU (regional compile)", var.get("regional_compile", {}).get("mfu"), TARGETS["mfu"])
    moe = result["sections"].get("moe", {})
    for mode in ("lora", "full"):
        add(f"MoE {mode}: ours / transformers' experts tokens/s (Qwen3-30B-A3B shape, world size 1)",
            moe.get("world_one", {}).get("ratios", {}).get(mode), MOE_TARGETS["vs_transformers"])
    add("MoE: FP8 rowwise / bf16 experts tokens/s",
        moe.get("fp8_experts", {}).get("ratios", {}).get("rowwise", {}).get("step"), MOE_TARGETS["fp8_vs_bf16"])
    add("fp8 / bf16 tokens/s (8B-shaped layers, regional compile)",
        result["sections"].get("fp8_large", {}).get("fp8_speedup"), TARGETS["fp8_speedup"])
    return rows


def table(result: dict) -> str:
    lines = [f"hf_fsdp2 GPU check on {result['device'].get('name', result['device']['type'])} "
             f"(torch {result['versions']['torch']}, transformers {result['versions']['transformers']})"]
    for name, sec in result["sections"].items():
        status = ("ERROR " + sec["error"][:100]) if "error" in sec else sec.get("skipped") or (
            {True: "ok", False: "FAILED", None: "measured"}[sec.get("ok")])
        lines.append(f"{name:12s} {status}  ({sec.get('seconds', 0):.0f} s)")
        for key in ("cases", "checks"):
            for case, r in sec.get(key, {}).items():
                extra = f"loss diff {r['max_loss_diff']:.2e}, weight diff {r['max_weight_diff']:.2e}" \
                    if "max_loss_diff" in r else f"{r.get('max_diff', r.get('value'))}"
                lines.append(f"    {'ok  ' if r['ok'] else 'FAIL'} {case}: {extra}")
        for mode in ("full", "lora"):
            for who, r in sec.get(mode, {}).items() if isinstance(sec.get(mode), dict) else ():
                lines.append("    " + _training_row(f"{mode}/{who}", r))
        if name in ("variants", "fp8_large"):
            for who, r in sec.items():
                if isinstance(r, dict):
                    lines.append("    " + _training_row(who, r))
        if name == "save_load" and "save_GBps" in sec:
            lines.append(f"    {sec['bytes'] / 1e9:.2f} GB: save {sec['save_GBps']:.2f} GB/s, load {sec['load_GBps']:.2f} "
                         f"GB/s; disk write+fsync {sec['disk_write_fsync_GBps']:.2f}, read {sec['disk_read_GBps']:.2f}")
        if name == "generate":
            for k, r in sec.items():
                if isinstance(r, dict):
                    lines.append(f"    {k}: ours {r['ours_tokens_per_s']:.1f} vs plain {r['plain_tokens_per_s']:.1f} "
                                 f"tokens/s ({r['ours_vs_plain']:.2f}x), same tokens: {r['same_tokens']}")
        if name == "memory_phases":
            for who, r in sec.items():
                if not isinstance(r, dict):
                    continue
                if "saved_bytes" not in r:
                    lines.append(f"    {who}: {r.get('skipped') or r.get('error', '')[:120]}")
                    continue
                phases = ", ".join(f"{k} peak {v['peak'] / 2**30:.1f}" for k, v in r.get("phases", {}).items())
                lines.append(f"    {who}: saved for backward {r['saved_bytes'] / 2**30:.2f} GiB "
                             f"{ {k: round(v / 2**30, 2) for k, v in r['saved_by_dtype'].items()} }; {phases}")
                for site in r.get("peak_sites", {}).get("sites", [])[:6]:
                    lines.append(f"        {site['bytes'] / 2**30:6.2f} GiB  {site['site']}")
        if name == "simulate":
            for case, r in sec.items():
                if not isinstance(r, dict) or case == "not_done":
                    continue
                if "ranks" not in r:
                    lines.append(f"    {case}: {r.get('skipped') or r.get('not_done') or str(r.get('error', ''))[-160:]}")
                    continue
                measured = ", ".join(f"rank {x['rank']} peak {x['measured_peak'] / 2**30:.1f} GiB "
                                     f"({x['estimate_ratio']:.2f}x the estimate)" for x in r["ranks"])
                lines.append(f"    {case}: measured per rank: {measured}; compute {r['ranks'][0]['compute_s']:.2f} s/step")
                lines.append(f"        PREDICTED {r['predicted_tokens_per_s_per_gpu']:.0f} tokens/s/GPU (a model: "
                             f"hf_fsdp2/planner/step_time.py); published: {r['published_tokens_per_s_per_gpu']}")
            for case, why in sec.get("not_done", {}).items():
                lines.append(f"    {case}: {why}")
        if name == "local_ranks":
            for case, r in sec.get("results", {}).items():
                if "error" in r:
                    lines.append(f"    FAIL {case}: {r['error'][:160]}")
                    continue
                if "not_done" in r:
                    lines.append(f"    not done {case}: {r['not_done'][:200]}")
                    continue
                lines.append(f"    {'ok  ' if r['ok'] else 'FAIL'} {case} on {','.join(r.get('devices', [sec['device']]))}: "
                             f"loss diff {r['max_loss_diff']:.2e}, weight diff {r['max_param_diff']:.2e}"
                             + (f", saved = trained {r['saved_equal_trained']}, loaded rows = trained "
                                f"{r['loaded_rows_equal']}" if "saved_equal_trained" in r else ""))
        if name == "moe":
            wo, f8 = sec.get("world_one", {}), sec.get("fp8_experts", {})
            for mode, ratio in wo.get("ratios", {}).items():
                lines.append(f"    {mode}: hf_fsdp2 / transformers' experts {ratio:.2f}x tokens/s "
                             f"({wo[mode]['hf_fsdp2']['tokens_per_s']:.0f} vs {wo[mode]['transformers']['tokens_per_s']:.0f})")
            for mode, ratio in f8.get("ratios", {}).items():
                lines.append(f"    fp8 {mode} / bf16 experts: {ratio['step']:.2f}x tokens/s (forward + backward "
                             f"{ratio['fwd_bwd']:.2f}x)")
            for part in (wo, f8):
                if part.get("error") or part.get("not_done") or part.get("skipped"):
                    lines.append(f"    {part.get('error') or part.get('not_done') or part.get('skipped')}"[:200])
        if name == "two_process":
            for k, r in sec.items():
                if isinstance(r, dict):
                    what = ("ran, losses " + str(r["losses"][0]) if r["ran"] else
                            "refused by name: " + _last_error(r) if r.get("refused_by_name") else "failed: " + _last_error(r))
                    lines.append(f"    {k}: {what}")
    lines.append("targets:")
    for t in result["targets"]:
        mark = {True: "met ", False: "MISS", None: "n/a "}[t["met"]]
        value = "-" if t["value"] is None else f"{t['value']:.3f}"
        lines.append(f"    {mark} {t['target']}: {value} (bar {t['bar']})")
    return "\n".join(lines)


def _training_row(who: str, r: dict) -> str:
    if "tokens_per_s" not in r:
        return f"{who}: {r.get('skipped') or r.get('error', '')[:120]}"
    mem = f", peak {r['max_allocated'] / 2**30:.1f} GiB" if r.get("max_allocated") else ""
    est = f" (estimate {r['estimate_bytes'] / 2**30:.1f})" if r.get("estimate_bytes") and mem else ""
    mfu = f", MFU {r['mfu']:.1%}" if r.get("mfu") else ""
    return f"{who}: {r['tokens_per_s']:.0f} tokens/s{mfu}{mem}{est}"


def _last_error(r: dict) -> str:
    lines = [line for t in r["log_tail"] for line in t.splitlines() if "Error" in line]
    return (lines[-1] if lines else "exit codes " + str(r["returncodes"]))[:160]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for gpu_check.json (and the table, gpu_check.txt)")
    p.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny shapes: every code path, no numbers")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    p.add_argument("--rounds", type=int, default=2, help="throughput: contestants measured this many times, "
                   "alternating order; the fastest run of each is kept (default 2)")
    p.add_argument("--variants", default="", help="comma-separated subset of the variants section's knobs (default: all)")
    p.add_argument("--budget-s", type=float, default=450.0, help="stop starting new work after this (default 450)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="timed steps per contestant (after 2 warm-up steps)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak, for MFU")
    p.add_argument("--tmp", default=None, help="scratch folder on the disk to measure (default: the system's)")
    args = p.parse_args(argv)
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        p.error(f"--sections: unknown {unknown}; choose from {SECTIONS}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    run = Run(args)
    init_world_one(run.device)
    result = {"argv": sys.argv[1:], "dry_run": run.dry, "versions": versions(), "device": device_info(run),
              "shapes": {"big": run.big, "small": run.small, "seq_len": run.seq, "batch_size": run.batch,
                         "steps": run.steps}, "peak_flops": run.peak_flops, "sections": {}}
    state: dict = {}
    for name in wanted:
        t = time.monotonic()
        if run.left() <= 0:
            result["sections"][name] = {"skipped": "out of time", "ok": None}
            continue
        try:
            fn = globals()[f"section_{name}"]
            sec = fn(run, state) if name in ("variants", "memory_phases", "fp8_large") else fn(run)
        except Exception as e:
            sec = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
            run.reset_memory()
        sec["seconds"] = time.monotonic() - t
        result["sections"][name] = sec
        print(f"[gpu_check] {name}: {time.monotonic() - t:.1f} s", flush=True)
        (out_dir / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str))  # partial results survive
    result["targets"] = targets(result)
    missed = [t for t in result["targets"] if t["met"] is False and "tokens/s" in t["target"]]
    if missed and run.left() > 30 and "throughput" in wanted and not run.dry:
        # Where a speed target is missed, the profile says where: two steps of plain and ours, side by side.
        state_p: dict = {}
        result["profiles"] = {name: measure_training(run, name, "full", state_p, profile=True).get("profile")
                              for name in ("plain", "ours")}
    result["elapsed_s"] = time.monotonic() - started
    (out_dir / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str))
    text = table(result)
    (out_dir / "gpu_check.txt").write_text(text + "\n")
    print(text, flush=True)
    import shutil

    shutil.rmtree(run.tmp, ignore_errors=True)
    failed = [n for n, s in result["sections"].items() if s.get("ok") is False]
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
