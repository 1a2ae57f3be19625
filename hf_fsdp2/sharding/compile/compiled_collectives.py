"""`compile="model"`: the whole training forward compiled with its data-parallel collectives in the graph,
so inductor buckets the all-gathers and reduce-scatters (the seeds' "Communication Optimization in the
Compiler").

torch 2.13 runs FSDP2's hooks `torch._dynamo.disable`d (`_fsdp_common._dynamo_disable`): compiling a
`fully_shard`ed model breaks the graph at every group, and its collectives stay outside inductor (the
compiled-autograd "traceable FSDP2" path is gone). What torch's compiler passes target instead is
SimpleFSDP's form (torchtitan/experiments/simple_fsdp/simple_fsdp.py, the model for this module): every
parameter is stored as a DTensor sharded on dim 0 over the data-parallel mesh (Replicate x Shard(0) under
HSDP), and each *use* redistributes it to Replicate, so the all-gather is a functional collective in the
forward graph and its autograd (Partial("avg") -> Shard(0)) the reduce-scatter (HSDP: and all-reduce) in
the backward graph. Inductor's FX passes (`bucket_all_gathers_fx="only_fsdp"`,
`bucket_reduce_scatters_fx="all"`: torch/_inductor/fx_passes/fsdp.py, bucketing.py) then merge them into
buckets of `bucket_cap_mb` (default: one decoder layer's gathered bytes, FSDP2's granularity).

The "use" is a property on the module's class (torchtitan's `_register_parametrization`: the module's
class is swapped for a subclass of the same name), so parameter names, `state_dict` keys, hf_fsdp2's
checkpoints and `save_pretrained`'s `architectures` are unchanged: the stored parameters are DTensors
sharded on dim 0 as FSDP2's are. Unlike torchtitan's, the property gathers only inside the model's
forward (`_inside_forward`); outside it (checkpoint code, LoRA merge, a user reading `.weight`) a module
attribute is the stored shard, as under FSDP2.

Training forwards (grad enabled, `model.training`) run the compiled graph; evaluation and `generate` run
the same forward eagerly, each use gathering its parameter, except that inside `generate()` each parameter
is gathered once per call and kept when the model fits (`_Use.gathered_once`, the record's `gather`, from
sharding/generation.py). `reshard_after_forward` and
activation checkpointing are recompute tags on the joint graph (`_JointPasses`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from ...config import FSDP2Config
from ...quantization import quantized
from ...runtime import collectives, upstream
from ...runtime.distributed import data_parallel_mesh
from ..record import ShardedModel

_inside = 0  # > 0 while a traced model's forward runs: properties gather


@contextlib.contextmanager
def _inside_forward() -> Iterator[None]:
    global _inside
    _inside += 1
    try:
        yield
    finally:
        _inside -= 1


class _Use:
    """A stored parameter's use in forward: all-gathered over the mesh (cast to `param_dtype` first, as
    FSDP2 casts before its all-gather), its gradient reduce-scattered (all-reduced over a replicate dim)
    as an average, in `reduce_dtype`."""

    def __init__(self, mesh: DeviceMesh, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None):
        self.compute = [Replicate()] * mesh.ndim
        self.grad = [Partial("avg")] * mesh.ndim
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.kept: dict[int, torch.Tensor] | None = None  # inside `gathered_once`: gathered weights by id

    def __call__(self, stored: DTensor) -> torch.Tensor:
        if self.kept is not None and not torch.is_grad_enabled():
            if id(stored) not in self.kept:
                self.kept[id(stored)] = self._gather(stored)
            return self.kept[id(stored)]
        return self._gather(stored)

    def _gather(self, stored: DTensor) -> torch.Tensor:
        param_dtype = self.param_dtype if stored.is_floating_point() else None
        full = stored.redistribute(placements=self.compute, forward_dtype=param_dtype,
                                   backward_dtype=self.reduce_dtype if stored.requires_grad else None)
        return full.to_local(grad_placements=self.grad)

    def gathered_bytes(self, model: nn.Module) -> int:
        return _gathered_bytes((p for p in model.parameters() if isinstance(p, DTensor)), self.param_dtype)

    @contextlib.contextmanager
    def gathered_once(self, model: nn.Module, budget: int) -> Iterator[bool]:
        """Inside the block (generation), each parameter is gathered at its first use without gradient and
        kept, when the model's gathered weights fit `budget` bytes (the same on every rank); yields whether
        they do. Otherwise every use gathers again, as in training. Not re-entrant by design: an inner block
        keeps the outer one's weights."""
        if self.kept is not None or self.gathered_bytes(model) > budget:
            yield self.kept is not None
            return
        self.kept = {}
        try:
            yield True
        finally:
            self.kept = None


