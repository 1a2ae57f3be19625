"""Randomized SIGKILL trials (issue: nothing lost, ever), shared by `tests/test_faults.py` (a few
trials) and `benchmarks/kill_stress.py` (many).

One trial, on 2 gloo ranks: train, save a complete model (`model/`) and state (`states/step-1`),
train again, write reference copies of the new weights, then one random rank SIGKILLs itself at a
random moment while overwriting `model/` and saving `states/step-2` (with `blocking=False`, the
moment falls in the staging or in the background write and commit). Afterwards `model/` must be
exactly the old or exactly the new weights (every tensor, bit for bit), `latest_state` must return
a complete state whose weights are bit-exact and that `load_state` accepts, and the next save into
the same places must repair whatever the kill left.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import torch

from .common import build_model, optimizer, saved_tensors, train_step
from .dist_harness import run_ranks_collecting_errors


def _trial_worker(rank, world, root, seed, blocking=True):
    from hf_fsdp2 import save_pretrained, shard_model
    from hf_fsdp2.checkpoint.state import save_state

    root = Path(root)
    model = build_model()
    shard_model(model)
    opt = optimizer(model)
    train_step(model, opt, rank, world, seed=1)
    start = time.monotonic()
    save_pretrained(model, root / "model", durable=False)
    save_state(root / "states" / "step-1", model, opt, step=1, durable=False)
    save_pretrained(model, root / "ref-1", durable=False)
    took = time.monotonic() - start
    train_step(model, opt, rank, world, seed=2)
    save_pretrained(model, root / "ref-2", durable=False)
    rng = random.Random(seed)
    victim, delay = rng.randrange(world), rng.uniform(0, took * 1.5)  # the two saves below take ~2/3 of `took`
    if rank == victim:
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    first = save_pretrained(model, root / "model", durable=False, blocking=blocking)
    second = save_state(root / "states" / "step-2", model, opt, step=2, durable=False, blocking=blocking)
    if not blocking:
        train_step(model, opt, rank, world, seed=3)  # training goes on while the background commits
        assert first.done()  # the second save waited for the first
        second.wait()
    time.sleep(took * 1.5 if rank == victim else 0)  # the victim dies in here at the latest
    return "survived"


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run_trial(root: Path, seed: int, blocking: bool = True) -> dict:
    """One trial; returns what it found. Raises AssertionError if anything was lost or mixed."""
    from hf_fsdp2 import save_pretrained
    from hf_fsdp2.checkpoint.state import latest_state, load_state, save_state

    out, errors = run_ranks_collecting_errors(_trial_worker, 2, str(root), seed, blocking, timeout=180, pg_timeout=20)
    killed = any("exited with code -9" in e for e in errors.values())
    # With a rank killed, the survivor's collective fails (an error, expected); without one, none may.
    unexpected = [] if killed else list(errors.values())
    refs = {step: saved_tensors(root / f"ref-{step}") for step in (1, 2)}
    model_now = saved_tensors(root / "model")
    model_is = [step for step, ref in refs.items() if _same(model_now, ref)]
    assert len(model_is) == 1, f"seed {seed}: model/ is neither the old nor the new checkpoint"
    latest = latest_state(root / "states")
    assert latest is not None and latest.name in ("step-1", "step-2"), f"seed {seed}: latest_state {latest}"
    step = int(latest.name.split("-")[1])
    assert _same(saved_tensors(latest), refs[step]), f"seed {seed}: {latest} does not hold its weights bit for bit"
    fresh = build_model(seed=9)
    assert load_state(latest, fresh, optimizer(fresh))[0] == step
    # The next saves into the same places repair what the kill left.
    save_pretrained(fresh, root / "model")
    save_state(root / "states" / "step-2", fresh, optimizer(fresh), step=2)
    leftovers = [p.name for d in (root, root / "states") for p in d.iterdir() if p.name.startswith(".")]
    assert not leftovers, f"seed {seed}: leftovers after the repairing save: {leftovers}"
    assert latest_state(root / "states") == root / "states" / "step-2"
    return {"seed": seed, "killed": killed, "model": f"step-{model_is[0]}", "latest_state": latest.name,
            "unexpected_errors": unexpected[:1]}
