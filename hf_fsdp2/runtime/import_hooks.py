"""Run a function once a module has been imported (at once if it already is).

`register()` patches the Transformers Trainer, but a plain Accelerate script never imports it, and
importing it costs about 2 s of CPU per process (`transformers.training_args` and `.trainer` pull in
peft, datasets and pandas): on 4 ranks, seconds of every launch. So the Trainer's seams are installed
when the script itself imports those modules, by a finder at the front of `sys.meta_path` that wraps
the real loader of the named modules only, runs the callbacks after the module's code, and then puts
the real loader back on the module (`__loader__`, `__spec__.loader`). The modules it may wrap are
declared in runtime/upstream.py (IMPORT_HOOK seams), which also changes `sys.meta_path` for it.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from typing import Callable

from . import upstream

_pending: dict[str, list[Callable[[], None]]] = {}
_watched: dict[str, Callable[[], None]] = {}  # run after every execution of the module: `importlib.reload` too
_lock = threading.RLock()


def when_imported(module: str, callback: Callable[[], None]) -> None:
    """`callback()` now if `module` is imported, else right after its import completes (once)."""
    with _lock:
        if module not in sys.modules:
            _pending.setdefault(module, []).append(callback)
            upstream.add_finder(_FINDER)
            return
    callback()


def cancel(module: str) -> None:
    """Forget the callbacks still waiting for `module`."""
    with _lock:
        _pending.pop(module, None)
        _drop_finder_if_idle()


def after_every_execution(module: str, callback: Callable[[], None]) -> None:
    """`callback()` after each later execution of `module`'s code (its import, `importlib.reload`), until
    `stop_watching(module)`. Reload finds a module's spec through `sys.meta_path` again, so the finder
    stays there while anything is watched."""
    with _lock:
        _watched[module] = callback
        upstream.add_finder(_FINDER)


def stop_watching(module: str) -> None:
    with _lock:
        _watched.pop(module, None)
        _drop_finder_if_idle()


def _drop_finder_if_idle() -> None:
    """With nothing pending or watched, the finder leaves `sys.meta_path` (call under `_lock`)."""
    if not _pending and not _watched:
        upstream.remove_finder(_FINDER)


def pending() -> list[str]:
    with _lock:
        return sorted(_pending)


def _run(module: str) -> None:
    with _lock:
        callbacks = _pending.pop(module, [])
        watcher = _watched.get(module)
        _drop_finder_if_idle()
    for callback in callbacks + ([watcher] if watcher is not None else []):
        callback()


class _Loader(importlib.abc.Loader):
    def __init__(self, loader, name: str):
        self._loader, self._name = loader, name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        upstream.unwrap_loader(module, self._loader)  # the real loader, before its code runs
        self._loader.exec_module(module)
        _run(self._name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _pending and fullname not in _watched:
            return None
        spec = upstream.spec_from_other_finders(self, fullname, path, target)
        if spec is None:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            upstream.wrap_loader(spec, lambda loader: _Loader(loader, fullname))
        return spec


_FINDER = _Finder()

__all__ = ["after_every_execution", "cancel", "pending", "stop_watching", "when_imported"]
