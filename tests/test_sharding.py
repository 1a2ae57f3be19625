"""The sharding engine on real gloo ranks, compared with a single-process reference."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import hf_fsdp2
from hf_fsdp2 import FSDP2Config, shard_model

from .common import (
    FSDP_ALL_GATHER, FSDP_REDUCE_SCATTER, assert_close_dicts, batches, build_model, count_collectives, full_params,
    local_rows, lora, optimizer,
    plain_params, reference_train, sharded_train,
)
from .dist_harness import run_ranks

# Reduction order differs between one process and N ranks; this is the tolerance that needs.
LOSS_ATOL = 1e-4
PARAM_ATOL = 1e-4


def _reference(model_fn, data):
    model = model_fn()
    losses = reference_train(model, data)
    return losses, plain_params(model)


def _fsdp_groups(model) -> set:
    """One entry per `fully_shard` call (a [norm, head] group spans two modules but is one state)."""
    return {id(m._get_fsdp_state()) for m in model.modules() if isinstance(m, FSDPModule)}


# ---------------------------------------------------------------------------------------------


def _full_finetune(rank, world, config_kwargs, model_kwargs):
    model = build_model(**model_kwargs)
    shard_model(model, FSDP2Config(**config_kwargs))
    assert all(isinstance(p, DTensor) for p in model.parameters())
    n_layers = model.config.num_hidden_layers
    groups = _fsdp_groups(model)
    losses = sharded_train(model, batches(), rank, world)
    params = full_params(model)
    return {"losses": losses, "params": params if rank == 0 else None, "groups": len(groups),
            "layer_groups": sum(isinstance(m, FSDPModule) for m in model.model.layers), "n_layers": n_layers,
            "checkpointed": sum(type(m).__name__.endswith("CheckpointWrapper") for m in model.model.layers),
            # op-level selective checkpointing: torch's checkpoint gets the selective context_fn
            "selective": sum("context_fn" in getattr(getattr(m, "checkpoint_fn", None), "keywords", {})
                             for m in model.model.layers)}


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.oldest), 4])
def test_full_finetune_matches_reference(world):
    ref_losses, ref_params = _reference(build_model, batches())
    out = run_ranks(_full_finetune, world, {}, {})
    assert out[0]["layer_groups"] == out[0]["n_layers"]
    assert out[0]["groups"] == out[0]["n_layers"] + 3  # layers, embedding, [norm, head], root
    for r in out:
        assert r["losses"] == pytest.approx(ref_losses, abs=LOSS_ATOL)
    assert_close_dicts(out[0]["params"], ref_params, atol=PARAM_ATOL)


def test_tied_embeddings_share_one_group():
    ref_losses, ref_params = _reference(lambda: build_model(tie_word_embeddings=True), batches())
    out = run_ranks(_full_finetune, 2, {}, {"tie_word_embeddings": True})
    assert out[0]["groups"] == out[0]["n_layers"] + 2  # layers, [embedding, norm, head], root
    assert out[0]["losses"] == pytest.approx(ref_losses, abs=LOSS_ATOL)
    assert_close_dicts(out[0]["params"], ref_params, atol=PARAM_ATOL)


def test_activation_checkpointing_and_cpu_offload_match_reference():
    ref_losses, ref_params = _reference(build_model, batches())
    for kwargs in ({"activation_checkpointing": True}, {"activation_checkpointing": True, "checkpoint_every": 2},
                   {"activation_checkpointing": True, "checkpoint_save_matmuls": True},
                   {"cpu_offload": True},
                   {"forward_prefetch": 1, "backward_prefetch": 2, "reshard_after_forward": False}):
        out = run_ranks(_full_finetune, 2, kwargs, {})
        assert out[0]["losses"] == pytest.approx(ref_losses, abs=LOSS_ATOL), kwargs
        every = kwargs.get("checkpoint_every", 1) if kwargs.get("activation_checkpointing") else 0
        assert out[0]["checkpointed"] == (len(range(0, out[0]["n_layers"], every)) if every else 0), kwargs
        assert out[0]["selective"] == (out[0]["n_layers"] if kwargs.get("checkpoint_save_matmuls") else 0), kwargs
        assert_close_dicts(out[0]["params"], ref_params, atol=PARAM_ATOL)


def _schedule_worker(rank, world, config_kwargs, lora_targets):
    model = build_model()
    if lora_targets:
        model = lora(model, target_modules=lora_targets)
    shard_model(model, FSDP2Config(**config_kwargs))
    base = model.base_model.model if lora_targets else model
    ids = local_rows(batches()[0], rank, world)
    with count_collectives() as fwd:
        loss = model(input_ids=ids, labels=ids).loss
    with count_collectives() as bwd:
        loss.backward()
    model.zero_grad(set_to_none=True)
    first_layer = base.model.layers[0]._get_fsdp_state()
    chain = ["layers.0" if s is first_layer else "other"
             for s in base.model.embed_tokens._get_fsdp_state()._states_to_forward_prefetch]
    losses = sharded_train(model, batches(), rank, world)
    params = full_params(model)  # collective: every rank
    return {"fwd": fwd[FSDP_ALL_GATHER], "bwd": bwd[FSDP_ALL_GATHER], "embedding_prefetches": chain,
            "losses": losses, "n_layers": base.config.num_hidden_layers, "params": params if rank == 0 else None}


def test_cpu_schedule_skips_embedding_regather_and_prefetches():
    """Forward gathers each group once; backward re-gathers only the resharded layers (not the last
    one, the head, or the embedding, whose backward reads no weight); results equal the reference."""
    ref_losses, ref_params = _reference(build_model, batches())
    r = run_ranks(_schedule_worker, 2, {}, None)[0]
    n = r["n_layers"]
    assert (r["fwd"], r["bwd"]) == (n + 2, n - 1)
    assert r["embedding_prefetches"] == ["layers.0"]  # forward_prefetch=None is 1 on CPU
    assert r["losses"] == pytest.approx(ref_losses, abs=LOSS_ATOL)
    assert_close_dicts(r["params"], ref_params, atol=PARAM_ATOL)
    # Explicit 0 turns the chain off; the gather counts stay.
    r = run_ranks(_schedule_worker, 2, {"forward_prefetch": 0}, None)[0]
    assert (r["fwd"], r["bwd"], r["embedding_prefetches"]) == (n + 2, n - 1, [])


def test_lora_on_embedding_is_gathered_again_in_backward():
    """An adapted embedding's backward reads its LoRA weights, so it keeps its backward all-gather."""
    targets = ["embed_tokens", "q_proj"]

    def ref_model():
        return lora(build_model(), target_modules=targets)

    ref_losses, ref_params = _reference(ref_model, batches())
    r = run_ranks(_schedule_worker, 2, {}, targets)[0]
    assert r["bwd"] == r["n_layers"] - 1 + 1
    assert r["losses"] == pytest.approx(ref_losses, abs=LOSS_ATOL)
    assert_close_dicts({k: v for k, v in r["params"].items() if "lora_" in k},
                       {k: v for k, v in ref_params.items() if "lora_" in k}, atol=PARAM_ATOL)


