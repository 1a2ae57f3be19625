"""Real model sizes from nothing, phase by phase (issue 51): load, train steps, every save, resume.

    python benchmarks/real_size.py                    # the 1B and 0.5B cases at their real shapes (tens of minutes, 2 ranks)
    python benchmarks/real_size.py --cases lora_1b    # one of them
    python benchmarks/real_size.py --tiny             # the same phases on tiny shapes (tests/test_real_size.py)

Cases (random init, saved like the hub: transformers' save_pretrained in 1 GB safetensors shards):
  lora_1b       Llama-3.2-1B's shape (1.24B), bf16 base, LoRA r 16 on all seven projections, bf16 compute,
                seq 512: hf_fsdp2.from_pretrained(..., peft_config=...) on 2 ranks.
  lora_3b       the same at Llama-3.2-3B's shape (3.21B); only when named (--cases lora_3b).
  full_qwen05b  Qwen2-0.5B's shape, fp32 + AdamW, shard_size="auto" under a budget only sharding fits.
Per phase and rank: wall time and peak RSS (VmHWM reset before the phase) over the RSS before it; the train
phase's peak against `estimate-memory`'s for the same setup (and the process's base RSS, interpreter and
libraries, reported beside it); each save's GB/s against rank 0 writing the same bytes with fsync; the resumed
run's next losses against the uninterrupted run's; what one replica per rank (DDP) would need, from the
same estimator. Results: stdout and benchmarks/results/real_size-*.json.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import harness

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CASES = {
    "lora_1b": dict(arch="llama", lora=True, dtype="bfloat16", seq=512, shape=dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, tie_word_embeddings=True)),
    "lora_3b": dict(arch="llama", lora=True, dtype="bfloat16", seq=512, shape=dict(  # Llama-3.2-3B's shape
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
        num_key_value_heads=8, tie_word_embeddings=True)),
    "full_qwen05b": dict(arch="qwen2", lora=False, dtype="float32", seq=512, shape=dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, tie_word_embeddings=True)),
}
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=True)


def _config(case: dict, tiny: bool):
    from transformers import LlamaConfig, Qwen2Config

    cls = LlamaConfig if case["arch"] == "llama" else Qwen2Config
    return cls(**(TINY if tiny else case["shape"]), max_position_embeddings=4096)


def make_checkpoint(case: dict, directory: Path, tiny: bool) -> None:
    """The base model as the hub has it: random init, saved by transformers in 1 GB shards."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(case, tiny), dtype=getattr(torch, case["dtype"]))
    model.save_pretrained(directory, max_shard_size="1GB")


def _phase(name: str, out: dict, fn):
    import torch.distributed as dist

    harness.malloc_trim()
    dist.barrier()
    before = harness.rss_bytes()
    harness.reset_hwm()
    t = time.perf_counter()
    result = fn()
    dist.barrier()
    out[name] = {"s": time.perf_counter() - t, "peak_rss_delta": harness.hwm_bytes() - before, "rss_before": before}
    return result


