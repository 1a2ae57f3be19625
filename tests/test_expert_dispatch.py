"""Expert parallelism's token dispatch without a host read per MoE layer (issue 64, sharding/expert_dispatch.py):
no device value read by the MoE layers of a training step (transformers' AllToAllEP reads its split sizes in each),
one process's losses and gradients with ranks holding batches of different lengths (Qwen3-MoE at ep 4, gpt-oss at
ep 2), and the MoE settings it cannot honour refused by name. tests/test_expert_parallel.py runs its equality
tests (Qwen3-MoE, Mixtral, DeepSeek-V3; full, LoRA on linears and on fused experts; ep 2 and 4) on this dispatch,
the default."""

from __future__ import annotations

import pytest
import torch

from hf_fsdp2 import FSDP2Config, shard_model

from .common import batches, local_rows
from .dist_harness import run_ranks
from .host_reads import HostReads
from .test_expert_parallel import build_moe, with_lora

WORLD = 4


def _moe_blocks(model):
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def _step_reads(model, ids) -> tuple[HostReads, HostReads]:
    """One training step: reads inside the MoE blocks' forwards, and over the whole step."""
    from hf_fsdp2.sharding import expert_dispatch

    moe, step = HostReads(expert_dispatch.host_buffers()), HostReads(expert_dispatch.host_buffers())
    with moe.counting(), moe.windows(_moe_blocks(model)), step.counting(), step.window():
        model(input_ids=ids, labels=ids).loss.backward()
    return moe, step


def _reads_rank(rank, world):
    from hf_fsdp2.sharding import expert_dispatch

    ids = local_rows(batches(1)[0], rank, world)
    out = {}
    for name, ep_size, dispatch in (("fsdp2", 1, "even"), ("ep4", 4, "even"), ("ep2", 2, "even"),
                                    ("ep4_all_to_all", 4, "all_to_all")):
        expert_dispatch.set_dispatch(dispatch)
        model = build_moe()
        shard_model(model, FSDP2Config(ep_size=ep_size))
        model(input_ids=ids, labels=ids).loss.backward()  # warm: first-step reads (lazy init) are not the layers'
        moe, step = _step_reads(model, ids)
        experts = HostReads()  # the matmuls of the experts' forwards (both MoE layers)
        with experts.counting(), experts.windows([block.experts for block in _moe_blocks(model)]):
            model(input_ids=ids, labels=ids)
        out[name] = {"moe": dict(moe.counts), "step": dict(step.counts), "host": moe.exempt_reads,
                     "matmuls": dict(experts.ops)}
    expert_dispatch.set_dispatch("even")
    out["refusals"] = {}
    for name, field, value in (("capacity", "expert_capacity", 4), ("kernel", "_experts_implementation", "sonicmoe"),
                               ("own_loop", None, None)):
        model = build_moe()
        if field is None:  # experts of a class with a loop of its own (transformers' Step3p7Experts): no interface
            for block in _moe_blocks(model):
                del block.experts.has_gate
        else:
            setattr(model.config, field, value)
        try:
            shard_model(model, FSDP2Config(ep_size=2))
        except ValueError as error:
            out["refusals"][name] = str(error)
    return out


def test_no_host_read_in_the_moe_layers_of_a_training_step():
    """Qwen3-MoE, 2 MoE layers, on 4 ranks: the MoE blocks' forwards read no device value at ep 4 and ep 2 (the
    one host read per layer is the token count, a CPU tensor all-reduced over gloo), and the whole step reads
    what FSDP2 alone reads; transformers' AllToAllEP, the same model and step, reads its split sizes in each.
    The experts run one grouped matmul per projection (gate_up, down) for all their local experts, no loop.
    A capacity in the model's config, an experts implementation not known to skip other ranks' rows, and experts
    that run a loop of their own are refused by name."""
    out = run_ranks(_reads_rank, WORLD)
    for rank in out:
        for name in ("ep4", "ep2"):
            assert rank[name]["moe"] == {}, (name, rank[name])
            assert rank[name]["step"] == rank["fsdp2"]["step"], (name, rank[name], rank["fsdp2"])
            assert rank[name]["host"] == 2  # one token-count exchange per MoE layer
            # transformers' grouped_mm experts: one grouped matmul per projection for all local experts, no loop
            assert rank[name]["matmuls"] == {"_grouped_mm": 2 * 2}, rank[name]["matmuls"]
        assert rank["ep4_all_to_all"]["moe"].get("tolist", 0) >= 2  # the baseline the test would catch
    refusals = out[0]["refusals"]
    assert refusals["capacity"].startswith("`expert_capacity`=4 in the model's config with `ep_size`=2: expert "
                                           "parallelism in hf_fsdp2 is dropless"), refusals
    assert refusals["kernel"].startswith("`experts_implementation`='sonicmoe' with `ep_size`=2: its experts are not "
                                         "known to skip the rows another EP rank holds"), refusals
    assert refusals["own_loop"].startswith("expert parallelism (`ep_size`=2) with experts that do not run "
                                           "transformers' experts implementations (Qwen3MoeExperts at "), refusals


