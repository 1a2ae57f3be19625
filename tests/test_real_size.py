"""benchmarks/real_size.py's tiny mode: every phase of the real-size run (load through hf_fsdp2.from_pretrained,
steps, every save, resume) on tiny shapes, so the benchmark cannot rot (issue 51; its real shapes take tens of
minutes and are run by hand)."""

from __future__ import annotations

from .common import tiny_benchmark_results


def test_real_size_tiny_mode_runs_every_phase():
    results = tiny_benchmark_results("real_size.py")
    assert set(results) == {"lora_1b", "full_qwen05b"}
    for name, r in results.items():
        phases = r["ranks"][0]["phases"]
        assert {"load", "train", "resume", "save_state"} <= set(phases), name
        assert r["resumed_max_loss_diff"] < 1e-5, name  # the resumed run continues the same way
        assert r["estimates"]["ours_device_bytes"] > 0 and r["train_peak_vs_estimate"] > 0
    assert {"save_adapter", "save_merged"} <= set(results["lora_1b"]["ranks"][0]["phases"])
    assert results["full_qwen05b"]["layout"]["shard_size"] == 2  # the budget only sharding fits
