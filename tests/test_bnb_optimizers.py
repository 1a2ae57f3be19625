"""bitsandbytes 8-bit optimizers on sharded parameters: training equal to one process, the 8-bit state
in our safetensors training state by rows, resumed exactly on another rank count and on one process."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("bitsandbytes")

import bitsandbytes as bnb  # noqa: E402

from hf_fsdp2 import load_state, prepare_optimizer, save_state, shard_model  # noqa: E402

from .common import batches, build_model, reference_train, saved_tensors, sharded_train  # noqa: E402
from .dist_harness import run_ranks  # noqa: E402

STEPS, SPLIT = 4, 2
# Rows of 256 values (8-bit state, split by rows) except down_proj's 320 (32-bit state: its blocks of
# 256 would straddle rows); norms are 1-D (32-bit, as bitsandbytes keeps them below min_8bit_size).
SHAPE = dict(hidden_size=256, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def _model():
    return build_model(**SHAPE)


def _optimizer(model):
    return bnb.optim.AdamW8bit(model.parameters(), lr=1e-2, weight_decay=0.01)


def _steps(model, opt, data, rank=0, world=1):
    if world == 1:
        return reference_train(model, data, opt=opt)
    return sharded_train(model, data, rank, world, opt=opt)


def _save_then_train(rank, world, directory):
    model = _model()
    shard_model(model)
    opt = prepare_optimizer(_optimizer(model))
    data = batches(STEPS)
    losses = _steps(model, opt, data[:SPLIT], rank, world)
    save_state(directory, model, opt, step=SPLIT)
    return losses + _steps(model, opt, data[SPLIT:], rank, world)


def _resume(rank, world, directory):
    model = build_model(seed=123, **SHAPE)  # other weights: everything must come from the state
    shard_model(model)
    opt = _optimizer(model)  # not prepared by hand: load_state does it
    start, _ = load_state(directory, model, opt)
    return _steps(model, opt, batches(STEPS)[start:], rank, world)


def test_8bit_adamw_trains_like_one_process_and_resumes_on_other_rank_counts(tmp_path):
    model = _model()
    opt = prepare_optimizer(_optimizer(model))
    reference = _steps(model, opt, batches(STEPS))
    kinds = {name: opt.state[p]["state1"].dtype for name, p in model.named_parameters()}
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == torch.uint8
    assert kinds["model.layers.0.mlp.down_proj.weight"] == torch.float32
    assert kinds["model.norm.weight"] == torch.float32

    directory = str(tmp_path / "state")
    sharded = run_ranks(_save_then_train, 2, directory)[0]
    assert sharded == pytest.approx(reference, abs=1e-5)
    state = saved_tensors(directory, "optimizer.safetensors")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert state[f"{q}/state1"].dtype == torch.uint8 and state[f"{q}/state1"].shape == (256, 256)
    assert state[f"{q}/absmax1"].shape == (256, 1)  # one block of 256 per row, written by rows
    assert state["model.layers.0.mlp.down_proj.weight/state1"].dtype == torch.float32

    assert run_ranks(_resume, 4, directory)[0] == pytest.approx(sharded[SPLIT:], abs=1e-5)
    model = build_model(seed=123, **SHAPE)
    opt = _optimizer(model)
    start, _ = load_state(directory, model, opt)
    assert _steps(model, opt, batches(STEPS)[start:]) == pytest.approx(sharded[SPLIT:], abs=1e-5)


def test_prepared_optimizer_steps_like_stock_where_the_state_layouts_agree():
    """Every 2-D tensor with rows of 256: the prepared optimizer makes bitsandbytes' own choices."""
    shape = dict(SHAPE, intermediate_size=512)
    stock_model, ours_model = build_model(**shape), build_model(**shape)
    stock, ours = _optimizer(stock_model), prepare_optimizer(_optimizer(ours_model))
    assert _steps(stock_model, stock, batches(2)) == _steps(ours_model, ours, batches(2))
    for (_, a), (_, b) in zip(stock_model.named_parameters(), ours_model.named_parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("make, message", [
    (lambda ps: bnb.optim.LAMB8bit(ps, lr=1e-3), "max_unorm"),
    (lambda ps: bnb.optim.AdEMAMix8bit(ps, lr=1e-3), "AdEMAMix8bit (bitsandbytes)"),
])
def test_optimizers_whose_state_cannot_split_by_rows_are_refused_by_name(make, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        prepare_optimizer(make(_model().parameters()))
