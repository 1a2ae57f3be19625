"""Expert parallelism's token dispatch without a host read per MoE layer (issue 64, sharding/expert_parallel/dispatch.py):
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
from .test_expert_parallel import EXPERT_TARGETS, build_moe, expert_adapter_files_are_stock, with_lora

WORLD = 4


def _moe_blocks(model):
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def _adapted(module):
    while hasattr(module, "base_layer"):  # PEFT's ParamWrappers around the experts (`target_parameters`)
        module = module.base_layer
    return module


def _step_reads(model, ids) -> tuple[HostReads, HostReads]:
    """One training step: reads inside the MoE blocks' forwards, and over the whole step."""
    from hf_fsdp2.sharding.expert_parallel import dispatch as expert_dispatch

    moe, step = HostReads(expert_dispatch.host_buffers()), HostReads(expert_dispatch.host_buffers())
    with moe.counting(), moe.windows(_moe_blocks(model)), step.counting(), step.window():
        model(input_ids=ids, labels=ids).loss.backward()
    return moe, step


def _reads_rank(rank, world):
    from hf_fsdp2.sharding.expert_parallel import dispatch as expert_dispatch

    ids = local_rows(batches(1)[0], rank, world)
    out = {}
    for name, ep_size, dispatch in (("fsdp2", 1, "even"), ("ep4", 4, "even"), ("ep2", 2, "even"),
                                    ("ep4_all_to_all", 4, "all_to_all"), ("ep2_lora", 2, "even")):
        expert_dispatch.set_dispatch(dispatch)
        model = build_moe() if name != "ep2_lora" else with_lora(build_moe(), "qwen3_moe", "experts")
        shard_model(model, FSDP2Config(ep_size=ep_size))
        model(input_ids=ids, labels=ids).loss.backward()  # warm: first-step reads (lazy init) are not the layers'
        moe, step = _step_reads(model, ids)
        experts = HostReads()  # the matmuls of the experts' forwards (both MoE layers)
        with experts.counting(), experts.windows([_adapted(block.experts) for block in _moe_blocks(model)]):
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
        for name in ("ep4", "ep2", "ep2_lora"):
            assert rank[name]["moe"] == {}, (name, rank[name])
            if name != "ep2_lora":
                assert rank[name]["step"] == rank["fsdp2"]["step"], (name, rank[name], rank["fsdp2"])
            assert rank[name]["host"] == 2  # one token-count exchange per MoE layer
        # transformers' grouped_mm experts: one grouped matmul per projection for all local experts, no loop; LoRA
        # on the experts inside them: two more per projection (x @ A, then @ B), no merged weight (no baddbmm)
        assert rank["ep4"]["matmuls"] == rank["ep2"]["matmuls"] == {"_grouped_mm": 2 * 2}, rank["ep2"]["matmuls"]
        assert rank["ep2_lora"]["matmuls"] == {"_grouped_mm": 2 * 2 * 3}, rank["ep2_lora"]["matmuls"]
        assert rank["ep4_all_to_all"]["moe"].get("tolist", 0) >= 2  # the baseline the test would catch
    refusals = out[0]["refusals"]
    assert refusals["capacity"].startswith("`expert_capacity`=4 in the model's config with `ep_size`=2: expert "
                                           "parallelism in hf_fsdp2 is dropless"), refusals
    assert refusals["kernel"].startswith("`experts_implementation`='sonicmoe' with `ep_size`=2: its experts are not "
                                         "known to skip the rows another EP rank holds"), refusals
    assert refusals["own_loop"].startswith("expert parallelism (`ep_size`=2) with experts that do not run "
                                           "transformers' experts implementations (Qwen3MoeExperts at "), refusals


