"""Tensor parallelism x FSDP2 on 4 CPU ranks (tp 2 x dp_shard 2), with transformers' own TP plan:
training equal to one process, gather-free Hugging Face files stock `from_pretrained` reads, and a
training state that resumes on plain FSDP (4 ranks), on one process, and back on TP; PEFT LoRA on
colwise and rowwise layers trains as one process and saves an adapter PEFT loads."""

from __future__ import annotations

import pytest
import torch

from hf_fsdp2 import FSDP2Config, load_state, save_pretrained, save_state, shard_model

from .common import (batches, build_model, local_rows, lora, optimizer, reference_train, saved_tensors,
                     sharded_train)
from .dist_harness import NCCL_LIKE, run_ranks

STEPS, SPLIT = 4, 2
TP = FSDP2Config(tp_size=2)


def _dp(model) -> tuple[int, int]:
    """(this rank's data-parallel index, data-parallel size): the ranks of one TP group share a batch."""
    mesh = next(model.parameters()).device_mesh
    names = mesh.mesh_dim_names
    if "tp" not in names:
        return mesh.get_coordinate()[-1], mesh.size(-1)
    dp = "dp_shard" if "dp_shard" in names else "fsdp"  # transformers' name (a model it sharded at load)
    return mesh.get_coordinate()[names.index(dp)], mesh[dp].size()


def _steps(model, opt, data):
    rank, world = _dp(model)
    return sharded_train(model, data, rank, world, opt=opt)


def _train_checkpointing(model, root: str, name: str) -> list[float]:
    """STEPS steps; the training state saved after SPLIT (`root/name-state`), the model at the end
    (`root/name-final`)."""
    opt = optimizer(model)
    data = batches(STEPS)
    losses = _steps(model, opt, data[:SPLIT])
    save_state(f"{root}/{name}-state", model, opt, step=SPLIT)
    losses += _steps(model, opt, data[SPLIT:])
    save_pretrained(model, f"{root}/{name}-final")
    return losses


def _tp_train_save(rank, world, root):
    model = build_model()
    shard_model(model, TP)
    q, o = (model.model.layers[0].self_attn.q_proj.weight, model.model.layers[0].self_attn.o_proj.weight)
    layout = {"mesh": list(q.device_mesh.mesh_dim_names), "q": str(q.placements), "o": str(o.placements),
              "o_local": list(o.to_local().shape)}
    return {"losses": _train_checkpointing(model, root, "tp"), "layout": layout}


def _resume(rank, world, directory, config, resave, with_layout=False):
    model = build_model(seed=123)  # other weights: everything must come from the state
    shard_model(model, config)
    opt = optimizer(model)
    start, _ = load_state(directory, model, opt)
    if resave:
        save_state(resave, model, opt, step=start)
    losses = _steps(model, opt, batches(STEPS)[start:])
    if not with_layout:
        return losses
    from hf_fsdp2.sharding import record_of

    record = record_of(model)
    return losses, {"mesh": list(record.mesh.mesh_dim_names), "shape": list(record.mesh.shape),
                    "candidates_tp": sorted({c.tp_size for c in record.layout.candidates})}