def build_gpt_oss(seed: int = 0):
    """A tiny gpt-oss: expert biases, its clamped gated activation, attention sinks, router auxiliary loss."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=64, tie_word_embeddings=False, output_router_logits=True, router_aux_loss_coef=0.01)
    model = transformers.GptOssForCausalLM(config).float()
    with torch.no_grad():  # transformers initialises the expert biases at zero: make them count
        for name, p in model.named_parameters():
            if name.endswith("_bias"):
                p.normal_(0, 0.1)
    return model


def _build(arch: str, use_lora: str | None = None):
    model = build_gpt_oss() if arch == "gpt_oss" else build_moe(arch=arch)
    return with_lora(model, arch, use_lora) if use_lora else model


def _uneven(rank: int, world: int) -> torch.Tensor:
    """This rank's rows of the first batch, cut to a length of its own (16, 13, 10, 7 tokens): the EP ranks'
    token counts differ."""
    ids = local_rows(batches(1)[0], rank, world)
    return ids[:, :ids.shape[1] - 3 * rank]


def _grads(model):
    return {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for name, p in model.named_parameters() if p.requires_grad}


def _aux(result):
    return None if result.aux_loss is None else result.aux_loss.item()


def _uneven_rank(rank, world, cases):
    out = {}
    for arch, ep_size, use_lora in cases:
        model = _build(arch, use_lora)
        shard_model(model, FSDP2Config(ep_size=ep_size))
        ids = _uneven(rank, world)
        result = model(input_ids=ids, labels=ids)
        result.loss.backward()  # FSDP2 averages the ranks' gradients: the reference's mean of the ranks' losses
        out[arch, ep_size, use_lora] = {"loss": result.loss.item(), "aux": _aux(result), "grads": _grads(model)}
    return out


# (model, ep size, LoRA): full fine-tunes, and PEFT LoRA on the fused experts (`target_parameters`) of gpt-oss
# (transposed experts with biases) and DeepSeek-V3 (shared expert, grouped routing); with tests/test_expert_parallel.py's
# equality matrix every model is covered full and with LoRA on its experts at ep 2 and ep 4
UNEVEN_CASES = [("qwen3_moe", 4, None), ("gpt_oss", 2, None), ("gpt_oss", 4, "experts"), ("deepseek_v3", 2, "experts"),
                ("mixtral", 2, "experts"), ("mixtral", 4, None), ("gpt_oss", 4, None), ("deepseek_v3", 2, None),
                ("qwen3_moe", 4, "experts"), ("gpt_oss", 2, "experts"), ("deepseek_v3", 4, "experts")]


def test_uneven_token_counts_train_like_one_process():
    """Ranks holding batches of different lengths (the gathers are sized by the group's largest), UNEVEN_CASES in one
    run: Qwen3-MoE, Mixtral, gpt-oss, DeepSeek-V3, full and with LoRA on the fused experts, at ep 2 and 4: each
    rank's loss and router auxiliary loss, and every trained gradient, are one process's."""
    ranks = run_ranks(_uneven_rank, WORLD, UNEVEN_CASES)
    for case in UNEVEN_CASES:
        model = _build(case[0], case[2])
        outs = [model(input_ids=_uneven(r, WORLD), labels=_uneven(r, WORLD)) for r in range(WORLD)]
        (sum(o.loss for o in outs) / WORLD).backward()
        ref = _grads(model)
        assert ref and (case[2] is None or all("lora_" in name for name in ref)), case
        if case[2]:
            assert any(".experts." in name for name in ref), case
        for rank, result in enumerate(r[case] for r in ranks):
            assert result["loss"] == pytest.approx(outs[rank].loss.item(), rel=1e-5), case
            aux = _aux(outs[rank])  # None for DeepSeek-V3 (an expert bias, no auxiliary loss)
            assert result["aux"] == (None if aux is None else pytest.approx(aux, rel=1e-5)), case
            assert result["grads"].keys() == ref.keys()
            for name, expected in ref.items():
                torch.testing.assert_close(result["grads"][name], expected, rtol=1e-5, atol=1e-7, msg=f"{case} {name}")
