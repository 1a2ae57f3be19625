"""Stress the interpreter exit of real `accelerate launch` jobs (issue: SIGABRT at exit after gloo).

Runs `tests/scripts/exit_endings.py` on 2 CPU processes (gloo) many times for each ending (a user's
all-reduce, `get_state_dict`, `save_state`, `save_model`), alternating runs with and without
`accelerator.end_training()`, and counts exits: clean, aborted (-6 / SIGABRT on a rank), other.

    python benchmarks/exit_stress.py --runs 50              # with hf_fsdp2's exit guard (default)
    python benchmarks/exit_stress.py --runs 20 --no-guard   # the same without it (before the fix)
    python benchmarks/exit_stress.py --jobs 2               # two launches at a time (more contention)
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "exit_endings.py"
CONFIG = ROOT / "accelerate_configs" / "fsdp2.yaml"
ENDINGS = ("get_state_dict", "all_reduce", "save_state", "save_model")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(ending: str, end_training: bool, guard: bool) -> tuple[str, str]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG),
               "--num_processes", "2", "--main_process_port", str(free_port()), str(SCRIPT),
               "--ending", ending, "--out", out]
        cmd += ["--end-training"] * end_training + ["--no-guard"] * (not guard)
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    log = proc.stdout + proc.stderr
    if proc.returncode == 0:
        return "clean", ""
    log = f"$ {' '.join(cmd)}\n{log}"
    aborted = "terminate called without an active exception" in log or "exitcode  : -6" in log or "SIGABRT" in log
    return ("aborted" if aborted else "other"), log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50, help="launches per ending")
    parser.add_argument("--endings", nargs="+", default=list(ENDINGS), choices=ENDINGS)
    parser.add_argument("--no-guard", action="store_true", help="take the exit guard off (before the fix)")
    parser.add_argument("--jobs", type=int, default=1, help="launches at a time")
    parser.add_argument("--json", type=Path, help="write the counts here")
    parser.add_argument("--failure-log", type=Path, help="append the full log of every failed launch here")
    args = parser.parse_args()
    plan = [(ending, run % 2 == 1) for ending in args.endings for run in range(args.runs)]
    counts = {f"{e}{'+end_training' if t else ''}": {"clean": 0, "aborted": 0, "other": 0}
              for e in args.endings for t in (False, True)}
    start = time.time()
    with cf.ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(launch, e, t, not args.no_guard): (e, t) for e, t in plan}
        for done, future in enumerate(cf.as_completed(futures), 1):
            ending, end_training = futures[future]
            outcome, log = future.result()
            counts[f"{ending}{'+end_training' if end_training else ''}"][outcome] += 1
            if outcome == "other":
                print(f"unexpected failure ({ending}):\n{log[-2000:]}", file=sys.stderr)
            if log and args.failure_log:
                with args.failure_log.open("a") as f:
                    f.write(f"===== {outcome} ({ending}) =====\n{log}\n")
            print(f"\r{done}/{len(plan)} launches, {time.time() - start:.0f} s", end="", file=sys.stderr)
    print(file=sys.stderr)
    guard = "without the exit guard" if args.no_guard else "with the exit guard"
    print(f"{len(plan)} launches {guard}, 2 CPU processes each, {time.time() - start:.0f} s")
    print(f"{'ending':<30} {'clean':>6} {'aborted':>8} {'other':>6}")
    for name, c in counts.items():
        print(f"{name:<30} {c['clean']:>6} {c['aborted']:>8} {c['other']:>6}")
    total = {k: sum(c[k] for c in counts.values()) for k in ("clean", "aborted", "other")}
    print(f"{'total':<30} {total['clean']:>6} {total['aborted']:>8} {total['other']:>6}")
    if args.json:
        args.json.write_text(json.dumps({"guard": not args.no_guard, "counts": counts, "total": total}, indent=1))
    sys.exit(1 if total["other"] or (total["aborted"] and not args.no_guard) else 0)


if __name__ == "__main__":
    main()