def _gathering_property(name: str, use: _Use) -> property:
    def get(module: nn.Module) -> Any:
        stored = module._parameters[name]
        return use(stored) if _inside and isinstance(stored, DTensor) else stored
    return property(get)


_SEAM = "torch.nn.Module.__getattr__"


def _swap_class(module: nn.Module, members: dict[str, Any]) -> None:
    """`module` becomes an instance of a subclass of its class with the same name, holding `members`: a
    class property is found before `nn.Module.__getattr__`, which reads `_parameters` only when ordinary
    lookup fails (runtime/upstream.py seam)."""
    cls = type(module)
    swapped = type(cls.__name__, (cls,), {"__qualname__": cls.__qualname__, "__module__": cls.__module__,
                                          **members})
    upstream.set_class(module, swapped, _SEAM)


def unsupported(model: nn.Module) -> list[str]:
    """What `compile="model"` cannot honour on this model (the config's own conflicts, the model-parallel sizes a
    mesh gives included, are refused by FSDP2Config: the engine sets them from the mesh before this runs)."""
    reasons = []
    if quantized.has_quantized_layers(model):
        reasons.append("4-bit base weights (their packed rows and quantization state are FSDP2's)")
    return reasons


def apply(model: nn.Module, config: FSDP2Config, mesh: DeviceMesh, ignored: set, layers: list[nn.Module],
          checkpointed: list[nn.Module], record: ShardedModel, kept_ops: frozenset = frozenset()) -> None:
    """Store every parameter of `model` (but `ignored`) sharded on dim 0 over `mesh`'s data-parallel
    dimensions, gathered where it is used; compile the root's training forward with bucketed collectives
    (buckets of `bucket_cap_mb`, by default the largest of the decoder `layers` gathered), recomputing the
    `checkpointed` layers in backward but the outputs of `kept_ops` (the engine's: selective checkpointing's). The
    gather is kept in the model's `record` (generation reads it)."""
    reasons = unsupported(model)
    if reasons:
        raise ValueError("compile='model' (collectives in the compiled graph) cannot honour "
                         + "; ".join(reasons) + ". Use compile=True (regional) or drop the setting.")
    mesh = data_parallel_mesh(mesh)
    names = {id(module): name for name, module in model.named_modules()}
    passes = _JointPasses(reshard=config.reshard_after_forward, kept_ops=kept_ops,
                          checkpointed=[names[id(layer)] for layer in checkpointed])
    sharded = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    use = record.gather = _Use(mesh, config.param_dtype, config.reduce_dtype)
    stored: dict[int, nn.Parameter] = {}  # a tied weight stays one parameter
    for module in list(model.modules()):
        own = []
        for name, param in list(module.named_parameters(recurse=False)):
            if param in ignored:
                continue
            if id(param) not in stored:
                # Each rank keeps its own rows without communication (src_data_rank=None), as
                # `fully_shard` does: ranks built the same weights (seeded, or loaded after). A 0-dim
                # parameter is replicated (its gradient still averaged).
                placements = sharded if param.dim() else [Replicate()] * mesh.ndim
                shard = distribute_tensor(param.detach(), mesh, placements, src_data_rank=None)
                stored[id(param)] = nn.Parameter(shard, requires_grad=param.requires_grad)
            module.register_parameter(name, stored[id(param)])
            own.append(name)
        members = {name: _gathering_property(name, use) for name in own}
        if module is model:
            members["forward"] = _root_forward(type(model).forward, _backend(_inductor_options(config, layers), passes))
            members["set_requires_gradient_sync"] = _set_requires_gradient_sync
        if members:
            _swap_class(module, members)


def _root_forward(original, backend):
    """The root's forward: its properties gather inside it; training forwards run compiled (one compiled
    callable per model, made at its first training forward), the others eagerly."""
    compiled: dict[str, Any] = {}  # the class is this model's own (`_swap_class`): one compiled callable

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        with _inside_forward():
            if not (self.training and torch.is_grad_enabled()):
                return original(self, *args, **kwargs)
            if "forward" not in compiled:
                # One graph or none: at a graph break the collectives on either side could not be bucketed
                # together, and torch 2.13 cannot compile a partial graph whose DTensor inputs come out
                # aliased (Llava's forward, for one).
                compiled["forward"] = torch.compile(functools.partial(original, self), backend=backend,
                                                    fullgraph=True)
            try:
                return compiled["forward"](*args, **kwargs)
            except torch._dynamo.exc.Unsupported as error:
                reason = str(error).strip().splitlines()[0]
                raise ValueError(f"compile='model' needs {type(self).__name__}'s training forward to compile as "
                                 f"one graph, and dynamo breaks it: {reason}. Use compile=True (regional "
                                 "compilation of the decoder layers) for this model.") from error
    return forward


