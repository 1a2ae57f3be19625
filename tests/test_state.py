"""Training state: elastic resume across world sizes, atomic commits, crashes, rotation."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from hf_fsdp2 import FSDP2Config, save_pretrained, shard_model
from hf_fsdp2.checkpoint.safetensors_io import CheckpointError
from hf_fsdp2.checkpoint.state import latest_state, list_states, load_state, read_manifest, save_state

from .common import batches, build_model, global_mean, local_rows, lora, optimizer, trained_one_step
from .dist_harness import run_ranks

TOTAL, SPLIT = 5, 3


def _scheduler(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _train_single(model, opt, sched, data) -> list[float]:
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _reference_losses(use_lora: bool) -> list[float]:
    model = lora(build_model()) if use_lora else build_model()
    opt = optimizer(model)
    return _train_single(model, opt, _scheduler(opt), batches(TOTAL))


def _train_phase(rank, world, directory, use_lora, phase):
    """Phase 0 trains steps [0, SPLIT) and saves; phase 1 builds a *different* model, resumes, finishes."""
    # A LoRA state holds only the adapter: resume on the same base model, with other adapter values.
    model = build_model(seed=0 if phase == 0 or use_lora else 123)
    if use_lora:
        model = lora(model, seed=0 if phase == 0 else 123)
    shard_model(model, FSDP2Config(replicate_size=2 if world == 4 and phase == 1 else 1))
    opt = optimizer(model)
    sched = _scheduler(opt)
    data = batches(TOTAL)
    start = 0
    if phase == 1:
        start, extra = load_state(directory, model, opt, sched)
        assert extra == {"note": "phase 0", "world": 4 if world == 2 else 2}
    losses = []
    for step in range(start, SPLIT if phase == 0 else TOTAL):
        ids = local_rows(data[step], rank, world)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(global_mean(loss))
    if phase == 0:
        save_state(directory, model, opt, sched, step=SPLIT, extra={"note": "phase 0", "world": world})
    return {"losses": losses, "lr": opt.param_groups[0]["lr"]}


@pytest.mark.parametrize("before, after, use_lora", [(4, 2, False), (2, 4, False), (2, 1, True)])
def test_elastic_resume_continues_like_an_uninterrupted_run(tmp_path, before, after, use_lora):
    reference = _reference_losses(use_lora)
    state_dir = str(tmp_path / "step-3")
    first = run_ranks(_train_phase, before, state_dir, use_lora, 0)
    assert first[0]["losses"] == pytest.approx(reference[:SPLIT], abs=1e-4)
    if after == 1:  # world size 1: a plain single process, no process group at all
        second = [_single_process_resume(state_dir, use_lora)]
    else:
        second = run_ranks(_train_phase, after, state_dir, use_lora, 1)
    assert second[0]["losses"] == pytest.approx(reference[SPLIT:], abs=1e-4)
    manifest = read_manifest(state_dir)
    assert manifest["world_size"] == before and manifest["step"] == SPLIT
    weights = "adapter_model.safetensors" if use_lora else "model.safetensors"
    assert (Path(state_dir) / weights).exists()
    assert not list(Path(state_dir).rglob("*.pt")) and not list(Path(state_dir).rglob("*.bin"))


def _single_process_resume(state_dir, use_lora):
    model = lora(build_model(seed=0), seed=123) if use_lora else build_model(seed=123)
    opt = optimizer(model)
    sched = _scheduler(opt)
    start, _ = load_state(state_dir, model, opt, sched)
    return {"losses": _train_single(model, opt, sched, batches(TOTAL)[start:])}


# ---------------------------------------------------------------------------------------------


def test_incomplete_directory_is_refused_and_never_latest(tmp_path):
    model = build_model()
    opt = optimizer(model)
    save_state(tmp_path / "step-1", model, opt, step=1)
    partial = tmp_path / "step-9"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"partial")
    with pytest.raises(CheckpointError, match="step-9: incomplete training state"):
        load_state(partial, model, opt)
    assert latest_state(tmp_path) == tmp_path / "step-1"


def test_rotation_keeps_last_n_and_extra_must_be_json(tmp_path):
    model = build_model()
    opt = optimizer(model)
    for step in (1, 2, 3, 4):
        save_state(tmp_path / f"step-{step}", model, opt, step=step, keep_last=2)
    assert [p.name for _, p in list_states(tmp_path)] == ["step-3", "step-4"]
    with pytest.raises(TypeError, match="`extra` is not JSON-serialisable"):
        save_state(tmp_path / "step-5", model, opt, step=5, extra={"x": object()})
    assert not (tmp_path / "step-5").exists()
    assert json.loads((tmp_path / "step-4" / "COMPLETE.json").read_text())["step"] == 4


def test_state_weights_load_with_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    model = build_model()
    save_state(tmp_path / "s", model, optimizer(model), step=0)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "s")
    for (n, a), (_, b) in zip(model.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), n


def test_state_without_fsync_loads_and_syncs_nothing(tmp_path, monkeypatch):
    import os

    model = build_model()
    opt = optimizer(model)
    calls = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real_fsync(fd))[1])
    save_state(tmp_path / "step-1", model, opt, step=1, durable=False)
    assert calls == []
    save_state(tmp_path / "step-2", model, opt, step=2)
    assert len(calls) >= 4  # weights, optimizer, JSON files, directories
    assert load_state(tmp_path / "step-1", model, opt)[0] == 1
    assert latest_state(tmp_path) == tmp_path / "step-2"


def _eval_then_save_worker(rank, world, root):
    """Issue: save_state after an evaluation forward (no backward) found unsharded parameters."""
    model, opt = trained_one_step(rank, world)
    ids = local_rows(batches(1)[0], rank, world)
    opt.zero_grad()
    model.eval()
    with torch.no_grad():
        model(input_ids=ids, labels=ids)
    save_state(os.path.join(root, "state"), model, opt, step=1)
    save_pretrained(model, os.path.join(root, "model"))
    model.train()
    step, _ = load_state(os.path.join(root, "state"), model, opt)
    model(input_ids=ids, labels=ids).loss.backward()  # trains on after the reload
    opt.step()
    return step


def test_save_and_load_after_an_evaluation_forward(tmp_path):
    assert run_ranks(_eval_then_save_worker, 2, str(tmp_path)) == [1, 1]


def test_state_format_id_is_stable(tmp_path):
    """The manifest's format id is an on-disk contract: states written by earlier releases carry
    "hf_fsdp2.state/1" and must stay loadable, whatever the module is called."""
    model = build_model()
    save_state(tmp_path / "s", model, optimizer(model), step=1)
    manifest = json.loads((tmp_path / "s" / "hf_fsdp2_state.json").read_text())
    assert manifest["format"] == "hf_fsdp2.state/1"
    assert json.loads((tmp_path / "s" / "COMPLETE.json").read_text())["format"] == "hf_fsdp2.state/1"
