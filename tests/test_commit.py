"""Nothing on disk is lost: what a save replaces, the atomic swap, concurrent readers and writers,
symlinks, mount points, modes, and failures of any type (hf_fsdp2/checkpoint/atomic_dir.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import stat
import subprocess
import threading

import pytest
import torch

from hf_fsdp2.checkpoint import atomic_dir
from hf_fsdp2.checkpoint.atomic_dir import TargetBusyError, committed_directory, lock_path, staging_path
from hf_fsdp2.checkpoint.pretrained import save_pretrained
from hf_fsdp2.checkpoint.safetensors_io import CheckpointError, CheckpointFiles
from hf_fsdp2.checkpoint.state import latest_state, load_state, save_state

from .common import build_model, optimizer
from .dist_harness import run_ranks_collecting_errors

FOREIGN = {
    "model_ema.safetensors": b"ema weights",
    "model-best.safetensors": b"best weights",
    "adapter_model_old.safetensors": b"an old adapter",
    "README.md": b"# my model\n",
    "tokenizer.json": b"{}",
    "checkpoint-5/trainer_state.json": b'{"step": 5}',
}


def _plant(directory):
    for name, data in FOREIGN.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)


def _digest(directory):
    return {p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _no_leftovers(parent):
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


def test_save_pretrained_replaces_only_its_own_files(tmp_path):
    target = tmp_path / "ckpt"
    save_pretrained(build_model(), target, max_shard_size="100KB")  # a sharded save of ours first
    assert len(list(target.glob("model-*-of-*.safetensors"))) > 1
    _plant(target)
    before = {k: v for k, v in _digest(target).items() if k in FOREIGN}
    save_pretrained(build_model(seed=1), target)  # now one file: the old shards and index are ours to replace
    after = _digest(target)
    assert {k: after[k] for k in FOREIGN} == before
    assert not list(target.glob("model-*-of-*.safetensors")) and not (target / "model.safetensors.index.json").exists()
    assert sorted(p.name for p in target.iterdir()) == sorted(
        {"config.json", "generation_config.json", "model.safetensors", "checkpoint-5"} | {
            n for n in FOREIGN if "/" not in n})
    assert _no_leftovers(tmp_path) == []
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(target)
    torch.testing.assert_close(loaded.lm_head.weight, build_model(seed=1).lm_head.weight)


def test_save_state_keeps_files_of_others(tmp_path):
    model = build_model()
    opt = optimizer(model)
    target = tmp_path / "state"
    target.mkdir()
    _plant(target)
    before = _digest(target)
    save_state(target, model, opt, step=3)
    after = _digest(target)
    assert {k: after[k] for k in before} == before
    fresh = build_model(seed=5)
    assert load_state(target, fresh, optimizer(fresh))[0] == 3


def test_symlinked_target_is_written_through_and_modes_are_kept(tmp_path):
    real = tmp_path / "real"
    save_pretrained(build_model(), real)
    os.chmod(real, 0o700)
    for p in real.iterdir():
        os.chmod(p, 0o600)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    save_pretrained(build_model(seed=2), link)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert stat.S_IMODE(real.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in real.iterdir()} == {0o600}
    with CheckpointFiles(link) as files:
        torch.testing.assert_close(files.read("lm_head.weight"), build_model(seed=2).lm_head.weight)
    assert _no_leftovers(tmp_path) == []


def test_planted_links_at_our_names_are_refused_untouched(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    target = tmp_path / "ckpt"
    save_pretrained(build_model(), target)
    for planted in (staging_path(target), atomic_dir.old_path(target), lock_path(target)):
        planted.symlink_to(victim, target_is_directory=True)
        with pytest.raises(OSError, match="symbolic link|Too many levels"):
            save_pretrained(build_model(seed=1), target)
        assert planted.is_symlink() and (victim / "precious").read_text() == "keep me"
        assert CheckpointFiles(target).names()  # the previous checkpoint is intact
        planted.unlink()


def test_a_second_writer_is_refused_while_the_first_holds_the_target(tmp_path):
    target = tmp_path / "ckpt"
    save_pretrained(build_model(), target)
    with atomic_dir.target_lock(target.absolute()):
        with pytest.raises(TargetBusyError, match="being written by another job"):
            save_pretrained(build_model(seed=1), target)
    save_pretrained(build_model(seed=1), target)  # free again; the lock file is gone afterwards
    assert _no_leftovers(tmp_path) == []


def test_readers_always_find_one_complete_checkpoint_while_saves_swap_it(tmp_path):
    """Saves alternate two models; a reader thread opens the directory over and over. Every read
    sees a complete checkpoint whose config and weights belong together: never a missing target,
    never a mix (the swap is one `renameat2(RENAME_EXCHANGE)`; `CheckpointFiles` pins its files)."""
    target = tmp_path / "ckpt"
    models = {seed: build_model(seed=seed, num_hidden_layers=1) for seed in (1, 2)}
    # Detached copies: the reader thread must not touch the live parameters the saver reads (torch's
    # autograd takes a per-tensor mutex and then the GIL; a second thread doing the reverse deadlocks).
    expected = {seed: m.lm_head.weight[0, :4].detach().clone() for seed, m in models.items()}
    embeds = {seed: m.model.embed_tokens.weight[:1].detach().clone() for seed, m in models.items()}
    save_pretrained(models[1], target, durable=False)
    stop, seen, problems = threading.Event(), [], []

    def reader():
        while not stop.is_set():
            try:
                with CheckpointFiles(target) as files:
                    row = files.read_rows("lm_head.weight", 0, 1)[0, :4]
                    head = files.read_rows("model.embed_tokens.weight", 0, 1)
                seeds = [s for s, e in expected.items() if torch.equal(row, e)]
                embed = {s: torch.equal(head, embeds[s]) for s in seeds}
                if len(seeds) != 1 or not embed[seeds[0]]:
                    problems.append("mix")
                seen.append(seeds[0] if seeds else None)
            except (CheckpointError, OSError) as e:
                problems.append(repr(e))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(30):
            save_pretrained(models[1 + i % 2], target, durable=False)
    finally:
        stop.set()
        thread.join()
    assert problems == [] and len(set(seen)) == 2, (problems[:5], len(seen))


def test_mount_point_target_is_saved_in_place(tmp_path):
    mount = tmp_path / "mnt"
    mount.mkdir()
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mount)],
                                                       capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        (mount / "README.md").write_text("mine")
        save_pretrained(build_model(), mount, max_shard_size="100KB")
        save_pretrained(build_model(seed=3), mount)
        assert (mount / "README.md").read_text() == "mine"
        assert sorted(p.name for p in mount.iterdir()) == [
            "README.md", "config.json", "generation_config.json", "model.safetensors"]
        with CheckpointFiles(mount) as files:
            torch.testing.assert_close(files.read("lm_head.weight"), build_model(seed=3).lm_head.weight)
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def _foreign_exception_worker(rank, world, root):
    from hf_fsdp2 import shard_model
    from hf_fsdp2.checkpoint.safetensors_io import FileWriter

    model = build_model()
    shard_model(model)
    save_pretrained(model, os.path.join(root, "ckpt"))
    if rank == 1:  # a network filesystem's resolver error: OSError with a negative errno
        def fail(self, *args, **kwargs):
            raise socket.gaierror(-2, "Name or service not known")
        FileWriter.write_rows = fail
    second = build_model(seed=7)
    shard_model(second)
    try:
        save_pretrained(second, os.path.join(root, "ckpt"))
    except BaseException as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def test_any_exception_on_any_rank_keeps_the_previous_checkpoint_and_raises_everywhere(tmp_path):
    out, errors = run_ranks_collecting_errors(_foreign_exception_worker, 2, str(tmp_path), timeout=180)
    assert not errors, errors
    assert out[1].startswith("gaierror") and out[0].startswith("RuntimeError: another rank failed"), out
    with CheckpointFiles(tmp_path / "ckpt") as files:
        torch.testing.assert_close(files.read("lm_head.weight"), build_model().lm_head.weight)
    assert _no_leftovers(tmp_path) == []


def test_crash_after_the_exchange_is_repaired_by_the_next_save(tmp_path, monkeypatch):
    """Killed between the exchange and deleting the old copy: the target is the new checkpoint,
    the old one sits at the staging name; the next save drops it and keeps foreign files."""
    target = tmp_path / "ckpt"
    save_pretrained(build_model(), target)
    (target / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(atomic_dir.shutil, "rmtree", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        with committed_directory(target, weights_names=("model.safetensors",)) as staging:
            shutil.copy(target / "model.safetensors", staging / "model.safetensors")
            monkeypatch.setattr(atomic_dir, "swap_in", _swap_then_die)
    monkeypatch.undo()
    assert staging_path(target).exists()
    save_pretrained(build_model(seed=4), target)
    assert (target / "tokenizer.json").read_text() == "{}"
    assert _no_leftovers(tmp_path) == []


def _swap_then_die(staging, target, replaced, durable):
    atomic_dir._carry_over(target, staging, replaced)
    assert atomic_dir.rename_exchange(staging, target)
    raise KeyboardInterrupt  # as if SIGKILLed before the old copy was deleted


# ---------------------------------------------------------------------------------------------
# Reading validates everything before anything changes


def _damage_lr(d):
    m = json.loads((d / "hf_fsdp2_state.json").read_text())
    m["param_groups"][0]["lr"] = "0.01"
    (d / "hf_fsdp2_state.json").write_text(json.dumps(m))


def _damage_exp_avg(d):
    from safetensors.torch import load_file, save_file

    tensors = load_file(d / "optimizer.safetensors")
    key = next(k for k in tensors if k.endswith("/exp_avg"))
    tensors[key] = torch.zeros(3, 4)
    save_file(tensors, d / "optimizer.safetensors")


def _damage_rng(d):
    (d / "rng" / "rank-00000.json").write_text(json.dumps({"python": [3, [1, 2], None], "numpy": [], "torch": []}))


def _damage_manifest(d):
    (d / "hf_fsdp2_state.json").write_text("[" * 100_000 + "]" * 100_000)


def _fifo_weights(d):
    (d / "model.safetensors").unlink()
    os.mkfifo(d / "model.safetensors")


@pytest.mark.parametrize("damage, file", [(_damage_lr, "hf_fsdp2_state.json"), (_damage_exp_avg, "optimizer.safetensors"),
                                          (_damage_rng, "rank-00000.json"), (_damage_manifest, "hf_fsdp2_state.json"),
                                          (_fifo_weights, "model.safetensors")])
def test_damaged_state_is_refused_before_anything_changes(tmp_path, damage, file):
    model = build_model()
    opt = optimizer(model)
    model(input_ids=torch.arange(8)[None], labels=torch.arange(8)[None]).loss.backward()
    opt.step()
    save_state(tmp_path / "step-1", model, opt, step=1)
    save_state(tmp_path / "step-2", model, opt, step=2)
    damage(tmp_path / "step-2")
    fresh = build_model(seed=3)
    fresh_opt = optimizer(fresh)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError, match=file):
        load_state(tmp_path / "step-2", fresh, fresh_opt)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())  # nothing was loaded
    assert not fresh_opt.state and fresh_opt.param_groups[0]["lr"] == 1e-2
    if file == "hf_fsdp2_state.json":  # a state whose manifest is invalid is never the latest
        assert latest_state(tmp_path) == tmp_path / "step-1"


def test_deeply_nested_index_is_a_clear_error(tmp_path):
    save_pretrained(build_model(), tmp_path / "ckpt", max_shard_size="100KB")
    (tmp_path / "ckpt" / "model.safetensors.index.json").write_text('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        CheckpointFiles(tmp_path / "ckpt")
