"""axolotl's own CLI with hf_fsdp2 registered and nothing else changed: is the model sharded by us?

    .venv-axolotl-cli/bin/python benchmarks/axolotl_cli.py [--processes 2] [--adapter lora|qlora|none]

axolotl needs Python >= 3.12, so this is a script for its own virtual environment, not a test:

    python3.12 -m venv .venv-axolotl-cli
    .venv-axolotl-cli/bin/pip install axolotl==0.21.0 && .venv-axolotl-cli/bin/pip install --no-deps -e .

It writes a tiny Llama (examples/tiny-llama's config, random weights) and a completion data set from
examples/data/train.txt, an axolotl config with `fsdp_version: 2`, then runs
`axolotl train cfg.yml --launcher torchrun -- --nproc_per_node N` with a `sitecustomize` that calls
`hf_fsdp2.register()` (the one line a user adds) and records what hf_fsdp2's prepare sharded on each rank.
axolotl's `patch_accelerate_fsdp2()` rebinds Accelerate's `fsdp2_prepare_model` at model load, after
`register()`; hf_fsdp2 takes it back at `prepare` with a warning naming the patch. Checked: that
warning, every rank's model sharded by hf_fsdp2 (DTensors, a layer's q_proj split by rows), training
finished, and the adapter (or model) axolotl saved loads with stock PEFT / transformers. Writes
benchmarks/results/axolotl-<stamp>.json.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
from pathlib import Path

import harness  # benchmarks/harness.py: result files, the scratch folder
import shard_probe

REPO = Path(__file__).resolve().parents[1]

SITECUSTOMIZE = '''
import json, os
import torch

if not torch.cuda.is_available():
    # A CUDA build of torch on a machine without a driver (PyPI's build for Python 3.12) raises
    # RuntimeError from this P2P probe, where a CPU build raises the AssertionError axolotl catches
    # (axolotl/utils/environment.py): answer as a CPU build does. Not part of hf_fsdp2.
    def _no_cuda_peer(*args, **kwargs):
        raise AssertionError("Torch not compiled with CUDA enabled")

    torch.cuda.can_device_access_peer = _no_cuda_peer

    # axolotl builds its device mesh on "cuda" whatever the machine (axolotl/utils/distributed.py
    # build_parallelism_config): on a CPU-only machine, on "cpu" (gloo), as Accelerate itself would.
    from accelerate.parallelism_config import ParallelismConfig

    _build = ParallelismConfig.build_device_mesh

    def _build_on_cpu(self, device_type):
        return _build(self, "cpu" if device_type == "cuda" else device_type)

    ParallelismConfig.build_device_mesh = _build_on_cpu

    # For QLoRA under FSDP axolotl loads onto device_map {"": LOCAL_RANK} (axolotl/loaders/model.py
    # _set_device_map_config), an integer: CUDA device N. On a CPU-only machine, onto the CPU.
    from axolotl.loaders import model as _axolotl_model

    _set_device_map = _axolotl_model.ModelLoader._set_device_map_config

    def _set_device_map_on_cpu(self):
        _set_device_map(self)
        if isinstance(self.model_kwargs.get("device_map"), dict) and isinstance(
                self.model_kwargs["device_map"].get(""), int):
            self.model_kwargs["device_map"] = {"": "cpu"}

    _axolotl_model.ModelLoader._set_device_map_config = _set_device_map_on_cpu

import hf_fsdp2
import shard_probe  # benchmarks/shard_probe.py: what each rank's prepare sharded

hf_fsdp2.register()
shard_probe.install(os.environ["AXOLOTL_PROBE_DIR"])
'''


def write_inputs(work: Path, adapter: str) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_dir = work / "model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "examples" / "tiny-llama")).save_pretrained(
        model_dir)
    AutoTokenizer.from_pretrained(REPO / "examples" / "tiny-llama").save_pretrained(model_dir)
    lines = [line for line in (REPO / "examples" / "data" / "train.txt").read_text().splitlines() if line.strip()]
    with open(work / "data.jsonl", "w") as f:
        for line in lines[:64]:
            f.write(json.dumps({"text": line}) + "\n")
    cfg = {
        "base_model": str(model_dir), "tokenizer_type": "AutoTokenizer",
        "datasets": [{"path": str(work / "data.jsonl"), "ds_type": "json", "type": "completion"}],
        "dataset_prepared_path": str(work / "prepared"), "val_set_size": 0.0, "sequence_len": 64,
        "sample_packing": False, "micro_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 3,
        "num_epochs": 1, "learning_rate": 1e-3, "optimizer": "adamw_torch", "lr_scheduler": "constant",
        "output_dir": str(work / "out"), "save_strategy": "no", "logging_steps": 1, "seed": 0,
        "bf16": False, "fp16": False, "tf32": False, "flash_attention": False, "sdp_attention": True,
        "fsdp_version": 2,
        "fsdp_config": {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                        "transformer_layer_cls_to_wrap": "LlamaDecoderLayer", "reshard_after_forward": True,
                        "state_dict_type": "SHARDED_STATE_DICT"},
    }
    if adapter in ("lora", "qlora"):
        cfg.update(adapter=adapter, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                   lora_target_modules=["q_proj", "v_proj"])
    if adapter == "qlora":
        cfg.update(load_in_4bit=True)
    import yaml

    path = work / "cfg.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--adapter", choices=["lora", "qlora", "none"], default="lora")
    args = ap.parse_args(argv)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    work = harness.TMP_ROOT / f"axolotl-{args.adapter}-{stamp}"
    (work / "inject").mkdir(parents=True)
    (work / "probe").mkdir()
    (work / "inject" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    cfg = write_inputs(work, args.adapter)
    axolotl = Path(sys.executable).with_name("axolotl")
    cmd = [str(axolotl), "train", str(cfg), "--launcher", "torchrun", "--", "--nproc_per_node", str(args.processes)]
    env = {**os.environ, "PATH": os.pathsep.join([str(axolotl.parent), os.environ.get("PATH", "")]),  # its torchrun
           "PYTHONPATH": os.pathsep.join([str(work / "inject"), str(REPO / "benchmarks"),
                                         os.environ.get("PYTHONPATH", "")]),
           "AXOLOTL_PROBE_DIR": str(work / "probe"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "WANDB_DISABLED": "true", "WANDB_MODE": "disabled", "DO_NOT_TRACK": "1"}
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    log = proc.stdout + proc.stderr
    (work / "log.txt").write_text(log)
    probes, sharded = shard_probe.read(work / "probe", args.processes)
    taken_back = "takes it back" in log and "axolotl" in log.split("takes it back")[0].rsplit("hf_fsdp2: ", 1)[-1]
    loaded = None
    if proc.returncode == 0:
        out = work / "out"
        if args.adapter == "none":
            from transformers import AutoModelForCausalLM

            AutoModelForCausalLM.from_pretrained(out)
        else:
            from peft import PeftModel
            from transformers import AutoModelForCausalLM

            PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(work / "model"), out)
        loaded = True
    report = {"adapter": args.adapter, "processes": args.processes, "returncode": proc.returncode,
              "taken_back_from_axolotl": taken_back, "sharded_by_hf_fsdp2": sharded, "probes": probes,
              "saved_output_loads": loaded, "work": str(work),
              "losses": [line.strip() for line in log.splitlines() if "'loss'" in line][:6]}
    import axolotl as axolotl_pkg
    report["axolotl"] = getattr(axolotl_pkg, "__version__", "?")
    path = harness.write_results(f"axolotl-{args.adapter}", argv, **report)  # with the commit, machine and CPUs
    print(json.dumps({k: v for k, v in report.items() if k not in ("probes",)}, indent=1))
    if proc.returncode != 0:
        print(log[-6000:])
    print(f"wrote {path}")
    return 0 if proc.returncode == 0 and sharded and taken_back and loaded else 1


if __name__ == "__main__":
    sys.exit(main())
