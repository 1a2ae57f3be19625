"""Expert parallelism against FSDP2 alone on a mixture-of-experts model whose experts dominate its bytes (issue 49).

    python benchmarks/moe_bench.py            # 4 gloo ranks, Qwen3-MoE-shaped, fp32 + AdamW
    python benchmarks/moe_bench.py --tiny     # the same contestants in seconds (the suite runs it)

Contestants, side by side in one run, each loading the same hub-format checkpoint:
  fsdp2            hf_fsdp2.from_pretrained, FSDP2Config()            every expert all-gathered by every rank
  ep2, ep4         hf_fsdp2.from_pretrained, FSDP2Config(ep_size=E)   E/ep experts per rank, tokens by hf_fsdp2's
                   dispatch (sharding/expert_parallel/dispatch.py: fixed-size gathers and reduce-scatters, no host read per
                   layer)
  ep2_all_to_all,  the same with transformers' AllToAllEP as the dispatch (expert_parallel.dispatch.set_dispatch): what
  ep4_all_to_all   hf_fsdp2 ran before issue 64 (split sizes read to the host each layer, no padding)
  transformers,    from_pretrained(distributed_config=DistributedConfig(fsdp_size=4, ep_size=2 or 4)), adopted by
  transformers_ep4 hf_fsdp2.shard_model: transformers' own EP x FSDP2

Per contestant: FSDP2's all-gathered bytes and the EP token dispatch's bytes of one training step (torch.profiler's
c10d events, `_collective_bytes`), host reads per MoE layer in the next step's forwards (tests/host_reads.py:
item/tolist/bool/nonzero/... of a tensor; the even dispatch's one read of its CPU token-count tensor counted apart,
`host_int_reads_per_layer`), tokens/s over the timed steps (the median of `--repeat` round-robin runs), each
rank's own CPU seconds per timed step (max over ranks: what other load on the machine moves least), peak RSS per
rank over the steps (max over ranks), and the losses (equal across contestants: EP changes where experts run,
not the math).

World size 1 (issue 64; `world_one`, which benchmarks/gpu_check.py can call on its one GPU):

    python benchmarks/moe_bench.py --world-one --layers 4           # a GPU: Qwen3-30B-A3B's shape, 4 layers, bf16
    python benchmarks/moe_bench.py --world-one --tiny --seq 512     # CPU, the tiny shape
    python benchmarks/moe_bench.py --world-one --dry-run            # CPU, tiny, 2 steps: the code path only

  transformers     the model as transformers builds it (its default experts implementation, grouped_mm); LoRA by
                   PEFT, which folds the experts' adapters into their weights every forward (a baddbmm per projection)
  hf_fsdp2         the same model through hf_fsdp2.shard_model: LoRA on the experts inside the grouped matmuls
                   (sharding/expert_parallel/grouped.py), no merged weight and no gradient of one

LoRA r16 on attention and the fused experts, and full fine-tuning; tokens/s (the faster of `--rounds` alternating
runs), peak CUDA memory, the first loss of each (equal up to bf16 rounding), and hf_fsdp2's ratio (target 1.5x).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import time
from pathlib import Path

import harness

SHAPE = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512, num_experts=16,
             num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
             max_position_embeddings=512, tie_word_embeddings=False)
TINY = dict(SHAPE, vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
            num_hidden_layers=2, num_attention_heads=4)
CONTESTANTS = ("fsdp2", "ep2", "ep4", "ep2_all_to_all", "ep4_all_to_all", "transformers", "transformers_ep4")


def _config(tiny: bool):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**(TINY if tiny else SHAPE))


def _collective_bytes(prof, ep: int) -> dict[str, int]:
    """Bytes of the step's collectives (values x 4 bytes, fp32): FSDP2's all-gathers' output buffers, and the EP token
    dispatch's ep x tokens buffers: the all-to-alls' outputs (AllToAllEP's, transformers' EP), hf_fsdp2's all-gathers
    (torch's functional ones: outputs ep x their input) and reduce-scatters (inputs), forward and backward."""
    out = {"all_gather": 0, "all_to_all": 0, "dispatch": 0}
    for event in prof.events():
        shape = event.input_shapes[0] if event.input_shapes and event.input_shapes[0] else None
        if shape is None:
            continue
        values = math.prod(shape)
        if event.name == "c10d::_allgather_base_":
            out["all_gather"] += 4 * values
        elif event.name == "c10d::alltoall_base_":
            out["all_to_all"] += 4 * values
            out["dispatch"] += 4 * values
        elif event.name == "_c10d_functional::all_gather_into_tensor":
            out["dispatch"] += 4 * values * ep
        elif event.name == "_c10d_functional::reduce_scatter_tensor":
            out["dispatch"] += 4 * values
    return out


def run_rank(rank: int, world: int, job: dict) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    import hf_fsdp2

    import sys

    sys.path.insert(0, str(harness.REPO))
    from hf_fsdp2.sharding.expert_parallel import dispatch as expert_dispatch
    from tests.host_reads import HostReads

    name = job["contestant"]
    if name.startswith("transformers"):
        from transformers.distributed import DistributedConfig

        model = AutoModelForCausalLM.from_pretrained(job["src"], distributed_config=DistributedConfig(
            fsdp_size=world, ep_size=4 if name.endswith("ep4") else 2))
        hf_fsdp2.shard_model(model)  # adopted as transformers sharded it
    else:
        ep = int(name[2]) if name.startswith("ep") else 1
        expert_dispatch.set_dispatch("all_to_all" if name.endswith("all_to_all") else "even")
        model = hf_fsdp2.from_pretrained(AutoModelForCausalLM, job["src"], hf_fsdp2.FSDP2Config(ep_size=ep),
                                         progress=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1 + rank)
    vocab = model.config.vocab_size
    data = [torch.randint(0, vocab, (job["batch"], job["seq"]), generator=g) for _ in range(job["warmup"] + 2 + job["steps"])]

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    losses = [step(ids) for ids in data[:job["warmup"]]]
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        losses.append(step(data[job["warmup"]]))
    collective = _collective_bytes(prof, job["ep"])
    moe_blocks = [layer.mlp for layer in model.model.layers]
    reads = HostReads(expert_dispatch.host_buffers())  # a step of its own: the modes would show in the profile
    with reads.counting(), reads.windows(moe_blocks):
        losses.append(step(data[job["warmup"] + 1]))
    collective["host_reads"] = dict(reads.counts)
    collective["host_reads_per_layer"] = reads.total / len(moe_blocks)
    collective["host_int_reads_per_layer"] = reads.exempt_reads / len(moe_blocks)
    import torch.distributed as dist

    harness.malloc_trim()
    dist.barrier()
    harness.reset_hwm()
    start, cpu_start = time.perf_counter(), time.process_time()
    timed = data[job["warmup"] + 2:]
    losses += [step(ids) for ids in timed]
    cpu_seconds = time.process_time() - cpu_start  # this rank's own CPU: less moved by other load than the wall
    dist.barrier()
    seconds = time.perf_counter() - start
    return {"losses": losses, "seconds": seconds, "cpu_s_per_step": cpu_seconds / len(timed),
            "peak_rss": harness.hwm_bytes(), **collective, "tokens": len(timed) * job["batch"] * job["seq"]}


# ---------------------------------------------------------------------------------------------
# World size 1 (issue 64): transformers' default experts implementation against hf_fsdp2's path, LoRA and full

# Qwen3-30B-A3B's shape (48 layers there; `layers` here), and the dry run's
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_experts=128, num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     max_position_embeddings=32768, norm_topk_prob=True, tie_word_embeddings=False)
WORLD_ONE_TINY = dict(QWEN3_30B_A3B, vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                      num_experts=8, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=512)
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
WORLD_ONE_TARGET = 1.5  # issue 64: hf_fsdp2 >= 1.5x transformers' default experts implementation's tokens/s


