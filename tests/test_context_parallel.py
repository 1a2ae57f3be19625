"""Context parallelism x FSDP2 (sharding/context_parallel.py): Accelerate's `maybe_context_parallel`
with torch's ring attention, on CPU through the CPU SDPA kernel's handler."""

from __future__ import annotations

import pytest
import torch

from .common import build_model
from .dist_harness import NCCL_LIKE, run_ranks


def _ring_attention(rank, world):
    """torch's `context_parallel` on 2 CPU ranks: SDPA forward and backward equal one process's. The cp
    mesh gets gloo groups of its own where the default group refuses CPU tensors (as
    `hf_fsdp2.build_mesh` does under NCCL), so nothing may go through the default group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    from hf_fsdp2.sharding import context_parallel as cp, model_parts

    from hf_fsdp2.runtime import collectives

    cp.enable_cpu_ring_attention()
    override = None if "cpu" in collectives.default_group_devices() else {0: "gloo"}
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",), backend_override=override)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.square().sum().backward()
    reference = (out.detach(), q.grad, k.grad, v.grad)
    qs, ks, vs = (t.detach().clone() for t in (q, k, v))
    with context_parallel(mesh, buffers=[qs, ks, vs], buffer_seq_dims=[2, 2, 2], no_restore_buffers={qs, ks, vs}):
        assert cp.context_parallel_active()
        leaves = [t.detach().requires_grad_() for t in (qs, ks, vs)]
        local = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
        local.square().sum().backward()
        results = context_parallel_unshard(mesh, [local.detach(), *(t.grad for t in leaves)], [2, 2, 2, 2])
    assert not cp.context_parallel_active()
    for got, want in zip(results, reference):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["gloo", NCCL_LIKE])
def test_cpu_ring_attention_equals_one_process(backend):
    run_ranks(_ring_attention, 2, backend=backend)


# shard_size="auto" under Accelerate's TP/CP mesh: the planner keeps the run's sizes and the mesh's
# data-parallel shape, and with an ample budget turns resharding off.
AUTO_LAYOUT = {"HF_FSDP2_SHARD_SIZE": "auto", "HF_FSDP2_MEMORY_BUDGET": "20GB", "HF_FSDP2_PLAN_SEQ_LEN": "16"}


def test_accelerate_launch_with_cp_size_2_matches_one_process(tmp_path):
    """`accelerate launch --config_file accelerate_configs/fsdp2_cp.yaml` (dp_shard 2 x cp 2) with
    register(): every sequence split over 2 ranks inside `maybe_context_parallel`, FSDP2 over the 4
    ranks; losses equal one process on the same global batch, and the state resumes on plain FSDP."""
    from .launched_runs import launch, launch_forked, reference_losses

    out = launch("fsdp2_cp.yaml", 4, tmp_path / "cp.json", "--steps", "3", "--per-device-batch", "4",
                 "--save-state", str(tmp_path / "state"), env=AUTO_LAYOUT)
    assert out["all_dtensor"] and out["mesh"] == [2, 2] and out["world"] == 4  # Accelerate's (dp_shard, cp) mesh
    assert out["reshard_after_forward"] is False  # the planner's choice (the yaml says true), on Accelerate's mesh
    assert out["losses"] == pytest.approx(reference_losses(3), rel=1e-4)
    resumed = launch_forked("fsdp2.yaml", 2, tmp_path / "resumed.json", "--start", "3", "--steps", "1",
                            "--load-state", str(tmp_path / "state"))
    assert resumed["losses"] == pytest.approx(reference_losses(4)[3:], rel=1e-4)


def test_trainer_under_accelerate_launch_with_cp_size_2_matches_one_process(tmp_path):
    """A Trainer script under the same CP config: the Trainer enters `maybe_context_parallel` itself
    (labels shifted and positions made before the split); losses equal one process's."""
    from .launched_runs import single_trainer_losses, trainer_under_launch

    out = trainer_under_launch("fsdp2_cp.yaml", tmp_path)
    assert out["all_dtensor"] and out["world"] == 4
    assert out["losses"] == pytest.approx(single_trainer_losses(tmp_path, 3), rel=1e-4)


def test_a_training_forward_outside_maybe_context_parallel_is_refused_by_name():
    """With cp_size > 1 a loop that never enters `maybe_context_parallel` would silently run every CP
    rank on whole sequences; the forward is refused, naming the setting. Evaluation is not."""
    from hf_fsdp2.sharding import context_parallel as cp, model_parts

    model = build_model()
    cp.require_context_parallel(model_parts(model), 2)
    ids = torch.arange(8).view(1, 8)
    with pytest.raises(RuntimeError, match=r"cp_size=2.*maybe_context_parallel"):
        model(input_ids=ids)
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)


def test_a_padded_batch_under_context_parallelism_is_refused_by_name(monkeypatch):
    """Issue 48: under CP a left-padded batch trained as if it had no mask (Accelerate drops the mask, torch's
    ring attention attends without one). A training forward whose attention_mask marks padding is refused by
    name; a mask of ones (no padding) and no mask pass."""
    from hf_fsdp2.sharding import context_parallel as cp, model_parts

    model = build_model()
    cp.require_context_parallel(model_parts(model), 2)
    monkeypatch.setattr(cp, "context_parallel_active", lambda: True)
    ids = torch.arange(8).view(1, 8)
    model(input_ids=ids)
    model(input_ids=ids, attention_mask=torch.ones(1, 8, dtype=torch.long))
    padded = torch.ones(1, 8, dtype=torch.long)
    padded[0, :3] = 0
    with pytest.raises(ValueError, match=r"cp_size=2: the batch's attention_mask marks padding"):
        model(input_ids=ids, attention_mask=padded)
    with pytest.raises(ValueError, match=r"not a \[batch, seq\] mask"):
        model(input_ids=ids, attention_mask=torch.zeros(1, 1, 8, 8))


