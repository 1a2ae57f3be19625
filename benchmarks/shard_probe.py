"""What hf_fsdp2 sharded on each rank of a framework's own command (benchmarks/axolotl_cli.py,
benchmarks/llamafactory_cli.py): `install` (from a `sitecustomize` the script puts on PYTHONPATH, beside this
folder) wraps the function Accelerate's prepare shards with (`checkpoint/loading.shard_and_fill`: plan, then fill)
so that every rank writes what it got; `read` gathers those reports and says whether every rank was sharded.
The scripts' probe, not part of hf_fsdp2.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def install(probe_dir: str) -> None:
    from hf_fsdp2.checkpoint import loading

    shard = loading.shard_and_fill

    def recording_shard_and_fill(model, *args, **kwargs):
        out = shard(model, *args, **kwargs)
        from torch.distributed.tensor import DTensor

        q = next(p for n, p in out.named_parameters() if "layers.0.self_attn.q_proj" in n and n.endswith("weight"))
        report = {"rank": int(os.environ.get("RANK", 0)), "params": sum(1 for _ in out.parameters()),
                  "dtensor": sum(isinstance(p, DTensor) for p in out.parameters()),
                  "q_proj_rows": [q.to_local().shape[0], q.shape[0]] if isinstance(q, DTensor) else None,
                  "q_proj_dtype": str(q.dtype)}  # torch.uint8: the packed 4-bit base (QLoRA)
        with open(os.path.join(probe_dir, f"rank{report['rank']}.json"), "w") as f:
            json.dump(report, f)
        return out

    loading.shard_and_fill = recording_shard_and_fill


def read(probe_dir: Path, processes: int) -> tuple[list[dict], bool]:
    """The ranks' reports, and whether each rank's parameters are all DTensors with q_proj split by rows."""
    probes = [json.loads(p.read_text()) for p in sorted(Path(probe_dir).glob("rank*.json"))]
    sharded = len(probes) == processes and all(
        p["dtensor"] == p["params"] and p["q_proj_rows"] and p["q_proj_rows"][0] < p["q_proj_rows"][1] for p in probes)
    return probes, sharded