def test_hsdp_2x2_matches_reference():
    ref_losses, ref_params = _reference(build_model, batches())
    out = run_ranks(_full_finetune, 4, {"replicate_size": 2}, {})
    for r in out:
        assert r["losses"] == pytest.approx(ref_losses, abs=LOSS_ATOL)
    assert_close_dicts(out[0]["params"], ref_params, atol=PARAM_ATOL)


def test_bf16_params_fp32_reduce_close_to_fp32():
    ref_losses, _ = _reference(build_model, batches())
    out = run_ranks(_full_finetune, 2, {"param_dtype": "bf16", "reduce_dtype": "fp32"}, {})
    # bf16 keeps 8 mantissa bits (0.4% per rounding); over 5 Adam steps losses stay within 2%.
    assert out[0]["losses"] == pytest.approx(ref_losses, rel=2e-2)
    assert out[0]["losses"][-1] < out[0]["losses"][0]


# ---------------------------------------------------------------------------------------------


def _lora_worker(rank, world, frozen_dtype):
    model = lora(build_model())
    shard_model(model, FSDP2Config(frozen_dtype=frozen_dtype))
    data = batches()
    layer = model.base_model.model.model.layers[0]
    kinds = {(p.requires_grad, p.dtype) for p in layer.parameters()}
    n_groups_with_params = len(model.base_model.model.model.layers) + 2  # + embedding + [norm, head]
    ids = local_rows(data[0], rank, world)
    with count_collectives() as fwd:
        loss = model(input_ids=ids, labels=ids).loss
    with count_collectives() as bwd:
        loss.backward()
    frozen_grads = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    trainable_grads = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    model.zero_grad(set_to_none=True)
    losses = sharded_train(model, data, rank, world)
    trainable = {n: t for n, t in full_params(model).items() if "lora_" in n}
    return {"fwd": fwd, "bwd": bwd, "expected_groups": n_groups_with_params, "kinds": kinds,
            "frozen_grads": frozen_grads, "missing_grads": trainable_grads, "losses": losses,
            "params": trainable if rank == 0 else None}


