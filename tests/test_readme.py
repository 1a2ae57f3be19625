"""The README and the docs pages stay true as the code changes: their runnable snippet runs, their command runs,
every file they name exists, the code layout (docs/internals.md) names every module, the FSDP2Config reference
describes every field, the README's Setup block is what CI runs (and Getting started shows the same block).
tests/test_docs.py builds the site itself."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

from hf_fsdp2 import FSDP2Config

from .dist_harness import run_launched, torchrun

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = {p.relative_to(ROOT / "docs").as_posix(): p.read_text() for p in sorted((ROOT / "docs").rglob("*.md"))}


def _page(page: str) -> str:
    """README.md, or a docs page by its path under docs/ (e.g. "planner.md")."""
    return README if page == "README.md" else DOCS[page]


def _blocks(language: str, page: str = "README.md") -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", _page(page), flags=re.S)


def _setup_block(page: str) -> str:
    return next(b for b in _blocks("bash", page) if b.startswith("pip install -c constraints.txt"))


def test_smallest_use_snippet_runs_under_torchrun(tmp_path):
    snippet = next(b for b in _blocks("python", "plain-pytorch.md")
                   if b.startswith("# torchrun --nproc_per_node 2 demo.py"))
    (tmp_path / "demo.py").write_text(snippet)
    run_launched(torchrun(2) + [str(tmp_path / "demo.py")], cwd=tmp_path, timeout=300)


def test_plan_command_runs(tmp_path):
    command = next(line for block in _blocks("bash", "planner.md") for line in block.splitlines()
                   if line.startswith("hf-fsdp2 plan"))
    from transformers import LlamaConfig

    # The command's llama8b/config.json: Llama-3-8B's shape.
    LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256).save_pretrained(tmp_path / "llama8b")
    args = command.split()[1:]
    proc = subprocess.run([sys.executable, "-m", "hf_fsdp2.cli", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_every_repository_path_it_names_exists():
    tokens = re.findall(r"(?<![\w/.-])((?:tests|benchmarks|examples|accelerate_configs|hf_fsdp2|docs)/[\w./*-]+)",
                        "\n".join([README, *DOCS.values()]))
    named = {t.rstrip(".") for t in tokens if not t.endswith("/") and "*" not in t}  # a directory, a pattern: skip
    missing = sorted(p for p in named if not (ROOT / p).exists() and not (ROOT / "hf_fsdp2" / p).exists())
    assert not missing, f"README or docs/ name paths that do not exist: {missing}"


def test_code_layout_names_every_module():
    layout = DOCS["internals.md"]
    modules = sorted(p.relative_to(ROOT / "hf_fsdp2") for p in (ROOT / "hf_fsdp2").rglob("*.py")
                     if p.name != "__init__.py")
    unnamed = [str(m) for m in modules if m.name not in layout]
    assert not unnamed, f"docs/internals.md's code layout does not name: {unnamed}"


def test_config_reference_describes_every_field():
    """docs/config.md renders FSDP2Config from its source (mkdocstrings reads it with griffe, as here): each
    dataclass field needs its attribute docstring, the string right below it, or the reference lacks it."""
    import griffe

    config = griffe.load("hf_fsdp2.config", search_paths=[str(ROOT)], resolve_aliases=False)["FSDP2Config"]
    undescribed = [f.name for f in dataclasses.fields(FSDP2Config)
                   if f.name not in config.members or config.members[f.name].docstring is None
                   or not config.members[f.name].docstring.value.strip()]
    assert not undescribed, f"FSDP2Config fields without a docstring (hf_fsdp2/config.py): {undescribed}"
    assert "::: hf_fsdp2.config.FSDP2Config" in DOCS["config.md"]


def test_setup_block_is_what_ci_runs():
    """.ci/run runs the README's install and test commands, no more and no fewer (the main job is the
    one Setup command CI leaves to tests/test_examples.py)."""
    readme = [line.split("  #")[0].strip() for line in _setup_block("README.md").splitlines() if line.strip()]
    readme = [c for c in readme if not c.startswith("accelerate launch")]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd "))]
    normalise = lambda c: c.removeprefix("python -m ")  # noqa: E731
    assert [normalise(c) for c in ci] == [normalise(c) for c in readme]


def test_getting_started_shows_the_readme_setup_block():
    assert _setup_block("getting-started.md") == _setup_block("README.md")
