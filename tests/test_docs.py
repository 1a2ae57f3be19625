"""The docs site builds with MkDocs' strict flag (a broken link or anchor, a page missing from the nav, a
docstring mkdocstrings cannot read: each fails), and its generated references cover the code: the CLI page
every `hf-fsdp2` subcommand (from hf_fsdp2.cli.build_parser), the FSDP2Config page every field. The package's
built files (sdist and wheel, README.md as their long description) pass `twine check --strict`."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hf_fsdp2 import FSDP2Config

ROOT = Path(__file__).resolve().parents[1]


def _subcommands() -> list[str]:
    from hf_fsdp2.cli import build_parser

    actions = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return list(actions[0].choices)


@pytest.mark.launch
def test_the_docs_build_strictly_with_references_generated_from_the_code(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-3000:]
    cli = (site / "cli" / "index.html").read_text()
    assert "cli-reference" not in cli  # the hook replaced its marker
    missing = [name for name in _subcommands() if f"usage: hf-fsdp2 {name} " not in cli]
    assert not missing and len(_subcommands()) >= 7, f"docs/cli.md lacks the help of: {missing}"
    reference = (site / "config" / "index.html").read_text()
    missing = [f.name for f in dataclasses.fields(FSDP2Config)
               if f'id="hf_fsdp2.config.FSDP2Config.{f.name}"' not in reference]
    assert not missing, f"docs/config.md's FSDP2Config reference lacks: {missing}"
    # The README is not part of the site, so MkDocs does not check its links into it: here, each page and anchor.
    links = re.findall(r"\]\(docs/([\w/-]+)\.md(?:#([\w-]+))?\)", (ROOT / "README.md").read_text())
    assert links
    pages = {page: site / ("" if page == "index" else page) / "index.html" for page, _ in links}
    broken = [f"docs/{page}.md#{anchor}" for page, anchor in links
              if not pages[page].exists() or anchor and f'id="{anchor}"' not in pages[page].read_text()]
    assert not broken, f"README links to what the site does not have: {broken}"


@pytest.mark.launch
def test_the_built_sdist_and_wheel_pass_twine_check(tmp_path):
    # Built from a copy of what the package is made of: a build in the checkout writes its egg-info there, where
    # tests/test_package.py may be building the wheel at the same time.
    source = tmp_path / "source"
    shutil.copytree(ROOT / "hf_fsdp2", source / "hf_fsdp2", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, source / name)
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(source)],
                   check=True, capture_output=True, text=True, timeout=300)
    built = sorted(dist.glob("hf_fsdp2-*"))
    assert sorted(p.suffix for p in built) == [".gz", ".whl"], built  # the sdist, and the wheel built from it
    proc = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, built)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.count("PASSED") == 2, proc.stdout + proc.stderr
