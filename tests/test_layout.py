"""The layout planner (`shard_size="auto"`, `hf-fsdp2 plan`) and regional compilation (`compile=True`)."""

from __future__ import annotations

import json

import pytest
import torch

from hf_fsdp2 import FSDP2Config
from hf_fsdp2.sharding import record_of
from hf_fsdp2.cli import main as cli_main
from hf_fsdp2.planner.layout import plan_layout
from hf_fsdp2.planner.memory import prepare_meta_model
from tests.common import (GLOBAL_BATCH, SEQ, batches, build_model, full_params, lora,
                          optimizer, reference_train, saved_tensors, sharded_train, tiny_config)
from tests.dist_harness import run_ranks

WORLD = 2


def _plan(budget: int, world: int = 4, device: str = "cuda", **config):
    prepared = prepare_meta_model(tiny_config(), FSDP2Config(**config))
    return plan_layout(prepared, world, FSDP2Config(**config), budget_bytes=budget, device_type=device,
                       batch_size=2, seq_len=SEQ)


def test_candidates_in_cost_order_and_the_first_that_fits_wins():
    plan = _plan(budget=1 << 40)
    activations = [(False, 1, False, False), (True, 1, True, False), (True, 2, False, False), (True, 1, False, False),
                   (False, 1, False, True)]
    keys = [(c.cpu_offload, activations.index((c.activation_checkpointing, c.checkpoint_every,
                                               c.checkpoint_save_matmuls, c.activation_offload)),
             c.reshard_after_forward, c.shard_size) for c in plan.candidates]
    # offload x activations (kept; every layer checkpointed but its matmul outputs kept; every other layer;
    # every layer; offloaded) x reshard x S in {1, 2, 4}
    assert keys == sorted(keys) and len(keys) == 2 * 5 * 2 * 3
    assert plan.chosen is plan.candidates[0] and plan.chosen.shard_size == 1 and plan.chosen.replicate_size == 4
    # Sharding wider needs less per rank; each knob on top of full sharding needs less again.
    full = [c for c in plan.candidates if not (c.cpu_offload or c.activation_checkpointing or c.reshard_after_forward
                                               or c.activation_offload)]
    assert [c.needed_bytes for c in full] == sorted((c.needed_bytes for c in full), reverse=True)
    for budget_from in plan.candidates[1:]:
        tight = _plan(budget=budget_from.needed_bytes)
        first_fit = next(c for c in tight.candidates if c.needed_bytes <= budget_from.needed_bytes)
        assert tight.chosen.describe() == first_fit.describe()
        assert all(c.needed_bytes > budget_from.needed_bytes for c in tight.candidates[:tight.candidates.index(tight.chosen)])
    config = _plan(budget=full[1].needed_bytes).config(FSDP2Config(shard_size="auto", memory_budget=1))
    assert (config.replicate_size, config.shard_size, config.reshard_after_forward, config.memory_budget) == (2, 2, False, None)


def test_cpu_plans_without_offload_and_gpu_offload_needs_host_room():
    cpu = _plan(budget=1 << 40, device="cpu")
    layouts = [c for c in cpu.candidates if not c.returns_freed_memory]  # 4 activations x 2 reshard x S in {1, 2, 4}
    assert not any(c.cpu_offload for c in cpu.candidates) and len(layouts) == 24
    # with freed memory given back: every layout (the activations a step frees; the sharded ones' gathers too)
    assert len(cpu.candidates) - len(layouts) == 24
    kept = _plan(budget=1 << 40, activation_checkpointing=True)  # a True you set is kept, every layer
    assert all(c.activation_checkpointing and c.checkpoint_every == 1 for c in kept.candidates)


def test_checkpointing_every_other_layer_is_costed_between_none_and_every_layer():
    """Selective layer checkpointing (checkpoint_every=2): the estimate keeps the other layers'
    activations and recomputes one checkpointed layer; the planner tries it before every layer."""
    from hf_fsdp2.planner.memory import estimate_memory

    def activations(**kwargs):
        return estimate_memory(tiny_config(), 2, FSDP2Config(**kwargs), batch_size=4, seq_len=256).activations

    none, every, other = (activations(), activations(activation_checkpointing=True),
                          activations(activation_checkpointing=True, checkpoint_every=2))
    assert len(other.layer_bytes) == 3 and every.peak_bytes < other.peak_bytes < none.peak_bytes
    assert other.peak_bytes == (other.outside_layers_bytes + other.layer_inputs_bytes + other.layer_bytes[1]
                                + max(other.layer_bytes[0], other.layer_bytes[2]))  # layers 0 and 2 checkpointed
    plan = _plan(budget=1 << 40, device="cpu")
    leanest_other = min(c.needed_bytes for c in plan.candidates if c.checkpoint_every == 2)
    tight = _plan(budget=leanest_other, device="cpu")
    assert tight.chosen.checkpoint_every == 2 and tight.chosen.activation_checkpointing
    assert tight.config(FSDP2Config(shard_size="auto", memory_budget=1)).checkpoint_every == 2
    with pytest.raises(ValueError, match="checkpoint_every.*activation_checkpointing"):
        FSDP2Config(checkpoint_every=2)