@pytest.mark.oldest
def test_lora_frozen_and_adapters_gathered_together():
    data = batches()

    def ref_model():
        return lora(build_model())

    ref_losses_full, ref_params = _reference(ref_model, data)
    # The sharded run first does one extra forward/backward with zeroed grads; no optimizer step, so
    # the reference is the plain 5-step run.
    out = run_ranks(_lora_worker, 2, None)
    r = out[0]
    assert r["fwd"][FSDP_ALL_GATHER] == r["expected_groups"], r["fwd"]
    # Only the decoder-layer groups hold trainable LoRA weights: only they are reduce-scattered.
    assert r["bwd"][FSDP_REDUCE_SCATTER] == r["expected_groups"] - 2, r["bwd"]
    assert r["kinds"] == {(False, torch.float32), (True, torch.float32)}
    assert r["frozen_grads"] == [] and r["missing_grads"] == []
    assert r["losses"] == pytest.approx(ref_losses_full, abs=LOSS_ATOL)
    assert_close_dicts(r["params"], {k: v for k, v in ref_params.items() if "lora_" in k}, atol=PARAM_ATOL)


def test_lora_bf16_frozen_base_with_fp32_adapters_in_one_group():
    out = run_ranks(_lora_worker, 2, "bf16")
    r = out[0]
    assert r["kinds"] == {(False, torch.bfloat16), (True, torch.float32)}
    assert r["fwd"][FSDP_ALL_GATHER] == r["expected_groups"], r["fwd"]
    assert r["frozen_grads"] == [] and r["missing_grads"] == []
    assert r["losses"][-1] < r["losses"][0]


# ---------------------------------------------------------------------------------------------


def _no_sync_worker(rank, world):
    model = build_model()
    shard_model(model)
    opt = optimizer(model)
    scatters_inside = []
    for ids in batches(steps=3):
        ids = local_rows(ids, rank, world)
        first, second = ids.chunk(2)
        with count_collectives() as inside, hf_fsdp2.no_sync(model):
            (model(input_ids=first, labels=first).loss / 2).backward()
        scatters_inside.append(inside[FSDP_REDUCE_SCATTER] + inside["all_reduce"])
        (model(input_ids=second, labels=second).loss / 2).backward()
        opt.step()
        opt.zero_grad()
    params = full_params(model)  # collective: every rank gathers
    return {"scatters_inside": scatters_inside, "params": params if rank == 0 else None}


def test_no_sync_accumulates_without_communication():
    _, ref_params = _reference(build_model, batches(steps=3))
    out = run_ranks(_no_sync_worker, 2)
    assert out[0]["scatters_inside"] == [0, 0, 0]
    assert_close_dicts(out[0]["params"], ref_params, atol=PARAM_ATOL)


# ---------------------------------------------------------------------------------------------


def _meta_worker(rank, world):
    from transformers import LlamaForCausalLM

    from .common import tiny_config

    with torch.device("meta"):
        model = LlamaForCausalLM(tiny_config())
    shard_model(model)
    local_bytes = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    finite = all(torch.isfinite(p.to_local()).all().item() for p in model.parameters())
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    ids = local_rows(batches()[0], rank, world)
    loss = model(input_ids=ids, labels=ids).loss.item()
    return {"local": local_bytes, "total": total, "finite": finite, "inv_freq": inv_freq, "loss": loss}


@pytest.mark.oldest
def test_meta_device_deferred_init_materialises_only_local_shards():
    reference = build_model()
    out = run_ranks(_meta_worker, 2)
    for r in out:
        assert r["finite"]
        assert r["local"] <= r["total"] // 2 + 64 * 2  # a shard, plus rounding of uneven rows
        torch.testing.assert_close(r["inv_freq"], reference.model.rotary_emb.inv_freq)
        assert 3.0 < r["loss"] < 6.0  # freshly initialised: near ln(vocab) = 4.85


# ---------------------------------------------------------------------------------------------
# Accelerate's wrap policies and ignored modules (from Accelerate's FSDP2 options: NO_WRAP,
# SIZE_BASED_WRAP with fsdp_min_num_params, fsdp_ignored_modules)