def test_tp_x_fsdp_trains_like_one_process_and_checkpoints_on_any_mesh(tmp_path):
    reference = reference_train(build_model(), batches(STEPS))
    reference_model = build_model()
    reference_train(reference_model, batches(STEPS))

    out = run_ranks(_tp_train_save, 4, str(tmp_path))[0]
    assert out["layout"]["mesh"] == ["dp_shard", "tp"]
    assert "Shard(dim=0)" in out["layout"]["q"] and "Shard(dim=1)" in out["layout"]["o"]  # colwise, rowwise
    assert out["layout"]["o_local"][1] == 32  # this rank's columns of o_proj (64 / tp 2)
    assert out["losses"] == pytest.approx(reference, rel=1e-4)

    # Gather-free files: stock from_pretrained reads them; equal to the single process's trained weights.
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "tp-final")
    expected = dict(reference_model.named_parameters())
    for name, value in loaded.named_parameters():
        torch.testing.assert_close(value, expected[name], atol=1e-4, rtol=0)  # 4 AdamW steps of lr 1e-2

    # The TP state resumes on plain FSDP over 4 ranks (which saves it again), on one process, and the
    # plain save resumes back on TP, laid out by the planner (shard_size="auto" keeps tp_size=2 and
    # counts it: an ample budget replicates the two TP groups, 2 replicas x 1 shard x tp 2).
    tail = out["losses"][SPLIT:]
    plain = run_ranks(_resume, 4, str(tmp_path / "tp-state"), FSDP2Config(), str(tmp_path / "plain-state"))[0]
    assert plain == pytest.approx(tail, rel=1e-4)
    model = build_model(seed=123)
    opt = optimizer(model)
    start, _ = load_state(tmp_path / "tp-state", model, opt)
    single = reference_train(model, batches(STEPS)[start:], opt=opt)
    assert single == pytest.approx(tail, rel=1e-4)
    auto_tp = FSDP2Config(tp_size=2, shard_size="auto", memory_budget="20GB", plan_seq_len=16)
    back, layout = run_ranks(_resume, 4, str(tmp_path / "plain-state"), auto_tp, None, with_layout=True)[0]
    assert back == pytest.approx(tail, rel=1e-4)
    assert layout == {"mesh": ["dp_replicate", "dp_shard", "tp"], "shape": [2, 1, 2], "candidates_tp": [2]}
    # What the TP ranks wrote equals what plain FSDP writes for the same state.
    tp_files, plain_files = saved_tensors(tmp_path / "tp-state"), saved_tensors(tmp_path / "plain-state")
    assert tp_files.keys() == plain_files.keys() and all(torch.equal(tp_files[k], plain_files[k]) for k in tp_files)


def _tp_lora_train_save(rank, world, root):
    model = lora(build_model())  # q_proj, v_proj (colwise) and down_proj (rowwise)
    shard_model(model, TP)
    layer = model.base_model.model.model.layers[0]
    def on_tp(p):  # the placement on the tp mesh dimension; FSDP2 alone shards what TP leaves whole
        names = p.device_mesh.mesh_dim_names
        return str(p.placements[names.index("tp")]) if "tp" in names else "whole"

    placements = {name: on_tp(p) for name, p in (
        ("q_base", layer.self_attn.q_proj.base_layer.weight), ("q_B", layer.self_attn.q_proj.lora_B.default.weight),
        ("q_A", layer.self_attn.q_proj.lora_A.default.weight),
        ("down_A", layer.mlp.down_proj.lora_A.default.weight), ("down_B", layer.mlp.down_proj.lora_B.default.weight))}
    losses = _steps(model, optimizer(model), batches(STEPS))
    frozen_grads = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    save_pretrained(model, f"{root}/tp-adapter")
    try:
        save_pretrained(model, f"{root}/tp-merged", merge_adapters=True)
        merged_error = None
    except ValueError as error:
        merged_error = str(error)
    return {"losses": losses, "placements": placements, "frozen_grads": frozen_grads, "merged_error": merged_error}


def test_lora_on_colwise_and_rowwise_layers_trains_like_one_process_and_saves_a_peft_adapter(tmp_path):
    """The adapter follows its base layer's split (lora_B colwise under a colwise base, lora_A rowwise
    under a rowwise one); losses equal one process's; the adapter the TP ranks write gather-free is what
    the single process trained, loaded by stock PEFT."""
    from peft import PeftModel

    reference = lora(build_model())
    expected_losses = reference_train(reference, batches(STEPS))
    out = run_ranks(_tp_lora_train_save, 4, str(tmp_path))[0]
    p = out["placements"]
    # On the mesh's tp dimension: the colwise base and its lora_B split by rows, the rowwise base's
    # lora_A by columns, the other factors whole.
    assert p == {"q_base": "S(0)", "q_B": "S(0)", "q_A": "whole", "down_A": "S(1)",
                 "down_B": "whole"}
    assert out["frozen_grads"] == []
    # Merging needs whole rows of the rowwise layers: refused by name, nothing written.
    assert "tensor parallelism" in out["merged_error"] and not (tmp_path / "tp-merged").exists()
    assert out["losses"] == pytest.approx(expected_losses, rel=1e-4)
    loaded = PeftModel.from_pretrained(build_model(), tmp_path / "tp-adapter")
    trained = {n: v for n, v in reference.named_parameters() if "lora_" in n}
    got = {n: v for n, v in loaded.named_parameters() if "lora_" in n}
    assert got.keys() == trained.keys()
    for name, value in got.items():
        torch.testing.assert_close(value, trained[name], atol=1e-4, rtol=0)


