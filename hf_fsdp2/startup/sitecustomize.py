"""hf_fsdp2's start-up switch (`hf-fsdp2 run COMMAND ...`, hf_fsdp2/cli.py).

`hf-fsdp2 run` puts this folder first on PYTHONPATH and sets HF_FSDP2=1; Python imports `sitecustomize` at
start-up, so every Python process the command starts (accelerate launch and its workers, torchrun's, a framework's
own CLI, but also `pip`, `python -c ...`) runs this file. Importing hf_fsdp2 here would import torch in each of them
(seconds of CPU for `python -c pass`), so it only puts a finder on `sys.meta_path`: `hf_fsdp2.register()` runs once
the process imports Accelerate or the Trainer (TRIGGERS), when the outermost import under way of a module
`register()` reaches into (WATCHED) has completed, so that it never meets one half made (`from transformers import
TrainingArguments` inside the Trainer's own import would fail, and the Trainer would go unpatched). A process that
imports neither has nothing for hf_fsdp2 to route and never loads it. Off unless HF_FSDP2=1 (a name outside the
HF_FSDP2_<FIELD> settings, which are FSDP2Config fields). `python -I`, `-E` and `-S` never read this folder: the
switch is off in such a process (cli.py warns when the command itself is one).

The environment's own sitecustomize, if any, still runs first, and stays the module `import sitecustomize` gives.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading

_HERE = os.path.dirname(os.path.abspath(__file__))
TRIGGERS = ("accelerate", "transformers.training_args", "transformers.trainer")
# What register() patches besides (transformers' from_pretrained, TRL's prepare_fsdp): a trigger imported inside
# one of these (trl/models/utils.py imports accelerate) waits for it to complete.
WATCHED = TRIGGERS + ("transformers.modeling_utils", "trl.models.utils")


def is_startup_folder(path: str) -> bool:
    """This folder in any install of hf_fsdp2 (this one, a copy, another checkout, by any link): each runs the
    environment's sitecustomize, so none may take another's for it (`hf-fsdp2 run hf-fsdp2 run ...` through two
    installs recursed until RecursionError)."""
    path = os.path.abspath(path or os.curdir)
    return (os.path.basename(path) == "startup" and os.path.basename(os.path.dirname(path)) == "hf_fsdp2"
            and os.path.isfile(os.path.join(path, "sitecustomize.py")))


def _run_previous_sitecustomize() -> None:
    """The next `sitecustomize` on sys.path (a distribution's, a virtualenv's), run as Python would have: in
    sys.modules under its name while it runs, and after (importlib returns what sys.modules holds at the end of
    an import, so `import sitecustomize` gives the environment's module, not this one)."""
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [p for p in sys.path if not is_startup_folder(p)])
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


def _load_upstream():
    """hf_fsdp2/runtime/upstream.py, the one module that changes `sys.meta_path` and loaders (its docstring), loaded
    by itself: imported as hf_fsdp2.runtime.upstream it would import the package, and torch, first. It imports the
    standard library only; nothing of its state is shared with the package's own copy but the declarations."""
    name = "_hf_fsdp2_startup_upstream"
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(_HERE), "runtime", "upstream.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class _Switch(importlib.abc.MetaPathFinder):
    """Wraps the loader of each WATCHED module (declared IMPORT_HOOK in upstream.py) to count the imports under way
    in this thread; registers at the end of the outermost, once a trigger has completed."""

    def __init__(self, upstream):
        self._upstream, self._depth, self._due, self._done = upstream, threading.local(), None, False
        self._lock = threading.Lock()

    def find_spec(self, fullname, path, target=None):
        if self._done or fullname not in WATCHED:
            return None
        spec = self._upstream.spec_from_other_finders(self, fullname, path, target)
        if spec is None:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            self._upstream.wrap_loader(spec, lambda loader: _Loader(loader, fullname, self))
        return spec

    def entered(self) -> None:
        self._depth.n = getattr(self._depth, "n", 0) + 1

    def left(self, name: str, completed: bool) -> None:
        self._depth.n -= 1
        if completed and name in TRIGGERS and self._due is None:
            self._due = name
        if not completed or self._due is None or self._depth.n:
            return
        with self._lock:
            if self._done:
                return
            self._done = True
        self._upstream.remove_finder(self)
        try:
            import hf_fsdp2

            hf_fsdp2.register()
        except BaseException as error:
            # Said here: the import that triggered this may sit in a library's `try: ... except ImportError`
            # (evaluate's and transformers' availability checks do), which would swallow the error and leave the
            # process silently unregistered.
            print(f"hf_fsdp2: registration at start-up (hf-fsdp2 run) FAILED on importing {self._due} in pid "
                  f"{os.getpid()}: {type(error).__name__}: {error}", file=sys.stderr)
            raise
        if os.environ.get("RANK", "0") == "0":  # the launcher, or rank 0 of what it starts
            print(f"hf_fsdp2: registered at start-up (HF_FSDP2=1, hf-fsdp2 run; on importing {self._due}) in pid "
                  f"{os.getpid()}", file=sys.stderr)


class _Loader(importlib.abc.Loader):
    def __init__(self, loader, name: str, switch: _Switch):
        self._loader, self._name, self._switch = loader, name, switch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._switch._upstream.unwrap_loader(module, self._loader)  # the real loader, before its code runs
        self._switch.entered()
        try:
            self._loader.exec_module(module)
        except BaseException:
            self._switch.left(self._name, completed=False)
            raise
        self._switch.left(self._name, completed=True)


try:
    _run_previous_sitecustomize()
finally:  # the environment's failing sitecustomize is reported by Python's site as usual; the switch stays on
    if os.environ.get("HF_FSDP2") == "1":
        _upstream = _load_upstream()
        _upstream.add_finder(_Switch(_upstream))
