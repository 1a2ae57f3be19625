"""Process group and device mesh: NCCL on CUDA, gloo on CPU; env://, tcp:// and file:// init."""

from __future__ import annotations

import contextlib
import datetime
import os
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..config import MODEL_SPLIT_DIMS, FSDP2Config
from . import collectives


def reshard(model: nn.Module) -> None:
    """Put every FSDP group of `model` back in its sharded state. A forward without backward (an
    evaluation step under `no_grad`) leaves groups with `reshard_after_forward=False` (the root,
    the last layer, the head) unsharded, so their registered parameters are the full tensors, not
    the sharded ones the optimizer holds. No communication: it only frees the gathered copies."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2's sharded parameters); any other tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor

SHARD_DIM = "dp_shard"
REPLICATE_DIM = "dp_replicate"
# A rank that dies inside a collective leaves the others waiting; this bounds the wait.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
_INIT_SCHEMES = ("env://", "tcp://", "file://")


# The device ranks that are threads of this process shard onto (tools/local_ranks.py sets it for its run; None:
# the GPU where there is one). One value for the process: every thread-rank of a run uses the same device.
_threads_device: str | None = None


def device_type() -> str:
    """The device FSDP2 shards onto: "cuda" when the default group runs NCCL (alone, or beside gloo
    as Accelerate's "cuda:nccl,cpu:gloo") or is one whose ranks all live in this process (torch's fake
    or threaded group: they carry any device's tensors, as NCCL would), on a GPU; else "cpu". Thread-ranks
    shard on the device their run chose (`threads_shard_on`)."""
    in_process = collectives.in_process_backend()
    if dist.is_initialized() and "nccl" not in str(dist.get_backend()) and in_process is None:
        return "cpu"
    if in_process == "threaded" and _threads_device is not None:
        return _threads_device
    return "cuda" if torch.cuda.is_available() else "cpu"


@contextlib.contextmanager
def threads_shard_on(device: str) -> Iterator[None]:
    """While it lasts, ranks under torch's threaded process group shard onto `device` ("cpu" or "cuda")."""
    global _threads_device
    if device not in ("cpu", "cuda"):
        raise ValueError(f"`device`={device!r} must be 'cpu' or 'cuda'.")
    previous, _threads_device = _threads_device, device
    try:
        yield
    finally:
        _threads_device = previous


def refuse_accelerator_model_on_host_backend(device_types: set[str], target: torch.device) -> None:
    """A model already on an accelerator, sharded where the default group carries only CPU tensors (gloo):
    FSDP2 moves a module's states to its mesh's device, so the model would leave the GPU unannounced and
    fail at the first batch (the first GPU run: "index is on cuda:0, different from other tensors on cpu").
    Refused by name instead."""
    stranded = sorted(t for t in device_types if t not in ("cpu", "meta"))
    if target.type == "cpu" and stranded:
        backend = dist.get_backend() if dist.is_initialized() else "no process group"
        raise ValueError(
            f"the model's parameters are on {stranded[0]}, but the default process group runs {backend!r}, "
            f"which hf_fsdp2 shards on the CPU (gloo carries CPU tensors): initialise with backend='nccl' "
            f"(one GPU per rank; Accelerate's 'cuda:nccl,cpu:gloo' works too), or build the model on the CPU.")


def local_world_size(world: int) -> int:
    """Ranks on this machine, as launchers export it (`LOCAL_WORLD_SIZE`); the RAM budget is split by it."""
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is None:
        return world
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= max(world, 1):
        raise ValueError(f"environment variable LOCAL_WORLD_SIZE={raw!r} must be an integer from 1 to the world "
                         f"size {world}; unset it or launch with torchrun / accelerate launch, which set it.")
    return value


def default_device() -> torch.device:
    if device_type() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_process_group(
    init_method: str = "env://",
    *,
    backend: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> None:
    """Initialise the default process group once (a no-op when one exists).

    `env://` reads MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE as torchrun and `accelerate launch` set them;
    `tcp://host:port` and `file:///path` need `rank` and `world_size`.
    """
    if dist.is_initialized():
        return
    if not isinstance(init_method, str) or not init_method.startswith(_INIT_SCHEMES):
        raise ValueError(f"`init_method`={init_method!r} must start with one of {', '.join(_INIT_SCHEMES)}.")
    if not init_method.startswith("env://") and (rank is None or world_size is None):
        raise ValueError(f"`init_method`={init_method!r} needs explicit `rank` and `world_size`.")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo", "cpu:gloo,cuda:nccl"):
        raise ValueError(f"`backend`={backend!r} must be 'nccl' or 'gloo'.")
    if backend == "nccl":
        if local_rank is None:
            # torchrun/accelerate export LOCAL_RANK; it is the only environment variable read here.
            local_rank = int(os.environ.get("LOCAL_RANK", (rank or 0) % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local_rank)
    kwargs = {} if rank is None else {"rank": rank, "world_size": world_size}
    dist.init_process_group(backend=backend, init_method=init_method, timeout=timeout, **kwargs)


def build_mesh(config: FSDP2Config | None = None) -> DeviceMesh:
    """A 1-D ("dp_shard",) mesh, or a 2-D ("dp_replicate", "dp_shard") mesh for HSDP; the shard ranks split
    further by the config's `sequence_split_dims` (FSDP2 shards over all of them, `data_parallel_mesh`); with
    `tp_size` > 1 a last "tp" dimension (neighbouring ranks: one machine's devices share a TP group).

    Collective: call on every rank.
    """
    if not dist.is_initialized():
        raise RuntimeError("No process group: call `hf_fsdp2.init_distributed()` (or launch with "
                           "torchrun / accelerate launch) before sharding.")
    config = config or FSDP2Config()
    config.refuse_unbuilt_dims()  # Accelerate's parallelism_config builds a "cp" dimension, hf_fsdp2 none
    replicate, shard = config.mesh_shape(dist.get_world_size())
    device = device_type()
    shape, names = ((shard,), (SHARD_DIM,)) if replicate == 1 else ((replicate, shard), (REPLICATE_DIM, SHARD_DIM))
    for name, size in config.sequence_split_dims():  # after dp_shard, before tp (Accelerate's order): neighbours
        at = names.index(SHARD_DIM)  # dp_shard splits into dp_shard x cp x sp, in that order
        shape, names = (*shape[:at], shape[at] // size, *shape[at + 1:], size), (*names, name)
    for name, size in config.model_split_dims():  # last: one machine's neighbouring devices split each layer
        shape, names = (*shape, size), (*names, name)
    override = None
    if device not in collectives.default_group_devices():
        # The default group cannot carry this device's tensors (e.g. "cuda:gloo" or NCCL while sharding
        # on the CPU): the mesh gets gloo groups of its own instead of reusing it.
        override = {dim: "gloo" for dim in range(len(shape))}
    return init_device_mesh(device, shape, mesh_dim_names=names, backend_override=override)


def init_distributed(
    init_method: str = "env://",
    *,
    backend: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    config: FSDP2Config | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> DeviceMesh:
    """Initialise the process group (if needed) and return the device mesh `config` asks for.

    Collective: call on every rank.
    """
    init_process_group(init_method, backend=backend, rank=rank, world_size=world_size, timeout=timeout)
    return build_mesh(config)


def flattened(mesh: DeviceMesh, dims: tuple[str, ...]) -> DeviceMesh:
    """The mesh's `dims` as one dimension named by joining them (row-major: the first dimension's rank is the
    slowest), on gloo where the mesh's own groups are (build_mesh: the default group cannot carry the mesh's
    device's tensors, e.g. NCCL while sharding on the CPU)."""
    flat = "_".join(dims)
    try:
        return mesh[flat]
    except KeyError:
        override = "gloo" if mesh.device_type not in collectives.default_group_devices() else None
        return mesh[dims]._flatten(flat, backend_override=override)


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: `mesh` without its "tp" dimension (the same mesh without one). With
    dimensions whose ranks hold slices of the same sequences ("cp", context parallelism, or the config's
    `sequence_split_dims`, "sp"), FSDP2 shards over dp_shard x those flattened ("dp_shard_cp", as Accelerate's
    own FSDP2 path names it; "dp_shard_sp"), so their gradients are averaged with the data-parallel ones."""
    names = mesh.mesh_dim_names or ()
    split = tuple(n for n in names if n not in (REPLICATE_DIM, SHARD_DIM, *MODEL_SPLIT_DIMS))
    if split:
        flat = "_".join((SHARD_DIM, *split))  # under CP: "dp_shard_cp", Accelerate's name
        try:
            shard_split = mesh[flat]  # Accelerate's build_device_mesh flattens dp_shard_cp already
        except KeyError:
            # the flattened group on gloo where the mesh's own groups are (build_mesh: the default group cannot
            # carry the mesh's device's tensors, e.g. NCCL while sharding on the CPU)
            override = "gloo" if mesh.device_type not in collectives.default_group_devices() else None
            shard_split = mesh[tuple(n for n in (SHARD_DIM, *split) if n in names)]._flatten(flat,
                                                                                              backend_override=override)
        return shard_split if REPLICATE_DIM not in names else mesh[(REPLICATE_DIM, flat)]
    rest = tuple(n for n in names if n not in MODEL_SPLIT_DIMS)
    if rest == names:
        return mesh
    return mesh[rest] if len(rest) > 1 else mesh[rest[0]]