def test_lora_settings_tp_cannot_honour_are_refused_by_name():
    from hf_fsdp2.sharding import model_parts, tensor_parallel

    with pytest.raises(NotImplementedError, match="`lora_dropout`=0.1 .*set lora_dropout=0"):
        tensor_parallel.refuse_unsupported(model_parts(lora(build_model(), lora_dropout=0.1)), TP, on_meta=False)
    for saved in (["lm_head"], ["embed_tokens"]):  # issue 48: "aten.mm.default got mixed torch.Tensor and DTensor"
        with pytest.raises(NotImplementedError, match=r"`modules_to_save` / `trainable_token_indices` \(on .*"
                                                      + saved[0]):
            tensor_parallel.refuse_unsupported(model_parts(lora(build_model(), modules_to_save=saved)), TP, on_meta=False)
    model = lora(build_model(), target_modules=["embed_tokens", "q_proj"])
    with pytest.raises(NotImplementedError, match="LoRA on `model.embed_tokens`.*'embedding_rowwise'"):
        tensor_parallel.plan_with_lora(model.get_base_model(), {"model.embed_tokens": "embedding_rowwise"})


def _loaded_sharded_by_transformers(rank, world, model_dir, root):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from hf_fsdp2.sharding import adopt
    from hf_fsdp2.sharding.record import record_of

    model = AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=DistributedConfig(fsdp_size=2,
                                                                                               tp_size=2))
    shard_model(model)  # taken as transformers sharded it
    config = record_of(model).config
    try:
        adopt.adopted_config(model, FSDP2Config(activation_checkpointing=True))
        refused = None
    except NotImplementedError as error:
        refused = str(error)
    # The decoder layer as the wrap unit (the shipped configs') is what transformers grouped: accepted.
    same_groups = adopt.adopted_config(model, FSDP2Config(layer_cls_names=["LlamaDecoderLayer"]))[0].tp_size
    return {"losses": _train_checkpointing(model, root, "adopted"), "sizes": [config.replicate_size, config.shard_size, config.tp_size], "refused": refused,
            "same_groups": same_groups}


def test_a_model_transformers_sharded_at_load_gets_our_checkpoints(tmp_path):
    """`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2, tp_size=2))`: transformers
    applies TP and FSDP2 itself; `shard_model` keeps that sharding. Training equals one process; the model
    saved gather-free loads with stock from_pretrained; its training state resumes on hf_fsdp2's own
    FSDP over 2 ranks; a setting that would reshard it is refused by name."""
    build_model().save_pretrained(tmp_path / "model")
    reference_model = build_model()
    reference = reference_train(reference_model, batches(STEPS))
    out = run_ranks(_loaded_sharded_by_transformers, 4, str(tmp_path / "model"), str(tmp_path))[0]
    assert out["sizes"] == [1, 2, 2]
    assert "`activation_checkpointing`=True" in out["refused"] and "DistributedConfig" in out["refused"]
    assert out["same_groups"] == 2
    assert out["losses"] == pytest.approx(reference, rel=1e-4)

    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "adopted-final")
    expected = dict(reference_model.named_parameters())
    for name, value in loaded.named_parameters():
        torch.testing.assert_close(value, expected[name], atol=1e-4, rtol=0)
    resumed = run_ranks(_resume, 2, str(tmp_path / "adopted-state"), FSDP2Config(), None)[0]
    assert resumed == pytest.approx(out["losses"][SPLIT:], rel=1e-4)


@pytest.mark.parametrize("make, message", [
    (lambda: FSDP2Config(tp_size=2, wrap_policy="size"), "needs `wrap_policy`='transformer'"),
])
def test_tp_settings_that_cannot_hold_are_refused_by_name(make, message):
    with pytest.raises(ValueError, match=message):
        make()
    with pytest.raises(ValueError, match="`tp_size`=3 does not divide the world size 4"):
        FSDP2Config(tp_size=3).mesh_shape(4)
    assert FSDP2Config(tp_size=2).mesh_shape(4) == (1, 2)


