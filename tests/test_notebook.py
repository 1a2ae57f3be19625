"""examples/peft_lora_fsdp2.ipynb, executed top to bottom in a real Jupyter kernel: its
`notebook_launcher` forks 2 gloo ranks that train a LoRA adapter with FSDP2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "peft_lora_fsdp2.ipynb"
PROMPTS = ["the capital of france is", "the cow says", "anna went to the"]


def python3_kernel() -> str:
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:  # ipykernel is installed but its spec is not registered
        from ipykernel.kernelspec import install

        install(user=True)
    return "python3"


def cell(nb, tag: str):
    found = [c for c in nb.cells if tag in c.metadata.get("tags", [])]
    assert len(found) == 1, f"one cell tagged {tag!r} expected"
    return found[0]


def stdout(c) -> str:
    return "".join(o.text for o in c.outputs if o.output_type == "stream" and o.name == "stdout")


def test_notebook_trains_plots_saves_reloads_and_generates(tmp_path):
    out = tmp_path / "adapter"
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert nb.metadata.kernelspec.name == "python3"
    # Override the parameters the way papermill does: a cell right after the tagged one.
    params = nb.cells.index(cell(nb, "parameters"))
    nb.cells.insert(params + 1, nbformat.v4.new_code_cell(f"OUTPUT_DIR = {str(out)!r}\nMAX_STEPS = 60"))
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name=python3_kernel(), record_timing=False,
                                     resources={"metadata": {"path": str(ROOT / "examples")}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, if any cell fails

    losses = json.loads((out / "losses.json").read_text())
    assert len(losses) == 60 and losses[-1] < losses[0] - 1.0, losses
    plot = cell(nb, "plot")
    first, last = map(float, re.search(r"loss (\S+) -> (\S+) over 60 steps", stdout(plot)).groups())
    assert (first, last) == (round(losses[0], 3), round(losses[-1], 3))
    assert any("image/png" in o.get("data", {}) for o in plot.outputs), "no inline PNG plot"

    # Gather-free adapter in the PEFT layout, reloaded with PeftModel.from_pretrained in the kernel.
    assert (out / "adapter_model.safetensors").stat().st_size > 0 and (out / "adapter_config.json").exists()
    assert not (out / "model.safetensors").exists()
    without, with_adapter = map(float, re.search(r"validation loss: (\S+) without the adapter, (\S+) with it",
                                                 stdout(cell(nb, "reload"))).groups())
    assert with_adapter < without - 1.0, (without, with_adapter)

    lines = stdout(cell(nb, "generate")).strip().splitlines()
    assert len(lines) == len(PROMPTS)
    for prompt, line in zip(PROMPTS, lines):
        assert line.startswith(prompt) and len(line.split()) > len(prompt.split()), line