def test_lora_inside_the_grouped_matmuls_is_peft_s():
    """One process, no EP: the experts' rows through `grouped_experts` with PEFT's LoRA factors inside the grouped
    matmuls (x @ W + s (x @ A) @ B; rank 3 padded to 4 for alignment, unused sentinel rows last) give what PEFT's
    own forward (its fold of the factors into W) and transformers' grouped_mm experts give for the same rows and
    experts, and the same LoRA gradients; the frozen base gets none. Qwen3-MoE ([E, out, in]) and gpt-oss
    ([E, in, out] with biases)."""
    from peft import LoraConfig, get_peft_model

    from hf_fsdp2.sharding.expert_parallel import lora as expert_lora
    from hf_fsdp2.sharding.expert_parallel.dispatch import grouped_experts

    for arch in ("qwen3_moe", "gpt_oss"):
        model = get_peft_model(build_moe(arch=arch), LoraConfig(r=3, lora_alpha=8, target_parameters=EXPERT_TARGETS,
                                                                init_lora_weights=False))
        outer = model.get_base_model().model.layers[0].mlp.experts
        chain, experts = expert_lora.adapter_chain(outer)
        ids = torch.tensor([0, 0, 1, 3, 3, 3, 5, 7, 7])  # sorted by expert; two sentinel rows (8) appended below
        x = torch.randn(len(ids), model.config.hidden_size, generator=torch.Generator().manual_seed(0))
        offsets = torch.cumsum(torch.bincount(ids, minlength=8), 0, dtype=torch.int32)
        lora = [p for n, p in model.named_parameters() if "lora_" in n and ".layers.0.mlp.experts" in n]
        assert len(lora) == 4 and all(p.requires_grad for p in lora)

        expected = outer(x, ids.unsqueeze(-1), torch.ones(len(ids), 1))  # PEFT's forward, top-1 unit weights
        expected.square().sum().backward()
        expected_grads = [p.grad.clone() for p in lora]
        model.zero_grad()
        terms = {name: factors for name, (_, factors) in expert_lora._local_terms(chain, experts, 0).items()}
        assert sorted(terms) == ["down_proj", "gate_up_proj"]
        rows = torch.cat([x, x[:2]])  # the sentinel rows: past `offsets`, never read
        out = grouped_experts(experts, rows, torch.cat([ids, ids.new_full((2,), 8)]), offsets, terms)[:len(ids)]
        out.square().sum().backward()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6, msg=arch)
        for p, grad in zip(lora, expected_grads):
            torch.testing.assert_close(p.grad, grad, rtol=1e-5, atol=1e-6, msg=arch)
        assert experts.gate_up_proj.grad is None and experts.down_proj.grad is None
        assert not torch.equal(out, grouped_experts(experts, x, ids, offsets))  # the adapters count


def _build(arch: str, use_lora: str | None = None):
    model = build_moe(arch=arch)
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


def _uneven_rank(rank, world, cases, root):
    from hf_fsdp2 import save_pretrained

    out = {}
    for arch, ep_size, use_lora in cases:
        model = _build(arch, use_lora)
        shard_model(model, FSDP2Config(ep_size=ep_size))
        ids = _uneven(rank, world)
        result = model(input_ids=ids, labels=ids)
        result.loss.backward()  # FSDP2 averages the ranks' gradients: the reference's mean of the ranks' losses
        out[arch, ep_size, use_lora] = {"loss": result.loss.item(), "aux": _aux(result), "grads": _grads(model)}
        if (arch, ep_size, use_lora) in FILE_CASES:  # a step, then the adapter and the merged model, gather-free
            torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5).step()
            directory = f"{root}/{arch}-{ep_size}"
            save_pretrained(model, f"{directory}/final")
            save_pretrained(model, f"{directory}/merged", merge_adapters=True)
            out[arch, ep_size, use_lora]["weights"] = {
                name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for name, p in model.named_parameters()}
    return out


# (model, ep size, LoRA): full fine-tunes, and PEFT LoRA on the fused experts (`target_parameters`) of gpt-oss
# (transposed experts with biases) and DeepSeek-V3 (shared expert, grouped routing); with tests/test_expert_parallel.py's
# equality matrix every model is covered full and with LoRA on its experts at ep 2 and ep 4
UNEVEN_CASES = [("qwen3_moe", 4, None), ("gpt_oss", 2, None), ("gpt_oss", 4, "experts"), ("deepseek_v3", 2, "experts"),
                ("mixtral", 2, "experts"), ("mixtral", 4, None), ("gpt_oss", 4, None), ("deepseek_v3", 2, None),
                ("qwen3_moe", 4, "experts"), ("gpt_oss", 2, "experts"), ("deepseek_v3", 4, "experts")]
# whose trained adapter and merged model are also held against PEFT's and transformers' files (Qwen3-MoE, Mixtral
# and DeepSeek-V3 are in tests/test_expert_parallel.py's matrix)
FILE_CASES = [("gpt_oss", 4, "experts")]


def test_uneven_token_counts_train_like_one_process(tmp_path):
    """Ranks holding batches of different lengths (the gathers are sized by the group's largest), UNEVEN_CASES in one
    run: Qwen3-MoE, Mixtral, gpt-oss, DeepSeek-V3, full and with LoRA on the fused experts, at ep 2 and 4: each
    rank's loss and router auxiliary loss, and every trained gradient, are one process's. gpt-oss's adapter and
    merged model after a step (FILE_CASES) are PEFT's and transformers' files of the same weights."""
    ranks = run_ranks(_uneven_rank, WORLD, UNEVEN_CASES, str(tmp_path))
    for case in FILE_CASES:
        expert_adapter_files_are_stock(tmp_path / f"{case[0]}-{case[1]}", case[0], ranks[0][case]["weights"])
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
