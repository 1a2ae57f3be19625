"""Shard size 1 trains with DDP's reducer (sharding/replication.py): plain parameters under torch's
composable `replicate`, behind the same API as FSDP2 groups. Compared with one process and with FSDP2
sharding: losses, gradient accumulation, checkpoints across layouts (both ways), loaders, generation,
and what is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_fsdp2 import FSDP2Config
from tests.common import (batches, build_model, full_params, local_rows, lora, optimizer, reference_train,
                          saved_tensors, sharded_train)
from tests.dist_harness import run_ranks

WORLD = 2
REPLICATED = dict(replicate_size=WORLD, shard_size=1)


def _is_ddp(model) -> bool:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from hf_fsdp2.sharding.replication import is_replicated

    return (is_replicated(model) and not any(isinstance(m, FSDPModule) for m in model.modules())
            and not any(isinstance(p, DTensor) for p in model.parameters()))


def _replicated_surface(rank: int, world: int, root: str) -> dict:
    import hf_fsdp2
    from hf_fsdp2 import load_state, no_sync, save_pretrained, save_state, shard_model
    from hf_fsdp2.checkpoint import loading
    from hf_fsdp2.runtime.distributed import build_mesh
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from transformers import LlamaForCausalLM

    root = Path(root)
    out: dict = {}
    data = batches(3)
    model = shard_model(build_model(), FSDP2Config(**REPLICATED))
    out["ddp"] = _is_ddp(model) and type(model).__name__ == "DDPLlamaForCausalLM"
    # A comm hook registered after shard_model (torch queues it once the reducer exists) still applies.
    reduced: list[int] = []

    def counting_allreduce(state, bucket):
        reduced.append(bucket.buffer().numel())
        return default_hooks.allreduce_hook(None, bucket)

    model.register_comm_hook(state=None, hook=counting_allreduce)
    opt = optimizer(model)
    out["losses"] = sharded_train(model, data[:2], rank, world, opt=opt)
    out["reduced_per_step"] = sum(reduced) / 2
    # Gradient accumulation: the first half of the rank's rows under no_sync, the second half synced.
    ids = local_rows(data[2], rank, world)
    half = ids.shape[0] // 2
    reduced.clear()
    with no_sync(model):
        (model(input_ids=ids[:half], labels=ids[:half]).loss / 2).backward()
    out["reduced_in_no_sync"] = sum(reduced)
    (model(input_ids=ids[half:], labels=ids[half:]).loss / 2).backward()
    opt.step()
    opt.zero_grad()
    out["trained"] = full_params(model) if rank == 0 else None
    save_pretrained(model, root / "replicated")
    save_state(root / "state-replicated", model, opt, step=3)

    # Written replicated, read by FSDP2 sharding; written sharded, read replicated: same weights, same state.
    sharded = shard_model(build_model(seed=5))
    sharded_opt = optimizer(sharded)
    load_state(root / "state-replicated", sharded, sharded_opt)
    out["to_sharded"] = all(torch.equal(a, b) for a, b in zip(full_params(sharded).values(),
                                                               full_params(model).values()))
    save_state(root / "state-sharded", sharded, sharded_opt, step=3)
    back = shard_model(build_model(seed=6), FSDP2Config(**REPLICATED))
    back_opt = optimizer(back)
    load_state(root / "state-sharded", back, back_opt)
    out["to_replicated"] = all(torch.equal(a, b) for a, b in zip(full_params(back).values(),
                                                                 full_params(model).values()))
    out["state_equal"] = all(torch.equal(back_opt.state[p]["exp_avg_sq"], opt.state[q]["exp_avg_sq"])
                             for p, q in zip(back.parameters(), model.parameters()))
    step_ids = local_rows(batches(1, seed=9)[0], rank, world)
    for m, o in ((sharded, sharded_opt), (back, back_opt)):
        m(input_ids=step_ids, labels=step_ids).loss.backward()
        o.step()
    out["step_after_resume_equal"] = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(
        full_params(sharded).values(), full_params(back).values()))

    # Loaders: from_pretrained (meta build, every rank reads the file) and rank-0 loading (other ranks differ).
    loaded = hf_fsdp2.from_pretrained(LlamaForCausalLM, root / "replicated", FSDP2Config(**REPLICATED))
    out["from_pretrained"] = _is_ddp(loaded) and all(
        torch.equal(a, b) for a, b in zip(full_params(loaded).values(), full_params(model).values()))
    config = FSDP2Config(**REPLICATED)
    mine = build_model(seed=rank)  # rank 1's weights differ: only rank 0's may survive
    loading.shard_and_fill(mine, loading.plan_for(mine, config, loading.FromRank0(), mesh=build_mesh(config)),
                           loading.FromRank0())
    reference = full_params(build_model(seed=0))
    out["rank0"] = _is_ddp(mine) and all(torch.equal(a, reference[n]) for n, a in full_params(mine).items())

    # A step where a trainable parameter gets no gradient: DDP's error at the next forward names our setting.
    skipping = shard_model(build_model(), FSDP2Config(**REPLICATED))
    out["unused_named"] = ""
    try:
        for _ in range(2):  # a loss on the first layer's output: the later layers, norm and lm_head get no gradient
            skipping(input_ids=data[0], output_hidden_states=True).hidden_states[1].sum().backward()
    except RuntimeError as error:
        out["unused_named"] = str(error)

    # generate(): a different number of new tokens per rank must not wait on the other rank.
    model.eval()
    with torch.no_grad():
        out["generated"] = model.generate(input_ids=data[0][:1, :4], max_new_tokens=2 + 3 * rank, do_sample=False,
                                          min_new_tokens=2 + 3 * rank).shape[1]
    model.train()

    # A decoder layer run under autograd outside the model's forward would not be averaged: refused.
    layer = model.model.layers[0]
    hidden = torch.randn(1, 4, 64)
    position = model.model.rotary_emb(hidden, torch.arange(4)[None])
    with torch.no_grad():
        layer(hidden, position_embeddings=position)  # inference is fine
    try:
        layer(hidden, position_embeddings=position)
        out["outside_refused"] = ""
    except RuntimeError as error:
        out["outside_refused"] = str(error)

    # LoRA, and a model with nothing to train (a reference model): plain replicas, no reducer.
    peft_model = shard_model(lora(build_model()), FSDP2Config(**REPLICATED))
    out["lora_ddp"] = _is_ddp(peft_model)
    out["lora_losses"] = sharded_train(peft_model, data, rank, world)
    save_pretrained(peft_model, root / "adapter")
    frozen = build_model().requires_grad_(False)
    shard_model(frozen, FSDP2Config(**REPLICATED))
    from hf_fsdp2.sharding import is_sharded
    from hf_fsdp2.sharding.replication import is_replicated

    out["frozen_plain"] = is_sharded(frozen) and not is_replicated(frozen) and type(frozen) is LlamaForCausalLM
    # A compute cast (Accelerate's mixed_precision) on DDP's reducer has FSDP2's numerics: the same losses and
    # weights as FSDP2 one-rank groups under the same policy, the checkpointed layers recasting in their
    # recomputation; generate() casts once per call, not once per token.
    from hf_fsdp2.sharding import compute_cast

    casts: list[int] = []
    set_casts = compute_cast._set
    compute_cast._set = lambda entries, dtype: (casts.append(len(entries)), set_casts(entries, dtype))
    for repl in ("ddp", "fsdp2"):
        cast = shard_model(build_model(), FSDP2Config(param_dtype="bf16", activation_checkpointing=True,
                                                      replication=repl, **REPLICATED))
        losses = sharded_train(cast, data, rank, world)
        cast.eval()
        casts.clear()
        with torch.no_grad():
            tokens = cast.generate(input_ids=data[0][:1, :4], max_new_tokens=5, min_new_tokens=5, do_sample=False)
        out[f"cast_{repl}"] = dict(ddp=_is_ddp(cast), losses=losses, params=full_params(cast), tokens=tokens,
                                   generate_casts=list(casts))
    compute_cast._set = set_casts
    # What only FSDP2 provides keeps FSDP2 groups at shard size 1.
    bf16_reduce = shard_model(build_model(), FSDP2Config(reduce_dtype="bf16", **REPLICATED))
    out["reduce_cast_on_fsdp2"] = not is_replicated(bf16_reduce)
    # Rank 0 hosts the store: it must not tear it down while rank 1 still connects the last mesh's groups.
    torch.distributed.barrier()
    return out


def test_shard_size_one_trains_with_ddp_reducer_behind_the_same_api(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    results = run_ranks(_replicated_surface, WORLD, str(tmp_path), timeout=600)
    r = results[0]
    assert all(res["ddp"] for res in results)
    # Every gradient all-reduced once per step, nothing inside no_sync.
    trainable = sum(p.numel() for p in build_model().parameters())
    assert all(res["reduced_per_step"] == trainable and res["reduced_in_no_sync"] == 0 for res in results)
    reference = build_model()
    torch.testing.assert_close(r["losses"], reference_train(reference, batches(3))[:2], atol=2e-5, rtol=0)
    # The third step, accumulated over two micro-batches (the first under no_sync), equals one
    # whole-batch step of the single process.
    for name, tensor in reference.named_parameters():
        torch.testing.assert_close(r["trained"][name], tensor.detach(), atol=2e-5, rtol=0, msg=name)
    assert all(res["to_sharded"] and res["to_replicated"] and res["state_equal"] for res in results)
    assert all(res["step_after_resume_equal"] for res in results)
    assert all(res["from_pretrained"] and res["rank0"] for res in results)
    assert [res["generated"] for res in results] == [6, 9]
    assert all("ran under autograd outside the forward of the replicated" in res["outside_refused"]
               for res in results)
    assert all("FSDP2Config(find_unused_parameters=True)" in res["unused_named"] for res in results)
    assert all(res["lora_ddp"] and res["frozen_plain"] and res["reduce_cast_on_fsdp2"] for res in results)
    for res in results:
        ddp, fsdp2 = res["cast_ddp"], res["cast_fsdp2"]
        assert ddp["ddp"] and not fsdp2["ddp"]
        assert ddp["losses"] == fsdp2["losses"] and torch.equal(ddp["tokens"], fsdp2["tokens"])
        for name, tensor in fsdp2["params"].items():
            torch.testing.assert_close(ddp["params"][name], tensor, atol=0, rtol=0, msg=name)
        # Every parameter cast once for the whole call (per token: once per group forward for each token).
        assert ddp["generate_casts"] == [len(list(build_model().parameters()))]
    torch.testing.assert_close(r["lora_losses"], reference_train(lora(build_model()), batches(3)), atol=2e-5, rtol=0)

    # What was written is what stock loading reads, under the original class name.
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "replicated")
    assert saved.config.architectures == ["LlamaForCausalLM"]
    for name, tensor in saved.named_parameters():
        torch.testing.assert_close(tensor, r["trained"][name], atol=0, rtol=0, msg=name)
    adapter = PeftModel.from_pretrained(build_model(), tmp_path / "adapter")
    assert set(saved_tensors(tmp_path / "adapter", "adapter_model.safetensors")) and adapter is not None


@pytest.mark.parametrize("bad", [dict(replication="zero"), dict(bucket_cap_mb=0)])
def test_replication_settings_are_checked(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        FSDP2Config(**bad)


def test_estimate_counts_no_gather_or_reduce_buffers_under_ddp_replication():
    from hf_fsdp2.planner.memory import estimate_memory
    from tests.common import tiny_config

    ddp = estimate_memory(tiny_config(), 2, FSDP2Config(**REPLICATED))
    fsdp2 = estimate_memory(tiny_config(), 2, FSDP2Config(replication="fsdp2", **REPLICATED))
    assert ddp.gathered_peak_bytes == ddp.reduce_scatter_peak_bytes == 0
    assert fsdp2.gathered_peak_bytes > 0 and fsdp2.reduce_scatter_peak_bytes > 0
    # A compute cast on the reducer: autograd keeps every group's bf16 copies until backward, a
    # checkpointed layer's only while it (re)computes.
    model = build_model()
    total, layer = (sum(p.numel() for p in m.parameters()) for m in (model, model.model.layers[0]))
    cast = estimate_memory(tiny_config(), 2, FSDP2Config(param_dtype="bf16", **REPLICATED))
    checkpointed = estimate_memory(tiny_config(), 2, FSDP2Config(param_dtype="bf16", activation_checkpointing=True,
                                                                 **REPLICATED))
    assert cast.reduce_scatter_peak_bytes == checkpointed.reduce_scatter_peak_bytes == 0
    assert cast.gathered_peak_bytes == 2 * total
    assert checkpointed.gathered_peak_bytes == 2 * (total - 2 * layer)  # 3 layers: one layer's copies at a time
    assert ddp.param_bytes_per_rank == fsdp2.param_bytes_per_rank and ddp.grad_bytes_per_rank == fsdp2.grad_bytes_per_rank
    assert any("DDP's reducer" in note for note in ddp.notes)
