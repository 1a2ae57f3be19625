"""Asynchronous saves (`blocking=False`): what is written is the state at the call, training goes on
meanwhile, failures surface on every rank, and the process never ends before a pending save."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from hf_fsdp2 import save_pretrained, shard_model
from hf_fsdp2.checkpoint.state import latest_state, load_state, save_state

from .common import build_model, optimizer, saved_tensors, train_step
from .dist_harness import run_ranks

ROOT = Path(__file__).resolve().parents[1]


def _async_worker(rank, world, root):
    import torch.distributed as dist

    root = Path(root)
    model = build_model()
    shard_model(model)
    opt = optimizer(model)
    train_step(model, opt, rank, world, seed=1)
    save_pretrained(model, root / "sync-model", durable=False)
    save_state(root / "sync-state", model, opt, step=1, durable=False)
    model_handle = save_pretrained(model, root / "async-model", blocking=False)
    state_handle = save_state(root / "states" / "step-1", model, opt, step=1, blocking=False)  # waits for the first
    train_step(model, opt, rank, world, seed=2)  # training goes on while the state is written
    out = {"model_done": model_handle.done(), "state_path": str(state_handle.wait())}
    # The same weights restored from the asynchronous state as from the blocking one.
    fresh = build_model(seed=7)
    shard_model(fresh)
    load_state(root / "states" / "step-1", fresh, optimizer(fresh))
    # A background failure (the target is a file) is raised on every rank by wait() ...
    if rank == 0:
        (root / "states" / "step-2").write_text("not a directory")
    dist.barrier()
    handle = save_state(root / "states" / "step-2", model, opt, step=2, blocking=False)
    try:
        handle.wait()
        out["wait_error"] = None
    except Exception as e:  # noqa: BLE001
        out["wait_error"] = type(e).__name__
    # ... and, when nobody waited, by the next save; the last complete state stays the latest.
    save_state(root / "states" / "step-3", model, opt, step=3, blocking=False)
    dist.barrier()
    if rank == 0:
        (root / "states" / "step-4").write_text("not a directory")
    try:
        save_state(root / "states" / "step-4", model, opt, step=4, blocking=False)
        save_pretrained(model, root / "after", blocking=False)
        out["next_save_error"] = None
    except Exception as e:  # noqa: BLE001
        out["next_save_error"] = type(e).__name__
    out["latest"] = latest_state(root / "states").name
    return out


def test_async_save_writes_the_state_at_the_call_and_surfaces_failures_everywhere(tmp_path):
    outs = run_ranks(_async_worker, 2, str(tmp_path))
    assert all(o["state_path"] == str(tmp_path / "states" / "step-1") for o in outs)
    assert all(o["model_done"] for o in outs)  # the second save waited for the first
    sync_model, async_model = saved_tensors(tmp_path / "sync-model"), saved_tensors(tmp_path / "async-model")
    assert sync_model.keys() == async_model.keys() and all(torch.equal(sync_model[k], async_model[k]) for k in sync_model)
    sync_state, async_state = saved_tensors(tmp_path / "sync-state"), saved_tensors(tmp_path / "states" / "step-1")
    assert all(torch.equal(sync_state[k], async_state[k]) for k in sync_state)
    sync_opt = saved_tensors(tmp_path / "sync-state", "optimizer.safetensors")
    async_opt = saved_tensors(tmp_path / "states" / "step-1", "optimizer.safetensors")
    assert sync_opt.keys() == async_opt.keys() and all(torch.equal(sync_opt[k], async_opt[k]) for k in sync_opt)
    assert [o["wait_error"] for o in outs][0] == "NotADirectoryError"
    assert all(o["wait_error"] for o in outs)  # the other rank learns of it too
    assert all(o["next_save_error"] for o in outs)
    assert all(o["latest"] == "step-3" for o in outs)
    assert (tmp_path / "states" / "step-4").read_text() == "not a directory"  # nothing of ours lost either


EXIT_SCRIPT = """
import sys, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
from tests.common import build_model
from hf_fsdp2 import save_pretrained, shard_model
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
model = build_model()
shard_model(model)
target = {target!r}
if target.endswith("file"):
    open(target, "w").write("x")
save_pretrained(model, target, blocking=False)
print("returned", flush=True)
"""


def test_process_waits_for_a_pending_save_at_exit_and_fails_loudly(tmp_path):
    from .dist_harness import free_port

    for target, code in ((tmp_path / "model", 0), (tmp_path / "file", 1)):
        proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT.format(root=str(ROOT), port=free_port(),
                                                                        target=str(target))],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == code, proc.stderr[-2000:]
        assert "returned" in proc.stdout
        if code == 0:
            from transformers import AutoModelForCausalLM

            AutoModelForCausalLM.from_pretrained(target)  # committed before the process ended
        else:
            assert "the background save of" in proc.stderr and "NotADirectoryError" in proc.stderr, proc.stderr
