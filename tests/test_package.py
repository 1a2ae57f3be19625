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


def test_the_wheel_outside_the_checkout_runs_the_main_job_with_a_config_it_wrote(tmp_path):
    """Issue 52: the built wheel (not editable) in a fresh virtual environment (torch and the rest from this
    interpreter's packages), used from a folder outside the checkout: `hf-fsdp2 config` writes the Accelerate
    config for the example's model, and `accelerate launch` runs the README's main job with it (2 steps)."""
    import shutil

    from .dist_harness import run_launched

    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(ROOT)], check=True, capture_output=True, text=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("hf_fsdp2-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    _see_this_interpreters_packages(python)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True, text=True, timeout=300)
    work = tmp_path / "work"  # the example and its data, nothing else of the checkout
    shutil.copytree(ROOT / "examples", work, ignore=shutil.ignore_patterns("*.ipynb", "outputs"))
    where = subprocess.run([str(python), "-c", "import hf_fsdp2; print(hf_fsdp2.__file__)"], check=True,
                           capture_output=True, text=True, timeout=120, cwd=work).stdout.strip()
    assert where.startswith(str(venv)), where  # the wheel, not the checkout's editable install
    run_launched([str(python), "-m", "hf_fsdp2.cli", "config", str(work / "tiny-llama"), "-o", str(work / "cfg.yaml")],
                 cwd=work)
    assert "fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer" in (work / "cfg.yaml").read_text()
    out = run_launched([str(python), "-m", "accelerate.commands.launch", "--config_file", str(work / "cfg.yaml"),
                        str(work / "finetune.py"), "--max-steps", "2", "--output-dir", str(work / "out")], cwd=work,
                       timeout=600)
    assert (work / "out").is_dir() and any((work / "out").rglob("*.safetensors")), out.stdout[-2000:]


def _see_this_interpreters_packages(python: Path) -> None:
    """The new environment imports torch and the rest from where this interpreter does. `--system-site-packages`
    alone is not that when the suite runs in a virtual environment itself (the README's install in a venv): a venv
    made from a venv's Python shares the base interpreter's site-packages, not the venv's (issue 65). So a .pth
    file lists this interpreter's sys.path, less the checkout (the wheel must be what `import hf_fsdp2` finds) and
    the standard library the new environment has already; entries a .pth adds come after its own site-packages."""
    import sysconfig

    stdlib = [Path(sysconfig.get_paths()[key]) for key in ("stdlib", "platstdlib")]
    entries = [Path(p) for p in sys.path if p and Path(p).is_dir()]
    keep = [str(p) for p in entries if not any(p == d or d in p.parents for d in [ROOT, *stdlib])]
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True, timeout=120).stdout.strip()
    (Path(purelib) / "_hf_fsdp2_test_parent_packages.pth").write_text("".join(f"{p}\n" for p in dict.fromkeys(keep)))
