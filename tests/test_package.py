"""The built wheel (not the checkout) carries what the README tells users to launch with (issue 52)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_carries_the_accelerate_configs_and_the_startup_switch_and_the_cli_finds_them(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
                    str(ROOT)], check=True, capture_output=True, text=True, timeout=300)
    wheel = next(tmp_path.glob("hf_fsdp2-*.whl"))
    shipped = sorted(p.name for p in (ROOT / "accelerate_configs").iterdir())
    assert "fsdp2.yaml" in shipped and (ROOT / "accelerate_configs").resolve() == ROOT / "hf_fsdp2" / "configs"
    with zipfile.ZipFile(wheel) as z:
        for name in shipped:
            assert z.read(f"hf_fsdp2/configs/{name}") == (ROOT / "accelerate_configs" / name).read_bytes(), name
        # `hf-fsdp2 run`'s start-up switch: a folder for PYTHONPATH, not a package, shipped as package data
        assert z.read("hf_fsdp2/startup/sitecustomize.py") == (ROOT / "hf_fsdp2/startup/sitecustomize.py").read_bytes()
        # Metadata a registry reads, the version from its one place (hf_fsdp2.__version__)
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    import hf_fsdp2

    assert f"\nVersion: {hf_fsdp2.__version__}\n" in metadata and "\nRequires-Python: >=3.10\n" in metadata
    assert "Classifier: License :: OSI Approved :: Apache Software License" in metadata
    assert "Description-Content-Type: text/markdown" in metadata
    out = subprocess.run([sys.executable, "-m", "hf_fsdp2.cli", "config-file", "fsdp2.yaml"], check=True,
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert Path(out.stdout.strip().splitlines()[-1]).read_bytes() == (ROOT / "accelerate_configs" / "fsdp2.yaml").read_bytes()
    refused = subprocess.run([sys.executable, "-m", "hf_fsdp2.cli", "config-file", "nope.yaml"], capture_output=True,
                             text=True, timeout=120, cwd=tmp_path)
    assert refused.returncode == 1 and "not a shipped config; choose from" in refused.stderr and "fsdp2.yaml" in refused.stderr