def test_op_level_checkpointing_keeps_matmul_outputs_and_is_costed_between_none_and_every_layer():
    """checkpoint_save_matmuls (sharding/selective_checkpoint.py): a checkpointed layer keeps what its
    matmuls and attention output (measured by the trace) and recomputes the rest; the planner tries it
    first among the checkpointing options (the least recomputation). Losses: tests/test_sharding.py."""
    from hf_fsdp2.planner.memory import estimate_memory

    def activations(**kwargs):
        return estimate_memory(tiny_config(), 2, FSDP2Config(**kwargs), batch_size=4, seq_len=256).activations

    none, ops, every = (activations(), activations(activation_checkpointing=True, checkpoint_save_matmuls=True),
                        activations(activation_checkpointing=True))
    assert every.peak_bytes < ops.peak_bytes < none.peak_bytes and ops.kept_outputs == "matmul outputs"
    # per layer: 7 linears' outputs (q, k, v, o, gate, up, down) + attention's output and fp32 log-sum-exp
    hidden, inter, kv, tokens = 64, 128, 2 * 16, 4 * 256
    linear_outputs = tokens * (hidden + 2 * kv + hidden + 2 * inter + hidden) * 4
    attention = tokens * hidden * 4 + 4 * tokens * 4  # output + lse (batch x heads x seq) in fp32
    assert ops.layer_matmul_bytes == (linear_outputs + attention,) * 3
    assert ops.peak_bytes == (ops.outside_layers_bytes + ops.layer_inputs_bytes + sum(ops.layer_matmul_bytes)
                              + max(b - m for b, m in zip(ops.layer_bytes, ops.layer_matmul_bytes)))
    plan = _plan(budget=1 << 40, device="cpu")
    leanest_ops = min(c.needed_bytes for c in plan.candidates if c.checkpoint_save_matmuls)
    tight = _plan(budget=leanest_ops, device="cpu")
    assert tight.chosen.checkpoint_save_matmuls
    assert tight.config(FSDP2Config(shard_size="auto", memory_budget=1)).checkpoint_save_matmuls
    with pytest.raises(ValueError, match="checkpoint_save_matmuls.*activation_checkpointing"):
        FSDP2Config(checkpoint_save_matmuls=True)


def test_activation_offload_moves_the_layers_activations_to_the_host():
    """Activation offload (sharding/activation_offload.py): the device keeps what the embedding, head and
    loss save plus one layer brought back; the host holds the layers' activations. A planner
    candidate on accelerators only (on a CPU host and device are one memory)."""
    from hf_fsdp2.planner.memory import estimate_memory

    def estimate(**kwargs):
        return estimate_memory(tiny_config(), 2, FSDP2Config(**kwargs), batch_size=4, seq_len=256)

    kept, moved = estimate(), estimate(activation_offload=True)
    a = moved.activations
    assert a.offloaded and a.peak_bytes == a.outside_layers_bytes + a.largest_layer_bytes
    assert a.host_bytes == a.layer_inputs_bytes + sum(a.layer_bytes) and moved.host_bytes == a.host_bytes
    assert a.peak_bytes < kept.activations.peak_bytes
    assert not any(c.activation_offload for c in _plan(budget=1 << 40, device="cpu").candidates)
    gpu = _plan(budget=1 << 40)
    kept_by_layout = {(c.shard_size, c.reshard_after_forward, c.cpu_offload): c for c in gpu.candidates
                      if not (c.activation_offload or c.activation_checkpointing)}
    offloaded = [c for c in gpu.candidates if c.activation_offload]
    assert len(offloaded) == len(kept_by_layout) == 12
    for c in offloaded:  # the same layout with activations moved: less on the device, more on the host
        same = kept_by_layout[(c.shard_size, c.reshard_after_forward, c.cpu_offload)]
        assert c.needed_bytes < same.needed_bytes and c.host_bytes > same.host_bytes
    tight = _plan(budget=min(c.needed_bytes for c in offloaded))
    config = tight.config(FSDP2Config(shard_size="auto", memory_budget=1))
    assert (config.activation_offload, config.activation_checkpointing) == (
        tight.chosen.activation_offload, tight.chosen.activation_checkpointing)
    with pytest.raises(ValueError, match="activation_offload.*replaces `activation_checkpointing`"):
        FSDP2Config(activation_offload=True, activation_checkpointing=True)


# A long sequence whose logits (fp32, 4096 x 32000 per sequence) are most of a step: no checkpointing touches them,
# sequence tiling does (sharding/sequence_tiling.py; its losses and gradients: tests/test_sequence_parallel.py).
LONG = dict(vocab_size=32000, hidden_size=64, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=8192)
LONG_SEQ = 4096