# shard_size="auto" under Accelerate's TP/CP mesh: the planner keeps the run's sizes and the mesh's
# data-parallel shape, and with an ample budget turns resharding off.
AUTO_LAYOUT = {"HF_FSDP2_SHARD_SIZE": "auto", "HF_FSDP2_MEMORY_BUDGET": "20GB", "HF_FSDP2_PLAN_SEQ_LEN": "16"}


def test_accelerate_launch_with_tp_size_2_matches_one_process(tmp_path):
    """`accelerate launch --config_file accelerate_configs/fsdp2_tp.yaml` (tp 2 x dp_shard 2) with
    register(): Accelerate's own TP step (broken on transformers 5.x) is passed over, hf_fsdp2 applies
    the model's TP plan on the accelerator's mesh; losses equal one process on the same global batch,
    and the state it saves resumes on plain FSDP."""
    from .launched_runs import launch, launch_forked, reference_losses

    out = launch("fsdp2_tp.yaml", 4, tmp_path / "tp.json", "--steps", "3", "--per-device-batch", "4",
                 "--save-state", str(tmp_path / "state"), env=AUTO_LAYOUT)
    assert out["all_dtensor"] and out["mesh"] == [2, 2] and out["world"] == 4
    assert out["reshard_after_forward"] is False  # the planner's choice (the yaml says true), on Accelerate's mesh
    assert out["losses"] == pytest.approx(reference_losses(3), rel=1e-4)
    resumed = launch_forked("fsdp2.yaml", 2, tmp_path / "resumed.json", "--start", "3", "--steps", "1",
                            "--load-state", str(tmp_path / "state"))
    assert resumed["losses"] == pytest.approx(reference_losses(4)[3:], rel=1e-4)


def test_lora_under_accelerate_launch_with_tp_size_2_matches_one_process(tmp_path):
    """A PEFT LoRA model through `accelerate launch --config_file accelerate_configs/fsdp2_tp.yaml`: TP x
    FSDP2 with the adapter following its base layers' split; losses equal one process's, and
    `save_model` writes an adapter stock PEFT loads with the single process's trained values."""
    from peft import PeftModel

    from .common import lora
    from .launched_runs import launch_forked, reference_losses

    out = launch_forked("fsdp2_tp.yaml", 4, tmp_path / "tp.json", "--steps", "3", "--per-device-batch", "4", "--lora",
                        "--save-model", str(tmp_path / "adapter"))
    reference = lora(build_model())
    assert out["all_dtensor"] and out["mesh"] == [2, 2]
    assert out["losses"] == pytest.approx(reference_losses(3, model=reference), rel=1e-4)
    loaded = PeftModel.from_pretrained(build_model(), tmp_path / "adapter")
    trained = {n: v for n, v in reference.named_parameters() if "lora_" in n}
    for name, value in ((n, v) for n, v in loaded.named_parameters() if "lora_" in n):
        torch.testing.assert_close(value, trained[name], atol=1e-4, rtol=0)


def test_trainer_under_accelerate_launch_with_tp_size_2_matches_one_process(tmp_path):
    """A Trainer script under the same TP config: the Trainer builds its Accelerator from the launch
    config's parallelism settings; hf_fsdp2 applies TP x FSDP2; losses equal one process's."""
    from .launched_runs import single_trainer_losses, trainer_under_launch

    out = trainer_under_launch("fsdp2_tp.yaml", tmp_path)
    assert out["all_dtensor"] and out["world"] == 4
    assert out["losses"] == pytest.approx(single_trainer_losses(tmp_path, 3), rel=1e-4)


# PEFT's LoraConfig options under TP (issue 48: each one way or the other). Works: losses equal one process's.
# Refused by name: lora_bias (below), and elsewhere in this file lora_dropout > 0, DoRA, modules_to_save /
# trainable_token_indices, LoRA on an embedding_rowwise embedding. `bias` (base layers' biases) is a no-op on
# Llama, which has none.
PEFT_OPTIONS = {
    "rslora": dict(use_rslora=True),
    "gaussian_init": dict(init_lora_weights="gaussian"),
    "rank_and_alpha_patterns": dict(rank_pattern={"q_proj": 2}, alpha_pattern={"down_proj": 16}),
    "every_projection": dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"]),
    "layers_to_transform": dict(layers_to_transform=[1]),
}


