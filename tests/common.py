"""Tiny models, data and training loops shared by the single-process references and the ranks."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from hf_fsdp2.sharding import canonical_name

STEPS = 5
LR = 1e-2
GLOBAL_BATCH = 8
SEQ = 16


def tiny_config(**overrides) -> LlamaConfig:
    values = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False, attention_dropout=0.0)
    values.update(overrides)
    return LlamaConfig(**values)


def build_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config(**overrides)).float()


def lora(model, seed: int = 0, **overrides):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    values = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
                  init_lora_weights=False)  # random B too, so the adapter changes the output from step 0
    values.update(overrides)
    return get_peft_model(model, LoraConfig(**values))


def batches(steps: int = STEPS, batch: int = GLOBAL_BATCH, vocab: int = 128, seed: int = 1) -> list[torch.Tensor]:
    """Learnable sequences (each token is the previous + a per-row stride), so losses fall."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        stride = torch.randint(1, 4, (batch, 1), generator=g)
        out.append((start + stride * torch.arange(SEQ)) % vocab)
    return out


def local_rows(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = batch.shape[0] // world
    return batch[rank * per:(rank + 1) * per]


def optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)


def trained_one_step(rank: int, world: int):
    """(model, optimizer) after one sharded training step on this rank's rows: a model with
    optimizer state, for the checkpoint tests."""
    from hf_fsdp2 import shard_model

    model = build_model()
    shard_model(model)
    opt = optimizer(model)
    ids = local_rows(batches(1)[0], rank, world)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return model, opt


def train_step(model, opt, rank: int, world: int, seed: int) -> None:
    """One sharded step on this rank's rows of batch `seed`."""
    ids = local_rows(batches(1, seed=seed)[0], rank, world)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def tiny_benchmark_results(script: str, *args: str) -> dict:
    """`benchmarks/<script> --tiny *args` run whole; its results (the file it wrote is deleted: a tiny run's numbers
    are no result)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(repo / "benchmarks" / script), "--tiny", *args], capture_output=True,
                          text=True, timeout=600, cwd=repo)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    path = repo / proc.stdout.strip().splitlines()[-1].removeprefix("results: ")
    try:
        return json.loads(path.read_text())["results"]
    finally:
        path.unlink()


def saved_tensors(directory, weights_name: str | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a saved checkpoint's weights (or of `weights_name`), read whole."""
    from hf_fsdp2.checkpoint.safetensors_io import CheckpointFiles

    with (CheckpointFiles(directory) if weights_name is None else CheckpointFiles(directory, weights_name)) as files:
        return {name: files.read(name) for name in files.names()}


def reference_train(model, data: list[torch.Tensor], opt: torch.optim.Optimizer | None = None) -> list[float]:
    """One process, whole batches; `opt`: the optimizer to step (AdamW over the trainable ones by default)."""
    opt = opt if opt is not None else optimizer(model)
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def global_mean(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def sharded_train(model, data: list[torch.Tensor], rank: int, world: int, dp_rank: int | None = None,
                  dp_world: int | None = None, opt: torch.optim.Optimizer | None = None) -> list[float]:
    """Each rank trains on its rows of the global batch; FSDP averages the gradients. `opt`: the
    optimizer to step (one for the model's trainable parameters by default)."""
    dp_rank = rank if dp_rank is None else dp_rank
    dp_world = world if dp_world is None else dp_world
    opt = opt if opt is not None else optimizer(model)
    losses = []
    for ids in data:
        ids = local_rows(ids, dp_rank, dp_world)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss))
    return losses


def full_params(model) -> dict[str, torch.Tensor]:
    """Test-only gather of every parameter, by canonical name (collective)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[canonical_name(name)] = t.detach().float().clone()
    return out


def plain_params(model) -> dict[str, torch.Tensor]:
    return {canonical_name(n): p.detach().float().clone() for n, p in model.named_parameters()}


def assert_close_dicts(actual: dict, expected: dict, atol: float, rtol: float = 0.0) -> None:
    assert actual.keys() == expected.keys(), set(actual) ^ set(expected)
    for k in expected:
        torch.testing.assert_close(actual[k], expected[k], atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}")


# The collectives FSDP2's all-gather and reduce-scatter call (_fsdp_collectives.DefaultAllGather and
# DefaultReduceScatter): dist.all_gather_single / reduce_scatter_single from torch 2.13,
# all_gather_into_tensor / reduce_scatter_tensor in 2.11 and 2.12; each counted under its own name. SENT_ARG: which
# argument is the tensor a rank sends.
FSDP_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
FSDP_REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
SENT_ARG = {"all_gather_single": -1, "all_gather_into_tensor": 1}


@contextlib.contextmanager
def count_collectives() -> Iterator[dict[str, int]]:
    """Count the collectives FSDP2 issues (it calls them as `dist.<name>` at run time)."""
    names = [n for n in ("all_gather_single", "reduce_scatter_single", "all_reduce", "all_gather_into_tensor",
                         "reduce_scatter_tensor", "all_gather", "broadcast", "barrier", "all_to_all_single")
             if hasattr(dist, n)]  # torch 2.11/2.12 have no *_single
    counts = {n: 0 for n in names}
    counts["elements"] = 0  # tensor elements sent, summed over the calls
    counts["bytes"] = 0  # and their bytes
    originals = {n: getattr(dist, n) for n in names}

    def wrap(name):
        def counted(*args, **kwargs):
            counts[name] += 1
            where = SENT_ARG.get(name, 0) if name == FSDP_ALL_GATHER else 0
            if len(args) > abs(where) and isinstance(args[where], torch.Tensor):
                sent = args[where]
                counts["elements"] += sent.numel()
                counts["bytes"] += sent.numel() * sent.element_size()
            return originals[name](*args, **kwargs)
        return counted

    for n in names:
        setattr(dist, n, wrap(n))
    try:
        yield counts
    finally:
        for n, f in originals.items():
            setattr(dist, n, f)
