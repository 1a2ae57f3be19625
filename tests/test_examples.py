"""examples/finetune.py under a real `accelerate launch`: the README's main job, LoRA, and resume.

The main-job command is read from the README, so the test breaks when the two drift apart. Each run
is shortened with `--max-steps`; everything else (embedded model and data, 2 gloo ranks) is what a
user gets with no flags.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .dist_harness import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "finetune.py"
PROMPT = "the capital of france is"


def readme_main_job() -> list[str]:
    """The `accelerate launch ... examples/finetune.py` line of the README's setup block."""
    lines = [line.split("#")[0].strip() for line in (ROOT / "README.md").read_text().splitlines()]
    found = [line for line in lines if line.startswith("accelerate launch") and "examples/finetune.py" in line]
    assert found, "README.md has no `accelerate launch ... examples/finetune.py` line"
    return shlex.split(found[0])


def launch(cmd: list[str], *, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run an `accelerate launch ...` command line with this interpreter, on a free port."""
    assert cmd[:2] == ["accelerate", "launch"], cmd
    full = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()), *cmd[2:]]
    proc = subprocess.run(full, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def finetune(*args: str, config: str = "fsdp2.yaml", processes: int | None = None) -> subprocess.CompletedProcess:
    launcher = ["--num_processes", str(processes)] if processes else []
    return launch(["accelerate", "launch", "--config_file", f"accelerate_configs/{config}", *launcher,
                   str(SCRIPT), *args])


def one_line(stdout: str, prefix: str) -> str:
    """The single stdout line starting with `prefix` (only rank 0 prints)."""
    lines = [line for line in stdout.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, f"expected one {prefix!r} line, got {lines}\n{stdout[-3000:]}"
    return lines[0]


def losses(stdout: str) -> tuple[float, float, float]:
    """(validation loss before, after, final train loss)."""
    before, after = map(float, re.fullmatch(r"validation loss (\S+) -> (\S+)", one_line(stdout, "validation loss"))
                        .groups())
    final = float(re.match(r"final train loss (\S+)", one_line(stdout, "final train loss")).group(1))
    return before, after, final


def greedy(model, tokenizer) -> str:
    inputs = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        ids = model.generate(**inputs, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(ids[0], skip_special_tokens=True)


def test_readme_main_job_trains_saves_reloads_and_samples(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cmd = readme_main_job()
    assert cmd == ["accelerate", "launch", "--config_file", "accelerate_configs/fsdp2.yaml", "examples/finetune.py"]
    out = tmp_path / "out"
    proc = launch([*cmd, "--output-dir", str(out), "--max-steps", "20"])
    assert "DistributedType.FSDP" in one_line(proc.stdout, "full fine-tune of the embedded tiny Llama on 2 cpu")
    before, after, _ = losses(proc.stdout)
    assert after < before - 1.0, (before, after)
    assert "tokens_per_s=" in proc.stderr and "20/20" in proc.stderr  # the progress bar (rank 0 only)
    assert proc.stderr.count(" 0/20 [") == 1  # one bar was started
    # A plain Hugging Face directory, written gather-free by `accelerator.save_model`.
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.hidden_size == 64 and (out / "model.safetensors").exists()
    tokenizer = AutoTokenizer.from_pretrained(out)
    sample = one_line(proc.stdout, "sample: ")
    assert sample.startswith(f"sample: {PROMPT}")
    assert sample == f"sample: {greedy(model, tokenizer)}"  # what rank 0 generated is what was saved


def test_lora_adapter_loads_with_peft(tmp_path):
    from peft import AutoPeftModelForCausalLM, PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "out"
    proc = finetune("--lora", "--output-dir", str(out), "--max-steps", "8", config="fsdp2_lora.yaml")
    before, after, _ = losses(proc.stdout)
    assert after < before
    assert (out / "adapter_model.safetensors").exists() and (out / "adapter_config.json").exists()
    assert not (out / "model.safetensors").exists()  # the adapter only; the seeded base is in base-model/
    adapter = load_file(out / "adapter_model.safetensors")
    assert any(".lora_B." in k and v.abs().max() > 0 for k, v in adapter.items())  # B starts at 0: it trained
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "base-model"), out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert one_line(proc.stdout, "sample: ") == f"sample: {greedy(model, tokenizer)}"
    # The gather-free adapter is what PEFT itself writes for the reloaded model (the adapted `lm_head`
    # brings its base weight along, PEFT's `save_embedding_layers="auto"`).
    model.save_pretrained(tmp_path / "peft")
    reference = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert sorted(adapter) == sorted(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(adapter[name], tensor, atol=0, rtol=0)
    # adapter_config.json names the base, so PEFT's one-call loader finds it too.
    assert greedy(AutoPeftModelForCausalLM.from_pretrained(out), tokenizer) == greedy(model, tokenizer)


def test_qlora_example_trains_on_a_sharded_4bit_base(tmp_path):
    """The README's QLoRA command: 4-bit base loaded by transformers, sharded by prepare(), adapter saved."""
    pytest.importorskip("bitsandbytes")
    from peft import PeftModel
    from transformers import AutoTokenizer

    sys.path.insert(0, str(ROOT / "examples"))
    from finetune import load_4bit

    out = tmp_path / "out"
    proc = finetune("--load-in-4bit", "--output-dir", str(out), "--max-steps", "4", config="fsdp2_qlora.yaml")
    before, after, _ = losses(proc.stdout)
    assert after < before
    assert (out / "adapter_model.safetensors").exists() and not (out / "model.safetensors").exists()
    model = PeftModel.from_pretrained(load_4bit(out / "base-model", torch.float32), out)
    assert one_line(proc.stdout, "sample: ") == f"sample: {greedy(model, AutoTokenizer.from_pretrained(out))}"


def test_resume_auto_continues_from_latest_complete_checkpoint(tmp_path):
    """2 processes save every 2 steps (asynchronously) and "crash" while saving step 6; `--resume auto` on 1 process
    (same global batch) picks step 4, skips the batches it consumed and ends exactly where the
    uninterrupted run ended. A one-file dataset (5% held out for validation) packs into 5 steps per
    epoch, so the resumed steps cross an epoch boundary."""
    from safetensors.torch import load_file

    out = tmp_path / "out"
    common = ["--dataset", "examples/data/validation.txt", "--output-dir", str(out), "--max-steps", "6",
              "--save-every", "2"]
    full = finetune(*common, "--batch-size", "4", "--save-async")  # checkpoints committed in the background
    assert "42 x 128-token sequences, 6 steps of 8 sequences" in full.stdout
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4", "step-6"]
    full_weights = load_file(out / "model.safetensors")
    (out / "checkpoints" / "step-6" / "COMPLETE.json").unlink()  # the save of step 6 never finished

    refused = subprocess.run([sys.executable, str(SCRIPT), *common], capture_output=True, text=True, cwd=ROOT)
    assert refused.returncode != 0 and "--resume auto" in refused.stderr  # old checkpoints are not overwritten

    resumed = finetune(*common, "--batch-size", "8", "--resume", "auto", processes=1)
    assert one_line(resumed.stdout, "resumed from") == f"resumed from {out / 'checkpoints' / 'step-4'} at step 4"
    assert " 2/6 [" not in resumed.stderr and " 6/6 [" in resumed.stderr  # the bar starts at step 4
    assert losses(resumed.stdout)[2] == pytest.approx(losses(full.stdout)[2], abs=1e-4)
    assert (out / "checkpoints" / "step-6" / "COMPLETE.json").exists()
    resumed_weights = load_file(out / "model.safetensors")
    for name, tensor in full_weights.items():
        torch.testing.assert_close(resumed_weights[name], tensor, atol=1e-4, rtol=1e-4)
