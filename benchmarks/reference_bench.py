"""A TRL reference model's forward, TRL's own FSDP2 path vs hf_fsdp2's, side by side in one run.

    python benchmarks/reference_bench.py [--world-size 2] [--layers 8] [--hidden 1024] [--steps 5]

What DPO/KTO/GRPO (beta > 0) do with their reference model every step: a no-grad forward of the
batch. TRL shards that model with `trl.models.utils.prepare_fsdp` (one `fully_shard` at the root:
every forward all-gathers the whole model at once); with `hf_fsdp2.register()` the same call shards it
per layer, frozen (integrations/trl.py). Both models are prepared in the same processes, with one
real Accelerator (FSDP2 plugin), by TRL's own function (the original, not our replacement) and by
what register() routes it to. Per rank: peak RSS added by one forward (VmHWM reset before it; the
unsharded weights that stay gathered at once are what differs) and seconds per forward; the logits
of both are compared.

The whole GRPO step is not compared: without register(), Accelerate runs no FSDP at all on a CPU
machine (tests/test_accelerate.py::test_without_register_cpu_runs_unsynchronised_replicas), so TRL's
own path cannot be launched here; this measures the part of the step that differs.
Writes benchmarks/results/reference-<stamp>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

MiB = 2 ** 20


def build(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=1024, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def run_job(rank: int, world: int, job: dict) -> dict:
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.tensor import DTensor

    import hf_fsdp2
    from hf_fsdp2.integrations import trl as trl_backend
    from hf_fsdp2.runtime import upstream

    args = argparse.Namespace(**job["args"])
    os.environ.update(LOCAL_WORLD_SIZE=str(world))
    hf_fsdp2.register()
    # As accelerate_configs/fsdp2.yaml (and TRL's fsdp2.yaml) set it: the decoder layer as the wrap unit.
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["LlamaDecoderLayer"]))
    import trl.models.utils  # noqa: F401 - TRL's trainers import it; register()'s Accelerator patched it

    trl_backend.install_if_imported()
    ids = torch.randint(3, 1000, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(rank))
    paths = {"trl prepare_fsdp": upstream.original(trl_backend.TARGET), "hf_fsdp2": trl_backend._prepare_fsdp}
    out = {}
    for name, prepare in paths.items():
        model = prepare(build(args).requires_grad_(False), accelerator)
        groups = sum(1 for m in model.modules() if type(m).__name__.startswith("FSDP"))
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
        with torch.no_grad():
            model(input_ids=ids)  # warm-up (allocator, lazy init)
            seconds, peaks = [], []
            for _ in range(args.steps):
                dist.barrier()
                harness.malloc_trim()
                base = harness.rss_bytes()
                harness.reset_hwm()
                start = time.perf_counter()
                logits = model(input_ids=ids).logits
                seconds.append(time.perf_counter() - start)
                peaks.append(harness.hwm_bytes() - base)
        out[name] = {"groups": groups, "local_params": local, "seconds": statistics.median(seconds),
                     "peak_added_mib": max(peaks) / MiB, "logits": logits[:, -1, :8].tolist()}
        del model, logits
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    if not harness.reset_hwm():
        print("needs Linux /proc/self/clear_refs (peak-RSS reset)", file=sys.stderr)
        return 2
    ranks = harness.run_ranks(run_job, args.world_size, {"args": vars(args)}, timeout=1800)
    full_mib = sum(p.numel() for p in build(args).parameters()) * 4 / MiB
    print(f"reference model: {args.layers} layers, hidden {args.hidden} ({full_mib:.0f} MiB fp32), batch "
          f"{args.batch} x {args.seq_len}, {args.world_size} ranks")
    print(f"{'path':>17}  {'groups':>6}  {'peak added MiB (max rank)':>25}  {'s/forward (rank 0)':>18}  "
          f"{'peak x hf_fsdp2':>15}")
    rows = []
    ours = max(r["hf_fsdp2"]["peak_added_mib"] for r in ranks)
    for name in ("trl prepare_fsdp", "hf_fsdp2"):
        peak = max(r[name]["peak_added_mib"] for r in ranks)
        seconds = ranks[0][name]["seconds"]
        print(f"{name:>17}  {ranks[0][name]['groups']:>6}  {peak:>25.1f}  {seconds:>18.3f}  {peak / ours:>15.2f}")
        rows.append({"path": name, "groups": ranks[0][name]["groups"], "peak_added_mib": peak,
                     "peak_added_mib_by_rank": [r[name]["peak_added_mib"] for r in ranks],
                     "seconds_per_forward": seconds, "local_params": ranks[0][name]["local_params"]})
    same = all(r["hf_fsdp2"]["logits"] == r["trl prepare_fsdp"]["logits"] for r in ranks)
    print(f"same logits: {same}; time ratio trl/hf_fsdp2: "
          f"{rows[0]['seconds_per_forward'] / rows[1]['seconds_per_forward']:.2f}")
    path = harness.write_results("reference", argv, full_model_mib=full_mib, same_logits=same, rows=rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
