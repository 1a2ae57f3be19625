"""Faults: ranks killed mid-save, disks that fail, ranks that never reach a collective."""

from __future__ import annotations

import errno
import os
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest

from hf_fsdp2.checkpoint.safetensors_io import CheckpointError
from hf_fsdp2.checkpoint.state import latest_state, list_states, load_state, save_state

from .common import build_model, optimizer, trained_one_step
from .dist_harness import run_ranks_collecting_errors


_trained = trained_one_step


def _kill_worker(rank, world, root, point, target):
    """Save a good state, then SIGKILL one rank at `point` of a second save into `target`."""
    import hf_fsdp2.checkpoint.state as state_module
    from hf_fsdp2.checkpoint.safetensors_io import FileWriter

    model, opt = _trained(rank, world)
    save_state(os.path.join(root, "step-1"), model, opt, step=1)
    calls = {"n": 0}

    def die_on(owner, name, rank_to_die, nth, match=lambda *a: True):
        original = getattr(owner, name)

        def dying(*args, **kwargs):
            if rank == rank_to_die and match(*args):
                calls["n"] += 1
                if calls["n"] == nth:
                    os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)

        setattr(owner, name, dying)

    if point == "before":  # staging exists, no byte written yet
        die_on(FileWriter, "__init__", 1, 1)
    elif point == "during":  # some rows written, others not
        die_on(FileWriter, "write_rows", 1, 3)
    elif point == "after":  # every rank's data is written; rank 0 dies writing the completion marker
        die_on(state_module, "write_json", 0, 1, match=lambda path, obj: str(path).endswith("COMPLETE.json"))
    start = time.monotonic()
    try:
        save_state(os.path.join(root, target), model, opt, step=2)
    except Exception as e:  # the survivor learns that its peer is gone
        return {"error": f"{type(e).__name__}: {e}"[:300], "seconds": time.monotonic() - start}
    return {"error": None}


@pytest.mark.parametrize("point, target", [("before", "step-2"), ("during", "step-2"), ("after", "step-2"),
                                           ("during", "step-1")])
def test_rank_killed_during_save_state(tmp_path, point, target):
    out, errors = run_ranks_collecting_errors(_kill_worker, 2, str(tmp_path), point, target, timeout=180)
    dead = 0 if point == "after" else 1
    assert f"exited with code {-signal.SIGKILL}" in errors[dead]
    survivor = out[1 - dead]
    assert survivor["error"] is not None and survivor["seconds"] < 60  # an error, not a hang
    # The last complete checkpoint loads; the partial one is never listed, picked, or loadable.
    assert [p.name for _, p in list_states(tmp_path)] == ["step-1"]
    assert latest_state(tmp_path) == tmp_path / "step-1"
    model = build_model(seed=9)
    opt = optimizer(model)
    assert load_state(tmp_path / "step-1", model, opt)[0] == 1
    if target == "step-2":
        with pytest.raises(CheckpointError, match="step-2"):
            load_state(tmp_path / "step-2", model, opt)
    # The next save repairs the leftovers and succeeds.
    fresh = build_model()
    save_state(tmp_path / target, fresh, optimizer(fresh), step=2)
    assert latest_state(tmp_path) == tmp_path / "step-2" or target == "step-1"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# ---------------------------------------------------------------------------------------------


def _disk_full_worker(rank, world, root, limit, blocking=True):
    model, opt = _trained(rank, world)
    save_state(os.path.join(root, "step-1"), model, opt, step=1)
    if limit and rank == 1:
        # A real write failure from the kernel: writes past `limit` bytes fail with EFBIG.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    start = time.monotonic()
    try:
        handle = save_state(os.path.join(root, "step-1"), model, opt, step=2,  # overwrite: must not touch step-1
                            blocking=blocking)
        if not blocking:
            handle.wait()  # the disk fills in the background; the error comes back here, on every rank
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start}
    return {"error": None}


def test_write_failure_on_one_rank_fails_every_rank_and_keeps_the_previous_state(tmp_path):
    out, errors = run_ranks_collecting_errors(_disk_full_worker, 2, str(tmp_path), 4096, timeout=180)
    assert not errors, errors
    assert "File too large" in out[1]["error"] and str(tmp_path) in out[1]["error"]
    assert out[0]["error"].startswith("RuntimeError: another rank failed while saving state")
    assert "File too large" in out[0]["error"]
    assert all(r["seconds"] < 60 for r in out.values())
    model = build_model(seed=9)
    assert load_state(tmp_path / "step-1", model, optimizer(model))[0] == 1  # the previous state, untouched
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if shutil.which("mount") is None or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2500k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root); the RLIMIT_FSIZE test covers write failures")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_disk_full_on_a_real_small_tmpfs(tiny_tmpfs, blocking):
    # One state (0.5 MB of fp32 weights + 1 MB of Adam moments) fits in 2.5 MB; two do not.
    out, errors = run_ranks_collecting_errors(_disk_full_worker, 2, str(tiny_tmpfs), 0, blocking, timeout=180)
    assert not errors, errors
    assert all(r["error"] is not None and r["seconds"] < 60 for r in out.values()), out
    assert any(os.strerror(errno.ENOSPC) in r["error"] for r in out.values()), out
    model = build_model(seed=9)
    assert load_state(tiny_tmpfs / "step-1", model, optimizer(model))[0] == 1


# ---------------------------------------------------------------------------------------------


def _stuck_peer_worker(rank, world):
    import torch
    import torch.distributed as dist

    if rank == 1:
        time.sleep(15)  # raised and handled its error elsewhere: never joins the collective
        return {"seconds": None}
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as e:
        return {"seconds": time.monotonic() - start, "error": type(e).__name__}
    return {"seconds": None}


