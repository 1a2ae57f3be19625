"""Several ranks in one process, each a thread (hf_fsdp2/tools/local_ranks.py, torch's threaded process group), on
the CPU here; benchmarks/gpu_check.py runs the same checks (benchmarks/local_ranks_check.py) on one GPU: training at
2 and 4 ranks equals one process, each rank saves and loads its rows, EP at 2 trains like one process (issue 61)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import local_ranks_check as check  # noqa: E402

from hf_fsdp2.runtime import collectives, distributed, upstream  # noqa: E402
from hf_fsdp2.tools.local_ranks import run_local_ranks  # noqa: E402


def test_ranks_as_threads_train_save_and_load_like_one_process(tmp_path):
    for world in (2, 4):
        r = check.check_training(world, "cpu", tmp_path)
        assert r["max_loss_diff"] <= check.LOSS_TOL and r["max_param_diff"] <= check.PARAM_TOL, r
        assert r["ranks_same_losses"] and r["saved_equal_trained"] and r["loaded_rows_equal"], r
        assert r["devices"] == ["cpu"] and r["mesh_backend"] == "threaded" and r["ok"]
        assert r["losses"][-1] < r["losses"][0]  # it trained
    ep = check.check_expert_parallel("cpu", 2)
    assert ep["mesh"] == ["efsdp", "ep"] and ep["local_experts"] == 4, ep
    assert ep["max_loss_diff"] <= check.LOSS_TOL and ep["max_param_diff"] <= check.PARAM_TOL and ep["ok"], ep


def test_the_comparison_sees_a_rank_that_differs():
    """compare() fails on a one-element change of one parameter and on a loss off by more than the bar."""
    params = {"w": torch.zeros(3)}
    assert check.compare([1.0], [1.0], params, {"w": torch.zeros(3)})["equal"]
    assert not check.compare([1.0], [1.0], params, {"w": torch.tensor([0.0, 2e-4, 0.0])})["equal"]
    assert not check.compare([1.0], [1.0 + 2e-4], params, {"w": torch.zeros(3)})["equal"]


def _side_groups(rank, world):
    """Each thread-rank: its own side groups (threaded, as its default group), a host all-reduce, the device."""
    main, saves = collectives.host_group(), collectives.host_group("background-saves")
    again = collectives.host_group("background-saves")
    total = collectives.all_reduce_int(rank + 1, "max", purpose="background-saves")
    return {"backend": dist.get_backend(saves), "same": again is saves, "ids": (id(main), id(saves)),
            "max": total, "device": distributed.device_type(), "in_process": collectives.in_process_backend()}


def test_side_groups_are_threaded_and_per_rank():
    out = run_local_ranks(_side_groups, 2)
    assert [r["backend"] for r in out] == ["threaded", "threaded"] and all(r["same"] for r in out)
    assert out[0]["ids"][1] != out[1]["ids"][1]  # one rank never meets another's group
    assert [r["max"] for r in out] == [2, 2] and [r["device"] for r in out] == ["cpu", "cpu"]
    assert [r["in_process"] for r in out] == ["threaded", "threaded"]
    assert not dist.is_initialized()  # the process's world is back


def _fails_on_rank_one(rank, world):
    if rank == 1:
        raise KeyError("rank one's own error")
    collectives.all_reduce_int(1, "max")  # rank 0 waits here for a rank that is gone: woken, not hung
    return rank


def test_a_failing_rank_is_raised_by_name_and_wakes_the_others():
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 failed: KeyError") as info:
        run_local_ranks(_fails_on_rank_one, 2, timeout_s=60)
    assert isinstance(info.value.__cause__, KeyError)
    assert run_local_ranks(lambda rank, world: rank * 10, 3) == [0, 10, 20]  # usable again after a failure


def _background_save(rank, world, directory):
    from hf_fsdp2 import save_pretrained, shard_model

    model = shard_model(check.llama())
    save_pretrained(model, directory, blocking=False)


def test_what_thread_ranks_cannot_do_is_refused_by_name(monkeypatch, tmp_path):
    with pytest.raises(RuntimeError, match=r"ValueError: a background save .*threads of one process"):
        run_local_ranks(_background_save, 2, str(tmp_path / "saved"), timeout_s=120)
    assert not (tmp_path / "saved").exists()
    with pytest.raises(ValueError, match="`device`='tpu'"):
        run_local_ranks(lambda r, w: r, 2, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no GPU"):
            run_local_ranks(lambda r, w: r, 2, device="cuda")
    else:
        monkeypatch.delenv("CUDA_LAUNCH_BLOCKING", raising=False)
        with pytest.raises(ValueError, match="CUDA_LAUNCH_BLOCKING=1"):
            run_local_ranks(lambda r, w: r, 2, device="cuda")
    with pytest.raises(ValueError, match="`world_size`=0"):
        run_local_ranks(lambda r, w: r, 0)


def test_a_scoped_replacement_holds_for_its_own_thread_only():
    """upstream.scoped (checkpoint/pretrained.py builds on meta with it): another thread meets the original, and
    blocks of two threads ending in either order put the original back."""
    target = "torch.nn.Module.register_parameter"
    original = torch.nn.Module.register_parameter
    inside, release, seen = threading.Event(), threading.Event(), {}

    def other():
        with upstream.scoped(target, lambda previous: lambda *a: seen.setdefault("other", previous(*a))):
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    assert inside.wait(10)
    with upstream.scoped(target, lambda previous: lambda m, n, p: seen.setdefault("mine", previous(m, n, p))):
        torch.nn.Linear(2, 2)  # registers through this thread's replacement, not the other's
        release.set()
        thread.join(10)  # the other block ends first
    assert "mine" in seen and "other" not in seen
    assert torch.nn.Module.register_parameter is original
