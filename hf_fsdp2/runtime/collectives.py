"""Every collective hf_fsdp2 issues itself (FSDP2's and DTensor's own run on the mesh and are not
listed), each on a group that can carry its tensors.

NCCL, the default group on GPUs, carries only CUDA tensors ("No backend type associated with device
type cpu"); gloo carries CPU tensors. So nothing here ever uses the default group:

- **Host data** (an error code, a memory budget): one int64 on the CPU over `host_group()`, a gloo
  group over the whole world created once (the default group itself where it already has a CPU
  backend: plain gloo, or Accelerate's "cuda:nccl,cpu:gloo"). Background saves agree on their own
  gloo group (`host_group("background-saves")`): a collective from the saving thread must never
  interleave with one from the training thread on the same group. Where every rank lives in this one
  process (`in_process_backend()`: torch's fake group, tools/simulate.py; its threaded group, ranks as
  threads, tools/local_ranks.py) no gloo peer exists to connect to: the side groups take the default
  group's backend, and they are kept per default group (each thread-rank has its own).
- **Data bound for the shards** (rank 0's weights, initial LoRA factors, 4-bit absmax): over the
  mesh's own groups, on the mesh's device (`mesh_device`), copied back to where the caller keeps it.

Inventory (tests/test_gpu_semantics.py runs each of them with a default group that refuses CPU
tensors, as NCCL does):

| caller                                          | collective       | group                  | device |
|-------------------------------------------------|------------------|------------------------|--------|
| checkpoint/atomic_dir.py `agree` (every save)   | all-reduce MAX   | host_group()           | CPU    |
| checkpoint/async_save.py (background commit)    | all-reduce MAX   | host_group("background-saves") | CPU |
| planner/layout.py `resolve_auto_layout`        | all-reduce MIN   | host_group()           | CPU    |
| sharding/generation.py memory budget           | all-reduce MIN   | host_group()           | CPU    |
| checkpoint/pretrained.py `from_pretrained` LoRA | broadcast        | the mesh, dim by dim   | mesh   |
| checkpoint/loading.py rank 0's rows            | broadcast        | the mesh, dim by dim   | mesh   |
| checkpoint/loading.py rank 0's 4-bit dtype      | all-reduce MAX   | host_group()           | CPU    |
| checkpoint/full_weights.py (vLLM weight sync)   | all-reduce SUM   | the mesh, dim by dim   | mesh   |
| quantization/bnb_4bit.py double-quant absmax    | all-gather       | the mesh's shard dim   | mesh   |
| sharding/expert_parallel/dispatch.py tokens per MoE call | all-reduce MAX   | ep ranks' gloo group   | CPU    |
| sharding/expert_parallel/dispatch.py tokens, expert ids, router weights | all-gather | the expert mesh's "ep" | mesh |
| sharding/expert_parallel/dispatch.py experts' weighted sums | reduce-scatter | the expert mesh's "ep" | mesh |
| sharding/sequence_parallel.py Ulysses around attention (and its backward) | all-to-all | the mesh's "sp" | mesh |
| sharding/sequence_parallel.py padding mask, token counts; per-token outputs (TRL) | all-gather | "sp" (with ring CP: the cp x sp ranks) | mesh |
| sharding/sequence_parallel.py the loss over the sp (x cp) ranks | all-reduce SUM | "sp" (with ring CP: the cp x sp ranks) | mesh |
| sharding/sequence_tiling.py tiled loss on a vocabulary-split lm_head (TP), per tile | all-reduce MAX, SUM | the head's mesh dimension | mesh |
| sharding/sequence_tiling.py its hidden states' gradient (TP) | all-reduce SUM | the head's mesh dimension | mesh |

Relies on `ProcessGroup._device_types` (torch >= 2.6; checked in tests/test_gpu_semantics.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

# (default group, purpose) -> group: ranks that are threads of one process (tools/local_ranks.py) each have a
# default group of their own, and must not share one rank's side group.
_host_groups: dict[tuple[object, str], object] = {}
# Backends whose ranks all live in this process: torch's fake group (torch/testing/_internal/distributed/fake_pg.py:
# one rank of N, the others do not exist) and its threaded group (multi_threaded_pg.py: every rank a thread).
IN_PROCESS_BACKENDS = ("fake", "threaded")


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def in_process_backend() -> str | None:
    """The default group's backend where all its ranks live in this process ("fake" or "threaded"), else None.
    Such a group carries tensors of any device (as NCCL carries the GPU's): FSDP2 shards on the GPU there."""
    if not dist.is_initialized():
        return None
    backend = str(dist.get_backend())
    return backend if backend in IN_PROCESS_BACKENDS else None


def is_simulated() -> bool:
    """The default group is torch's fake one (torch.testing._internal.distributed.fake_pg): this process runs
    one rank of a job whose other ranks do not exist; collectives move nothing (tools/simulate.py)."""
    return in_process_backend() == "fake"


def default_group_devices() -> set[str]:
    """The device types the default group has a backend for ({"cuda"} for NCCL, {"cpu"} for gloo)."""
    group = dist.distributed_c10d._get_default_group()
    types = {device.type for device in group._device_types}
    if not types and in_process_backend() is not None:
        # A process group written in Python (torch's threaded one) names none; its registration says what it carries.
        types = set(dist.Backend.backend_capability.get(str(dist.get_backend()), ()))
    return types


def default_group_timeout():
    """The default group's timeout, so side groups fail a dead peer as soon as training would."""
    group = dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 - no backend for that device, or no options on it
            continue
    return None


def host_group(purpose: str = "main"):
    """A group that carries CPU tensors over the whole world; None without a process group.

    Collective the first time for each `purpose` (it may create a group): call on every rank.
    """
    if not dist.is_initialized():
        return None
    if purpose == "main" and "cpu" in default_group_devices():
        return dist.group.WORLD
    key = (dist.distributed_c10d._get_default_group(), purpose)
    if key not in _host_groups:
        timeout = default_group_timeout()
        # Under torch's fake group (one rank of an N-rank job, `hf-fsdp2 simulate`) the side group is fake too, so
        # its collectives are counted and skipped like the rest; under the threaded one it is threaded too.
        backend = in_process_backend() or "gloo"
        _host_groups[key] = dist.new_group(backend=backend, **({"timeout": timeout} if timeout else {}))
    return _host_groups[key]


def forget_host_groups() -> None:
    """Drop the cached groups of this default group, or all without one (they die with the default group:
    `dist.destroy_process_group()`)."""
    if not dist.is_initialized():
        _host_groups.clear()
        return
    default = dist.distributed_c10d._get_default_group()
    for key in [k for k in _host_groups if k[0] is default]:
        del _host_groups[key]


def all_reduce_int(value: int, op: str, *, purpose: str = "main") -> int:
    """`value` reduced over every rank with "max" or "min" (CPU int64 on `host_group(purpose)`).
    Collective: call on every rank."""
    if not dist.is_initialized():
        return value
    flag = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(flag, op={"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op], group=host_group(purpose))
    return int(flag.item())


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device the mesh's collectives carry tensors on (the current CUDA device for a CUDA mesh)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def broadcast_from_first(tensor: torch.Tensor, mesh: DeviceMesh) -> None:
    """Overwrite `tensor` on every rank of `mesh` with its value on the mesh's first rank (coordinate
    (0, ..., 0), global rank 0 for meshes from `build_mesh`), in place, wherever `tensor` lives.

    One broadcast per mesh dimension: along dim d only the lines whose later coordinates are all 0
    hold the data yet. Collective: call on every rank of the mesh.
    """
    device = mesh_device(mesh)
    work = tensor if tensor.device == device and tensor.is_contiguous() else tensor.to(device).contiguous()
    coords = mesh.get_coordinate()
    assert coords is not None, "this rank is not part of the mesh"
    for dim in range(mesh.ndim):
        if all(c == 0 for c in coords[dim + 1:]):
            dist.broadcast(work, group=mesh.get_group(dim), group_src=0)
    if work is not tensor:
        tensor.copy_(work)


def sum_over_mesh(tensor: torch.Tensor, mesh: DeviceMesh) -> None:
    """`tensor` summed over every rank of `mesh`, in place (one all-reduce per mesh dimension of more
    than one rank). `tensor` must be on `mesh_device(mesh)`. Collective: call on every rank of the mesh."""
    for dim in range(mesh.ndim):
        if mesh.size(dim) > 1:
            dist.all_reduce(tensor, group=mesh.get_group(dim))


def all_gather_along(tensor: torch.Tensor, mesh: DeviceMesh, dim: int) -> list[torch.Tensor]:
    """Every rank's `tensor` (same shape everywhere) along mesh dimension `dim`, in mesh order, on
    `tensor`'s device. Collective: call on every rank of the mesh."""
    device = mesh_device(mesh)
    work = tensor.to(device).contiguous()
    pieces = [torch.empty_like(work) for _ in range(mesh.size(dim))]
    dist.all_gather(pieces, work, group=mesh.get_group(dim))
    return [piece.to(tensor.device) for piece in pieces]


__all__ = ["IN_PROCESS_BACKENDS", "all_gather_along", "all_reduce_int", "broadcast_from_first", "default_group_devices",
           "default_group_timeout", "host_group", "in_process_backend", "is_simulated", "mesh_device", "rank",
           "sum_over_mesh", "world_size"]
