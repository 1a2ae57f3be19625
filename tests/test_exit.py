"""Every process exits cleanly after gloo collectives (hf_fsdp2/runtime/exit_guard.py).

Many short process-group lifetimes, each a forked child that ends right after a collective whose
tensor gloo's worker thread still holds: without the guard most of them abort at interpreter exit
(SIGABRT, "terminate called without an active exception"), with it none may.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# The parent imports torch and hf_fsdp2 once and forks; each child is one process-group lifetime.
# `sys.setswitchinterval(100)` keeps the GIL with the main thread until it blocks, and the loop stops
# at a collective whose tensor the gloo worker has not released yet: the race a script ending right
# after a save, a `get_state_dict` or a user's `reduce` loses now and then, made likely.
CHILDREN = r"""
import json, os, sys
import torch, torch.distributed as dist
import hf_fsdp2

guard, trials, store = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if guard == "off":
    hf_fsdp2.runtime.exit_guard.uninstall()
codes, caught = [], 0
for trial in range(trials):
    pid = os.fork()
    if pid == 0:
        dist.init_process_group("gloo", init_method=f"file://{store}.{trial}", rank=0, world_size=1)
        group = dist.group.WORLD  # kept to the end, as a DeviceMesh or an FSDP module keeps it
        sys.setswitchinterval(100)
        for _ in range(20000):
            t = torch.ones(8)
            dist.all_reduce(t)
            if t._use_count() > 1:  # gloo's worker still holds it
                break
        else:
            os._exit(3)  # never caught the worker holding a tensor: the scenario did not happen
        if trial % 2:
            dist.destroy_process_group()  # as `accelerator.end_training()` does: not enough
        sys.exit(0)  # the interpreter finalizes as at the end of any script
    _, status = os.waitpid(pid, 0)
    codes.append(os.waitstatus_to_exitcode(status))
print(json.dumps(codes))
"""


def _exit_codes(guard: str, trials: int, tmp_path) -> list[int]:
    proc = subprocess.run([sys.executable, "-c", CHILDREN, guard, str(trials), str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    # 3: that child never caught gloo's worker holding a tensor (seen under heavy load: another job's
    # processes on the same 2 cores); most children must have run the scenario.
    assert codes.count(3) <= len(codes) // 4, f"the scenario did not run often enough: {codes}"
    return [c for c in codes if c != 3]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and /proc: Linux")
def test_no_abort_at_exit_after_a_collective_the_worker_still_holds(tmp_path):
    guarded = _exit_codes("on", 8, tmp_path)
    assert guarded == [0] * len(guarded), guarded
    # The same children without the guard abort: the scenario is the real one, and this test fails
    # without the fix (measured: 12 of 12 abort).
    unguarded = _exit_codes("off", 8, tmp_path)
    assert set(unguarded) <= {0, -6}, unguarded
    assert unguarded.count(-6) >= 1, unguarded
