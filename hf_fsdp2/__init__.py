"""hf_fsdp2: PyTorch FSDP2 for Hugging Face models."""

from .config import FSDP2Config
from .distributed import build_mesh, init_distributed
from .integrations.accelerate import register, unregister
from .pretrained import from_pretrained, load_pretrained, save_pretrained
from .safetensors_io import CheckpointError
from .sharding import no_sync, shard_model

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "FSDP2Config",
    "build_mesh",
    "from_pretrained",
    "init_distributed",
    "load_pretrained",
    "no_sync",
    "register",
    "save_pretrained",
    "shard_model",
    "unregister",
]