def _long_plan(budget: int, device: str = "cuda", seq_len: int = LONG_SEQ, **config):
    prepared = prepare_meta_model(tiny_config(**LONG), FSDP2Config(**config))
    return prepared, plan_layout(prepared, 2, FSDP2Config(**config), budget_bytes=budget, device_type=device,
                                 batch_size=1, seq_len=seq_len)


def _tiles(candidate) -> tuple:
    return candidate.loss_tile_size, candidate.mlp_tile_size


def test_auto_layout_tiles_the_sequence_when_that_is_what_fits():
    """shard_size='auto' tries the tiled loss after each activation choice (it recomputes nothing), and the tiled MLP
    with it on the leanest checkpointing: chosen when no untiled layout fits, the tiles in the config it returns, whose
    estimate (estimate_memory, the plan's own route aside) is within the budget."""
    from hf_fsdp2.planner.memory import AUTO_TILE_SIZE, estimate_memory

    _, free = _long_plan(1 << 40)
    untiled = [c for c in free.candidates if _tiles(c) == (None, None)]
    loss_only = [c for c in free.candidates if _tiles(c) == (AUTO_TILE_SIZE, None)]
    both = [c for c in free.candidates if _tiles(c) == (AUTO_TILE_SIZE, AUTO_TILE_SIZE)]
    assert len(untiled) + len(loss_only) + len(both) == len(free.candidates) and loss_only and both
    assert all(c.activation_checkpointing and c.checkpoint_every == 1 and not c.checkpoint_save_matmuls for c in both)
    # each tiled-loss choice right after its untiled twin (same recomputation), before the next choice
    order = [(c.activations.label, _tiles(c)) for c in free.candidates if not c.cpu_offload]
    labels = list(dict.fromkeys(order))
    assert labels == [("False", (None, None)), ("False", (1024, None)), ("ops", (None, None)), ("ops", (1024, None)),
                      ("1/2", (None, None)), ("1/2", (1024, None)), ("True", (None, None)), ("True", (1024, None)),
                      ("True", (1024, 1024)), ("host", (None, None))]
    leanest_untiled = min(c.needed_bytes for c in untiled)
    assert max(c.needed_bytes for c in loss_only) < leanest_untiled / 3  # the logits were most of it
    base = FSDP2Config(shard_size="auto", memory_budget=1)
    for budget, want in ((leanest_untiled - 1, (AUTO_TILE_SIZE, None)),
                         (min(c.needed_bytes for c in loss_only) - 1, (AUTO_TILE_SIZE, AUTO_TILE_SIZE))):
        _, plan = _long_plan(budget)
        assert not any(c.fits for c in plan.candidates if _tiles(c) == (None, None))
        assert _tiles(plan.chosen) == want, plan.format_table()
        config = plan.config(base)
        assert (config.loss_tile_size, config.mlp_tile_size) == want
        assert estimate_memory(tiny_config(**LONG), 2, config, batch_size=1, seq_len=LONG_SEQ).device_bytes <= budget
        assert f"loss_tile_size={AUTO_TILE_SIZE}" in plan.chosen.describe() and "loss_tile_size" in plan.summary()
        assert ("mlp_tile_size=1024" in plan.chosen.describe()) == (want[1] is not None)
    assert config.activation_checkpointing  # the MLP's tiles come with checkpointing of every layer


def test_auto_layout_does_not_tile_what_fits_untiled_and_keeps_given_tiles():
    from hf_fsdp2.planner.memory import estimate_memory

    _, free = _long_plan(1 << 40)
    assert _tiles(free.chosen) == (None, None) and not free.chosen.activation_checkpointing
    config = free.config(FSDP2Config(shard_size="auto", memory_budget=1))
    assert (config.loss_tile_size, config.mlp_tile_size) == (None, None)
    # a rank holding one tile or less: nothing to tile, nothing offered (the short plans above count on it)
    assert all(_tiles(c) == (None, None) for c in _long_plan(1 << 40, seq_len=1024)[1].candidates)
    assert all(_tiles(c) == (None, None) for c in _plan(budget=1 << 40).candidates)
    # tiles you set are kept on every candidate, in the config returned, even where others would fit better
    _, given = _long_plan(1 << 40, loss_tile_size=512)
    assert {_tiles(c) for c in given.candidates} == {(512, None)}
    assert given.config(FSDP2Config(shard_size="auto", memory_budget=1, loss_tile_size=512)).loss_tile_size == 512
    tight = min(c.needed_bytes for c in given.candidates)
    _, given = _long_plan(tight, loss_tile_size=512)
    config = given.config(FSDP2Config(shard_size="auto", memory_budget=1, loss_tile_size=512))
    assert (config.loss_tile_size, config.mlp_tile_size) == (512, None)  # not the planner's own, nor an MLP tile
    assert estimate_memory(tiny_config(**LONG), 2, config, batch_size=1, seq_len=LONG_SEQ).device_bytes <= tight
    # not offered where the tiled loss would not compute the model's loss (a LoRA adapter on the lm_head)
    prepared = prepare_meta_model(tiny_config(**LONG), FSDP2Config(), lora_r=4, lora_targets=["q_proj", "lm_head"])
    plan = plan_layout(prepared, 2, FSDP2Config(), budget_bytes=1 << 40, device_type="cpu", batch_size=1,
                       seq_len=LONG_SEQ)
    assert {_tiles(c) for c in plan.candidates} == {(None, None), (None, 1024)}


