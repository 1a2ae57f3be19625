"""hf_fsdp2's start-up switch (`hf-fsdp2 run COMMAND ...`, hf_fsdp2/cli.py).

`hf-fsdp2 run` puts this folder first on PYTHONPATH and sets HF_FSDP2=1; Python imports
`sitecustomize` at start-up, so every Python process the command starts (accelerate launch and its workers,
torchrun's, a framework's own CLI) calls `hf_fsdp2.register()` before the user's code runs. Off unless
HF_FSDP2=1 (a name outside the HF_FSDP2_<FIELD> settings, which are FSDP2Config fields). The environment's own
sitecustomize, if any, is still run first.
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _run_previous_sitecustomize() -> None:
    """The next `sitecustomize` on sys.path (a distribution's, a virtualenv's), run as Python would have."""
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_run_previous_sitecustomize()
if os.environ.get("HF_FSDP2") == "1":
    import hf_fsdp2

    hf_fsdp2.register()
    if os.environ.get("RANK", "0") == "0":  # the launcher, or rank 0 of what it starts
        print(f"hf_fsdp2: registered at start-up (HF_FSDP2=1, hf-fsdp2 run) in pid {os.getpid()}",
              file=sys.stderr)