def run_rank(rank: int, world: int, job: dict) -> dict:
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    import hf_fsdp2

    case = CASES[job["case"]]
    src, work = Path(job["src"]), Path(job["work"])
    phases: dict = {"base_rss": harness.rss_bytes(), "base_live": (harness.malloc_bytes() or {}).get("live")}
    if case["lora"]:
        fields = dict(param_dtype="bf16")
    elif job["budget"] is None:
        fields = dict(shard_size=world)
    else:
        fields = dict(shard_size="auto", memory_budget=job["budget"], plan_seq_len=job["seq"])
    peft_config = LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS, lora_dropout=0.0) \
        if case["lora"] else None

    def load():
        return hf_fsdp2.from_pretrained(AutoModelForCausalLM, src, hf_fsdp2.FSDP2Config(**fields),
                                        peft_config=peft_config, progress=False)

    model = _phase("load", phases, load)
    from hf_fsdp2.sharding import record_of

    chosen = record_of(model).config  # the layout that ran (the auto layout's choice), for its estimate
    layout = {k: getattr(chosen, k) for k in ("shard_size", "replicate_size", "reshard_after_forward",
                                              "activation_checkpointing", "checkpoint_every", "cpu_offload")}
    plan = record_of(model).layout  # the auto layout's plan: its promise and whether glibc's lever was pulled
    if plan is not None:
        layout["planned_bytes"] = plan.chosen.needed_bytes
        layout["returns_freed_memory"] = plan.returns_freed_memory
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size if hasattr(model, "config") else model.get_base_model().config.vocab_size
    data = [torch.randint(0, vocab, (1, job["seq"]), generator=g) for _ in range(job["steps"] + 2)]

    def steps(batches):
        losses = []
        for ids in batches:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses

    live_before = harness.malloc_bytes()
    with harness.RssSampler(malloc=True) as sampler:
        losses = _phase("train", phases, lambda: steps(data[:job["steps"]]))
    phases["train"]["step_s"] = phases["train"]["s"] / job["steps"]
    if live_before is not None:  # what the tensors held (glibc's count) vs what the heap kept free on top
        phases["train"]["peak_live"] = sampler.max_live
        phases["train"]["heap_free_at_peak"] = sampler.heap_free_at_max
    saves = {"state": lambda: hf_fsdp2.save_state(work / "state", model, opt, step=job["steps"], progress=False)}
    if case["lora"]:
        saves["adapter"] = lambda: hf_fsdp2.save_pretrained(model, work / "adapter", progress=False)
        saves["merged"] = lambda: hf_fsdp2.save_pretrained(model, work / "merged", merge_adapters=True, progress=False)
    else:
        saves["full"] = lambda: hf_fsdp2.save_pretrained(model, work / "full", progress=False)
    for name, fn in saves.items():
        _phase(f"save_{name}", phases, fn)
        if rank == 0:
            target = work / name
            phases[f"save_{name}"]["bytes"] = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
    continued = steps(data[job["steps"]:])  # the uninterrupted run's next two steps
    del model, opt
    model = load()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    _phase("resume", phases, lambda: hf_fsdp2.load_state(work / "state", model, opt, progress=False))
    resumed = steps(data[job["steps"]:])
    return {"phases": phases, "losses": losses, "continued": continued, "resumed": resumed, "layout": layout}


def disk_seconds(path: Path, nbytes: int) -> float:
    try:
        return harness.write_fsync(path, nbytes)
    finally:
        path.unlink(missing_ok=True)


