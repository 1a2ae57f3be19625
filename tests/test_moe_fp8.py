"""FP8 experts (issue 64, `FSDP2Config.fp8_experts`, sharding/expert_parallel/low_precision.py): the experts' grouped
matmuls through torchao's MoE training, on CPU in its emulated MXFP8 mode (quantized and dequantized into a bf16
grouped matmul: the numbers of MXFP8, the speed of nothing). At ep 2 on 2 ranks the loss and every gradient equal one
process running the same FP8 experts over the same batch, and at ep 1 (whole experts) too but for the order of an
expert's rows; they differ from the experts in fp32 by the quantization's
bounded error; torchao's quantized grouped matmul ran (its autograd nodes counted, two per MoE layer: no silent
bf16 fallback); LoRA on a frozen expert base trains the same way; what cannot run is refused by name."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

from hf_fsdp2 import FSDP2Config, shard_model

from .common import batches, local_rows
from .dist_harness import run_ranks
from .host_reads import HostReads
from .test_expert_parallel import EXPERT_TARGETS, build_moe

pytest.importorskip("torchao.prototype.moe_training")

WORLD, MODE = 2, "mxfp8_emulated"
QUANTIZED_NODE = "_MXFP8GroupedMMBackward"  # torchao's autograd function of the MXFP8 grouped matmul


def _model(lora: bool):
    """Qwen3-MoE (8 experts, top-2, hidden 64, expert intermediate 32: MXFP8's blocks of 32), without the router's
    auxiliary loss (a function of the whole batch: the reference runs the ranks' rows as one batch, see `_reference`);
    LoRA (random B) on the fused experts with the base frozen, when `lora`."""
    model = build_moe()
    model.config.output_router_logits = False
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_parameters=EXPERT_TARGETS,
                                                 init_lora_weights=False))
    return model


def _quantized_nodes(loss: torch.Tensor) -> int:
    """torchao's quantized grouped matmuls in the autograd graph of `loss`."""
    seen, stack, count = set(), [loss.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += type(node).__name__ == QUANTIZED_NODE
        stack.extend(next_node for next_node, _ in node.next_functions)
    return count


def _step(model, ids, split: int = 1) -> tuple[float, int, dict[str, torch.Tensor]]:
    """One forward and backward (the mean loss of `split` forwards on as many slices of `ids`): the loss, torchao's
    quantized grouped matmuls in its graph, the gradients (whole)."""
    loss = sum(model(input_ids=part, labels=part).loss for part in ids.chunk(split)) / split
    loss.backward()
    grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
             for name, p in model.named_parameters() if p.requires_grad}
    return loss, _quantized_nodes(loss), grads


def _refused(config: FSDP2Config, dispatch_name: str = "even") -> str | None:
    from hf_fsdp2.sharding.expert_parallel import dispatch

    dispatch.set_dispatch(dispatch_name)
    try:
        shard_model(_model(False), config)
    except ValueError as error:
        return str(error)
    finally:
        dispatch.set_dispatch("even")
    return None


def _rank(rank, world):
    from .common import global_mean

    ids = local_rows(batches(1)[0], rank, world)
    out = {}
    for ep_size in (world, 1):
        for lora in (False, True):
            model = _model(lora)
            shard_model(model, FSDP2Config(ep_size=ep_size, fp8_experts=MODE))
            loss, nodes, grads = _step(model, ids)
            out[("lora" if lora else "full", ep_size)] = {"loss": global_mean(loss.detach()), "nodes": nodes,
                                                          "grads": grads}
            # after sharding, another experts implementation: the FP8 matmul would not run there
            (model.get_base_model() if lora else model).set_experts_implementation("batched_mm")
            try:
                model(input_ids=ids, labels=ids)
            except ValueError as error:
                out[("lora" if lora else "full", ep_size)]["batched_mm_after"] = str(error)
    out["refusals"] = {
        "rowwise_on_cpu": _refused(FSDP2Config(ep_size=world, fp8_experts="rowwise")),
        "mxfp8_on_cpu": _refused(FSDP2Config(ep_size=world, fp8_experts="mxfp8")),
        "all_to_all": _refused(FSDP2Config(ep_size=world, fp8_experts=MODE), "all_to_all"),
    }
    return out


def _sorted_experts(experts, hidden_states, top_k_index, top_k_weights, adapters=None):
    """One process's experts on every (token, expert) pair sorted by expert as the EP dispatch sorts its gathered
    rows (stable: a token's rows in token order within each expert's group, which MXFP8's blocks of 32 rows in the
    weight gradient see), through the same `grouped_experts`, weighted and summed over the top-k."""
    from hf_fsdp2.sharding.expert_parallel.dispatch import grouped_experts

    tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offsets = torch.cumsum(torch.bincount(flat, minlength=experts.num_experts), 0, dtype=torch.int32)
    out = grouped_experts(experts, hidden_states[order // top_k], flat[order], offsets, adapters)
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    return torch.zeros_like(out).index_copy(0, order, out).view(tokens, top_k, -1).sum(1).to(hidden_states.dtype)


def _reference(lora: bool, fp8: bool = True, split: int = 1):
    """One process, the ranks' rows as one batch (`split` 1: their mean loss and gradient at ep 2, where each
    expert sees every rank's rows at once) or as `split` batches (at ep 1 each rank's experts see its own rows), the
    experts through `_sorted_experts` with torchao's matmul (`fp8`) or in fp32."""
    from hf_fsdp2.sharding.expert_parallel import dispatch, low_precision
    from hf_fsdp2.sharding.expert_parallel import lora as expert_lora

    model = _model(lora)
    base = model.get_base_model() if lora else model
    for layer in base.model.layers:
        outer = layer.mlp.experts
        chain, experts = expert_lora.adapter_chain(outer)
        if fp8:
            dispatch.use_matmul(experts, functools.partial(low_precision.grouped_mm, MODE), "test")

        def forward(hidden, index, weights, *args, chain=chain, experts=experts, **kwargs):
            terms = {name: factors for name, (_, factors) in expert_lora._local_terms(chain, experts, 0).items()}
            return _sorted_experts(experts, hidden, index, weights, terms)

        outer.forward = forward  # the test's one-process experts (the model calls the outermost wrapper)
    return _step(model, batches(1)[0], split)


def test_fp8_experts_at_ep_2_equal_one_process_with_the_same_fp8_experts():
    out = run_ranks(_rank, WORLD)
    for name, lora in (("full", False), ("lora", True)):
        loss, nodes, grads = _reference(lora)
        exact_loss, _, exact_grads = _reference(lora, fp8=False)
        # gate_up and down in each of the two MoE layers; with LoRA the first layer's gate_up has no gradient to
        # carry (its rows come from frozen layers, its weight is frozen): it ran in FP8 outside the graph
        assert nodes == (3 if lora else 4), (name, nodes)
        assert grads.keys() == exact_grads.keys() and any("experts" in key for key in grads)
        if lora:
            assert all("lora_" in key for key in grads)  # the expert base frozen: no gradient of it
        # the quantization's error against fp32 experts: there, and bounded (measured: loss 4e-6 / 3e-5 of it, the
        # gradients' norms 1e-3..0.07 / 0.03..0.18; fp32 rounding alone is 1e-7)
        assert 1e-6 < abs(loss.item() - exact_loss.item()) / exact_loss.item() < 1e-3, (name, loss, exact_loss)
        differences = {key: ((grad - exact_grads[key]).norm() / exact_grads[key].norm()).item()
                       for key, grad in grads.items()}
        assert 1e-2 < max(differences.values()) < 0.25 and min(differences.values()) > 1e-4, (name, differences)
        for rank in out:
            ep = rank[(name, WORLD)]
            assert ep["nodes"] == nodes  # this rank's experts: one quantized grouped matmul per projection and layer
            # the same quantized numbers in the same token groups: fp32 rounding apart (attention on 4 rows at once
            # or 2, the top-k summed over ranks), the losses to 1e-6 and every gradient to 1e-4 of its scale
            assert ep["loss"] == pytest.approx(loss.item(), rel=1e-6), name
            assert ep["grads"].keys() == grads.keys()
            for key, expected in grads.items():
                torch.testing.assert_close(ep["grads"][key], expected, rtol=1e-4,
                                           atol=1e-4 * expected.abs().max().item(), msg=f"{name} {key}")
        # ep 1: whole experts in the grouped matmuls of sharding/expert_parallel/grouped.py (its sort is
        # transformers': not stable, so an expert's rows may come in another order, which MXFP8's blocks of 32 rows in
        # the weight gradient see; the forward and the input gradients are row by row). The loss and every gradient
        # but the trained experts' weights to fp32 rounding; those within the quantization's error.
        loss, nodes, grads = _reference(lora, split=WORLD)
        for rank in out:
            ep = rank[(name, 1)]
            assert ep["nodes"] * WORLD == nodes and ep["grads"].keys() == grads.keys()  # the reference: 2 forwards
            assert ep["loss"] == pytest.approx(loss.item(), rel=1e-6), name
            for key, expected in grads.items():
                if ".experts." in key and "lora_" not in key:
                    assert ((ep["grads"][key] - expected).norm() / expected.norm()).item() < 2e-2, (name, key)
                    continue
                torch.testing.assert_close(ep["grads"][key], expected, rtol=1e-4,
                                           atol=1e-4 * expected.abs().max().item(), msg=f"ep 1 {name} {key}")
    refusals = out[0]["refusals"]
    assert refusals["rowwise_on_cpu"].startswith("`fp8_experts`='rowwise' needs torch._scaled_grouped_mm's rowwise "
                                                 "FP8 kernels (CUDA compute capability >= 9.0); this device is cpu")
    assert refusals["mxfp8_on_cpu"].startswith("`fp8_experts`='mxfp8' needs torchao's MXFP8 SM100 kernels")
    assert refusals["all_to_all"].startswith("`fp8_experts`='mxfp8_emulated' runs in hf_fsdp2's EP dispatch with "
                                             "experts_implementation='grouped_mm'; Qwen3MoeExperts runs elsewhere")
    for key, run in out[0].items():
        if key != "refusals":
            assert run.get("batched_mm_after", "").startswith("`fp8_experts`='mxfp8_emulated' runs in the grouped_mm "
                                                              "experts implementation, not 'batched_mm'"), key


def test_fp8_experts_settings_refused_by_name():
    """Not one of the modes, or with compile or TP, at construction; a model without experts, dimensions that are not
    multiples of the mode's block, and fp16 weights, where the matmul is installed or called."""
    from hf_fsdp2.sharding.expert_parallel import low_precision

    from .common import build_model

    with pytest.raises(ValueError, match=r"^`fp8_experts`='rowwise' with `compile`=True is not done in hf_fsdp2"):
        FSDP2Config(fp8_experts="rowwise", compile=True)
    with pytest.raises(ValueError, match=r"^`fp8_experts`='mxfp8' with `tp_size`=2 is not done in hf_fsdp2"):
        FSDP2Config(fp8_experts="mxfp8", tp_size=2)
    with pytest.raises(ValueError, match=r"^`fp8_experts`='mxfp8_emulated': LlamaForCausalLM has no transformers "
                                         r"experts module"):
        low_precision.install_whole(build_model(), MODE, "cpu")
    with pytest.raises(ValueError, match=r"^`fp8_experts`='fp4' is not one of 'rowwise', 'mxfp8', 'mxfp8_emulated'"):
        FSDP2Config(ep_size=2, fp8_experts="fp4")
    assert FSDP2Config(ep_size=2, fp8_experts="none").fp8_experts is None
    rows, offsets = torch.randn(8, 64, dtype=torch.float16), torch.tensor([8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^`fp8_experts`='mxfp8_emulated' with expert weights in torch.float16"):
        low_precision.grouped_mm(MODE, rows, torch.randn(1, 64, 32, dtype=torch.float16), offsets)
    experts = _model(False).model.layers[0].mlp.experts
    experts.down_proj = torch.nn.Parameter(torch.randn(8, 64, 48))  # [E, hidden, 48]: 48 is no multiple of 32
    from hf_fsdp2.sharding.expert_parallel import dispatch

    dispatch._OURS.add(experts)  # as the EP dispatch registers the experts it runs
    with pytest.raises(ValueError, match=r"Qwen3MoeExperts.down_proj of shape \(8, 64, 48\): its kernels need both "
                                         r"matrix dimensions multiples of 32"):
        low_precision.install([experts], MODE, "cpu")


def test_the_padded_token_groups_are_the_groups():
    """Each expert's rows moved to a multiple of the block (an empty group one block of zeros; unused rows past the
    last group after it),
    through torchao's matmul: each group's output is torchao's on that group alone, each used row gets a gradient
    (the unused rows' are not defined: the dispatch never reads them); no host read (forward and backward), one
    grouped matmul each for output, dgrad and wgrad."""
    from torchao.prototype.moe_training.utils import _quantize_then_scaled_grouped_mm

    from hf_fsdp2.sharding.expert_parallel import low_precision

    torch.manual_seed(0)
    rows = torch.randn(50, 64, requires_grad=True)
    weight = torch.randn(4, 96, 64)  # [E, out, in], read transposed as the dispatch reads it
    offsets = torch.tensor([5, 5, 30, 41], dtype=torch.int32)  # an empty group; rows 41.. unused
    padded, places, ends = low_precision._pad_groups(rows.detach(), offsets, 32)
    assert ends.tolist() == [32, 64, 96, 128] and padded.shape == (64 + 4 * 32, 64)  # the empty group: one block
    assert places[:5].tolist() == list(range(5)) and places[5:30].tolist() == list(range(64, 89))
    assert places[30:41].tolist() == list(range(96, 107)) and places[41:].tolist() == list(range(128, 137))
    assert not padded[32:64].any() and torch.equal(padded[places], rows.detach())
    reads = HostReads()
    with reads.counting(), reads.window():  # the padding, torchao's quantization and grouped matmuls, both ways
        out = low_precision.grouped_mm(MODE, rows, weight.transpose(-2, -1), offsets)
        out.square().sum().backward()
    assert not reads.counts and reads.ops == {"_grouped_mm": 3}, (reads.counts, reads.ops)  # output, dgrad, wgrad
    config = low_precision.torchao_config(MODE)
    for expert, (start, end) in enumerate([(0, 5), (5, 5), (5, 30), (30, 41)]):
        if start == end:
            continue
        alone = torch.cat([rows[start:end].detach(), rows.new_zeros(-(end - start) % 32, 64)])
        expected = _quantize_then_scaled_grouped_mm(alone, weight[expert:expert + 1].transpose(-2, -1), config,
                                                    offs=torch.tensor([alone.shape[0]], dtype=torch.int32))
        assert torch.equal(out[start:end], expected[:end - start].float()), expert
    assert rows.grad[:41].abs().sum(-1).gt(0).all() and torch.isfinite(rows.grad[:41]).all()


def _bench(rank, world):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import moe_fp8

    return moe_fp8.run(tiny=True)


def test_the_fp8_experts_benchmark_reaches_its_code_on_cpu():
    """benchmarks/moe_fp8.py (the GPU check's bf16 vs FP8 experts at world size 1) at its tiny shape on CPU: both
    contestants train (emulated MXFP8 beside bf16: close losses, not equal ones), and the ratio is computed."""
    result = run_ranks(_bench, 1)[0]
    bf16, fp8 = result["contestants"]["bf16"], result["contestants"][MODE]
    assert "error" not in bf16 and "error" not in fp8, result
    assert fp8["losses"] != bf16["losses"] and fp8["losses"] == pytest.approx(bf16["losses"], rel=1e-3)
    assert result["ratios"][MODE]["step"] > 0 and result["shape"]["num_experts"] == 8


def test_the_rowwise_path_hands_torchao_what_its_gpu_kernels_take(monkeypatch):
    """'rowwise' on CPU, as far as it can go: torchao's rowwise FP8 autograd function (the H100/H200 path) with its
    Triton quantization kernels and `torch._scaled_grouped_mm` (CUDA only) replaced by torch reference code that
    asserts what the GPU kernels need: FP8 operands, the left row-major and the right column-major, strides of 16
    bytes, int32 group ends at multiples of 16 rows. Forward, input and weight gradients of [E, out, in] and
    transposed ([E, in, out], gpt-oss) experts, unaligned and empty groups and unused rows past the last: within FP8's
    error of fp32 (measured 3.7-3.9% rms; not a number the GPU must match, a check that the scales are applied)."""
    import torchao.prototype.moe_training.fp8_grouped_mm as torchao_fp8
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
    from torchao.prototype.moe_training.utils import (torch_to_3d_rowwise_float8_transpose_rhs,
                                                      torch_to_float8_per_group_colwise)

    from hf_fsdp2.sharding.expert_parallel import low_precision

    f8 = torch.float8_e4m3fn

    def scaled(hp, dim, dtype=f8, round_scales_to_power_of_2=False):
        scale = tensor_to_scale(hp, dtype, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=dim,
                                round_scales_to_power_of_2=round_scales_to_power_of_2)
        return to_fp8_saturated(hp.float() * scale, dtype), scale

    def column_major(t):
        return t.transpose(-2, -1).contiguous().transpose(-2, -1)

    def colwise_3d(hp, output_dtype=f8, round_scales_to_power_of_2=False):
        data, scale = scaled(hp, -2, output_dtype, round_scales_to_power_of_2)
        return column_major(data), scale

    def per_group_colwise_dual(a, b, offsets, output_dtype=f8, round_scales_to_power_of_2=False):
        out = []
        for t in (a, b):
            data, scale = torch_to_float8_per_group_colwise(column_major(t), offsets, output_dtype,
                                                            round_scales_to_power_of_2)
            out += [column_major(data), scale]
        return tuple(out)

    calls = []

    def scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype=None, use_fast_accum=False):
        assert a.dtype == b.dtype == f8 and offs.dtype == torch.int32
        assert a.stride(-1) == 1 and b.stride(-2) == 1, (a.stride(), b.stride())
        assert all(stride % 16 == 0 for t in (a, b) for stride in t.stride() if stride != 1), (a.stride(), b.stride())
        ends = offs.tolist()
        assert all(end % 16 == 0 for end in ends), ends
        calls.append((a.dim(), b.dim()))
        starts = [0] + ends[:-1]
        if b.dim() == 3:  # (M, K) x (E, K, N), scales (M,) and (E, N): the output, the input gradient
            out = torch.zeros(a.shape[0], b.shape[-1])
            for g, (s, e) in enumerate(zip(starts, ends)):
                out[s:e] = (a[s:e].float() * scale_a[s:e, None]) @ (b[g].float() * scale_b[g][None, :])
            return out.to(out_dtype)
        n, k = a.shape[0], b.shape[1]  # (N, M) x (M, K) grouped along M, scales per group: the weight gradient
        return torch.stack([(a[:, s:e].float() * scale_a[g * n:(g + 1) * n, None])
                            @ (b[s:e].float() * scale_b[g * k:(g + 1) * k][None, :])
                            for g, (s, e) in enumerate(zip(starts, ends))]).to(out_dtype)

    monkeypatch.setattr(torchao_fp8, "triton_fp8_rowwise_2d_scale_and_cast",
                        lambda hp, output_dtype=f8, round_scales_to_power_of_2=False: scaled(
                            hp, -1, output_dtype, round_scales_to_power_of_2))
    monkeypatch.setattr(torchao_fp8, "triton_fp8_colwise_3d_scale_and_cast", colwise_3d, raising=False)  # >= 0.18
    monkeypatch.setattr(torchao_fp8, "triton_fp8_rowwise_3d_transpose_rhs",
                        lambda hp, output_dtype=f8, round_scales_to_power_of_2=False:
                        torch_to_3d_rowwise_float8_transpose_rhs(hp, output_dtype, round_scales_to_power_of_2))
    monkeypatch.setattr(torchao_fp8, "triton_fp8_per_group_colwise_scales_dual", per_group_colwise_dual)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm, raising=False)

    torch.manual_seed(0)
    starts, ends = [0, 5, 5, 37], [5, 5, 37, 61]  # an empty group; rows 61.. unused
    for transposed in (False, True):
        rows = torch.randn(70, 64, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.randn(4, 64, 96, dtype=torch.bfloat16) if transposed else torch.randn(4, 96, 64,
                                                                                               dtype=torch.bfloat16)
        weight.requires_grad_()
        del calls[:]
        out = low_precision.grouped_mm("rowwise", rows, weight if transposed else weight.transpose(-2, -1),
                                       torch.tensor(ends, dtype=torch.int32))
        grad = torch.randn(61, 96)
        (out[:61].float() * grad).sum().backward()
        assert calls == [(2, 3), (2, 3), (2, 2)]  # output; input gradient, weight gradient
        exact_rows, exact_weight = rows.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
        w = exact_weight if transposed else exact_weight.transpose(-2, -1)
        exact = torch.cat([exact_rows[s:e] @ w[g] for g, (s, e) in enumerate(zip(starts, ends))])
        (exact * grad).sum().backward()
        for ours, theirs in ((out[:61], exact.detach()), (rows.grad[:61], exact_rows.grad[:61]),
                             (weight.grad, exact_weight.grad)):
            error = ((ours.float() - theirs).norm() / theirs.norm()).item()
            assert 5e-3 < error < 6e-2, (transposed, error)
