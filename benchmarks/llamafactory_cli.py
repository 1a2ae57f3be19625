"""LLaMA-Factory's own CLI under `hf-fsdp2 run`, nothing else changed: is the model sharded by hf_fsdp2?

    .venv-llamafactory/bin/python benchmarks/llamafactory_cli.py [--processes 2] [--finetuning lora|full]

LLaMA-Factory pins the oldest versions we support (constraints-min.txt), so this is a script for its own
virtual environment, not a test:

    python3.11 -m venv .venv-llamafactory
    .venv-llamafactory/bin/pip install "llamafactory==0.9.5" "bitsandbytes==0.50.0" -c constraints-min.txt
    .venv-llamafactory/bin/pip install --no-deps -e .
    .venv-llamafactory/bin/pip uninstall -y torchvision torchaudio   # built for another torch: their import fails

It writes a tiny Llama (examples/tiny-llama's config and tokenizer, random weights), an alpaca-format data set
from examples/data/train.txt with its dataset_info.json, and an SFT config with the Trainer's own FSDP flags
(`fsdp: full_shard auto_wrap`, `fsdp_config: {fsdp_version: 2, ...}`), then runs the command a user would:
`FORCE_TORCHRUN=1 NPROC_PER_NODE=N hf-fsdp2 run llamafactory-cli train cfg.yaml` (the start-up switch calls
`hf_fsdp2.register()` in every process). A probe (this script's, run as the environment's own `sitecustomize`,
which the switch runs first) records what hf_fsdp2's prepare sharded on each rank (`checkpoint/loading.shard_and_fill`). Checked: every rank's
model sharded by hf_fsdp2 (DTensors, a layer's q_proj split by rows), training finished, the switch said so on
rank 0, the losses equal the same command on one process with the same global batch, and what LLaMA-Factory
saved loads with stock PEFT / transformers. Writes
benchmarks/results/llamafactory-<finetuning>-<stamp>.json.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import harness  # benchmarks/harness.py: result files, the scratch folder
import shard_probe

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import os

if os.environ.get("SHARD_PROBE_DIR"):
    import shard_probe  # benchmarks/shard_probe.py: what each rank's prepare sharded

    shard_probe.install(os.environ["SHARD_PROBE_DIR"])
"""


def write_inputs(work: Path, finetuning: str, batch: int) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_dir = work / "model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "examples" / "tiny-llama")).save_pretrained(
        model_dir)
    AutoTokenizer.from_pretrained(REPO / "examples" / "tiny-llama").save_pretrained(model_dir)
    lines = [line.strip() for line in (REPO / "examples" / "data" / "train.txt").read_text().splitlines()
             if line.strip()]
    data = work / "data"
    data.mkdir()
    records = [{"instruction": " ".join(line.split()[:3]), "input": "", "output": " ".join(line.split()[3:]) or "."}
               for line in lines[:64]]
    (data / "toy.json").write_text(json.dumps(records))
    (data / "dataset_info.json").write_text(json.dumps({"toy": {"file_name": "toy.json"}}))
    cfg = {
        "model_name_or_path": str(model_dir), "stage": "sft", "do_train": True,
        "finetuning_type": "lora" if finetuning == "qlora" else finetuning,
        "dataset": "toy", "dataset_dir": str(data), "template": "default", "cutoff_len": 64, "max_samples": 64,
        "overwrite_cache": True, "preprocessing_num_workers": 1, "output_dir": str(work / "out"),
        "overwrite_output_dir": True, "logging_steps": 1, "save_strategy": "no", "per_device_train_batch_size": batch,
        "gradient_accumulation_steps": 1, "learning_rate": 1.0e-3, "max_steps": 3, "lr_scheduler_type": "constant",
        "report_to": "none", "seed": 0, "bf16": False, "fp16": False, "use_cpu": True,
        # The Trainer's own FSDP flags (LLaMA-Factory passes them through to TrainingArguments)
        "fsdp": "full_shard auto_wrap",
        "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                        "reshard_after_forward": True, "state_dict_type": "SHARDED_STATE_DICT"},
    }
    if finetuning in ("lora", "qlora"):
        cfg.update(lora_rank=4, lora_alpha=8, lora_dropout=0.0, lora_target="q_proj,v_proj")
    if finetuning == "qlora":  # LLaMA-Factory's bitsandbytes 4-bit base
        cfg.update(quantization_bit=4, quantization_method="bnb")
    import yaml

    path = work / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _losses(log: str) -> list[float]:
    return [float(m) for m in re.findall(r"'loss': '?([0-9.]+)", log)]


