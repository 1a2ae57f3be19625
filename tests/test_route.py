"""A model's route through `shard_model` (issue 62), by benchmarks/route.py's tracer on two forked gloo ranks: the
entry looks the model's parts and record up once (sharding/model_parts.py and sharding/record.py each entered once)
and hands them to every step; returns to files the route already left (runtime/ apart) are no more than the files
it enters. Shown failing on a deliberate violation: a step that looks the record up again from the bare model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .dist_harness import run_ranks

ROUTE = Path(__file__).resolve().parents[1] / "benchmarks" / "route.py"
ONCE = {"sharding/record.py": 1, "sharding/model_parts.py": 1}


def _tracer():
    spec = importlib.util.spec_from_file_location("hf_fsdp2_route_benchmark", ROUTE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.trace_route


def _shard_model_routes(rank: int, world: int) -> dict:
    """shard_model's route as it is, and with wrap_generate (the engine's last step) looking the record up again."""
    import hf_fsdp2
    from hf_fsdp2.sharding import engine, record

    from .common import build_model, lora

    trace_route = _tracer()
    package = Path(hf_fsdp2.__file__).resolve().parent
    model = lora(build_model())
    routes = {"as_is": trace_route(lambda: hf_fsdp2.shard_model(model), model, package)}
    original = engine.wrap_generate

    def looked_up_again(model, record_):  # this forked rank's engine only
        record.record_of(model)
        return original(model, record_)

    engine.wrap_generate = looked_up_again
    try:
        other = lora(build_model(seed=1))
        routes["looked_up_again"] = trace_route(lambda: hf_fsdp2.shard_model(other), other, package)
    finally:
        engine.wrap_generate = original
    return routes


def test_shard_model_looks_the_model_up_once():
    routes = run_ranks(_shard_model_routes, 2)[0]
    as_is, violated = routes["as_is"], routes["looked_up_again"]
    assert as_is["entered"] == ONCE, " > ".join(as_is["route"])
    assert as_is["returns"] <= as_is["files"], " > ".join(as_is["route"])
    # the record looked up again from the bare model: record.py and model_parts.py entered a second time, at the end
    assert violated["entered"] == {"sharding/record.py": 2, "sharding/model_parts.py": 2}
    assert violated["route"][-3:-1] == ["sharding/record.py", "sharding/model_parts.py"]
