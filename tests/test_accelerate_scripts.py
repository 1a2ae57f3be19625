"""Accelerate's own shipped test scripts (`accelerate/test_utils/scripts/`), unmodified (they never import
hf_fsdp2), under `hf-fsdp2 run accelerate launch` on 2 CPU processes: the start-up switch registers hf_fsdp2 in
every process (hf_fsdp2/startup/sitecustomize.py). The switch itself is checked first, on a plain loop.

Which scripts apply here, and why the others do not:
- test_ops.py: runs (gather, pad, reduce, broadcast, send across devices on the FSDP state).
- test_sync.py, test_script.py (what `accelerate test` runs): their RegressionModel's parameters are
  0-dim, which `fully_shard` rejects, with stock Accelerate's FSDP2 on GPUs too; the test checks that
  the error is torch's own, naming the parameter.
- test_distributed_data_loop.py: prepares a model without its optimizer, which Accelerate's FSDP2
  refuses by design ("a model and optimizer must be passed together").
- external_deps/test_checkpointing.py, test_performance.py: run with the Hub's bert-base-cased, GLUE
  MRPC and its metric replaced by local stand-ins in the libraries' offline caches (tests/offline_hub.py),
  under our accelerate_configs/fsdp2.yaml with the options Accelerate's tests/fsdp/test_fsdp.py
  (FSDP2IntegrationTest.test_checkpointing / test_performance) adds on the command line.
- external_deps/test_metrics.py, test_peak_memory_usage.py: need CUDA (memory counters, device
  placement checks) and are skipped by Accelerate itself on CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import accelerate
import pytest

from .dist_harness import accelerate_launch, run_launched

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(accelerate.__file__).parent / "test_utils" / "scripts"
NO_WRAP = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
mixed_precision: 'no'
num_machines: 1
num_processes: 2
machine_rank: 0
rdzv_backend: static
same_network: true
use_cpu: false
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: NO_WRAP
  fsdp_state_dict_type: SHARDED_STATE_DICT
"""


def run_script(script: Path, tmp_path: Path, *args: str, config: Path | None = None, launch: tuple = (),
               env: dict | None = None) -> subprocess.CompletedProcess:
    if config is None:
        config = tmp_path / "no_wrap.yaml"
        config.write_text(NO_WRAP)
    return run_launched(SWITCH + accelerate_launch(config, *launch) + [str(script), *args], cwd=tmp_path, env=env,
                        check=False)


SWITCH = [sys.executable, "-m", "hf_fsdp2.cli", "run"]  # `hf-fsdp2 run`, with this interpreter


def test_hf_fsdp2_run_registers_in_every_process_of_a_script_that_never_imports_it(tmp_path):
    """`hf-fsdp2 run accelerate launch ...`: hf_fsdp2 shards the model of a plain Accelerate loop that never
    imports it, said once by the launcher and once by rank 0; without the switch nothing of hf_fsdp2 loads."""
    script, config = ROOT / "tests" / "scripts" / "plain_accelerate.py", ROOT / "accelerate_configs" / "fsdp2.yaml"
    out = tmp_path / "on.json"
    proc = run_launched(SWITCH + accelerate_launch(config, processes=2) + [str(script), "--out", str(out)],
                        cwd=tmp_path)
    assert json.loads(out.read_text())["sharded_by_hf_fsdp2"] is True
    said = [line for line in proc.stderr.splitlines() if "hf_fsdp2: registered at start-up" in line]
    assert len(said) == 2, proc.stderr[-3000:]  # the launcher's process and rank 0; rank 1 says nothing
    off = tmp_path / "off.json"  # one process is enough to see what its start-up loads
    run_launched(accelerate_launch(config, processes=1) + [str(script), "--out", str(off)], cwd=tmp_path)
    assert json.loads(off.read_text())["hf_fsdp2_loaded"] is False
    missing = subprocess.run(SWITCH, capture_output=True, text=True)
    assert missing.returncode == 1 and "`COMMAND` is missing" in missing.stderr