class _NoLayers(torch.nn.Module):
    """A model without decoder layers or `_no_split_modules` (like Accelerate's RegressionModel)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _policies_worker(rank, world):
    out = {}
    for policy, kwargs in (("none", {}), ("size", {"min_num_params": 20_000})):
        model = build_model()
        shard_model(model, FSDP2Config(wrap_policy=policy, **kwargs))
        groups = _fsdp_groups(model)
        losses = sharded_train(model, batches(3), rank, world)
        out[policy] = {"groups": len(groups), "losses": losses,
                       "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters())}
    model = _NoLayers()
    shard_model(model, FSDP2Config(wrap_policy="none"))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()
    out["no_layers_groups"] = len(_fsdp_groups(model))
    model = build_model()
    shard_model(model, FSDP2Config(ignored_modules=r"lm_head"))
    out["ignored_is_plain"] = not isinstance(model.lm_head.weight, DTensor)
    out["others_dtensor"] = all(isinstance(p, DTensor) for n, p in model.named_parameters() if "lm_head" not in n)
    out["ignored_first_loss"] = sharded_train(model, batches(1), rank, world)[0]
    return out


def test_no_wrap_size_based_wrap_and_ignored_modules():
    ref_losses, _ = _reference(build_model, batches(3))
    out = run_ranks(_policies_worker, 2)[0]
    assert out["none"]["groups"] == 1 and out["none"]["all_dtensor"]  # the root group only
    n = build_model().config.num_hidden_layers
    # Size-based: every module over 20,000 parameters (layers, their MLPs, embedding, head), bottom-up.
    assert out["size"]["groups"] > n + 1 and out["size"]["all_dtensor"]
    for policy in ("none", "size"):
        assert out[policy]["losses"] == pytest.approx(ref_losses, abs=LOSS_ATOL)
    assert out["no_layers_groups"] == 1
    assert out["ignored_is_plain"] and out["others_dtensor"]
    assert out["ignored_first_loss"] == pytest.approx(ref_losses[0], abs=LOSS_ATOL)


def test_wrap_policy_and_ignored_modules_are_validated():
    with pytest.raises(ValueError, match="wrap_policy"):
        FSDP2Config(wrap_policy="LAYER_WRAP")
    assert FSDP2Config(wrap_policy="SIZE_BASED_WRAP").wrap_policy == "size"
    assert FSDP2Config(wrap_policy="NO_WRAP").wrap_policy == "none"
    with pytest.raises(ValueError, match="ignored_modules"):
        FSDP2Config(ignored_modules="(")
    with pytest.raises(ValueError, match="activation_checkpointing"):
        FSDP2Config(wrap_policy="none", activation_checkpointing=True)
    from hf_fsdp2.sharding import ignored_parameters

    with pytest.raises(ValueError, match=r"matches no module of LlamaForCausalLM .*model\.embed_tokens"):
        ignored_parameters(build_model(), "vision_tower")


def _offloaded_activations(rank, world):
    """`activation_offload=True` (on this CPU device nothing would move), plus the same hooks made to
    copy host tensors as a device's would be copied: the round trip trains like one process."""
    from hf_fsdp2.sharding import activation_offload

    model = build_model()
    shard_model(model, FSDP2Config(activation_offload=True))
    moved: list[int] = []
    activation_offload.apply_activation_offload(list(model.model.layers), copy_host_tensors=True, counter=moved)
    losses = sharded_train(model, batches(), rank, world)
    return {"losses": losses, "params": full_params(model), "moved_bytes": sum(moved)}


def test_activation_offload_round_trip_trains_like_one_process():
    ref_losses, ref_params = _reference(build_model, batches())
    out = run_ranks(_offloaded_activations, 2)
    assert out[0]["losses"] == pytest.approx(ref_losses, abs=LOSS_ATOL)
    assert_close_dicts(out[0]["params"], ref_params, atol=PARAM_ATOL)
    assert out[0]["moved_bytes"] > 0


def test_op_level_checkpointing_runs_without_the_kv_cache_in_training():
    """A KV cache filled in forward would make selective checkpointing's recompute run other ops (torch:
    "not found in storage"); checkpointed layers get none in training, whatever use_cache says, and
    gradients equal an unwrapped model's. Evaluation keeps the cache."""
    from hf_fsdp2.sharding.engine import apply_activation_checkpointing

    model, plain = build_model(), build_model()
    apply_activation_checkpointing(model, list(model.model.layers), 1, save_matmuls=True)
    ids = batches()[0]
    for kwargs in ({"use_cache": True}, {"attention_mask": torch.ones_like(ids)}):
        for m in (model, plain):
            m.zero_grad()
            m(input_ids=ids, labels=ids, **kwargs).loss.backward()
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)
    model.eval()
    with torch.no_grad():
        assert model(input_ids=ids[:1], use_cache=True).past_key_values is not None


def test_a_model_on_a_gpu_is_refused_where_the_default_group_carries_only_cpu_tensors():
    """FSDP2 moves a module's states to its mesh's device: on gloo a CUDA model would land on the CPU and fail
    at its first batch (the first GPU run's gloo_cuda case). Refused by name; CPU and meta models pass."""
    from hf_fsdp2.runtime.distributed import refuse_accelerator_model_on_host_backend

    with pytest.raises(ValueError, match=r"parameters are on cuda.*backend='nccl'"):
        refuse_accelerator_model_on_host_backend({"cpu", "cuda"}, torch.device("cpu"))
    refuse_accelerator_model_on_host_backend({"cpu", "meta"}, torch.device("cpu"))
    refuse_accelerator_model_on_host_backend({"cuda", "cpu"}, torch.device("cuda", 0))