def test_a_padded_batch_whose_mask_is_passed_positionally_is_refused_too(monkeypatch):
    """Issue 65: `model(input_ids, attention_mask)` (LlamaForCausalLM's and PeftModel's signature) passed the
    padded mask positionally, where the check read only the keyword, and trained unmasked. The forward's
    arguments are bound to its signature first: the mask is seen however it is passed."""
    from peft import LoraConfig, get_peft_model

    from hf_fsdp2.sharding import context_parallel as cp, model_parts

    monkeypatch.setattr(cp, "context_parallel_active", lambda: True)
    ids = torch.arange(8).view(1, 8)
    padded = torch.ones(1, 8, dtype=torch.long)
    padded[0, :3] = 0
    for model in (build_model(), get_peft_model(build_model(), LoraConfig(r=2, target_modules=["q_proj"]))):
        cp.require_context_parallel(model_parts(model), 2)
        model(ids, torch.ones(1, 8, dtype=torch.long))  # no padding: passes
        with pytest.raises(ValueError, match=r"cp_size=2: the batch's attention_mask marks padding"):
            model(ids, padded)


def test_a_sequence_length_cp_size_does_not_divide_is_refused_by_name():
    """torch would split it unevenly and its ring attention would fail inside; the accelerator's CP
    context (wrapped at prepare) refuses it first, naming the setting and the fix."""
    from hf_fsdp2.sharding.context_parallel import checked_context

    entered = []
    context = checked_context(lambda **kwargs: entered.append(kwargs), cp_size=2)
    context(buffers=[torch.zeros(2, 16)], buffer_seq_dims=[1])
    assert len(entered) == 1
    with pytest.raises(ValueError, match=r"lengths \[15\].*cp_size=2.*pad_to_multiple_of=4"):
        context(buffers=[torch.zeros(2, 15)], buffer_seq_dims=[1])
    with pytest.raises(ValueError, match=r"lengths \[8, 16\]"):
        context(buffers=[torch.zeros(2, 16), torch.zeros(2, 8)], buffer_seq_dims=[1, 1])
    assert len(entered) == 1


def _shard_with(rank, world, fields):
    from hf_fsdp2 import FSDP2Config, shard_model

    try:
        shard_model(build_model(), FSDP2Config(**fields))
    except ValueError as error:
        return str(error)
    return None


def test_cp_size_is_a_config_field_a_mesh_must_carry():
    """`cp_size` is FSDP2Config's (Accelerate's parallelism_config sets it, with the "cp" mesh dimension it builds):
    without such a mesh it is refused by name, never run as plain data parallelism; it must divide the shard size."""
    from hf_fsdp2 import FSDP2Config

    assert FSDP2Config.from_dict({"cp_size": "2"}).cp_size == 2
    with pytest.raises(ValueError, match=r"`cp_size`=3 must divide the shard size 4"):
        FSDP2Config(cp_size=3).mesh_shape(4)
    error = run_ranks(_shard_with, 2, {"cp_size": 2})[0]
    assert error and "`cp_size`=2 needs a device mesh with a 'cp' dimension" in error and "parallelism_config" in error


def _tiled_loss_under_cp(rank, world):
    """Accelerate's mesh (dp_shard 1 x cp 2) and torch's context_parallel around the step, as maybe_context_parallel
    enters it: the tiled loss (each rank's hidden states are its 1/cp of the sequence, labels shifted before the
    split) gives the loss and gradients of one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    import hf_fsdp2

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_shard", "cp"),
                            backend_override={0: "gloo", 1: "gloo"})
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (2, 16), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # some targets ignored: the count differs between the cp ranks' halves
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    count = (shift != -100).sum()
    reference = build_model(0)
    want = reference(input_ids=ids, labels=labels).loss
    want.backward()
    model = hf_fsdp2.shard_model(build_model(0), hf_fsdp2.FSDP2Config(loss_tile_size=3), mesh=mesh)
    model.train()
    buffers = [ids.clone(), shift.clone(), torch.arange(16).expand(2, -1).clone()]
    with context_parallel(mesh["cp"], buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
        local_ids, local_shift, positions = buffers
        assert local_ids.shape == (2, 16 // world)
        # each rank's loss: its valid targets' sum / the whole batch's count; FSDP2 averages over the cp ranks
        out = model(input_ids=local_ids, position_ids=positions, labels=local_shift, shift_labels=local_shift,
                    num_items_in_batch=count)
        assert out.logits.shape[1] == 1  # tiled: the rank's logits never whole
        (out.loss * world).backward()
    total = out.loss.detach().clone()
    torch.distributed.all_reduce(total, group=mesh["cp"].get_group())
    assert total.item() == pytest.approx(want.item(), rel=1e-4)
    for (name, p), (_, q) in zip(reference.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(q.grad.full_tensor(), p.grad, rtol=1e-4, atol=2e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    return total.item()


def test_the_tiled_loss_under_context_parallelism_equals_one_process():
    """Sequence tiling of the loss with ring CP (issue 63): nothing to change, each rank's tiles cover its 1/cp of
    the sequence; loss and every gradient equal one process's (2 ranks, GPU semantics)."""
    run_ranks(_tiled_loss_under_cp, 2, backend=NCCL_LIKE)
