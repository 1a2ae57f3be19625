"""train_bench.py's `traced_graph` contestant: the issue's "communication optimised by the compiler" tried on
this machine. A feasibility experiment, not an hf_fsdp2 feature (shard_model does not offer it yet).

torch 2.13 runs FSDP2's hooks `torch._dynamo.disable`d (`_fsdp_common._dynamo_disable`): a whole-model
`torch.compile` of a `fully_shard`ed model breaks the graph at every group and its collectives stay outside
inductor (the compiled-autograd "traceable FSDP2" path is gone). What torch's compiler passes now target is
SimpleFSDP's form (torchtitan/experiments/simple_fsdp): each parameter a DTensor sharded on dim 0 whose
*use* redistributes it to Replicate, so the all-gather is a functional collective in the forward graph and
its autograd (Partial -> Shard) the reduce-scatter in the backward graph. Inductor's FX passes
(`bucket_all_gathers_fx="only_fsdp"`, `bucket_reduce_scatters_fx="all"`, torch/_inductor/fx_passes/fsdp.py
and bucketing.py) then merge them into buckets. Here the "use" is a `torch.nn.utils.parametrize`
parametrization (public API; parameter names gain `.parametrizations.<name>.original`, so hf_fsdp2's
checkpoints do not apply; torchtitan swaps classes to keep names). Checked on 2 CPU ranks over gloo: losses
equal FSDP2's to 1e-6, eager and compiled.

    python benchmarks/traced_fsdp.py    # the tiny Llama, 2 ranks: collectives per step and step time of FSDP2
                                        # eager, FSDP2 + regional compile, traced eager / compiled / bucketed
"""

import torch
import torch.nn as nn
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor


class _GatherForCompute(nn.Module):
    """The parameter's use: all-gathered (cast to `param_dtype`) forward, gradient reduce-scattered (averaged)."""

    def __init__(self, param_dtype=None, reduce_dtype=None):
        super().__init__()
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype

    def forward(self, x):
        full = x.redistribute(placements=[Replicate()], forward_dtype=self.param_dtype,
                              backward_dtype=self.reduce_dtype)
        return full.to_local(grad_placements=[Partial("avg")])


def traced_fsdp(model: nn.Module, mesh, param_dtype=None, reduce_dtype=None) -> nn.Module:
    """Every parameter sharded on dim 0 over `mesh`, gathered where it is used (in place)."""
    from torch.nn.utils import parametrize

    seen = {}
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in seen:  # a tied weight stays one parameter
                seen[id(param)] = nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)]),
                                               requires_grad=param.requires_grad)
            module.register_parameter(name, seen[id(param)])
            parametrize.register_parametrization(module, name, _GatherForCompute(param_dtype, reduce_dtype),
                                                 unsafe=True)
    return model


def compile_with_bucketing(model: nn.Module) -> nn.Module:
    """Whole-model inductor compile with FSDP all-gathers and reduce-scatters bucketed by inductor."""
    import torch._inductor.config as inductor_config

    inductor_config.bucket_all_gathers_fx = "only_fsdp"
    inductor_config.bucket_reduce_scatters_fx = "all"
    return torch.compile(model)


def _collectives_per_step(rank: int, world: int, mode: str) -> dict:
    """One rank of `python benchmarks/traced_fsdp.py`: 5 steps of the tests' tiny Llama in `mode`; the
    collectives of the last step counted by torch.profiler (functional collectives inside compiled graphs
    bypass Python-level counters), step times, global-mean losses."""
    import time

    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    from hf_fsdp2 import FSDP2Config, shard_model
    from tests.common import batches, build_model, local_rows

    mesh = init_device_mesh("cpu", (world,))
    model = build_model()
    if mode in ("fsdp2_eager", "fsdp2_regional"):
        model = step = shard_model(model, FSDP2Config(compile=mode == "fsdp2_regional"))
    else:
        model = step = traced_fsdp(model, mesh)
        if mode == "traced_compiled":
            step = torch.compile(model)
        elif mode == "traced_bucketed":
            step = compile_with_bucketing(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, times, calls = [], [], {}
    data = batches(5)
    for i, ids in enumerate(data):
        ids = local_rows(ids, rank, world)
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss = step(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        times.append(time.perf_counter() - start)
        value = loss.detach().clone()
        torch.distributed.all_reduce(value)
        losses.append(value.item() / world)
    for event in prof.key_averages():
        if event.key.startswith("gloo:"):  # what reached the backend, whatever issued it
            calls[event.key] = event.count
    return {"losses": losses, "step_ms": [round(1000 * t, 1) for t in times], "gloo_calls_last_step": calls}


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.dist_harness import run_ranks

    for mode in sys.argv[1:] or ["fsdp2_eager", "fsdp2_regional", "traced_eager", "traced_compiled",
                                  "traced_bucketed"]:
        result = run_ranks(_collectives_per_step, 2, mode, timeout=1800)[0]
        print(f"{mode:16s} losses {[round(v, 5) for v in result['losses']]} step ms {result['step_ms']} "
              f"gloo calls (last step) {result['gloo_calls_last_step']}", flush=True)
