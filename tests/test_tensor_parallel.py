"""Tensor parallelism x FSDP2 on 4 CPU ranks (tp 2 x dp_shard 2), with transformers' own TP plan:
training equal to one process, gather-free Hugging Face files stock `from_pretrained` reads, and a
training state that resumes on plain FSDP (4 ranks), on one process, and back on TP."""

from __future__ import annotations

import pytest
import torch

from hf_fsdp2 import FSDP2Config, load_state, save_pretrained, save_state, shard_model

from .common import batches, build_model, optimizer, reference_train, saved_tensors, sharded_train
from .dist_harness import run_ranks

STEPS, SPLIT = 4, 2
TP = FSDP2Config(tp_size=2)


def _dp(model) -> tuple[int, int]:
    """(this rank's data-parallel index, data-parallel size): the ranks of one TP group share a batch."""
    mesh = next(model.parameters()).device_mesh
    names = mesh.mesh_dim_names
    if "tp" not in names:
        return mesh.get_coordinate()[-1], mesh.size(-1)
    return mesh.get_coordinate()[names.index("dp_shard")], mesh["dp_shard"].size()


def _steps(model, opt, data):
    rank, world = _dp(model)
    return sharded_train(model, data, rank, world, opt=opt)


def _tp_train_save(rank, world, root):
    model = build_model()
    shard_model(model, TP)
    q, o = (model.model.layers[0].self_attn.q_proj.weight, model.model.layers[0].self_attn.o_proj.weight)
    layout = {"mesh": list(q.device_mesh.mesh_dim_names), "q": str(q.placements), "o": str(o.placements),
              "o_local": list(o.to_local().shape)}
    opt = optimizer(model)
    data = batches(STEPS)
    losses = _steps(model, opt, data[:SPLIT])
    save_state(f"{root}/tp-state", model, opt, step=SPLIT)
    losses += _steps(model, opt, data[SPLIT:])
    save_pretrained(model, f"{root}/tp-final")
    return {"losses": losses, "layout": layout}


def _resume(rank, world, directory, config, resave):
    model = build_model(seed=123)  # other weights: everything must come from the state
    shard_model(model, config)
    opt = optimizer(model)
    start, _ = load_state(directory, model, opt)
    if resave:
        save_state(resave, model, opt, step=start)
    return _steps(model, opt, batches(STEPS)[start:])


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
    # plain save resumes back on TP.
    tail = out["losses"][SPLIT:]
    plain = run_ranks(_resume, 4, str(tmp_path / "tp-state"), FSDP2Config(), str(tmp_path / "plain-state"))[0]
    assert plain == pytest.approx(tail, rel=1e-4)
    model = build_model(seed=123)
    opt = optimizer(model)
    start, _ = load_state(tmp_path / "tp-state", model, opt)
    single = reference_train(model, batches(STEPS)[start:], opt=opt)
    assert single == pytest.approx(tail, rel=1e-4)
    back = run_ranks(_resume, 4, str(tmp_path / "plain-state"), TP, None)[0]
    assert back == pytest.approx(tail, rel=1e-4)
    # What the TP ranks wrote equals what plain FSDP writes for the same state.
    tp_files, plain_files = saved_tensors(tmp_path / "tp-state"), saved_tensors(tmp_path / "plain-state")
    assert tp_files.keys() == plain_files.keys() and all(torch.equal(tp_files[k], plain_files[k]) for k in tp_files)


@pytest.mark.parametrize("make, message", [
    (lambda: FSDP2Config(tp_size=2, shard_size="auto"), "layout planner does not count tensor parallelism"),
    (lambda: FSDP2Config(tp_size=2, wrap_policy="size"), "needs `wrap_policy`='transformer'"),
])
def test_tp_settings_that_cannot_hold_are_refused_by_name(make, message):
    with pytest.raises(ValueError, match=message):
        make()
    with pytest.raises(ValueError, match="`tp_size`=3 does not divide the world size 4"):
        FSDP2Config(tp_size=3).mesh_shape(4)
    assert FSDP2Config(tp_size=2).mesh_shape(4) == (1, 2)


def test_accelerate_launch_with_tp_size_2_matches_one_process(tmp_path):
    """`accelerate launch --config_file accelerate_configs/fsdp2_tp.yaml` (tp 2 x dp_shard 2) with
    register(): Accelerate's own TP step (broken on transformers 5.x) is passed over, hf_fsdp2 applies
    the model's TP plan on the accelerator's mesh; losses equal one process on the same global batch,
    and the state it saves resumes on plain FSDP."""
    from .test_accelerate import launch, reference_losses

    out = launch("fsdp2_tp.yaml", 4, tmp_path / "tp.json", "--steps", "3", "--per-device-batch", "4",
                 "--save-state", str(tmp_path / "state"))
    assert out["all_dtensor"] and out["mesh"] == [2, 2] and out["world"] == 4
    assert out["losses"] == pytest.approx(reference_losses(3), rel=1e-4)
    resumed = launch("fsdp2.yaml", 2, tmp_path / "resumed.json", "--start", "3", "--steps", "1",
                     "--load-state", str(tmp_path / "state"))
    assert resumed["losses"] == pytest.approx(reference_losses(4)[3:], rel=1e-4)


def test_trainer_under_accelerate_launch_with_tp_size_2_matches_one_process(tmp_path):
    """A Trainer script under the same TP config: the Trainer builds its Accelerator from the launch
    config's parallelism settings; hf_fsdp2 applies TP x FSDP2; losses equal one process's."""
    from pathlib import Path

    from .dist_harness import accelerate_launch
    from .test_trainer import run_script, train

    config = Path(__file__).resolve().parents[1] / "accelerate_configs" / "fsdp2_tp.yaml"
    # 2 data-parallel ranks (of 4 processes) x 4 rows = the single process's 8.
    out = run_script(accelerate_launch(config, processes=4), tmp_path / "tp.json", tmp_path / "tp", 2, 3,
                     "--save_strategy", "no")
    single = train(tmp_path, "single", 1, 3, "--save_strategy", "no")
    assert out["all_dtensor"] and out["world"] == 4
    assert out["losses"] == pytest.approx(single["losses"], rel=1e-4)
