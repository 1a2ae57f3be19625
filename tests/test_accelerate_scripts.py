"""Accelerate's own shipped test scripts (`accelerate/test_utils/scripts/`), unmodified, under
`accelerate launch` on 2 CPU processes with `hf_fsdp2.register()` injected (tests/accelerate_inject).

Which scripts apply here, and why the others do not:
- test_ops.py: runs (gather, pad, reduce, broadcast, send across devices on the FSDP state).
- test_sync.py, test_script.py (what `accelerate test` runs): their RegressionModel's parameters are
  0-dim, which `fully_shard` rejects, with stock Accelerate's FSDP2 on GPUs too; the test checks that
  the error is torch's own, naming the parameter.
- test_distributed_data_loop.py: prepares a model without its optimizer, which Accelerate's FSDP2
  refuses by design ("a model and optimizer must be passed together").
- external_deps/test_checkpointing.py, test_performance.py, test_metrics.py, test_peak_memory_usage.py:
  download bert-base-cased and GLUE from the Hub, which this machine cannot reach.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import accelerate

from .dist_harness import free_port

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


def run_script(script: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    config = tmp_path / "no_wrap.yaml"
    config.write_text(NO_WRAP)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "accelerate_inject"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                           "--main_process_port", str(free_port()), str(script)],
                          capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)


def test_accelerate_test_ops_passes_with_register(tmp_path):
    proc = run_script(SCRIPTS / "test_ops.py", tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "testing sending tensors across devices" in proc.stdout


def test_accelerate_test_sync_stops_at_fully_shards_own_error(tmp_path):
    proc = run_script(SCRIPTS / "test_sync.py", tmp_path)
    assert proc.returncode != 0
    assert "fully_shard doesn't support scalar parameters. Change a to a 1D tensor" in proc.stderr, proc.stderr[-3000:]
