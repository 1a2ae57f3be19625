"""Safetensors header parsing: `hf_fsdp2.checkpoint.safetensors_io.read_layout` vs `safetensors.safe_open`.

Writes one file with N tiny tensors (default 400,000: a ~38 MB header), then times both readers
alternately (best of --repeats) and prints the ratio; the target is <= 2.0.

    python benchmarks/header_bench.py [--tensors 400000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_fsdp2.checkpoint.safetensors_io import FileWriter, TensorSpec, plan_file, read_layout  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=400_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "many.safetensors"
        specs = [TensorSpec(f"model.layers.{i // 10}.block.weight_{i % 10}", torch.float32, (2,))
                 for i in range(args.tensors)]
        layout = plan_file(path.name, specs)
        with FileWriter(path, layout, create=True, durable=False):
            pass

        def safetensors_keys():
            with safe_open(str(path), "pt") as f:
                return len(list(f.keys()))

        ours, theirs = [], []
        for _ in range(args.repeats):  # alternate, so both see the same machine load
            t = time.perf_counter()
            assert len(read_layout(path).specs) == args.tensors
            ours.append(time.perf_counter() - t)
            t = time.perf_counter()
            assert safetensors_keys() == args.tensors
            theirs.append(time.perf_counter() - t)
    ratio = min(ours) / min(theirs)
    print(f"{args.tensors} tensors, header {len(layout.header) / 1e6:.1f} MB: read_layout {min(ours):.3f} s, "
          f"safetensors {min(theirs):.3f} s, ratio {ratio:.2f} ({'PASS' if ratio <= 2.0 else 'FAIL'}: target <= 2.0)")


if __name__ == "__main__":
    main()