def _train(work: Path, finetuning: str, processes: int, batch: int) -> tuple[subprocess.CompletedProcess, str]:
    """`hf-fsdp2 run llamafactory-cli train` on `processes` ranks of `batch` sequences each, in `work`."""
    cfg = write_inputs(work, finetuning, batch)
    (work / "probe_site" / "sitecustomize.py").write_text(PROBE)
    # LLaMA-Factory 0.9.5 imports torchaudio unconditionally (llamafactory/data/mm_plugin.py, for audio inputs);
    # PyPI has no torchaudio built for the CPU torch 2.13 this machine runs, and a text-only SFT never calls it:
    # an empty module in its place, for this script's environment only. Not part of hf_fsdp2.
    (work / "probe_site" / "torchaudio").mkdir(exist_ok=True)
    (work / "probe_site" / "torchaudio" / "__init__.py").write_text('__version__ = "0.0 (stand-in)"\n')
    bin_dir = Path(sys.executable).parent
    cmd = [str(bin_dir / "hf-fsdp2"), "run", str(bin_dir / "llamafactory-cli"), "train", str(cfg)]
    env = {**os.environ, "PATH": os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")]),  # its torchrun
           "PYTHONPATH": os.pathsep.join([str(work / "probe_site"), str(REPO / "benchmarks"),
                                         os.environ.get("PYTHONPATH", "")]),
           "SHARD_PROBE_DIR": str(work / "probe"), "FORCE_TORCHRUN": "1", "NPROC_PER_NODE": str(processes),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_DISABLED": "true", "DISABLE_VERSION_CHECK": "1"}
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    log = proc.stdout + proc.stderr
    (work / "log.txt").write_text(log)
    return proc, log


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--finetuning", choices=["lora", "qlora", "full"], default="lora")
    args = ap.parse_args(argv)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    work = harness.TMP_ROOT / f"llamafactory-{args.finetuning}-{stamp}"
    (work / "probe_site").mkdir(parents=True)
    (work / "probe").mkdir()
    proc, log = _train(work, args.finetuning, args.processes, 2)
    # The reference: one process, the same global batch, the same command
    (work / "one").mkdir()
    (work / "one" / "probe_site").mkdir()
    (work / "one" / "probe").mkdir()
    reference, reference_log = _train(work / "one", args.finetuning, 1, 2 * args.processes)
    probes, sharded = shard_probe.read(work / "probe", args.processes)
    loaded = None
    if proc.returncode == 0:
        from transformers import AutoModelForCausalLM

        if args.finetuning == "full":  # (QLoRA: the adapter, onto the unquantized base)
            AutoModelForCausalLM.from_pretrained(work / "out")
        else:
            from peft import PeftModel

            PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(work / "model"), work / "out")
        loaded = True
    report = {"finetuning": args.finetuning, "processes": args.processes,
              "command": "FORCE_TORCHRUN=1 NPROC_PER_NODE=N hf-fsdp2 run llamafactory-cli train cfg.yaml",
              "returncode": proc.returncode, "switch_said_so": "hf_fsdp2: registered at start-up" in log,
              "sharded_by_hf_fsdp2": sharded, "probes": probes, "saved_output_loads": loaded,
              "work": str(work),
              "losses": _losses(log), "one_process_losses": _losses(reference_log),
              "one_process_returncode": reference.returncode}
    # LLaMA-Factory logs losses to 4 significant digits
    report["losses_equal_one_process"] = bool(report["losses"]) and len(report["losses"]) == len(
        report["one_process_losses"]) and all(abs(a - b) <= 2e-3 for a, b in zip(report["losses"],
                                                                                 report["one_process_losses"]))
    import llamafactory

    report["llamafactory"] = getattr(llamafactory, "__version__", "?")
    path = harness.write_results(f"llamafactory-{args.finetuning}", argv, **report)  # with the commit, machine and CPUs
    print(json.dumps({k: v for k, v in report.items() if k not in ("probes",)}, indent=1))
    if proc.returncode != 0:
        print(log[-6000:])
    print(f"wrote {path}")
    return 0 if (proc.returncode == 0 and sharded and loaded and report["switch_said_so"]
                 and report["losses_equal_one_process"]) else 1


if __name__ == "__main__":
    sys.exit(main())