def estimates(case: dict, config, seq: int, world: int, layout: dict) -> dict:
    """estimate-memory's per-rank peak for the run's layout, and for one replica per rank (DDP's need)."""
    from hf_fsdp2 import FSDP2Config
    from hf_fsdp2.planner.memory import estimate_memory

    kw = dict(dtype=case["dtype"], lora_r=16 if case["lora"] else None, lora_targets=LORA_TARGETS,
              batch_size=1, seq_len=seq)
    mp = dict(param_dtype="bf16") if case["lora"] else {}
    fields = {k: v for k, v in layout.items() if k not in ("planned_bytes", "returns_freed_memory")}
    ours = estimate_memory(config, world, FSDP2Config(**mp, **fields), **kw)
    ddp = estimate_memory(config, world, FSDP2Config(**mp, shard_size=1, replicate_size=world), **kw)
    return {"ours_device_bytes": ours.device_bytes, "ddp_device_bytes": ddp.device_bytes}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=["full_qwen05b", "lora_1b"],
                   help="default: full_qwen05b lora_1b (lora_3b only when named: on the 24 GiB machine a rank reached "
                        "10.7 GB and was OOM-killed while tests ran beside it)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, 2 steps: every phase in seconds")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    root = harness.TMP_ROOT / "real_size"
    results, lines = {}, []
    for name in args.cases:
        case = CASES[name]
        seq = 32 if args.tiny else case["seq"]
        shutil.rmtree(root, ignore_errors=True)
        src, work = root / "src", root / "work"
        work.mkdir(parents=True)
        make_checkpoint(case, src, args.tiny)
        config = _config(case, args.tiny)
        budget = None
        if not case["lora"]:  # a budget only sharding fits: 1.05x the cheapest sharded layout the planner costs
            from hf_fsdp2 import FSDP2Config
            from hf_fsdp2.planner.layout import plan_layout
            from hf_fsdp2.planner.memory import prepare_meta_model

            candidates = plan_layout(prepare_meta_model(config, FSDP2Config(), dtype=case["dtype"]), args.world_size,
                                     FSDP2Config(), budget_bytes=1 << 50, device_type="cpu", batch_size=1,
                                     seq_len=seq).candidates
            budget = int(1.05 * min(c.needed_bytes for c in candidates if c.shard_size == args.world_size))
            if budget >= min(c.needed_bytes for c in candidates if c.shard_size == 1):
                budget = None  # tiny shapes: replication fits as well; shard explicitly instead
        job = {"case": name, "src": str(src), "work": str(work), "seq": seq, "steps": 2 if args.tiny else args.steps,
               "budget": budget}
        ranks = harness.run_ranks(run_rank, args.world_size, job, timeout=7200, threads=1,
                                  preload=harness.TINY_PRELOAD if args.tiny else ())
        est = estimates(case, config, seq, args.world_size, ranks[0]["layout"])
        phases = [r["phases"] for r in ranks]
        train_peak = max(ph["train"]["peak_rss_delta"] + ph["train"]["rss_before"] - ph["base_rss"] for ph in phases)
        saves = {k: v for k, v in phases[0].items() if k.startswith("save_")}
        for key, ph in saves.items():
            ph["disk_s"] = disk_seconds(root / "disk.bin", ph["bytes"])
            ph["vs_disk"] = ph["s"] / ph["disk_s"]
        resumed_diff = max(abs(a - b) for a, b in zip(ranks[0]["continued"], ranks[0]["resumed"]))
        results[name] = {"case": {**case, "seq": seq, "tiny": args.tiny}, "ranks": ranks, "estimates": est,
                         "layout": ranks[0]["layout"],
                         "train_peak_over_base": train_peak, "train_peak_vs_estimate": train_peak / est["ours_device_bytes"],
                         "budget": budget, "resumed_max_loss_diff": resumed_diff}
        gib = 1 << 30
        lines.append(f"{name} ({'tiny' if args.tiny else 'real'} shape, {args.world_size} ranks, seq {seq}; layout "
                     f"{ranks[0]['layout']}):")
        for key in ("load", "train", "resume", *saves):
            ph = max(phases, key=lambda x: x[key]["peak_rss_delta"])[key]
            extra = (f", {saves[key]['bytes'] / 1e9:.2f} GB = {saves[key]['vs_disk']:.2f}x the disk"
                     if key in saves else "")
            lines.append(f"  {key:14s} {ph['s']:8.2f} s  peak RSS +{ph['peak_rss_delta'] / gib:.2f} GiB (max rank){extra}")
        if phases[0].get("base_live") is not None and "peak_live" in phases[0]["train"]:
            # glibc's own count of what is in use (the tensors), beside the RSS, which adds what its heap keeps free
            live = max(ph["train"]["peak_live"] - ph["base_live"] for ph in phases)
            free = max(ph["train"]["heap_free_at_peak"] for ph in phases)
            results[name].update(train_live_peak_over_base=live, train_live_vs_estimate=live / est["ours_device_bytes"],
                                 heap_free_at_rss_peak=free)
            lines.append(f"  train live bytes (glibc's count) peak over base {live / gib:.2f} GiB = "
                         f"{live / est['ours_device_bytes']:.2f}x the estimate; the heap kept {free / gib:.2f} GiB free "
                         f"at the RSS peak")
        lines.append(f"  train peak over the process's base RSS {train_peak / gib:.2f} GiB vs estimate "
                     f"{est['ours_device_bytes'] / gib:.2f} GiB = {train_peak / est['ours_device_bytes']:.2f}x; "
                     f"one replica per rank (DDP) would need {est['ddp_device_bytes'] / gib:.2f} GiB")
        planned = ranks[0]["layout"].get("planned_bytes")
        if planned:  # the auto layout's promise: its estimate plus, without glibc's lever, what the heap keeps
            results[name]["train_peak_vs_planned"] = train_peak / planned
            lines.append(f"  auto layout planned {planned / gib:.2f} GiB (budget {budget / gib:.2f} GiB, glibc's lever "
                         f"{'pulled' if ranks[0]['layout']['returns_freed_memory'] else 'not pulled'}): peak = "
                         f"{train_peak / planned:.2f}x the plan")
        lines.append(f"  resumed vs uninterrupted: max loss difference {resumed_diff:.2e}")
    shutil.rmtree(root, ignore_errors=True)
    print("\n".join(lines))
    path = harness.write_results("real_size", argv, world_size=args.world_size, results=results)
    print(f"results: {path.relative_to(harness.REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
