"""Where the test suite's CPU goes, per test: a pytest plugin and its summary (the CI time budget, issue 50/52).

On 2 cores the suite is CPU-bound (xdist keeps both busy), so its wall time follows the CPU seconds its tests
spend, nearly all of it in the processes they launch (`accelerate launch`, torchrun: an interpreter's imports
are 4-7 CPU-s each). Timings under xdist mix two tests' contention; CPU seconds do not.

    PYTHONPATH=benchmarks python -m pytest -q -n 2 -p suite_cpu        # writes $SUITE_CPU_OUT (one line a test)
    python benchmarks/suite_cpu.py summarize FILE --out RESULT.json    # totals by file, the costliest tests

A test's CPU: this process's and its waited-for children's (`getrusage`: launched commands), and the fork
server's (tests/dist_harness.py: the ranks it forks are its children, reaped by it, never by the test; read from
/proc/PID/stat: its own and its reaped children's time). The fork server's start-up (its imports, once per xdist
worker) counts against the test that first forks ranks.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import time

OUT = os.environ.get("SUITE_CPU_OUT", "suite_cpu.jsonl")


def _cpu() -> tuple[float, float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime, _forkserver_cpu()


def _forkserver_cpu() -> float:
    """The fork server's CPU and its reaped children's (utime, stime, cutime, cstime of /proc/PID/stat), 0 before
    it starts. Its pid is multiprocessing's private `_forkserver_pid` (a benchmark's reading, not the package's)."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name: field 3 (state) first
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # fields 14-17


try:
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        own0, children0, forked0 = _cpu()
        start = time.monotonic()
        yield
        own1, children1, forked1 = _cpu()
        with open(OUT, "a") as f:
            f.write(json.dumps({"id": item.nodeid, "self": round(own1 - own0, 2),
                                "children": round(children1 - children0, 2), "forked": round(forked1 - forked0, 2),
                                "wall": round(time.monotonic() - start, 2)}) + "\n")
except ImportError:  # summarize needs no pytest
    pass


def summarize(path: str) -> dict:
    rows = [json.loads(line) for line in open(path)]
    cpu = lambda r: r["self"] + r["children"] + r.get("forked", 0.0)  # noqa: E731
    by_file = collections.Counter()
    for row in rows:
        by_file[row["id"].split("::")[0]] += cpu(row)
    return {"tests": len(rows), "cpu_s": round(sum(map(cpu, rows)), 1),
            "launched_cpu_s": round(sum(r["children"] for r in rows), 1),
            "forked_cpu_s": round(sum(r.get("forked", 0.0) for r in rows), 1),
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