def _peft_options(rank, world):
    out = {}
    for name, options in PEFT_OPTIONS.items():
        try:
            model = shard_model(lora(build_model(), **options), TP)
            out[name] = _steps(model, optimizer(model), batches(2))
        except Exception as error:  # noqa: BLE001 - reported per option, the others go on
            out[name] = f"{type(error).__name__}: {error}"
    return out


def test_peft_lora_options_under_tp_train_as_one_process():
    got = run_ranks(_peft_options, 4)[0]
    for name, options in PEFT_OPTIONS.items():
        expected = reference_train(lora(build_model(), **options), batches(2))
        assert got[name] == pytest.approx(expected, rel=1e-4), (name, got[name])
    from hf_fsdp2.sharding import model_parts, tensor_parallel

    with pytest.raises(NotImplementedError, match=r"`lora_bias` \(on .*q_proj; set lora_bias=False\)"):
        tensor_parallel.refuse_unsupported(model_parts(lora(build_model(), lora_bias=True)), TP, on_meta=False)


def _tiled_under_tp(rank, world):
    """tp 2 x dp_shard 2 with the loss and MLP tiled: this rank's losses of 3 steps on its data-parallel rows (no
    collective of the test's own: the default group refuses CPU tensors here), and the lm_head's logits per tile as
    this rank computed them (its vocabulary rows only)."""
    from hf_fsdp2.sharding import sequence_tiling

    model = build_model()
    shard_model(model, FSDP2Config(tp_size=2, loss_tile_size=5, mlp_tile_size=4))
    widths = []
    split_loss = sequence_tiling._split_vocabulary_loss_

    def counted(logits, *args):
        widths.append(logits.shape[-1])
        return split_loss(logits, *args)

    sequence_tiling._split_vocabulary_loss_ = counted
    dp_rank, dp_world = _dp(model)
    opt, losses = optimizer(model), []
    try:
        for ids in batches(3):
            ids = local_rows(ids, dp_rank, dp_world)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        sequence_tiling._split_vocabulary_loss_ = split_loss
    return losses, sorted(set(widths))


def test_sequence_tiling_under_tp_trains_like_one_process():
    """The tiled loss under TP: transformers' plan splits the lm_head along the vocabulary (colwise), so each rank
    computes its rows' logits per tile and the softmax's max, sum and target logit are all-reduced over the tp group
    (no rank holds the whole head's logits: 128 / tp 2 = 64 columns); with the tiled MLP too, losses equal one
    process's over 3 steps (so do the gradients the later steps are built on). The default group refuses CPU
    tensors, as NCCL does: the loss's collectives run on the mesh's tp group."""
    want = reference_train(build_model(), batches(3))
    out = run_ranks(_tiled_under_tp, 4, backend=NCCL_LIKE)  # its all-reduces on the tp group
    assert all(widths == [64] for _, widths in out)
    # each data-parallel pair of ranks holds the same loss: the mean over the 4 ranks is the global batch's
    losses = [sum(step) / len(out) for step in zip(*(rank_losses for rank_losses, _ in out))]
    assert losses == pytest.approx(want, rel=1e-5)


def test_planner_counts_the_tiled_loss_on_this_ranks_vocabulary_rows():
    """estimate-memory under TP with the tiled loss: one tile's two fp32 [tile, vocab] buffers hold this rank's
    vocabulary rows (the plan splits the lm_head colwise), half of them at tp 2."""
    from hf_fsdp2.planner.memory import estimate_memory

    def loss_bytes(**fields):
        return estimate_memory(build_model(), 4, FSDP2Config(loss_tile_size=5, **fields), batch_size=2,
                               seq_len=16).loss_backward_bytes

    assert loss_bytes() == 2 * 5 * 128 * 4
    assert loss_bytes(tp_size=2) == 2 * 5 * 64 * 4
