"""hf_fsdp2: PyTorch FSDP2 for Hugging Face models."""

from .config import FSDP2Config
from .distributed import build_mesh, init_distributed
from .sharding import no_sync, shard_model

__version__ = "0.1.0"

__all__ = [
    "FSDP2Config",
    "build_mesh",
    "init_distributed",
    "no_sync",
    "shard_model",
]
