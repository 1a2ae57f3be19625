"""PEFT LoRA on whole fused experts (ep_size 1) inside transformers' grouped matmuls (issue 64,
sharding/expert_parallel/grouped.py): what hf_fsdp2 runs whenever it shards a model whose experts PEFT adapts with
`target_parameters` and transformers' default experts implementation (grouped_mm). One process's losses and LoRA
gradients as PEFT's own forward (its fold of every expert's delta into the weights) gives them, for Qwen3-MoE
([E, out, in] experts) and gpt-oss ([E, in, out], biases, clamped activation); no fold (no baddbmm), three grouped
matmuls per projection, no host read in the MoE layers; a merge (PEFT's own, on replicated whole experts) and
disabled adapters as PEFT gives them."""

from __future__ import annotations

import pytest
import torch

from hf_fsdp2 import FSDP2Config, shard_model

from .common import batches, local_rows
from .dist_harness import run_ranks
from .host_reads import HostReads
from .test_expert_parallel import build_moe, with_lora

WORLD = 2
ARCHS = ("qwen3_moe", "gpt_oss")


def _moe_blocks(model):
    return [layer.mlp for layer in model.get_base_model().model.layers if hasattr(layer.mlp, "experts")]


def _lora_grads(model) -> dict[str, torch.Tensor]:
    return {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for name, p in model.named_parameters() if p.requires_grad}


def _step(model, ids) -> tuple[float, HostReads]:
    """One forward and backward; host reads and matmuls inside the MoE blocks' forwards."""
    reads = HostReads()
    with reads.counting(), reads.windows(_moe_blocks(model)):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), reads


def _rank(rank, world):
    from hf_fsdp2.sharding.expert_parallel import grouped

    out = {}
    ids = local_rows(batches(1)[0], rank, world)
    for arch in ARCHS:  # FSDP2 over both ranks, ep 1: the layer's group gathers the experts and their adapters
        model = with_lora(build_moe(arch=arch), arch, "experts")
        shard_model(model, FSDP2Config())
        loss, reads = _step(model, ids)
        out[arch] = {"loss": loss, "grads": _lora_grads(model), "reads": dict(reads.counts), "ops": dict(reads.ops)}
        model.set_experts_implementation("batched_mm")  # another implementation: PEFT's own forward (its fold)
        _, reads = _step(model, ids)
        out[arch]["batched_mm_ops"] = dict(reads.ops)
    # replicated (DDP's reducer, whole plain weights): PEFT's merge works; the merged model's forward is PEFT's
    model = with_lora(build_moe(arch="gpt_oss"), "gpt_oss", "experts")
    shard_model(model, FSDP2Config(replicate_size=world, shard_size=1))
    experts = _moe_blocks(model)[0].experts
    with torch.no_grad():
        logits = {"adapters": model(input_ids=ids).logits}
        model.merge_adapter()
        logits["merged"] = model(input_ids=ids).logits
        model.unmerge_adapter()
        logits["unmerged"] = model(input_ids=ids).logits
        with model.disable_adapter():
            logits["disabled"] = model(input_ids=ids).logits
    out["merge"] = {"logits": logits, "ours": grouped.runs_here(experts.base_layer.base_layer)}
    return out


def test_lora_on_whole_experts_runs_inside_the_grouped_matmuls_as_peft_computes_it():
    """Qwen3-MoE and gpt-oss (2 MoE layers, 8 experts, top-2) with PEFT LoRA on attention and the fused experts,
    sharded by hf_fsdp2 on 2 ranks without EP: each rank's loss and every LoRA gradient are one process's under
    PEFT's own forward (rel 1e-5, fp32); the MoE layers run 3 grouped matmuls per projection (x @ W, x @ A, @ B)
    and no baddbmm (PEFT's fold: 2 per projection and layer, shown in the reference and with experts_implementation='batched_mm'
    on the sharded model), and read nothing to the host. gpt-oss replicated: merge_adapter() then forward equals the
    forward with the adapters inside the grouped matmuls, unmerge_adapter() returns to it, disable_adapter() gives
    the base model's."""
    ranks = run_ranks(_rank, WORLD)
    for arch in ARCHS:
        model = with_lora(build_moe(arch=arch), arch, "experts")
        outs, ops = [], []
        for rank in range(WORLD):
            ids = local_rows(batches(1)[0], rank, WORLD)
            reads = HostReads()
            with reads.counting(), reads.windows(_moe_blocks(model)):
                outs.append(model(input_ids=ids, labels=ids))
            ops.append(dict(reads.ops))
        (sum(o.loss for o in outs) / WORLD).backward()
        reference = _lora_grads(model)
        assert any(".experts." in name for name in reference) and all("lora_" in name for name in reference)
        # PEFT's fold, the test's catch: per projection and layer, one in the forward and one more when
        # torch's register_parametrization evaluates the new parametrization for its checks
        assert ops[0].get("baddbmm") == 2 * 2 * 2, ops[0]
        for rank, result in enumerate(r[arch] for r in ranks):
            assert result["loss"] == pytest.approx(outs[rank].loss.item(), rel=1e-5), arch
            assert result["grads"].keys() == reference.keys()
            for name, expected in reference.items():
                torch.testing.assert_close(result["grads"][name], expected, rtol=1e-5, atol=1e-7, msg=f"{arch} {name}")
            assert result["reads"] == {}, (arch, result["reads"])
            assert result["ops"].get("_grouped_mm") == 2 * 2 * 3 and "baddbmm" not in result["ops"], result["ops"]
            assert result["batched_mm_ops"].get("baddbmm") == 2 * 2 * 2, result["batched_mm_ops"]
    for rank in ranks:
        logits = rank["merge"]["logits"]
        assert rank["merge"]["ours"]
        torch.testing.assert_close(logits["merged"], logits["adapters"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits["unmerged"], logits["adapters"], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(logits["disabled"], logits["adapters"], rtol=1e-3, atol=1e-3)
    base = build_moe(arch="gpt_oss")
    with torch.no_grad():
        expected = base(input_ids=local_rows(batches(1)[0], 0, WORLD)).logits
    torch.testing.assert_close(ranks[0]["merge"]["logits"]["disabled"], expected, rtol=1e-5, atol=1e-5)


def _world_one_dry_run(rank, world):
    import sys
    from pathlib import Path

    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import moe_bench

    return moe_bench.world_one(dry_run=True)


def test_the_world_one_benchmark_dry_run_compares_both_paths():
    """benchmarks/moe_bench.py's `world_one` (issue 64's GPU comparison at world size 1) on CPU at the tiny shape, so
    it cannot rot: both contestants train LoRA and full, hf_fsdp2's with the experts' LoRA inside the grouped matmuls
    (its one experts module's outermost ParamWrapper replaced; transformers' none), the same first loss (bf16)."""
    result = run_ranks(_world_one_dry_run, 1)[0]
    assert result["ratios"].keys() == {"lora", "full"} and all(r > 0 for r in result["ratios"].values())
    assert result["lora"]["hf_fsdp2"]["experts_in_grouped_matmuls"] == 1
    assert result["lora"]["transformers"]["experts_in_grouped_matmuls"] == 0
    assert result["full"]["hf_fsdp2"]["experts_in_grouped_matmuls"] == 0
    assert result["lora"]["hf_fsdp2"]["experts_implementation"] == "grouped_mm"
    for mode in ("lora", "full"):
        assert result[mode]["first_loss_diff"] < 1e-3 * result[mode]["transformers"]["losses"][0], result[mode]
