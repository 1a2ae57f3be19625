"""Cost markers, set from what each test calls (pyproject.toml declares them):

- `launch`: starts processes that import torch from scratch (`accelerate launch`, torchrun, a Python
  subprocess, a notebook kernel): seconds each on 2 cores, most of the suite's time.
- `ranks`: runs gloo ranks forked from the harness's fork server (tests/dist_harness.py): well
  under a second to start. A launcher's script run on forked workers (tests/launched_runs.py, `Forked`)
  is one of these; a test whose helper can run a script either way (`run_under`) carries both marks.

A test is marked when its function reaches, through the functions it names (its module's, or any
tests/ module's for names it imports locally), one of the entry points below. The harness checks
the marks at run time, so a test that launches without its mark fails by name instead of hiding
in `-m "not launch"`. `pytest -m "not launch"` is the quick loop; CI runs everything.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import pytest

from . import dist_harness

LONGEST = {"tests/test_compiled_collectives.py::test_compile_model_buckets_collectives_and_keeps_checkpoints",
           "tests/test_gpu_check.py::test_gpu_check_dry_run_runs_every_section"}
ENTRY_POINTS = {
    "launch": {"run_launched", "subprocess", "NotebookClient"},
    "ranks": {"run_ranks", "run_ranks_collecting_errors"},
}


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # nested functions, lambdas, comprehensions
            names |= _code_names(const)
    return names


def _reaches(fn, shared: dict, seen: set) -> set[str]:
    """The names `fn` reaches through test-suite functions, transitively."""
    code = getattr(fn, "__code__", None)
    if code is None or id(fn) in seen:
        return set()
    seen.add(id(fn))
    names = _code_names(code)
    out = set(names)
    for name in names:
        target = fn.__globals__.get(name, shared.get(name))
        if isinstance(target, types.FunctionType) and target.__module__.startswith("tests"):
            out |= _reaches(target, shared, seen)
    return out


def pytest_collection_modifyitems(items):
    for path in sorted(Path(__file__).parent.glob("*.py")):  # helpers a test imports only when it runs
        if not path.stem.startswith(("test_", "conftest", "__")):
            importlib.import_module(f"{__package__}.{path.stem}")
    shared = {}
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("tests") and module is not None:
            for name, value in vars(module).items():
                if isinstance(value, types.FunctionType):
                    shared.setdefault(name, value)
    for item in items:
        fn = getattr(item, "function", None)
        if fn is None:
            continue
        reached = _reaches(fn, shared, set())
        for marker, entry_points in ENTRY_POINTS.items():
            if reached & entry_points:
                item.add_marker(marker)
    # The costly modules first (one that launches, then one that forks ranks; in their order otherwise, a module's
    # tests kept together for its module-scoped fixtures): under `-n 2` the workers take the long tests while
    # there is still short work to even them out, instead of one worker ending alone on a two-minute test
    # (pyproject.toml's `--dist worksteal` lets an idle worker take the other's queue).
    # LONGEST: the tests CI's --durations listed over a minute, started before any other.
    cost: dict = {}
    for item in items:
        rank = 0 if item.get_closest_marker("launch") else 1 if item.get_closest_marker("ranks") else 2
        cost[item.module] = min(cost.get(item.module, 2), rank)
    items.sort(key=lambda item: -1 if item.nodeid in LONGEST else cost[item.module])


@pytest.fixture(autouse=True)
def _cost_marks_checked(request):
    """The harness refuses to launch or fork ranks for a test that lacks the mark (see above)."""
    dist_harness.CURRENT_MARKS = {m.name for m in request.node.iter_markers()}
    yield
    dist_harness.CURRENT_MARKS = None
