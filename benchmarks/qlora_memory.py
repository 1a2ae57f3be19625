"""QLoRA memory benchmark: per-rank peak RSS of a 4-bit base sharded by hf_fsdp2, against the usual ways.

Why: a QLoRA base is already small (4 bits a weight), and today's FSDP2 path (Accelerate) keeps
bitsandbytes' `Params4bit` out of `fully_shard`, so every rank holds the whole 4-bit base. hf_fsdp2
shards it (quantization/bnb_4bit.py). This script measures what that buys per rank, on N gloo ranks
on CPU that it spawns itself, each method in fresh processes:

  ours                   `hf_fsdp2.from_pretrained(AutoModelForCausalLM, bf16_dir, FSDP2Config(),
                         torch_dtype=bf16, quantization_config=nf4+double quant, peft_config=LoRA)`:
                         built on meta, each rank preads its rows of the bf16 checkpoint and quantizes
                         only them; the full model (bf16 or 4-bit) never exists on a rank.
  ours_after_stock_load  stock `AutoModelForCausalLM.from_pretrained(bf16_dir, quantization_config=...,
                         device_map="cpu", dtype=bf16)` on every rank, `get_peft_model`, then
                         `hf_fsdp2.shard_model(model, FSDP2Config())` (the Accelerate / Trainer path:
                         the full 4-bit model on every rank during the load, then 1/N).
  replicated_base        stock load + `get_peft_model`, then `shard_model(model, FSDP2Config(
                         ignored_modules=r".*\\.base_layer"))`: every `Linear4bit` base layer is kept
                         out of FSDP and replicated (what Accelerate does with `Params4bit` today); the
                         LoRA adapters, embedding, norms and lm_head are sharded. The script checks that
                         the pattern matches exactly the model's `Linear4bit` modules.
  single_process         stock load + `get_peft_model`, one process, no sharding.

Same BitsAndBytesConfig everywhere: nf4, double quantization, storage dtype bf16, compute dtype
--compute-dtype (float32 by default: on a CPU without bf16 instructions torch runs some bf16 matmul
layouts through a scalar fallback, and bitsandbytes' backward `grad @ dequantized weight` is one of
them; the memory difference is the transient dequantized weight, <= 2x 23 MiB at hidden 2048), non-
quantized weights in bf16 (`torch_dtype` / `dtype`). LoRA r=16 on q/k/v/o/gate/up/down. The frozen bf16
lm_head's input gradient is computed in fp32 chunks for the same CPU reason, for every method alike
(`patch_frozen_bf16_head`). The model is a LlamaForCausalLM built from a config (default ~0.75B params,
12 layers) with random weights, saved once in bf16 under --cache-dir and reused by later runs.

Per rank: RSS right after the imports and the process group (the baseline, before any model
exists); peak RSS during the load (VmHWM after a /proc/self/clear_refs reset, and a thread sampling
/proc/self/status every --sample-ms, which also gives peak RssAnon: the stock loader reads the
checkpoint through mmap, and those file pages count in RSS while touched); RSS after the load
(after gc.collect + malloc_trim); peak RSS over --steps training steps (batch 1 per rank, seq
--seq, AdamW on the trainable parameters); and the bytes of the rank's local 4-bit base tensors
(packed weights + first-level absmax). Reported as value - baseline in MiB, with the ratios
ours / single_process and ours / replicated_base (max over ranks). With glibc's default the training
peaks include allocator slack that differs between identical ranks by hundreds of MiB;
`--malloc-mmap-threshold 1048576` makes glibc return freed blocks over 1 MiB, so peaks measure what
the program holds.

    python benchmarks/qlora_memory.py                                  # 0.75B Llama, 2 and 4 ranks
    python benchmarks/qlora_memory.py --malloc-mmap-threshold 1048576  # peaks without allocator slack
    python benchmarks/qlora_memory.py --layers 4 --world-size 2        # quick
    python benchmarks/qlora_memory.py --methods ours replicated_base --world-size 4

Results: a table on stdout and `benchmarks/results/qlora_memory_<timestamp>.json`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import shutil
import sys
import time
import warnings
from pathlib import Path

import harness
from harness import RssSampler, hwm_bytes, malloc_trim, reset_hwm, status_bytes

REPO, RESULTS_DIR = harness.REPO, harness.RESULTS_DIR
MiB = 1 << 20
METHODS = ("ours", "ours_after_stock_load", "replicated_base", "single_process")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IGNORED_PATTERN = r".*\.base_layer"  # every targeted Linear4bit sits under PEFT's `...<proj>.base_layer`


# ---------------------------------------------------------------------------------------------
# Memory probes (Linux /proc)


def rss() -> dict[str, int]:
    s = status_bytes("VmRSS", "RssAnon", "RssFile")
    return {"rss": s["VmRSS"], "anon": s.get("RssAnon", 0), "file": s.get("RssFile", 0)}


def measured(fn, interval: float) -> tuple[object, dict]:
    """Run `fn`; peak RSS = max(VmHWM after a reset, the sampler's max), peak anon from the sampler."""
    hwm_ok = reset_hwm()
    t0 = time.perf_counter()
    with RssSampler(interval) as sampler:
        value = fn()
    wall = time.perf_counter() - t0
    hwm = hwm_bytes() if hwm_ok else 0
    return value, {"peak_rss": max(hwm, sampler.max), "peak_anon": sampler.max_anon, "hwm": hwm,
                   "hwm_reset": hwm_ok, "sampler_peak_rss": sampler.max, "samples": sampler.samples,
                   "time_s": wall}


# ---------------------------------------------------------------------------------------------
# Model


def shape_from_args(args) -> dict:
    return dict(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                num_attention_heads=args.heads, num_key_value_heads=args.kv_heads or args.heads,
                vocab_size=args.vocab)


def count_params(shape: dict) -> dict:
    h, i, n, v = (shape[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    linear = n * (2 * h * h + 2 * h * kv + 3 * h * i)  # the 4-bit ones
    total = linear + 2 * v * h + n * 2 * h + h
    return {"total": total, "quantized_linear": linear}


def checkpoint_dir(cache: Path, shape: dict) -> Path:
    """The bf16 checkpoint for `shape`, created once (random init, seed 0) and reused."""
    key = ("llama-h{hidden_size}-i{intermediate_size}-L{num_hidden_layers}-a{num_attention_heads}"
           "-kv{num_key_value_heads}-v{vocab_size}-bf16").format(**shape)
    directory = cache / key
    if (directory / "config.json").exists():
        return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    print(f"creating {directory} (bf16, random init; reused by later runs) ...", flush=True)
    t0 = time.perf_counter()
    config = LlamaConfig(**shape, max_position_embeddings=2048, tie_word_embeddings=False, attention_dropout=0.0)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # build in bf16 directly (no 4 B/param fp32 copy)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    tmp = cache / f".{key}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(tmp)
    del model
    tmp.rename(directory)
    print(f"  done in {time.perf_counter() - t0:.0f} s", flush=True)
    return directory


COMPUTE_DTYPE = "float32"  # set per rank from --compute-dtype


def bnb_config():
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=getattr(torch, COMPUTE_DTYPE),
                              bnb_4bit_quant_storage=torch.bfloat16)


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")


def stock_qlora(directory: str):
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, quantization_config=bnb_config(), device_map="cpu",
                                                 dtype=torch.bfloat16)
    return get_peft_model(model, lora_config())


def linear_4bit_names(model) -> list[str]:
    from hf_fsdp2.quantization.bnb_4bit import is_linear_4bit

    return [name for name, module in model.named_modules() if is_linear_4bit(module)]


def base_4bit_bytes(model) -> int:
    """Bytes of this rank's local 4-bit base: packed weights + first-level absmax (hf_fsdp2's uint8
    `weight` / `weight_absmax`, local shard or replicated; or a stock `Params4bit` + its QuantState's
    absmax). Double quantization's second level is ~1/16384 of the values and left out."""
    from hf_fsdp2.quantization.bnb_4bit import is_linear_4bit

    def nbytes(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    total = 0
    for module in model.modules():
        if not is_linear_4bit(module):
            continue
        if hasattr(module, "weight_absmax"):  # hf_fsdp2's row layout (uint8)
            total += nbytes(module.weight) + nbytes(module.weight_absmax)
        else:  # stock Params4bit
            total += nbytes(module.weight) + nbytes(module.weight.quant_state.absmax)
    return total


def load(method: str, directory: str, world: int) -> tuple[object, dict]:
    import torch

    import hf_fsdp2

    info: dict = {}
    if method == "ours":
        from transformers import AutoModelForCausalLM

        model = hf_fsdp2.from_pretrained(AutoModelForCausalLM, directory, hf_fsdp2.FSDP2Config(),
                                         torch_dtype=torch.bfloat16, quantization_config=bnb_config(),
                                         peft_config=lora_config(), progress=False)
    elif method == "ours_after_stock_load":
        model = stock_qlora(directory)
        hf_fsdp2.shard_model(model, hf_fsdp2.FSDP2Config())
    elif method == "replicated_base":
        import re

        model = stock_qlora(directory)
        regex = re.compile(IGNORED_PATTERN)
        matched = sorted(n for n, _ in model.named_modules() if n and regex.fullmatch(n))
        four_bit = sorted(linear_4bit_names(model))
        if matched != four_bit:
            raise AssertionError(f"ignored_modules={IGNORED_PATTERN!r} matches {len(matched)} modules, the model "
                                 f"has {len(four_bit)} Linear4bit: extra {sorted(set(matched) - set(four_bit))[:5]}, "
                                 f"missing {sorted(set(four_bit) - set(matched))[:5]}")
        info["ignored_modules"] = {"pattern": IGNORED_PATTERN, "matched": len(matched), "linear_4bit": len(four_bit),
                                   "exactly_the_4bit_modules": True, "example": matched[0]}
        hf_fsdp2.shard_model(model, hf_fsdp2.FSDP2Config(ignored_modules=IGNORED_PATTERN))
    elif method == "single_process":
        model = stock_qlora(directory)
    else:
        raise ValueError(method)
    patch_frozen_bf16_head(model)
    return model, info


HEAD_CHUNK = 4096  # vocab rows per fp32 chunk in the lm_head's input-gradient


def patch_frozen_bf16_head(model) -> None:
    """CPU speed workaround, the same for every method: the input gradient of the frozen bf16 lm_head.

    Autograd computes it as `grad [tokens, vocab] @ weight [vocab, hidden]` in bf16, and on a CPU
    without bf16 instructions (AVX2 only) torch runs that layout through a scalar fallback: 63 s per
    step at vocab 32000, hidden 2048, seq 128 (the forward's `x @ weight.t()` takes 1.7 s). Here the
    forward is unchanged and the backward computes the same product in fp32, `HEAD_CHUNK` vocab rows at
    a time (<= 32 MiB transient at hidden 2048), then casts to bf16. Peak memory moves by at most that.
    """
    import torch
    import torch.nn.functional as F

    class FrozenHead(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight):
            ctx.save_for_backward(weight)
            return F.linear(x, weight)

        @staticmethod
        def backward(ctx, grad):
            (weight,) = ctx.saved_tensors
            grad2d = grad.reshape(-1, grad.shape[-1])
            out = torch.zeros(grad2d.shape[0], weight.shape[1], dtype=torch.float32)
            for lo in range(0, weight.shape[0], HEAD_CHUNK):
                out += grad2d[:, lo:lo + HEAD_CHUNK].float() @ weight[lo:lo + HEAD_CHUNK].float()
            return out.to(grad.dtype).reshape(*grad.shape[:-1], weight.shape[1]), None

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    if head.weight.requires_grad or head.bias is not None:
        raise AssertionError("the lm_head patch is for a frozen, bias-free head")
    if head.weight.dtype != torch.bfloat16:
        return
    head.forward = lambda x: FrozenHead.apply(x, head.weight)  # reads the (FSDP-unsharded) weight at call time


def train_steps(model, steps: int, seq: int, vocab: int, rank: int) -> list[float]:
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    gen = torch.Generator().manual_seed(1234 + rank)
    times = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (1, seq), generator=gen)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def run_job(rank: int, world: int, job: dict) -> dict:
    """In a fresh rank process, after the process group: the imports, then baseline, load, train."""
    import torch

    _import_everything()

    global COMPUTE_DTYPE
    COMPUTE_DTYPE = job["compute_dtype"]
    gc.collect()
    malloc_trim()
    out = {"rank": rank, "baseline": rss()}
    (model, out["load_info"]), out["load"] = measured(lambda: load(job["method"], job["directory"], world),
                                                      job["interval"])
    gc.collect()
    malloc_trim()
    out["after_load"] = rss()
    out["base_4bit_bytes"] = base_4bit_bytes(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    out["trainable_local_bytes"] = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
                                       for p in trainable)
    out["trainable_params"] = sum(p.numel() for p in trainable)
    out["params"] = sum(p.numel() for p in model.parameters())
    out["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    times, train = measured(lambda: train_steps(model, job["steps"], job["seq"], job["vocab"], rank),
                            job["interval"])
    out["train"], out["step_times_s"] = train, times
    out["torch_threads"] = torch.get_num_threads()
    return out


def _import_everything() -> None:
    """Every import a run needs, before the baseline (the process baseline of any QLoRA job)."""
    import importlib

    for name in ("bitsandbytes", "peft", "transformers", "hf_fsdp2"):
        importlib.import_module(name)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)


