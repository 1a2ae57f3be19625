"""hf_fsdp2: PyTorch FSDP2 for Hugging Face models."""

from .runtime import versions as _versions

_versions.check()  # before anything else: one clear line instead of an obscure failure later

from .runtime import exit_guard  # noqa: E402
from .config import FSDP2Config  # noqa: E402
from .runtime.distributed import build_mesh, init_distributed  # noqa: E402
from .integrations import accelerate as _accelerate_backend  # noqa: E402
from .integrations import trainer as _trainer_backend  # noqa: E402
from .checkpoint.pretrained import from_pretrained, load_pretrained, save_pretrained  # noqa: E402
from .checkpoint.errors import CheckpointError  # noqa: E402
from .checkpoint.state import latest_state, load_state, save_state  # noqa: E402
from .checkpoint import async_save as _async_save  # noqa: E402
from .runtime import host_allocator as _host_allocator  # noqa: E402
from .checkpoint.async_save import SaveHandle, wait_pending as wait_for_saves  # noqa: E402
from .sharding.engine import no_sync  # noqa: E402
from .sharding import grad_clip as _grad_clip  # noqa: E402
from .sharding.grad_clip import clip_grad_norm_  # noqa: E402
from .shard import shard_model  # noqa: E402
from .sharding.engine import local_batch  # noqa: E402
from .quantization.bnb_optimizers import prepare as prepare_optimizer  # noqa: E402

__version__ = "0.1.0"

# Every process that imports us exits cleanly after gloo collectives (see exit_guard.py).
exit_guard.install()


def register(**overrides) -> None:
    """Route Accelerate's FSDP2 (and the Transformers Trainer's saving/resuming) through hf_fsdp2.

    Idempotent. `overrides`: `FSDP2Config` fields Accelerate's yaml cannot carry (e.g.
    `frozen_dtype="bf16"`); `HF_FSDP2_<FIELD>` environment variables take precedence.
    """
    _accelerate_backend.register(**overrides)
    _trainer_backend.register()


def accelerator_config(accelerator) -> FSDP2Config:
    """The `FSDP2Config` that `accelerator.prepare` shards a model with in this launch: the Accelerate
    config's FSDP and parallelism settings, `register()`'s overrides and `HF_FSDP2_*` variables. Pass it
    to `from_pretrained` so the model arrives at `prepare` sharded as `prepare` would shard it (prepare
    keeps it and refuses, by name, a setting that differs)."""
    if getattr(getattr(accelerator, "state", None), "fsdp_plugin", None) is None:
        raise ValueError("`accelerator` has no FSDP plugin: launch with an FSDP Accelerate config "
                         "(accelerate launch --config_file accelerate_configs/fsdp2.yaml ...).")
    config = _accelerate_backend.config_from_accelerator(accelerator)
    # prepare applies the config file's activation checkpointing itself (Accelerate's fsdp2_apply_ac) and
    # checks a sharded model for it; a model sharded before prepare takes it here.
    return config.replace(activation_checkpointing=bool(accelerator.state.fsdp_plugin.activation_checkpointing))


def unregister() -> None:
    """Restore Accelerate's, the Trainer's and torch's own functions (every PATCHED entry of
    hf_fsdp2/runtime/upstream.py), after waiting for a background save."""
    _trainer_backend.unregister()
    _accelerate_backend.unregister()
    _async_save.unregister()
    _grad_clip.unregister()
    _host_allocator.release()  # the planner's glibc lever, if it pulled it (runtime/host_allocator.py)


__all__ = [
    "CheckpointError",
    "accelerator_config",
    "FSDP2Config",
    "SaveHandle",
    "build_mesh",
    "clip_grad_norm_",
    "from_pretrained",
    "init_distributed",
    "latest_state",
    "local_batch",
    "load_pretrained",
    "load_state",
    "no_sync",
    "prepare_optimizer",
    "register",
    "save_pretrained",
    "save_state",
    "shard_model",
    "unregister",
    "wait_for_saves",
]
