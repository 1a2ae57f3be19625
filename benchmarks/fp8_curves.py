"""FP8 with FP8 all-gather against bf16: the example's loss curves, side by side.

    python benchmarks/fp8_curves.py [--steps 300] [--processes 2]

Runs the README's main job (`examples/finetune.py` under `accelerate launch --config_file
accelerate_configs/fsdp2.yaml`) twice with the same seed, data and schedule, both with
`--mixed_precision bf16`: once as is, once with `--fp8` (FSDP2Config(fp8=True): the decoder layers'
linears in torchao float8, their weights all-gathered in float8). Each run logs its per-step loss
(`--loss-log`); this prints both curves every `--every` steps, the largest and the mean absolute
difference over the last quarter, both final validation losses, and writes
benchmarks/results/fp8_curves_<time>.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def run(steps: int, processes: int, fp8: bool, work: Path) -> dict:
    name = "fp8" if fp8 else "bf16"
    log = work / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "accelerate_configs" / "fsdp2.yaml"), "--num_processes", str(processes),
           "--mixed_precision", "bf16", str(REPO / "examples" / "finetune.py"), "--max-steps", str(steps),
           "--output-dir", str(work / name), "--loss-log", str(log), *(["--fp8"] if fp8 else [])]
    tic = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise SystemExit(f"{name} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    validation = re.search(r"validation loss (\S+) -> (\S+)", proc.stdout)
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    return {"losses": losses, "validation": [float(validation.group(1)), float(validation.group(2))],
            "seconds": time.perf_counter() - tic}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--every", type=int, default=25, help="print the curves every N steps")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bf16 = run(args.steps, args.processes, False, Path(tmp))
        fp8 = run(args.steps, args.processes, True, Path(tmp))
    print(f"the example, {args.steps} steps on {args.processes} processes, mixed_precision bf16; fp8 = + --fp8")
    print(f"{'step':>6} {'bf16':>8} {'fp8':>8} {'diff':>8}")
    for i in range(0, args.steps, args.every):
        print(f"{i + 1:>6} {bf16['losses'][i]:8.4f} {fp8['losses'][i]:8.4f} {fp8['losses'][i] - bf16['losses'][i]:+8.4f}")
    diffs = [abs(a - b) for a, b in zip(fp8["losses"], bf16["losses"])]
    tail = diffs[-max(1, len(diffs) // 4):]
    summary = {"max_abs_diff": max(diffs), "mean_abs_diff_last_quarter": sum(tail) / len(tail),
               "final_validation": {"bf16": bf16["validation"][1], "fp8": fp8["validation"][1]},
               "seconds": {"bf16": bf16["seconds"], "fp8": fp8["seconds"]}}
    print(f"max |fp8 - bf16| = {summary['max_abs_diff']:.4f}; mean over the last quarter "
          f"{summary['mean_abs_diff_last_quarter']:.4f}; validation loss {bf16['validation'][0]:.4f} -> "
          f"bf16 {bf16['validation'][1]:.4f}, fp8 {fp8['validation'][1]:.4f}; wall {bf16['seconds']:.0f} s / "
          f"{fp8['seconds']:.0f} s")
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = RESULTS / f"fp8_curves_{stamp}.json"
    out.write_text(json.dumps({"args": vars(args), "bf16": bf16, "fp8": fp8, "summary": summary}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        plt.figure(figsize=(7, 4))
        plt.plot(range(1, len(bf16["losses"]) + 1), bf16["losses"], label="bf16")
        plt.plot(range(1, len(fp8["losses"]) + 1), fp8["losses"], label="fp8 (FP8 all-gather)")
        plt.xlabel("step")
        plt.ylabel("train loss")
        plt.legend()
        plt.tight_layout()
        plt.savefig(out.with_suffix(".png"), dpi=100)
    except ImportError:
        pass
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