def test_plan_command_and_simulate_name_the_tiles(tmp_path, capsys):
    """`hf-fsdp2 plan` shows each candidate's tiles and the chosen ones; simulate's note says what auto chose, and
    the simulated rank (shard_model with that config: the tiles applied) stays within the budget."""
    from hf_fsdp2.tools.simulate import simulate_rank

    model_dir = tmp_path / "long"
    tiny_config(**LONG).save_pretrained(model_dir)
    assert cli_main(["plan", "--model", str(model_dir), "--world-size", "2", "--memory", "1GiB", "--seq-len",
                     str(LONG_SEQ), "--tp-sizes", "1", "--cp-sizes", "1"]) == 0
    table = capsys.readouterr().out
    assert "loss 1024 mlp 1024" in table and "chosen: shard_size=1 x 2 replicas" in table
    assert "loss_tile_size=1024" in table.splitlines()[-1] and "<- chosen" in next(
        line for line in table.splitlines() if "loss 1024" in line and "yes" in line)
    budget = 600 * 2**20
    report = simulate_rank(model_dir, 2, FSDP2Config(shard_size="auto", memory_budget=budget, plan_seq_len=2048,
                                                    replication="fsdp2"), rank=1, seq_len=2048, steps=1)
    note = next(n for n in report.notes if "shard_size='auto' chose" in n)
    assert "loss_tile_size=1024" in note, report.notes
    assert report.rss_peak <= budget, report


def test_tp_and_cp_divide_what_they_split_and_are_proposed_when_fsdp_alone_does_not_fit():
    """Tensor and context parallelism in the estimate and the planner (sharding/tensor_parallel.py's TP blocks on paper; the
    per-rank parameter bytes of TP x FSDP are checked on real ranks in tests/test_memory.py)."""
    from hf_fsdp2.planner.activation_trace import trace_activations
    from hf_fsdp2.planner.layout import parallel_sizes
    from hf_fsdp2.planner.memory import estimate_memory
    from hf_fsdp2.planner.meta_model import build_meta_model

    def estimate(cp=1, **kwargs):
        return estimate_memory(tiny_config(), 4, FSDP2Config(**kwargs), batch_size=2, seq_len=64, cp_size=cp)

    plain, tp, cp = estimate(), estimate(tp_size=2), estimate(cp=2)
    # CP: each rank traces seq / cp tokens; FSDP still shards over all 4 ranks (dp_shard x cp).
    assert cp.activations == estimate_memory(tiny_config(), 4, FSDP2Config(), batch_size=2, seq_len=32).activations
    assert cp.param_bytes == plain.param_bytes
    # TP: a rank computes with half the heads and MLP features, which is a model with half of them
    # (embedding, norms and the gathered logits unsplit; hidden size and head_dim unchanged).
    half = build_meta_model(tiny_config(num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                                        head_dim=16))
    layers = list(half.model.layers)
    assert tp.activations.saved_bytes == trace_activations(half, layers, 2, 64).saved_bytes < plain.activations.saved_bytes
    assert tp.tp_size == 2 and tp.shard_size == 2 and plain.param_bytes < tp.param_bytes < 2 * plain.param_bytes
    for bad, match in ((dict(cp=3), "`cp_size`=3 must divide the shard size 4"),
                       (dict(cp=2, tp_size=4), "`cp_size`=2 must divide the shard size 1")):
        with pytest.raises(ValueError, match=match):
            estimate(**bad)
    with pytest.raises(ValueError, match="must divide `seq_len`=63"):
        estimate_memory(tiny_config(), 4, FSDP2Config(), batch_size=2, seq_len=63, cp_size=2)
    with pytest.raises(ValueError, match="`tp_size`=2 with `fp8` is not done"):
        estimate_memory(tiny_config(), 4, FSDP2Config(tp_size=2, fp8=True))
    fp8_model = prepare_meta_model(tiny_config(), FSDP2Config(fp8=True))  # the planner refuses it too, and
    assert parallel_sizes(fp8_model, 4, 64)[0] == [1]  # does not offer TP for it
    with pytest.raises(ValueError, match="`tp_size`=2 with `fp8` is not done"):
        plan_layout(fp8_model, 4, FSDP2Config(fp8=True), budget_bytes=1 << 40, device_type="cpu", batch_size=2,
                    seq_len=64, tp_sizes=(2,))

    # The planner: FSDP layouts first (all of them, checkpointing included), then CP, then TP, then both.
    prepared = prepare_meta_model(tiny_config(), FSDP2Config())
    tp_sizes, cp_sizes = parallel_sizes(prepared, 4, 64)
    assert (tp_sizes, cp_sizes) == ([1, 2], [1, 2, 4])  # 2 KV heads: no TP over 4

    def plan(budget):
        return plan_layout(prepared, 4, FSDP2Config(), budget_bytes=budget, device_type="cpu", batch_size=2,
                           seq_len=64, tp_sizes=tp_sizes, cp_sizes=cp_sizes)

    candidates = plan(1 << 40).candidates
    order = [(c.returns_freed_memory, c.tp_size > 1, c.tp_size, c.cp_size) for c in candidates]  # the lever last
    assert order == sorted(order) and {(c.tp_size, c.cp_size) for c in candidates} == {
        (1, 1), (1, 2), (1, 4), (2, 1), (2, 2)}
    assert all(c.shard_size % c.cp_size == 0 and c.shard_size * c.replicate_size * c.tp_size == 4 for c in candidates)
    fsdp_only = min(c.needed_bytes for c in candidates if (c.tp_size, c.cp_size) == (1, 1))
    needs_more = plan(fsdp_only - 1).chosen
    assert needs_more is not None and needs_more.cp_size > 1 and needs_more.tp_size == 1
    leanest = min(candidates, key=lambda c: c.needed_bytes)
    assert leanest.tp_size > 1 or leanest.cp_size > 1
    assert plan(leanest.needed_bytes).config(FSDP2Config(shard_size="auto", memory_budget=1)).tp_size == \
        plan(leanest.needed_bytes).chosen.tp_size
    # shard_size="auto" under Accelerate with TP or CP: the run's sizes and its mesh's data-parallel shape kept.
    fixed = plan_layout(prepared, 4, FSDP2Config(), budget_bytes=1 << 40, device_type="cpu", batch_size=2,
                        seq_len=64, tp_sizes=(2,), cp_sizes=(2,), mesh_shape=(1, 2))
    assert {(c.replicate_size, c.shard_size, c.tp_size, c.cp_size) for c in fixed.candidates} == {(1, 2, 2, 2)}
    with pytest.raises(ValueError, match=r"no layout to plan: the mesh shape \(2, 2\)"):
        plan_layout(prepared, 4, FSDP2Config(), budget_bytes=1 << 40, device_type="cpu", batch_size=2, seq_len=64,
                    tp_sizes=(2,), mesh_shape=(2, 2))