def _world_one_group(device) -> None:
    """A one-rank process group (NCCL on a GPU, gloo on CPU) unless one exists (benchmarks/gpu_check.py's)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(harness.free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    import hf_fsdp2

    hf_fsdp2.init_distributed()


def _world_one_model(shape: dict, layers: int, mode: str, device, dtype):
    """The Qwen3-MoE model (transformers' default experts implementation, grouped_mm), built on `device` in `dtype`
    from seed 0; with PEFT LoRA r16 on attention and the fused experts (`mode`="lora")."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**shape, num_hidden_layers=layers)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3MoeForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        # B random (not PEFT's zeros): the adapters change the output, so equal losses mean equal math
        model = get_peft_model(model, LoraConfig(**LORA, init_lora_weights=False))  # adapters in fp32 (PEFT's default)
    return model


def _world_one_run(contestant: str, mode: str, shape: dict, layers: int, data: list, warmup: int, device, dtype) -> dict:
    """One contestant's training steps: "transformers" (the model as built: transformers' grouped_mm experts, PEFT's
    fold of the experts' LoRA into their weights each forward) or "hf_fsdp2" (hf_fsdp2.shard_model at world size 1:
    the experts' LoRA inside the grouped matmuls). AdamW on the trainable parameters."""
    import gc

    import torch

    import hf_fsdp2

    model = _world_one_model(shape, layers, mode, device, dtype)
    grouped = 0
    if contestant == "hf_fsdp2":
        hf_fsdp2.shard_model(model)
        # the outermost PEFT ParamWrappers whose forward hf_fsdp2 replaced (sharding/expert_parallel/grouped.py)
        grouped = sum(1 for m in model.modules() if type(m).__name__ == "ParamWrapper" and "forward" in vars(m))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    cuda = torch.device(device).type == "cuda"

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    losses = [step(ids) for ids in data[:warmup]]
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start, cpu_start = time.perf_counter(), time.process_time()
    losses += [step(ids) for ids in data[warmup:]]
    if cuda:
        torch.cuda.synchronize()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    timed = data[warmup:]
    # on a shared CPU the process's own CPU seconds move less with other load than the wall clock
    out = {"tokens_per_s": sum(ids.numel() for ids in timed) / seconds, "seconds": seconds,
           "cpu_s_per_step": cpu_seconds / len(timed),
           "losses": [loss.item() for loss in losses], "experts_in_grouped_matmuls": grouped,
           # what the experts ran (an older transformers may default to another implementation than grouped_mm, where
           # hf_fsdp2's path does not apply: experts_in_grouped_matmuls counts the wrappers, not the calls)
           "experts_implementation": getattr(model.config, "_experts_implementation", None),
           "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
           "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    del model, opt
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def world_one(*, layers: int = 4, batch: int = 1, seq: int = 4096, steps: int = 5, warmup: int = 2, rounds: int = 2,
              modes: tuple = ("lora", "full"), vocab_size: int | None = None, dtype: str = "bfloat16",
              tiny: bool = False, dry_run: bool = False, device: str | None = None) -> dict:
    """Issue 64's GPU check at world size 1: tokens/s of transformers' default experts implementation (grouped_mm;
    PEFT's fold of the experts' LoRA into their weights each forward) against hf_fsdp2's (shard_model; the experts'
    LoRA inside the grouped matmuls, sharding/expert_parallel/grouped.py) on a Qwen3-30B-A3B-shaped model with
    `layers` decoder layers (all MoE: hidden 2048, 128 experts of 768, top 8; `vocab_size` 151936 unless given),
    `dtype` weights, the same `batch` x `seq` token batches for both, `warmup` untimed then `steps` timed AdamW steps.
    "lora": PEFT LoRA r16 (alpha 32) on q/k/v/o and the fused experts (gate_up_proj, down_proj), random B; "full":
    every parameter trained. Contestants alternate over `rounds`, the fastest run of each kept.

    `tiny`: the tiny shape (hidden 64, 8 experts of 32, top 2, vocab 256; a CPU's side-by-side). `dry_run`: CPU, the
    tiny shape, 1 layer, 1 round of 2 steps of 32 tokens (the code path, no number). Uses the process group
    there is (benchmarks/gpu_check.py's one rank), else starts one. Returns {"shape", "device", mode: {contestant:
    {tokens_per_s, losses, peak_bytes, ...}, "ratio": hf_fsdp2 / transformers, "first_loss_diff"}, "ratios",
    "target", "met"}."""
    import torch

    device = torch.device(device or ("cpu" if dry_run or not torch.cuda.is_available() else "cuda"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _world_one_group(device)
    shape = dict(WORLD_ONE_TINY if tiny or dry_run else QWEN3_30B_A3B)
    if vocab_size:
        shape["vocab_size"] = vocab_size
    if dry_run:
        layers, batch, seq, steps, warmup, rounds = 1, 1, 32, 2, 1, 1
    torch_dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, shape["vocab_size"], (batch, seq), generator=g).to(device) for _ in range(warmup + steps)]
    result = {"shape": dict(shape, num_hidden_layers=layers), "device": str(device), "dtype": dtype, "batch": batch,
              "seq": seq, "steps": steps, "warmup": warmup, "rounds": rounds, "tiny": tiny or dry_run,
              "dry_run": dry_run}
    contestants = ("transformers", "hf_fsdp2")
    for mode in modes:
        runs: dict = {}
        for round_ in range(rounds):
            for name in contestants if round_ % 2 == 0 else contestants[::-1]:
                run = _world_one_run(name, mode, shape, layers, data, warmup, device, torch_dtype)
                if name not in runs or run["tokens_per_s"] > runs[name]["tokens_per_s"]:
                    runs[name] = run
        runs["ratio"] = runs["hf_fsdp2"]["tokens_per_s"] / runs["transformers"]["tokens_per_s"]
        runs["cpu_ratio"] = runs["transformers"]["cpu_s_per_step"] / runs["hf_fsdp2"]["cpu_s_per_step"]
        runs["first_loss_diff"] = abs(runs["hf_fsdp2"]["losses"][0] - runs["transformers"]["losses"][0])
        result[mode] = runs
    result["ratios"] = {mode: result[mode]["ratio"] for mode in modes}
    result["target"] = WORLD_ONE_TARGET
    result["met"] = None if dry_run else {mode: ratio >= WORLD_ONE_TARGET for mode, ratio in result["ratios"].items()}
    return result


def world_one_table(result: dict) -> str:
    lines = [f"Qwen3-MoE {'(tiny) ' if result['tiny'] else ''}{result['shape']['num_hidden_layers']} layers, "
             f"{result['shape']['num_experts']} experts top {result['shape']['num_experts_per_tok']}, {result['dtype']}, "
             f"batch {result['batch']} x seq {result['seq']}, {result['steps']} timed steps, world size 1 on "
             f"{result['device']}",
             f"{'mode':6s} {'contestant':14s} {'tokens/s':>10s} {'CPU s/step':>10s} {'peak GiB':>9s}  first loss"]
    for mode, ratio in result["ratios"].items():
        for name in ("transformers", "hf_fsdp2"):
            r = result[mode][name]
            peak = f"{r['peak_bytes'] / 2**30:9.2f}" if r["peak_bytes"] else f"{'-':>9s}"
            lines.append(f"{mode:6s} {name:14s} {r['tokens_per_s']:10.1f} {r['cpu_s_per_step']:10.3f} {peak}  "
                         f"{r['losses'][0]:.6f}")
        lines.append(f"{mode:6s} {'ratio':14s} {ratio:9.2f}x {result[mode]['cpu_ratio']:9.2f}x (target "
                     f"{result['target']}x in tokens/s)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes (with --world-one: the tiny shape, on CPU)")
    p.add_argument("--world-one", action="store_true",
                   help="issue 64's world-size-1 comparison (world_one): transformers' experts vs hf_fsdp2's")
    p.add_argument("--dry-run", action="store_true", help="--world-one on CPU at the tiny shape")
    p.add_argument("--layers", type=int, default=4, help="--world-one: decoder layers")
    p.add_argument("--modes", nargs="+", choices=("lora", "full"), default=["lora", "full"])
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--contestants", nargs="+", choices=CONTESTANTS, default=list(CONTESTANTS))
    p.add_argument("--steps", type=int, default=4, help="timed steps, after a warm-up, a profiled and a counted step "
                   "(--world-one: after 2 warm-up steps)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the contestants this many times, round-robin (a loaded machine): tokens/s is the median")
    p.add_argument("--batch", type=int, default=None, help="per rank (default 2; --world-one: 1)")
    p.add_argument("--seq", type=int, default=None, help="default 256 (--world-one: 4096)")
    args = p.parse_args(argv)
    if args.world_one:
        import torch

        if args.tiny or args.dry_run or not torch.cuda.is_available():  # on CPU one thread: its CPU seconds are its
            torch.set_num_threads(1)  # work, on a shared machine too
        result = world_one(layers=args.layers, batch=args.batch or 1, seq=args.seq or 4096, steps=args.steps,
                           rounds=args.rounds, modes=tuple(args.modes), vocab_size=args.vocab_size, dtype=args.dtype,
                           tiny=args.tiny, dry_run=args.dry_run)
        print(world_one_table(result))
        path = harness.write_results("moe_bench_world_one", argv, **result)
        print(f"results: {path.relative_to(harness.REPO)}")
        return 0
    world = 4
    args.batch, args.seq = args.batch or 2, args.seq or 256
    root = harness.TMP_ROOT / f"moe_bench-{os.getpid()}"  # its own: a --tiny run (the suite) may run beside it
    shutil.rmtree(root, ignore_errors=True)
    import torch
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(_config(args.tiny))
    expert_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    total_bytes = sum(p.numel() * 4 for p in model.parameters())
    model.save_pretrained(root / "src")
    del model
    seq = 16 if args.tiny else args.seq
    steps = 1 if args.tiny else args.steps
    results = {}
    for _ in range(args.repeat):
        for name in args.contestants:
            ep = int(name[2]) if name.startswith("ep") else 4 if name.endswith("ep4") else 2 if name == "transformers" else 1
            job = {"contestant": name, "src": str(root / "src"), "batch": args.batch, "seq": seq, "warmup": 1,
                   "steps": steps, "ep": ep}
            ranks = harness.run_ranks(run_rank, world, job, timeout=3600, threads=1,
                                      preload=harness.TINY_PRELOAD if args.tiny else ())
            speed = world * ranks[0]["tokens"] / max(r["seconds"] for r in ranks)
            cpu = max(r["cpu_s_per_step"] for r in ranks)
            if name in results:
                results[name]["tokens_per_s_runs"].append(speed)
                results[name]["cpu_s_per_step_runs"].append(cpu)
                continue
            results[name] = {
                "losses": ranks[0]["losses"], "rank_losses": [r["losses"] for r in ranks],
                "all_gather_bytes": max(r["all_gather"] for r in ranks),
                "all_to_all_bytes": max(r["all_to_all"] for r in ranks),
                "dispatch_bytes": max(r["dispatch"] for r in ranks), "peak_rss": max(r["peak_rss"] for r in ranks),
                "tokens_per_s_runs": [speed], "cpu_s_per_step_runs": [cpu],
                "host_reads_per_layer": max(r["host_reads_per_layer"] for r in ranks),
                "host_reads": ranks[0]["host_reads"],
                "host_int_reads_per_layer": max(r["host_int_reads_per_layer"] for r in ranks),
            }
    for r in results.values():
        r["tokens_per_s"] = statistics.median(r["tokens_per_s_runs"])
        r["cpu_s_per_step"] = statistics.median(r["cpu_s_per_step_runs"])
    shutil.rmtree(root, ignore_errors=True)
    base = results.get("fsdp2")
    lines = [f"Qwen3-MoE shape {'(tiny)' if args.tiny else ''} {total_bytes / 2**20:.0f} MiB fp32, experts "
             f"{expert_bytes / total_bytes:.0%} of it; {world} ranks, batch {args.batch} x seq {seq} per rank",
             f"{'contestant':16s} {'all-gather/step':>16s} {'dispatch/step':>16s} {'peak RSS':>10s} {'tokens/s':>9s}"
             f"         CPU s/step  host reads/MoE layer  loss diff"]
    for name, r in results.items():
        rel = (f" ({r['all_gather_bytes'] / base['all_gather_bytes']:.2f}x)" if base else "")
        speed = (f" ({r['tokens_per_s'] / base['tokens_per_s']:.2f}x)" if base else "")
        diff = max(abs(a - b) for a, b in zip(r["losses"], base["losses"])) if base else float("nan")
        lines.append(f"{name:16s} {r['all_gather_bytes'] / 2**20:9.1f} MiB{rel:>8s} {r['dispatch_bytes'] / 2**20:8.1f} MiB "
                     f"{r['peak_rss'] / 2**30:7.2f} GiB {r['tokens_per_s']:8.0f}{speed:8s} {r['cpu_s_per_step']:6.2f}     "
                     f"{r['host_reads_per_layer']:4.1f} (+{r['host_int_reads_per_layer']:.0f} CPU int)  {diff:.1e}")
    print("\n".join(lines))
    path = harness.write_results("moe_bench", argv, world_size=world, tiny=args.tiny, shape=TINY if args.tiny else SHAPE,
                                 expert_fraction=expert_bytes / total_bytes, results=results)
    print(f"results: {path.relative_to(harness.REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
