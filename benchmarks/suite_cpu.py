"""Where the test suite's CPU goes, per test: a pytest plugin and its summary (the CI time budget, issue 50/52).

On 2 cores the suite is CPU-bound (xdist keeps both busy), so its wall time follows the CPU seconds its tests
spend, nearly all of it in the processes they launch (`accelerate launch`, torchrun: an interpreter's imports
are 4-7 CPU-s each). Timings under xdist mix two tests' contention; CPU seconds do not.

    PYTHONPATH=benchmarks python -m pytest -q -n 2 -p suite_cpu        # writes $SUITE_CPU_OUT (one line a test)
    python benchmarks/suite_cpu.py summarize FILE --out RESULT.json    # totals by file, the costliest tests

A test's CPU: this process's and its waited-for children's (`getrusage`): launched commands are counted; ranks
forked by tests/dist_harness.py's fork server are not (they are the fork server's children, never waited for by
the test): tests that only fork ranks (test_compiled_collectives, test_architectures, ...) show their wall time
only.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import time

OUT = os.environ.get("SUITE_CPU_OUT", "suite_cpu.jsonl")


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


try:
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        own0, children0 = _cpu()
        start = time.monotonic()
        yield
        own1, children1 = _cpu()
        with open(OUT, "a") as f:
            f.write(json.dumps({"id": item.nodeid, "self": round(own1 - own0, 2),
                                "children": round(children1 - children0, 2),
                                "wall": round(time.monotonic() - start, 2)}) + "\n")
except ImportError:  # summarize needs no pytest
    pass


def summarize(path: str) -> dict:
    rows = [json.loads(line) for line in open(path)]
    cpu = lambda r: r["self"] + r["children"]  # noqa: E731
    by_file = collections.Counter()
    for row in rows:
        by_file[row["id"].split("::")[0]] += cpu(row)
    return {"tests": len(rows), "cpu_s": round(sum(map(cpu, rows)), 1),
            "launched_cpu_s": round(sum(r["children"] for r in rows), 1),
            "by_file": {f: round(v, 1) for f, v in by_file.most_common()},
            "costliest": [{"test": r["id"], "cpu_s": round(cpu(r), 1), "wall_s": r["wall"]}
                          for r in sorted(rows, key=cpu, reverse=True)[:40]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("summarize")
    cmd.add_argument("path")
    cmd.add_argument("--out")
    args = parser.parse_args()
    result = summarize(args.path)
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text[:3000])


if __name__ == "__main__":
    main()
