"""A whole GRPO step (beta > 0: policy, reference model, generation), TRL's own FSDP2 path vs
hf_fsdp2's, side by side: step time and peak memory per rank.

    python benchmarks/grpo_bench.py [--processes 2] [--layers 8] [--hidden 1024] [--steps 4] [--new-tokens 32]

Both runs are TRL 1.x's `GRPOTrainer` under `accelerate launch --config_file accelerate_configs/fsdp2.yaml`
with `hf_fsdp2.register()`, on the same model, data and seeds:
  trl       every hf_fsdp2 replacement taken back except the one that lets Accelerate run FSDP on a
            CPU machine (`Accelerator.__init__`; stock Accelerate runs no FSDP without a GPU): the
            policy is sharded by Accelerate's own `fsdp2_prepare_model`, the reference by TRL's
            `prepare_fsdp` (one `fully_shard` at the root), generation re-gathers per token. That is
            TRL's path on GPUs, on this machine's gloo.
  hf_fsdp2  register() as it is: both models sharded per layer by hf_fsdp2, generation gathering each
            group once per generate() call.
Per rank, per optimizer step (a TrainerCallback): wall seconds and peak RSS added (VmHWM reset at the
step's start); the median step after the first, the largest peak. Writes
benchmarks/results/grpo-<stamp>.json. Linux only (peak-RSS reset).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness  # noqa: E402

MiB = 2 ** 20


def build_model_dir(directory: Path, layers: int, hidden: int) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    tiny = ROOT / "examples" / "tiny-llama"
    config = transformers.AutoConfig.from_pretrained(tiny, num_hidden_layers=layers, hidden_size=hidden,
                                                     intermediate_size=hidden * 3, num_attention_heads=8,
                                                     num_key_value_heads=4)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    transformers.AutoTokenizer.from_pretrained(tiny).save_pretrained(directory)


def worker(args) -> None:
    """One rank of one run (under accelerate launch)."""
    import torch

    import hf_fsdp2
    from hf_fsdp2.runtime import upstream

    hf_fsdp2.register()
    import trl  # noqa: F401 - installs hf_fsdp2's TRL replacement
    from hf_fsdp2.integrations import trl as trl_backend

    if args.path == "trl":
        # Stock Accelerate and TRL, but for the switch that lets Accelerate run FSDP on a CPU machine:
        # every other replacement's original put back (this process runs only this path).
        trl_backend.uninstall()
        trl_backend.install_if_imported = lambda: None  # Accelerator.__init__ (kept) would reinstall it
        for target in upstream.installed("accelerate"):
            if not target.endswith("Accelerator.__init__"):
                owner, name, original, _, _ = upstream._installed[target]
                setattr(owner, name, original)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    words = [line.split() for line in (ROOT / "examples" / "data" / "train.txt").read_text().splitlines()
             if len(line.split()) >= 6]
    data = Dataset.from_list([{"prompt": " ".join(w[:6])} for w in words[:64]])
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    steps = []

    class Measure(TrainerCallback):
        def on_step_begin(self, *a, **k):
            harness.malloc_trim()
            self.base, self.start = harness.rss_bytes(), time.perf_counter()
            harness.reset_hwm()

        def on_step_end(self, *a, **k):
            steps.append({"seconds": time.perf_counter() - self.start,
                          "peak_added_mib": (harness.hwm_bytes() - self.base) / MiB})

    def reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    trainer = GRPOTrainer(
        model=model, reward_funcs=[reward], train_dataset=data, processing_class=tokenizer,
        callbacks=[Measure()],
        args=GRPOConfig(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
                        learning_rate=1e-5, logging_steps=1, report_to=[], seed=0, data_seed=0, save_strategy="no",
                        beta=0.1, num_generations=2, max_completion_length=args.new_tokens, temperature=1.0,
                        bf16=False, model_init_kwargs={"dtype": torch.float32}))
    trainer.train()
    ref = trainer.ref_model
    result = {"rank": trainer.accelerator.process_index, "steps": steps,
              "policy_groups": sum(type(m).__name__.startswith("FSDP") for m in trainer.model.modules()),
              "ref_groups": sum(type(m).__name__.startswith("FSDP") for m in ref.modules()) if ref is not None else 0}
    Path(args.out).with_suffix(f".{result['rank']}.json").write_text(json.dumps(result))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--path", choices=["trl", "hf_fsdp2"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--output-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if not harness.reset_hwm():
        print("needs Linux /proc/self/clear_refs (peak-RSS reset)", file=sys.stderr)
        return 2
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        build_model_dir(tmp / "model", args.layers, args.hidden)
        for path in ("trl", "hf_fsdp2"):
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(ROOT / "accelerate_configs" / "fsdp2.yaml"), "--num_processes", str(args.processes),
                   "--main_process_port", str(harness.free_port()), __file__, "--worker", "--path", path,
                   "--model", str(tmp / "model"), "--out", str(tmp / path), "--output-dir", str(tmp / f"out-{path}"),
                   "--steps", str(args.steps), "--batch", str(args.batch), "--new-tokens", str(args.new_tokens)]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ},
                                  timeout=3600)
            if proc.returncode != 0:
                print(proc.stdout[-3000:], proc.stderr[-5000:], file=sys.stderr)
                return 1
            results[path] = [json.loads((tmp / f"{path}.{r}.json").read_text()) for r in range(args.processes)]
    print(f"GRPO (beta 0.1): {args.layers} layers, hidden {args.hidden}, {args.processes} ranks, batch {args.batch} "
          f"per rank, {args.new_tokens} new tokens, {args.steps} steps")
    print(f"{'path':>9}  {'groups policy/ref':>17}  {'s/step (median, slowest rank)':>29}  "
          f"{'peak added MiB (max rank)':>25}")
    rows = []
    for path, ranks in results.items():
        seconds = statistics.median(max(r["steps"][i]["seconds"] for r in ranks)
                                    for i in range(1, len(ranks[0]["steps"])))
        peak = max(s["peak_added_mib"] for r in ranks for s in r["steps"])
        groups = f"{ranks[0]['policy_groups']}/{ranks[0]['ref_groups']}"
        print(f"{path:>9}  {groups:>17}  {seconds:>29.2f}  {peak:>25.1f}")
        rows.append({"path": path, "policy_groups": ranks[0]["policy_groups"], "ref_groups": ranks[0]["ref_groups"],
                     "seconds_per_step": seconds, "peak_added_mib": peak, "ranks": ranks})
    trl_row, ours = rows
    print(f"hf_fsdp2 vs trl: step time x{trl_row['seconds_per_step'] / ours['seconds_per_step']:.2f} faster, "
          f"peak memory x{ours['peak_added_mib'] / trl_row['peak_added_mib']:.2f}")
    out = harness.write_results("grpo", argv, args={k: v for k, v in vars(args).items() if k != "worker"}, rows=rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