def run_ranks(world: int, job: dict, timeout: float) -> list[dict]:
    return harness.run_ranks(run_job, world, job, timeout, threads=job["threads"],
                             backend=None if job["method"] == "single_process" else "gloo")


# ---------------------------------------------------------------------------------------------
# Aggregation, report


def summarize(ranks: list[dict]) -> dict:
    """Per rank, value - baseline (bytes); and the max over ranks."""
    per = {
        "load_peak": [r["load"]["peak_rss"] - r["baseline"]["rss"] for r in ranks],
        "load_peak_anon": [r["load"]["peak_anon"] - r["baseline"]["anon"] for r in ranks],
        "after_load": [r["after_load"]["rss"] - r["baseline"]["rss"] for r in ranks],
        "after_load_anon": [r["after_load"]["anon"] - r["baseline"]["anon"] for r in ranks],
        "train_peak": [r["train"]["peak_rss"] - r["baseline"]["rss"] for r in ranks],
        "train_peak_anon": [r["train"]["peak_anon"] - r["baseline"]["anon"] for r in ranks],
        "base_4bit": [r["base_4bit_bytes"] for r in ranks],
    }
    return {"per_rank": per, "max": {k: max(v) for k, v in per.items()},
            "baseline_rss": [r["baseline"]["rss"] for r in ranks],
            "load_time_s": max(r["load"]["time_s"] for r in ranks),
            "step_time_s": [max(r["step_times_s"][i] for r in ranks) for i in range(len(ranks[0]["step_times_s"]))]}