def test_a_peer_that_never_arrives_times_out_instead_of_hanging():
    # `timeout` of init_distributed / torch.distributed.init_process_group bounds every collective.
    out, errors = run_ranks_collecting_errors(_stuck_peer_worker, 2, timeout=120, pg_timeout=5)
    assert 0 in out and out[0]["seconds"] is not None, (out, errors)
    assert 4 < out[0]["seconds"] < 15


# ---------------------------------------------------------------------------------------------


def _torchrun_restart(tmp, name, crash_at):
    from pathlib import Path

    from .dist_harness import run_launched, torchrun

    root = Path(__file__).resolve().parents[1]
    log = tmp / f"{name}.jsonl"
    cmd = torchrun(2, "--max-restarts", "1") + [
        str(root / "tests" / "scripts" / "restart_train.py"), "--root", str(tmp / name), "--loss-file", str(log),
        "--crash-at-step", str(crash_at)]
    run_launched(cmd, cwd=root)
    import json

    records = [json.loads(line) for line in log.read_text().splitlines()]
    final = {}
    for r in records:  # a re-run step after the restart replaces the first attempt's record
        final[r["step"]] = r["loss"]
    return records, [final[s] for s in sorted(final)]


def test_torchrun_restart_resumes_from_latest_complete_checkpoint(tmp_path):
    records, resumed = _torchrun_restart(tmp_path, "crashy", crash_at=3)
    assert {r["attempt"] for r in records} == {0, 1}  # rank 1 died and the job restarted
    assert [r["step"] for r in records if r["attempt"] == 1][0] == 3  # resumed after step-2's checkpoint
    _, whole = _torchrun_restart(tmp_path, "whole", crash_at=0)
    assert len(resumed) == len(whole) == 6
    assert resumed == pytest.approx(whole, abs=1e-4)


# ---------------------------------------------------------------------------------------------


def test_adapter_whose_target_modules_match_nothing_in_the_model(tmp_path):
    """An adapter saved for other modules: one error naming the file and every key on both sides."""
    import hf_fsdp2

    from .common import lora

    lora(build_model(), target_modules=["k_proj"]).save_pretrained(tmp_path / "adapter")
    model = lora(build_model(), target_modules=["q_proj"])
    with pytest.raises(CheckpointError) as info:
        hf_fsdp2.load_pretrained(model, tmp_path / "adapter")
    message = str(info.value)
    assert str(tmp_path / "adapter") in message
    assert "missing keys (6)" in message and "q_proj.lora_A.weight" in message
    assert "unexpected keys (6)" in message and "k_proj.lora_A.weight" in message


def test_unsupported_accelerate_version_is_refused_with_the_working_range(monkeypatch):
    import hf_fsdp2
    from hf_fsdp2.integrations import accelerate as backend
    from hf_fsdp2.runtime import versions

    real = versions.installed
    monkeypatch.setattr(versions, "installed", lambda p: "0.34.2" if p == "accelerate" else real(p))
    with pytest.raises(RuntimeError, match=r"accelerate 0\.34\.2 is installed \(supported: accelerate>=1\.11 \(tested up to 1\.15\)\)"):
        hf_fsdp2.register()
    assert not backend.is_registered()


def test_versions_outside_the_supported_range_are_named_in_one_line():
    from hf_fsdp2.runtime import versions

    good = {"torch": "2.13.0+cpu", "transformers": "5.6.0", "accelerate": "1.11.0", "peft": "0.18.1"}
    versions.check(good)
    versions.check({**good, "transformers": "5.23.0", "peft": "0.21.2", "accelerate": "1.15.0"})
    for package, bad in [("torch", "2.6.0"), ("transformers", "4.57.6"), ("transformers", "5.5.4"),
                         ("peft", "0.17.1"), ("accelerate", "1.10.1"), ("peft", None)]:
        with pytest.raises(RuntimeError) as info:
            versions.check({**good, package: bad})
        message = str(info.value)
        assert "\n" not in message and package in message and (bad or "not installed") in message, message


def test_newer_releases_than_tested_warn_once_and_are_not_refused(monkeypatch):
    """A plugin that refuses the release its users just upgraded to stops their training: newer
    versions warn once (tests/test_upstream_contracts.py decides whether they still fit)."""
    from hf_fsdp2.runtime import versions

    good = {"torch": "2.16.0", "transformers": "6.0.0", "accelerate": "1.16.0", "peft": "0.21.2"}
    monkeypatch.setattr(versions, "_warned", False)
    with pytest.warns(UserWarning, match=r"not been tested with torch 2\.16\.0 .*transformers 6\.0\.0 .*accelerate 1\.16\.0"):
        versions.check(good)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.check(good)  # once


def test_import_refuses_an_unsupported_version(tmp_path):
    """A real import in a fresh interpreter, with an old peft's metadata first on the path."""
    dist = tmp_path / "peft-0.17.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: peft\nVersion: 0.17.1\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", "import hf_fsdp2"], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: hf_fsdp2 does not support the installed versions: peft 0.17.1 is installed "
                           "(supported: peft>=0.18 (tested up to 0.21))"), result.stderr


@pytest.mark.parametrize("seed, blocking", [(3, True), (20, True), (2, False), (15, False)])
def test_random_sigkill_during_saves_never_loses_the_last_complete_checkpoint(tmp_path, seed, blocking):
    """A few of `benchmarks/kill_stress.py`'s randomized trials (see tests/kill_trials.py); with
    blocking=False the kill lands in the staging or the background write and commit."""
    from .kill_trials import run_trial

    result = run_trial(tmp_path, seed, blocking)
    assert not result["unexpected_errors"], result