def test_nothing_fits_names_the_smallest_budget():
    plan = _plan(budget=1000)
    assert plan.chosen is None
    smallest = plan.smallest_workable_budget
    assert smallest == min(c.needed_bytes for c in plan.candidates)
    with pytest.raises(ValueError, match=r"memory_budget.*smallest budget that works is"):
        plan.config(FSDP2Config(shard_size="auto", memory_budget=1000))
    assert _plan(budget=smallest).chosen is not None


def test_cpu_budget_that_glibc_heap_would_break_returns_freed_blocks():
    """On CPU each layout needs its peak plus what the step allocates and frees for gathered parameters (what
    glibc's heap may keep); giving freed blocks back to the OS (about 0.6x speed) is costed as one more
    candidate per layout, after every layout: a checkpointed layout that fits with the heap wins over an
    unchecked one that would need it (issue 51), and the lever is pulled only when no layout fits without it."""
    generous = _plan(budget=1 << 40, world=2, device="cpu")
    est = generous.chosen.estimate
    assert generous.chosen.shard_size == 1 and not generous.returns_freed_memory
    # replication on DDP's reducer, fp32: nothing gathered or cast; what the heap keeps is the activations' share
    act = est.activations
    assert est.heap_kept_bytes == act.peak_bytes * act.heap_saved_bytes // act.saved_bytes > 0
    kept = [c for c in generous.candidates if not c.returns_freed_memory]
    returned = [c for c in generous.candidates if c.returns_freed_memory]
    assert generous.candidates == tuple(kept + returned) and returned  # every lever candidate after every layout
    assert [c.describe().removesuffix(", freed memory returned to the OS") for c in returned] == [
        c.describe() for c in kept if c.estimate.heap_kept_bytes]
    sharded = [c for c in kept if c.shard_size == 2 and not c.activation_checkpointing]
    for c in sharded:  # each group gathered in forward, again in backward when resharded (the root once),
        groups = c.estimate.groups  # and its gradients reduce-scattered once; the heap's share counted
        twice = 2 if c.reshard_after_forward else 1
        act = c.estimate.activations
        freed = (sum(g.heap_gathered_bytes * (1 if g.name == "<root>" else twice) + g.heap_reduce_scatter_bytes
                     for g in groups) + act.peak_bytes * act.heap_saved_bytes // act.saved_bytes)
        assert c.estimate.heap_kept_bytes == freed > 0
        lever = next(r for r in returned if r.describe().startswith(c.describe()))
        assert c.needed_bytes == lever.needed_bytes + freed
    # The lean unchecked layout with the lever, against a checkpointed one that fits with the heap at its budget
    # (activations of batch 2 x 256: checkpointing saves more than the heap keeps).
    prepared = prepare_meta_model(tiny_config(), FSDP2Config())
    longer = plan_layout(prepared, 2, FSDP2Config(), budget_bytes=1 << 40, device_type="cpu", batch_size=2, seq_len=256)
    lean = next(r for r in longer.candidates
                if r.returns_freed_memory and r.shard_size == 2 and r.reshard_after_forward and not r.activation_checkpointing)
    costed = plan_layout(prepared, 2, FSDP2Config(), budget_bytes=lean.needed_bytes, device_type="cpu", batch_size=2,
                         seq_len=256)
    rival = costed.chosen
    assert not rival.returns_freed_memory and rival.activation_checkpointing  # the situation issue 51 met
    assert "given back to the OS" not in costed.summary()
    tightest = _plan(budget=min(c.needed_bytes for c in returned), world=2, device="cpu")
    assert tightest.returns_freed_memory and tightest.chosen.returns_freed_memory
    assert "given back to the OS" in tightest.summary() and "given back to the OS" in tightest.format_table()
    assert "to OS" in tightest.format_table() and "to OS" not in costed.format_table().split("chosen:")[1]
    assert not _plan(budget=lean.needed_bytes, world=2, device="cuda").returns_freed_memory  # caching allocator
    assert not any(c.returns_freed_memory for c in _plan(budget=1 << 40, world=2, device="cuda").candidates)


_HEAP_PROBE = """
import os, sys, torch
from hf_fsdp2.runtime import host_allocator
def rss(): return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
if sys.argv[1] == "return":
    assert host_allocator.return_freed_blocks() and host_allocator.returns_freed_blocks()
big = torch.ones(1 << 22)  # 16 MiB, mmapped; freed, it makes glibc's default raise its mmap threshold
del big
kept, freed = [], []
for _ in range(64):  # 1 MiB buffers (as gathered parameters) between live 128 KiB tensors (as activations)
    freed.append(torch.ones(1 << 18))
    kept.append(torch.ones(1 << 15))
before = rss()
del freed
print((before - rss()) >> 20)  # MiB given back
"""


def test_return_freed_blocks_gives_glibc_heap_pages_back():
    """The premise and the lever of `host_allocator`, on this machine's glibc: by default 64 MiB of freed
    buffers between live tensors stay resident; after `return_freed_blocks` they are given back."""
    import subprocess
    import sys

    from hf_fsdp2.runtime import host_allocator

    if not host_allocator.is_glibc():
        pytest.skip("not glibc")
    given_back = {policy: int(subprocess.run([sys.executable, "-c", _HEAP_PROBE, policy], check=True, text=True,
                                       capture_output=True).stdout.split()[-1]) for policy in ("default", "return")}
    assert given_back["default"] <= 16 and given_back["return"] >= 56, given_back


def test_config_fields():
    assert FSDP2Config(shard_size="AUTO", memory_budget="1.5GiB").memory_budget == 3 << 29
    assert FSDP2Config(shard_size="auto", memory_budget="80GB").memory_budget == 80 * 10**9
    for bad, match in ((dict(memory_budget="80GB"), "set `shard_size`='auto'"),
                       (dict(shard_size="auto", memory_budget="lots"), "not a size"),
                       (dict(shard_size="auto", replicate_size=2), "replicate_size"),
                       (dict(shard_size="some"), "shard_size"), (dict(compile="maybe"), "compile")):
        with pytest.raises(ValueError, match=match):
            FSDP2Config(**bad)
    with pytest.raises(ValueError, match="resolved by the layout planner"):
        FSDP2Config(shard_size="auto").mesh_shape(2)


def test_plan_command(tmp_path, capsys):
    config_json = tmp_path / "config.json"
    config_json.write_text(tiny_config().to_json_string())
    assert cli_main(["plan", "--model", str(config_json), "--world-size", "4", "--memory", "80GB",
                     "--seq-len", str(SEQ)]) == 0
    table = capsys.readouterr().out
    assert "<- chosen" in table and "chosen: shard_size=1 x 4 replicas" in table
    assert cli_main(["plan", "--model", str(config_json), "--world-size", "4", "--memory", "1KB", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["chosen"] is None and out["smallest_workable_budget"] > 1000 and out["returns_freed_memory"] is False
    assert all(c["heap_kept_bytes"] >= 0 for c in out["candidates"])
    # TP (2 divides both head counts) and CP (1, 2, 4 divide half of seq 2048) are costed too
    assert {(c["tp_size"], c["cp_size"]) for c in out["candidates"]} == {(1, 1), (1, 2), (1, 4), (2, 1), (2, 2)}
    assert cli_main(["plan", "--model", str(config_json), "--world-size", "4", "--memory", "1KB", "--json",
                     "--tp-sizes", "1", "--cp-sizes", "1"]) == 1
    candidates = json.loads(capsys.readouterr().out)["candidates"]  # FSDP alone: 60 untiled layouts, and at
    # 2048 tokens (> one tile of 1024) the loss tiled after each of the 4 kept-on-device choices, the MLP too on
    # the leanest: 60 more (x reshard x S x cpu_offload)
    assert sum(c["loss_tile_size"] is None and c["mlp_tile_size"] is None for c in candidates) == 60
    assert len(candidates) == 120
    for flag in ("--cp-sizes", "--tp-sizes"):  # a size that does not divide the world is refused, not dropped
        capsys.readouterr()
        assert cli_main(["plan", "--model", str(config_json), "--world-size", "4", "--memory", "80GB", flag, "1,3"]) == 1
        assert f"`{flag}` 3 does not divide `--world-size` 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["plan", "--model", str(config_json), "--world-size", "4", "--memory", "1KB", "--tp-sizes", "two"])
    assert "--tp-sizes: must be auto or positive integers" in capsys.readouterr().err
    assert cli_main(["estimate-memory", "--model", str(config_json), "--world-size", "4", "--tp-size", "2",
                     "--cp-size", "2", "--seq-len", "64", "--json"]) == 0
    from hf_fsdp2.planner.memory import estimate_memory

    got = json.loads(capsys.readouterr().out)
    want = estimate_memory(str(config_json), 4, FSDP2Config(tp_size=2), seq_len=64, cp_size=2)
    assert (got["tp_size"], got["cp_size"]) == (2, 2) and got["per_rank_max"]["device_bytes"] == want.device_bytes
    assert cli_main(["estimate-memory", "--model", str(config_json), "--world-size", "4", "--tp-size", "3"]) == 1
    assert "`--tp-size` 3 does not divide `--world-size` 4" in capsys.readouterr().err


def _auto_and_compile(rank: int, world: int, root: str) -> dict:
    from pathlib import Path

    from torch._dynamo.utils import counters

    from hf_fsdp2 import load_pretrained, save_pretrained, shard_model

    out: dict = {}
    data = batches(3)
    plan_for = dict(plan_batch_size=GLOBAL_BATCH // world, plan_seq_len=SEQ)
    # An ample budget: replication (S=1, 2 replicas of 1 rank), the cheapest layout.
    model = shard_model(build_model(), FSDP2Config(shard_size="auto", memory_budget="20GB", **plan_for))
    out["ample"] = record_of(model).config.to_dict()
    out["ample_mesh"] = tuple(record_of(model).mesh.shape)
    from hf_fsdp2.runtime import host_allocator

    out["heap_ample"] = host_allocator.returns_freed_blocks()
    out["losses"] = sharded_train(model, data, rank, world)
    save_pretrained(model, Path(root) / "auto")
    trained = full_params(model)
    # The smallest budget that works (from the plan itself): only full sharding fits it.
    need = record_of(model).layout.smallest_workable_budget
    other = shard_model(build_model(seed=3), FSDP2Config(shard_size="auto", memory_budget=need, **plan_for))
    out["tight"] = record_of(other).config.to_dict()
    # On CPU that budget has no room for what glibc's heap would keep, under any layout: the plan made it return
    # freed blocks.
    out["heap_tight"] = (record_of(other).layout.returns_freed_memory, host_allocator.returns_freed_blocks())
    load_pretrained(other, Path(root) / "auto")  # written by the replicated layout, read by the sharded one
    out["resumed_equal"] = all(torch.equal(a, b) for a, b in zip(full_params(other).values(), trained.values()))
    # hf_fsdp2.from_pretrained plans on the meta model (no rank holds the whole model), then loads its rows.
    from transformers import LlamaForCausalLM

    from hf_fsdp2 import from_pretrained

    loaded = from_pretrained(LlamaForCausalLM, Path(root) / "auto", FSDP2Config(shard_size="auto", memory_budget=need,
                                                                               **plan_for))
    out["loaded_tight"] = record_of(loaded).config.to_dict()
    out["loaded_equal"] = all(torch.equal(a, b) for a, b in zip(full_params(loaded).values(), trained.values()))

    # Replicated, the model trains with DDP's reducer (sharding/replication.py): plain parameters, no FSDP2.
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from hf_fsdp2.sharding.replication import is_replicated

    out["ddp"] = is_replicated(model) and not any(isinstance(m, FSDPModule) for m in model.modules())
    peft_model = shard_model(lora(build_model()), FSDP2Config(shard_size="auto", memory_budget="20GB", **plan_for))
    out["frozen_plain"] = is_replicated(peft_model) and not any(isinstance(p, DTensor) for p in peft_model.parameters())
    out["lora_losses"] = sharded_train(peft_model, data, rank, world)
    save_pretrained(peft_model, Path(root) / "adapter")

    # Regional compilation with LoRA, activation checkpointing and bf16 compute, against eager.
    setup = dict(param_dtype="bf16", activation_checkpointing=True)
    eager = shard_model(lora(build_model()), FSDP2Config(**setup))
    out["eager"] = sharded_train(eager, data, rank, world)
    torch._dynamo.reset()
    counters.clear()
    compiled = shard_model(lora(build_model()), FSDP2Config(compile=True, **setup))
    opt = optimizer(compiled)
    out["compiled"] = sharded_train(compiled, data[:1], rank, world, opt=opt)
    out["graphs_after_first_step"] = counters["stats"]["unique_graphs"]
    out["compiled"] += sharded_train(compiled, data[1:], rank, world, opt=opt)
    out["graphs_at_end"] = counters["stats"]["unique_graphs"]
    out["graph_breaks"] = sum(counters["graph_break"].values())
    out["names_unchanged"] = sorted(full_params(compiled)) == sorted(full_params(eager))
    compiled.eval()
    with torch.no_grad():  # evaluation keeps the KV cache (only training forwards drop it)
        out["eval_cache"] = compiled(input_ids=data[0][:1]).past_key_values is not None
    return out


def test_auto_layout_and_regional_compile_on_two_ranks(tmp_path):
    results = run_ranks(_auto_and_compile, WORLD, str(tmp_path), timeout=600)
    r = results[0]
    assert r["ample_mesh"] == (2, 1) and (r["ample"]["replicate_size"], r["ample"]["shard_size"]) == (2, 1)
    assert r["loaded_equal"] and (r["loaded_tight"]["replicate_size"], r["loaded_tight"]["shard_size"]) == (
        r["tight"]["replicate_size"], r["tight"]["shard_size"])
    assert r["ample"]["reshard_after_forward"] is False and r["ample"]["activation_checkpointing"] is False
    assert (r["tight"]["replicate_size"], r["tight"]["shard_size"]) == (1, 2)
    assert all(res["heap_ample"] is False and res["heap_tight"] == (True, True) for res in results)
    torch.testing.assert_close(r["losses"], reference_train(build_model(), batches(3)), atol=2e-5, rtol=0)
    assert all(res["resumed_equal"] for res in results)
    assert set(saved_tensors(tmp_path / "auto")) == set(build_model().state_dict())

    assert r["ddp"] and r["frozen_plain"]
    torch.testing.assert_close(r["lora_losses"], reference_train(lora(build_model()), batches(3)), atol=2e-5, rtol=0)
    adapter = saved_tensors(tmp_path / "adapter", "adapter_model.safetensors")
    assert adapter and all(".lora_" in name for name in adapter)

    torch.testing.assert_close(r["compiled"], r["eager"], atol=2e-2, rtol=0)
    assert r["graph_breaks"] == 0
    # Layer 0's input needs no grad (frozen embedding under LoRA), the others' does: two graphs,
    # both made in the first step; none after it (3 layers, one graph reused).
    assert r["graphs_after_first_step"] <= 2 and r["graphs_at_end"] == r["graphs_after_first_step"]
    assert r["names_unchanged"] and r["eval_cache"]


_LEVER_SCOPE_PROBE = r"""
import gc, resource, sys, torch
from hf_fsdp2.runtime import host_allocator

def faults():  # a user's own loop of 4 MiB buffers: minor page faults it costs
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(100):
        torch.empty(1 << 20).fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

class Model:
    pass

faults()  # glibc's own dynamic threshold settles
out = {"default": faults()}
model = Model()
host_allocator.return_freed_blocks(model)
out["held"], out["holding"] = faults(), host_allocator.returns_freed_blocks()
del model
gc.collect()
out["released"], out["holding_after"] = faults(), host_allocator.returns_freed_blocks()
host_allocator.return_freed_blocks()
import hf_fsdp2
hf_fsdp2.unregister()
out["after_unregister"], out["holding_after_unregister"] = faults(), host_allocator.returns_freed_blocks()
print(out)
"""


def test_the_glibc_lever_is_let_go_with_its_model_and_at_unregister():
    """Issue 48: once pulled, the lever made a user's own 4 MiB buffers fault every page for the rest of the
    process. It is held for the model that needed it and let go when that model is gone, or at unregister():
    the user's loop is back to (about) no page faults."""
    import ast
    import subprocess
    import sys

    from hf_fsdp2.runtime import host_allocator

    if not host_allocator.is_glibc():
        pytest.skip("not glibc")
    out = ast.literal_eval(subprocess.run([sys.executable, "-c", _LEVER_SCOPE_PROBE], check=True, text=True,
                                          capture_output=True).stdout.strip().splitlines()[-1])
    page_faults_per_loop = 100 * (4 << 20) // 4096  # every page of every buffer
    assert out["default"] < page_faults_per_loop // 20, out
    assert out["held"] > page_faults_per_loop // 2 and out["holding"], out
    assert out["released"] < page_faults_per_loop // 20 and not out["holding_after"], out
    assert out["after_unregister"] < page_faults_per_loop // 20 and not out["holding_after_unregister"], out