COLUMNS = (("load_peak", "load peak"), ("load_peak_anon", "(anon)"), ("after_load", "after load"),
           ("after_load_anon", "(anon)"), ("train_peak", "train peak"), ("train_peak_anon", "(anon)"),
           ("base_4bit", "4-bit base"))
W = 12  # column width


def mib(n: float) -> str:
    return f"{n / MiB:,.0f}"


def print_table(runs: list[dict]) -> None:
    print("\nper rank, MiB above the rank's baseline RSS (imports + process group); max over ranks "
          "[per rank]; '4-bit base' = local packed weights + absmax bytes")
    head = f"{'method':<23}{'N':>3}{'baseline':>10}" + "".join(f"{label:>{W}}" for _, label in COLUMNS)
    print(head + f"{'load s':>8}{'step s':>8}")
    for run in runs:
        s = run["summary"]
        cells = ""
        for key, _ in COLUMNS:
            cells += f"{mib(s['max'][key]):>{W}}"
        step = sorted(s["step_time_s"])[len(s["step_time_s"]) // 2]
        print(f"{run['method']:<23}{run['world_size']:>3}{mib(max(s['baseline_rss'])):>10}{cells}"
              f"{s['load_time_s']:>8.1f}{step:>8.2f}")
    print("per rank:")
    for run in runs:
        if run["world_size"] > 1:
            s = run["summary"]
            per = ", ".join(f"{key} {'/'.join(f'{x / MiB:.0f}' for x in s['per_rank'][key])}" for key, _ in COLUMNS)
            print(f"  {run['method']} x {run['world_size']}: {per}")


def ratios(runs: list[dict]) -> list[dict]:
    by = {(r["method"], r["world_size"]): r["summary"]["max"] for r in runs}
    single = next((r["summary"]["max"] for r in runs if r["method"] == "single_process"), None)
    out = []
    for run in runs:
        if run["method"] != "ours":
            continue
        world = run["world_size"]
        for peer_name, peer in (("single_process", single), ("replicated_base", by.get(("replicated_base", world))),
                                ("ours_after_stock_load", by.get(("ours_after_stock_load", world)))):
            if peer is None:
                continue
            out.append({"world_size": world, "vs": peer_name,
                        **{key: run["summary"]["max"][key] / peer[key] if peer[key] > 0 else None
                           for key, _ in COLUMNS}})
    return out


def print_ratios(rows: list[dict]) -> None:
    if not rows:
        return
    print("\nratios ours / peer (max over ranks of value - baseline; < 1 is less memory for ours)")
    print(f"{'':<32}" + "".join(f"{label:>{W}}" for _, label in COLUMNS))
    for row in rows:
        cells = "".join(f"{row[key]:>{W}.2f}" if row[key] is not None else f"{'n/a':>{W}}" for key, _ in COLUMNS)
        print(f"{'N=' + str(row['world_size']) + ' ours / ' + row['vs']:<32}{cells}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: --heads (no GQA)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--world-size", type=int, nargs="+", default=[2, 4], help="gloo ranks (single_process runs once)")
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="bnb_4bit_compute_dtype (float32 by default: CPUs without bf16 instructions run bf16 "
                         "matmuls several times slower)")
    ap.add_argument("--sample-ms", type=float, default=5.0, help="RSS sampling interval")
    ap.add_argument("--malloc-mmap-threshold", type=int, default=None, metavar="BYTES",
                    help="set MALLOC_MMAP_THRESHOLD_ for the ranks (e.g. 1048576): glibc then serves every larger "
                         "allocation by mmap and returns it on free, instead of raising the threshold to 32 MiB "
                         "after the first large free and keeping freed heap (allocator slack in the peaks)")
    ap.add_argument("--cache-dir", type=Path, default=Path("/tmp/hf_fsdp2_qlora_bench"),
                    help="where the bf16 checkpoint is created once and reused")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the ranks, per launch")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    for dim in (args.hidden, args.intermediate):
        if dim % 64:
            ap.error(f"{dim}: the input dims of 4-bit linears must be multiples of 64 (the blocksize)")

    shape = shape_from_args(args)
    counts = count_params(shape)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    directory = checkpoint_dir(args.cache_dir, shape)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    import torch

    print(f"Llama {counts['total'] / 1e9:.3f}B params (hidden {shape['hidden_size']}, intermediate "
          f"{shape['intermediate_size']}, {shape['num_hidden_layers']} layers, vocab {shape['vocab_size']}); "
          f"{counts['quantized_linear'] / 1e9:.3f}B in 4-bit linears (nf4 + double quant: "
          f"{counts['quantized_linear'] * (0.5 + 1 / 64) / MiB:,.0f} MiB); bf16 checkpoint {directory}")
    if args.malloc_mmap_threshold is not None:  # read by glibc at process start: the spawned ranks get it
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    launches = [(m, 1) for m in args.methods if m == "single_process"]
    launches += [(m, w) for w in args.world_size for m in args.methods if m != "single_process"]
    runs = []
    t_start = time.perf_counter()
    for method, world in launches:
        job = {"method": method, "directory": str(directory), "steps": args.steps, "seq": args.seq,
               "vocab": args.vocab, "interval": args.sample_ms / 1000, "threads": args.threads,
               "compute_dtype": args.compute_dtype}
        t0 = time.perf_counter()
        print(f"  {method} x {world} ...", end="", flush=True)
        ranks = run_ranks(world, job, args.timeout)
        wall = time.perf_counter() - t0
        print(f" {wall:.0f} s", flush=True)
        runs.append({"method": method, "world_size": world, "wall_s": wall, "summary": summarize(ranks),
                     "raw_ranks": ranks})
    print_table(runs)
    rows = ratios(runs)
    print_ratios(rows)
    total = time.perf_counter() - t_start
    print(f"\ntotal {total:.0f} s")

    meta = {"timestamp": stamp, "argv": sys.argv[1:] if argv is None else list(argv), "git": harness.git_state(),
            "python": platform.python_version(), "torch": torch.__version__,
            "versions": {name: __import__(name).__version__ for name in ("transformers", "peft", "bitsandbytes")},
            "cpus": os.cpu_count(), "platform": platform.platform(),
            "mem_total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "shape": shape, "params": counts, "checkpoint": str(directory),
            "quantization": f"nf4, double quant, compute {args.compute_dtype}, storage bf16; torch_dtype bf16", "lora": {"r": 16, "targets": LORA_TARGETS},
            "train": {"steps": args.steps, "batch_per_rank": 1, "seq": args.seq, "optimizer": "AdamW lr 1e-4"},
            "rss": "per rank, bytes above the baseline (VmRSS after the imports and the process group, before "
                   "any model); peaks = max(VmHWM after a clear_refs reset, a VmRSS sampler every "
                   f"{args.sample_ms} ms); anon peak from the sampler (RssAnon); after_load after gc.collect + "
                   "malloc_trim",
            "ignored_modules_pattern": IGNORED_PATTERN, "total_s": total,
            "malloc_mmap_threshold": args.malloc_mmap_threshold}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"qlora_memory_{stamp}.json"
    path.write_text(json.dumps({"meta": meta, "runs": runs, "ratios": rows}, indent=1))
    print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