def test_accelerate_test_ops_passes_with_register(tmp_path):
    proc = run_script(SCRIPTS / "test_ops.py", tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "testing sending tensors across devices" in proc.stdout


def test_accelerate_test_sync_stops_at_fully_shards_own_error(tmp_path):
    proc = run_script(SCRIPTS / "test_sync.py", tmp_path)
    assert proc.returncode != 0
    assert "fully_shard doesn't support scalar parameters. Change a to a 1D tensor" in proc.stderr, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def offline_hub(tmp_path_factory):
    from .offline_hub import build

    return build(tmp_path_factory.mktemp("offline_hub"))


def _accuracy(model_dir: str, weights: Path | None = None) -> float:
    """GLUE-MRPC validation accuracy of `model_dir`'s model (or of it with `weights`), in this process."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from .offline_hub import glue_mrpc_rows

    rows = glue_mrpc_rows()["validation"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(weights or model_dir).eval()
    batch = tokenizer(rows["sentence1"], rows["sentence2"], padding=True, return_tensors="pt")
    with torch.no_grad():
        predictions = model(**batch).logits.argmax(-1)
    return (predictions == torch.tensor(rows["label"])).float().mean().item()


# From Accelerate's tests/fsdp/test_fsdp.py, FSDP2IntegrationTest: bert's layer class on the command
# line, reshard after forward; mixed precision bf16 (their fp16 needs a GPU).
BERT_LAUNCH = ("--fsdp_transformer_layer_cls_to_wrap", "BertLayer", "--fsdp_reshard_after_forward", "true",
               "--mixed_precision", "bf16")


def test_accelerate_test_checkpointing_passes_with_register(tmp_path, offline_hub):
    """Train one epoch, `save_state`; a new launch `load_state`s it and the script asserts that accuracy,
    scheduler lr and optimizer lr are the saved ones. Saved under SHARDED_STATE_DICT and resumed under
    FULL_STATE_DICT: our checkpoint is the same Hugging Face layout for both."""
    config = ROOT / "accelerate_configs" / "fsdp2.yaml"
    script = SCRIPTS / "external_deps" / "test_checkpointing.py"
    model = offline_hub["TINY_BERT"]
    common = ("--model_name_or_path", model, "--output_dir", str(tmp_path / "out"))
    first = run_script(script, tmp_path, *common, "--partial_train_epoch", "1", config=config,
                       launch=(*BERT_LAUNCH, "--fsdp_state_dict_type", "SHARDED_STATE_DICT"), env=offline_hub)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    saved = tmp_path / "out" / "epoch_0"
    names = {p.name for p in saved.iterdir()}
    assert {"model.safetensors", "optimizer.safetensors", "COMPLETE.json"} <= names, names  # ours, not DCP
    state = json.loads((tmp_path / "out" / "state_0.json").read_text())
    # Training moved the accuracy, so the script's equality check after resuming can fail.
    assert state["accuracy"] != pytest.approx(_accuracy(model))
    resumed = run_script(script, tmp_path, *common, "--resume_from_checkpoint", str(saved), config=config,
                         launch=(*BERT_LAUNCH, "--fsdp_state_dict_type", "FULL_STATE_DICT"), env=offline_hub)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed checkpoint performance: {state['accuracy']}" in resumed.stdout


def test_accelerate_test_performance_passes_with_register(tmp_path, offline_hub):
    """Three epochs with a linear schedule (the script checks the lr after the first step and at the
    end); the model it saves with `save_model` loads with stock from_pretrained and scores the
    accuracy the script measured in its last epoch."""
    script = SCRIPTS / "external_deps" / "test_performance.py"
    model = offline_hub["TINY_BERT"]
    (tmp_path / "out").mkdir()
    proc = run_script(script, tmp_path, "--model_name_or_path", model, "--output_dir", str(tmp_path / "out"),
                      config=ROOT / "accelerate_configs" / "fsdp2.yaml", launch=BERT_LAUNCH[:4], env=offline_hub)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "all_results.json").read_text())
    assert set(results) == {"epoch-0", "epoch-1", "epoch-2"}
    assert _accuracy(model, tmp_path / "out") == pytest.approx(results["epoch-2"])
