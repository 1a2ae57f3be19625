"""What turn 2 added (background saves, rotation, the planner's config and environment, the `plan`
and `check-config` CLIs) under hostile input and faults: nothing lost, no hang, one clear error."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from hf_fsdp2 import FSDP2Config
from hf_fsdp2.cli import main as cli
from tests.dist_harness import run_ranks

# ---------------------------------------------------------------------------------------------
# Config fields and environment variables


@pytest.mark.parametrize("budget", [float("inf"), float("nan"), -float("inf"), 2 ** 70, "9" * 400 + "GB"])
def test_memory_budget_out_of_range_is_a_clear_error(budget):
    with pytest.raises(ValueError, match="`memory_budget`=.* is not a finite size"):
        FSDP2Config(shard_size="auto", memory_budget=budget)


@pytest.mark.parametrize("value", ["0", "-1", "two", "5"])
def test_local_world_size_out_of_range_is_a_clear_error(monkeypatch, value):
    from hf_fsdp2.runtime.distributed import local_world_size

    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    with pytest.raises(ValueError, match=f"LOCAL_WORLD_SIZE='{value}' must be an integer from 1 to the world size 4"):
        local_world_size(4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert local_world_size(4) == 2


def test_divisors_in_closed_form():
    from hf_fsdp2.planner.layout import divisors

    assert divisors(12) == [1, 2, 3, 4, 6, 12] and divisors(1) == [1] and divisors(49) == [1, 7, 49]
    start = time.monotonic()
    assert divisors(1 << 40)[-3:] == [1 << 38, 1 << 39, 1 << 40]
    assert time.monotonic() - start < 5


# ---------------------------------------------------------------------------------------------
# The CLIs on hostile files


ROOT = Path(__file__).resolve().parents[1]


def _cli(capsys, *argv) -> tuple[int, str]:
    try:
        code = cli(list(argv))
    except SystemExit as e:  # argparse
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_plan_refuses_an_absurd_world_size_at_once(capsys):
    start = time.monotonic()
    code, out = _cli(capsys, "plan", "--model", str(ROOT / "examples" / "tiny-llama"), "--world-size",
                     "10000000000000", "--memory", "8GB")
    assert code == 2 and "--world-size: must be at most 1048576 ranks" in out
    assert time.monotonic() - start < 10


def _hostile_files(tmp: Path) -> dict[str, Path]:
    files = {"deep.json": "[" * 200_000 + "]" * 200_000, "deep.yaml": "a: " + "[" * 200_000 + "]" * 200_000,
             "flat-deep.json": "[" * 100 + "]" * 100}
    # "Billion laughs": 9 levels of 9 aliases, a few hundred bytes that expand to 9^9 values.
    laughs = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    for i in range(8):
        prev, name = chr(97 + i), chr(98 + i)
        laughs += f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]\n"
    files["laughs.yaml"] = laughs
    out = {}
    for name, text in files.items():
        (tmp / name).write_text(text)
        out[name] = tmp / name
    (tmp / "random.json").write_bytes(bytes(range(256)) * 8)
    out["random.json"] = tmp / "random.json"
    return out


def test_cli_files_nested_expanded_or_binary_get_one_line(tmp_path, capsys):
    files = _hostile_files(tmp_path)
    expected = {
        ("plan", "deep.json"): "nested more than Python can parse",
        ("plan", "flat-deep.json"): "nested more than 64 levels deep",
        ("plan", "random.json"): "not UTF-8 text",
        ("check-config", "deep.json"): "nested more than Python can parse",
        ("check-config", "deep.yaml"): "nested more than Python can parse",
        ("check-config", "laughs.yaml"): "expands to more than 100000 values",
        ("check-config", "random.json"): "not UTF-8 text",
    }
    for (command, name), message in expected.items():
        argv = (["plan", "--model", str(files[name]), "--world-size", "2", "--memory", "8GB"]
                if command == "plan" else ["check-config", str(files[name])])
        code, out = _cli(capsys, *argv)
        assert code in (1, 2) and message in out and "Traceback" not in out, (command, name, out[:500])
        assert len(out) < 2000, (command, name, len(out))  # bounded: nothing of the file echoed back


# ---------------------------------------------------------------------------------------------
# Checkpoints: rotation beside symlinks, after-commit failures, a rank failing before its
# background save starts, and durability of every file


def _checkpoint_faults(rank, world, root):
    import hf_fsdp2
    from tests.common import trained_one_step

    root = Path(root)
    model, opt = trained_one_step(rank, world)
    out = {}
    states = root / "states"
    # (1) keep_last beside symlinks: links are not states, and their targets are kept.
    hf_fsdp2.save_state(states / "step-1", model, opt, step=1)
    hf_fsdp2.save_state(states / "step-2", model, opt, step=2)
    if rank == 0:
        os.symlink("step-2", states / "zz-best")
    hf_fsdp2.save_state(states / "step-3", model, opt, step=3, keep_last=2, blocking=False).wait()
    out["after_rotation"] = sorted(p.name for p in states.iterdir() if not p.name.startswith("."))
    hf_fsdp2.save_state(states / "step-4", model, opt, step=4, keep_last=1)
    out["after_second_rotation"] = sorted(p.name for p in states.iterdir() if not p.name.startswith("."))
    out["latest"] = hf_fsdp2.latest_state(states).name

    # (2) after_commit raising (rank 0) in a background save: every rank says what is true.
    def fail_after():
        raise OSError(28, "after-commit hook failed")

    handle = hf_fsdp2.save_state(root / "committed", model, opt, step=5, blocking=False, after_commit=fail_after)
    try:
        handle.wait()
        out["after_commit_error"] = None
    except Exception as e:  # noqa: BLE001
        out["after_commit_error"] = str(e)
    out["after_commit_state"] = (root / "committed" / "COMPLETE.json").exists()

    # (3) write_extra raising on rank 0 before the background save starts: rank 0 raises at once,
    # the others' wait() fails promptly (not after the process group's timeout), nothing committed.
    def bad_extra(staging):
        raise ValueError("tokenizer could not be written")

    start = time.monotonic()
    try:
        handle = hf_fsdp2.save_state(root / "never", model, opt, step=6, blocking=False, write_extra=bad_extra)
        handle.wait()
        out["extra_error"] = None
    except Exception as e:  # noqa: BLE001
        out["extra_error"] = str(e)
    out["extra_seconds"] = time.monotonic() - start
    hf_fsdp2.wait_for_saves()  # already reported: nothing more raised
    out["never_exists"] = (root / "never").exists()

    # (4) durable save_state: every file and directory fsynced before the commit.
    synced = []
    real_fsync = os.fsync

    def traced(fd):
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    os.fsync = traced
    try:
        hf_fsdp2.save_state(root / "durable", model, opt, step=7)
    finally:
        os.fsync = real_fsync
    out["synced"] = sorted(set(synced))
    return out


def test_checkpoint_faults_of_turn_two(tmp_path):
    outs = run_ranks(_checkpoint_faults, 2, str(tmp_path), pg_timeout=60)
    for rank, out in enumerate(outs):
        assert out["after_rotation"] == ["step-2", "step-3", "zz-best"], out
        assert out["after_second_rotation"] == ["step-2", "step-4", "zz-best"], out  # step-2 is linked
        assert out["latest"] == "step-4"
        assert out["after_commit_state"]
        assert out["extra_error"] is not None and out["extra_seconds"] < 30, out
        assert not out["never_exists"]
    assert "after-commit hook failed" in outs[0]["after_commit_error"]
    assert "was committed, but the work after the commit failed" in outs[1]["after_commit_error"]
    assert "tokenizer could not be written" in outs[0]["extra_error"]
    assert "nothing was committed" in outs[1]["extra_error"]
    assert {"config.json", "generation_config.json", "rng", "hf_fsdp2_state.json"} <= set(outs[0]["synced"]), outs[0]
    assert (tmp_path / "states" / "zz-best" / "COMPLETE.json").exists()