def _inductor_options(config: FSDP2Config, layers: list[nn.Module]) -> dict:
    """Inductor's bucketing passes, with a bucket cap: `bucket_cap_mb`, or else one decoder layer's gathered
    bytes, so about one layer's weights are in flight at a time, as with FSDP2's per-layer groups (torch's
    own default, 2 GB, would gather a small model whole in one bucket)."""
    cap = float(config.bucket_cap_mb) if config.bucket_cap_mb is not None else _layer_mb(layers, config.param_dtype)
    options: dict[str, Any] = {"bucket_all_gathers_fx": "only_fsdp", "bucket_reduce_scatters_fx": "all",
                               "bucket_all_reduces_fx": "all"}
    for kind in ("all_gathers", "reduce_scatters", "all_reduces"):
        options[f"bucket_{kind}_fx_bucket_size_determinator"] = functools.partial(_constant_cap, cap)
    return options


def _constant_cap(cap: float, _bucket_index: int) -> float:
    return cap  # module-level (under functools.partial) so inductor's cache can pickle the option


def _layer_mb(layers: list[nn.Module], param_dtype: torch.dtype | None) -> float:
    """The largest layer's parameters as gathered, in MiB; 1 without layers."""
    return max((_gathered_bytes(layer.parameters(), param_dtype) for layer in layers), default=0) / 2**20 or 1.0


def _gathered_bytes(params, param_dtype: torch.dtype | None) -> int:
    """Bytes of `params` gathered whole: floating ones in `param_dtype` when set (the cast precedes the gather)."""
    return sum(p.numel() * (param_dtype.itemsize if param_dtype and p.is_floating_point() else p.element_size())
               for p in params)


def _backend(inductor_options: dict, passes: "_JointPasses"):
    """Inductor with the bucketing options; `passes` tag the joint graph before the partitioner splits it
    into forward and backward (torch._functorch.config.joint_custom_pass)."""
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        # AOT autograd's cache leaves joint_custom_pass out of its key (functorch config
        # `_save_config_ignore`): a graph cached by another setting (or none) would come back with other
        # recompute tags, so it is not used for these graphs (inductor's own cache keys the partitioned ones).
        with functorch_config.patch(joint_custom_pass=passes, enable_autograd_cache=False,
                                    enable_remote_autograd_cache=False):
            return compile_fx(gm, example_inputs, config_patches=inductor_options)
    return backend


