"""Randomized SIGKILL trials: one of 2 gloo ranks killed at a random moment while overwriting a
model (`save_pretrained`) and saving a training state (`save_state`); after each, the last complete
checkpoint must load bit-exact and `latest_state` must never return a partial one
(`tests/kill_trials.py` has the trial and its checks).

    python benchmarks/kill_stress.py --trials 20
    python benchmarks/kill_stress.py --trials 20 --async   # the saves with blocking=False
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.kill_trials import run_trial  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--first-seed", type=int, default=1000)
    parser.add_argument("--async", dest="asynchronous", action="store_true",
                        help="save with blocking=False: kills land in the staging or the background commit")
    args = parser.parse_args()
    seen = collections.Counter()
    start = time.time()
    failures = 0
    for seed in range(args.first_seed, args.first_seed + args.trials):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                r = run_trial(Path(tmp), seed, blocking=not args.asynchronous)
            except AssertionError as e:
                failures += 1
                print(f"FAIL {e}")
                continue
        seen[(r["killed"], r["model"], r["latest_state"])] += 1
        print(f"seed {seed}: killed={r['killed']} model={r['model']} latest_state={r['latest_state']}"
              f"{' unexpected: ' + str(r['unexpected_errors']) if r['unexpected_errors'] else ''}", flush=True)
    print(f"{args.trials} trials in {time.time() - start:.0f} s, {failures} lost or mixed checkpoints")
    for (killed, model, latest), n in sorted(seen.items()):
        print(f"  killed={killed!s:<5} model/={model} latest_state={latest}: {n}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