class _JointPasses:
    """What the partitioner recomputes in backward, said as `recompute` tags on the joint graph's forward
    nodes (the tags torch's own checkpoint puts there: torch/utils/checkpoint.py, `_CachingTorchDispatchMode`):

    - activation checkpointing: every forward node run inside a checkpointed layer (its `nn_module_stack`
      names the layer) is PREFER_RECOMPUTE, one `ac_graph_id` per layer; the `kept_ops` the engine hands over
      (op-level selective checkpointing's matmuls and attention) are MUST_SAVE; random ops (dropout, attention
      kernels) are saved (`_seeded`). torch's `checkpoint` (CheckpointWrapper) around a layer failed here
      ("expected all tensors_saved_with_vc_check to be Tensors", torch 2.13): it recomputes the layer's
      attention kernel, a seeded op, which `_seeded` explains; these tags keep it saved instead.
    - reshard after forward: each parameter all-gather (torch's `is_fsdp_all_gather`: fed by one graph
      input), its wait, the cast before it and the views after it are MUST_RECOMPUTE (gathered again in
      backward) or, with `reshard_after_forward=False`, MUST_SAVE (torchtitan's
      simple_fsdp/reshard_after_forward.py)."""

    def __init__(self, reshard: bool, kept_ops: frozenset, checkpointed: list[str]):
        self.reshard, self.kept_ops, self.checkpointed = reshard, kept_ops, checkpointed

    def __call__(self, gm: torch.fx.GraphModule, _inputs: Any = None) -> torch.fx.GraphModule:
        if self.checkpointed:
            self._tag_checkpointed(gm)
        self._tag_gathers(gm)
        gm.recompile()
        return gm

    def _layer_of(self, node: torch.fx.Node) -> int | None:
        for source, _type in (node.meta.get("nn_module_stack") or {}).values():
            for index, name in enumerate(self.checkpointed):
                # dynamo names modules by their source: "L['fn'].args[0].model.layers.3"
                if source.endswith("." + name) or source.endswith("]" + name) or source == name:
                    return index
        return None

    def _tag_checkpointed(self, gm: torch.fx.GraphModule) -> None:
        from torch.utils.checkpoint import CheckpointPolicy

        kept_tuples: set[torch.fx.Node] = set()  # tuple-valued ops whose outputs are saved
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.meta.get("partitioner_tag") == "is_backward":
                continue
            layer = self._layer_of(node)
            if layer is None:
                continue
            if node.target is operator.getitem:
                parent = node.args[0]
                if parent in kept_tuples:
                    policy = CheckpointPolicy.MUST_SAVE
                elif "recompute" in parent.meta:
                    policy = parent.meta["recompute"]
                else:
                    continue
            elif _seeded(node) or node.target in self.kept_ops:
                if isinstance(node.meta.get("val"), (tuple, list)):
                    kept_tuples.add(node)  # a tuple is not saved itself: its getitems are
                    continue
                policy = CheckpointPolicy.MUST_SAVE
            else:
                policy = CheckpointPolicy.PREFER_RECOMPUTE
            node.meta["recompute"] = policy
            node.meta["ac_graph_id"] = layer + 1

    def _tag_gathers(self, gm: torch.fx.GraphModule) -> None:
        from torch._inductor.fx_passes.bucketing import is_all_gather_into_tensor, is_wait_tensor
        from torch.utils.checkpoint import CheckpointPolicy

        policy = CheckpointPolicy.MUST_RECOMPUTE if self.reshard else CheckpointPolicy.MUST_SAVE

        def tag(node: torch.fx.Node) -> None:
            node.meta["recompute"] = policy
            node.meta["ac_graph_id"] = 100000  # a region of its own, apart from the layers'

        for node in list(gm.graph.nodes):
            if not (is_wait_tensor(node) and is_all_gather_into_tensor(node.args[0])
                    and _is_fsdp_all_gather(node.args[0])):
                continue
            gather = node.args[0]
            tag(gather)
            tag(node)
            source = gather.all_input_nodes[0]
            if source.op == "call_function" and source.target == torch.ops.prims.convert_element_type.default:
                tag(source)
            user = node
            while len(user.users) == 1:
                user = next(iter(user.users))
                if not (user.op == "call_function" and getattr(user.target, "is_view", False)):
                    break
                tag(user)


def _seeded(node: torch.fx.Node) -> bool:
    """A random op (dropout; every attention kernel is tagged so, dropout or not). Its outputs are saved, not
    recomputed: a recomputed random op makes the partitioner thread RNG states out of the forward graph
    after the saved DeviceMesh objects, and AOT autograd then takes one of those states for the mesh
    (torch 2.13, `functionalize_rng_ops`)."""
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def is_traced(record: ShardedModel | None) -> bool:
    """A model of this record was sharded with compile="model" (the record holds the gather)."""
    return record is not None and record.gather is not None


def _set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
    """FSDPModule's switch, which Accelerate's `no_sync` (gradient accumulation) and hf_fsdp2.no_sync call:
    here gradients are reduce-scattered in every backward regardless (`say_no_sync_reduces`)."""
    if not requires_gradient_sync:
        say_no_sync_reduces()


@functools.cache
def say_no_sync_reduces() -> None:
    """`no_sync` cannot keep gradients unreduced here: a stored parameter's gradient is its shard, so each
    backward reduce-scatters (the sum of averages is the average of the sums: the same result, more
    communication). Said once, on rank 0."""
    if collectives.rank() == 0:
        logging.getLogger("hf_fsdp2").warning(
            "no_sync under compile='model': gradients are still reduce-scattered at every micro-step (the "
            "gradient a parameter holds is its shard); the result is the same, the communication is not saved.")


__all__ = ["apply", "is_traced", "unsupported"]


def _is_fsdp_all_gather(gather: torch.fx.Node) -> bool:
    """torch's test that an all-gather gathers a parameter (one placeholder among its ancestors). torch 2.13+
    finds the ancestors itself; 2.11 and 2.12 take a map of every node's ancestors, built here for this one."""
    import inspect

    from torch._inductor.fx_passes.bucketing import is_fsdp_all_gather
    from torch.utils._ordered_set import OrderedSet

    if inspect.signature(is_fsdp_all_gather).parameters["all_node_ancestors"].default is not inspect.Parameter.empty:
        return is_fsdp_all_gather(gather)
    ancestors, stack = OrderedSet(), list(gather.all_input_nodes)
    while stack:
        node = stack.pop()
        if node not in ancestors:
            ancestors.add(node)
            stack.extend(node.all_input_nodes)
    return is_fsdp_all_gather(gather, {gather: ancestors})
