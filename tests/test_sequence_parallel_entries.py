"""Ulysses sequence parallelism from the entry points (issue 63): Accelerate's prepare, the Trainer, TRL's SFT.
hf_fsdp2's `sp_size` (register(sp_size=...) / HF_FSDP2_SP_SIZE): the prepared data loader gives the ranks of an sp
group the same rows and the prepared model's training forward keeps each rank's slice of every sequence
(sharding/sequence_parallel.split_in_forward); the loop is a plain Accelerate loop. Losses equal one process's
(rel 1e-4, fp32) on 2 ranks at sp 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .common import build_model, lora, saved_tensors
from .dist_harness import NCCL_LIKE, run_ranks

ROOT = Path(__file__).resolve().parents[1]
ROWS, SEQ = 4, 16


def _rows(groups: int) -> list[dict]:
    """2 steps of ROWS left-padded rows per data-parallel group, of different lengths (the valid token counts differ
    between rows, groups and sp shards)."""
    n = 2 * groups * ROWS
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (n, SEQ), generator=g)
    mask = torch.ones_like(ids)
    for row in range(n):
        mask[row, :(row * 3) % 7] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return [{"input_ids": i, "attention_mask": m, "labels": x} for i, m, x in zip(ids, mask, labels)]


def _model(use_lora: bool):
    return lora(build_model(0)) if use_lora else build_model(0)


def _reference(use_lora: bool, groups: int) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """The same loop on one process: each step's loss of each data-parallel group's rows (Accelerate's loader deals
    ROWS-row batches to the groups in turn), the gradient of their mean (FSDP2's average)."""
    from torch.utils.data import DataLoader

    model = _model(use_lora)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for batch in DataLoader(_rows(groups), batch_size=groups * ROWS):
        step = [model(**{k: v[d * ROWS:(d + 1) * ROWS] for k, v in batch.items()}).loss for d in range(groups)]
        (sum(step) / groups).backward()
        opt.step()
        opt.zero_grad()
        losses.append([x.item() for x in step])
    return losses, {name: t.detach().clone() for name, t in model.state_dict().items()}


def _sft_dataset_and_model():
    """The bundled tiny Llama (its tokenizer) and texts of different lengths (right padding in each batch)."""
    import transformers
    from datasets import Dataset

    tiny = ROOT / "examples" / "tiny-llama"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tiny)).float()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny)
    texts = ["the capital of france is paris .", "the sky is blue .", "a cat sat on the mat and slept .",
             "rain ."] * 2
    return Dataset.from_list([{"text": t} for t in texts]), model, tokenizer


def _prepared(use_lora: bool, rows: list[dict]):
    """A fresh Accelerator (FSDP2) and the model, optimizer and loader it prepared; the sequence lengths the
    embedding sees, filled as the loop runs."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.utils.data import DataLoader

    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model = _model(use_lora)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt, data = accelerator.prepare(model, opt, DataLoader(rows, batch_size=ROWS))
    lengths = set()
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: lengths.add(args[0].shape[-1]))
    return accelerator, model, opt, data, lengths


def _step(accelerator, model, opt, batch) -> float:
    loss = model(**batch).loss
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    return loss.item()


def _mesh_of(model) -> dict:
    from hf_fsdp2.sharding import record_of

    mesh = record_of(model).mesh
    return dict(zip(mesh.mesh_dim_names, mesh.shape))


def _accelerate_loops(rank, world, cases, saved=None):
    """On each rank: the Accelerate loop for each case (LoRA or not), sp 2 x world / 2 data-parallel groups."""
    from accelerate.state import AcceleratorState

    import hf_fsdp2

    hf_fsdp2.register(sp_size=2)
    report = {}
    for use_lora in cases:
        accelerator, model, opt, data, lengths = _prepared(use_lora, _rows(world // 2))
        losses, rows_seen = [], []
        for batch in data:
            rows_seen.append(batch["input_ids"][:, 0].tolist())
            assert hf_fsdp2.local_batch(batch, model) == batch  # the forward splits: nothing to do in the loop
            losses.append(_step(accelerator, model, opt, batch))
        report[use_lora] = {"losses": losses, "rows": rows_seen, "lengths": sorted(lengths), "mesh": _mesh_of(model)}
        if saved is not None and not use_lora:  # gather-free, on the dp_shard x sp mesh
            accelerator.save_model(model, saved)
        if not use_lora:  # packed rows (TRL's padding_free / packing: positions restart, no mask): refused by name
            packed = torch.cat([torch.arange(SEQ // 2)] * 2).expand(ROWS, -1)
            with pytest.raises(ValueError, match="packs several sequences per row"):
                model(input_ids=batch["input_ids"], position_ids=packed, labels=batch["labels"])
            model.eval()  # evaluation runs whole sequences on every rank
            with torch.no_grad():
                model(**batch)
            assert sorted(lengths) == [SEQ // 2, SEQ]
        AcceleratorState._reset_state(True)
    return report


def _sft(rank, world, tmp, sp):
    """TRL's SFTTrainer (its loss from the per-token log-probabilities of its fused LM head, which the model's
    training forward gathers along the sequence under Ulysses) for 2 steps; rank 0's logged metrics."""
    import hf_fsdp2
    from trl import SFTConfig, SFTTrainer

    from hf_fsdp2.sharding import record_of

    hf_fsdp2.register(sp_size=sp)
    dataset, model, tokenizer = _sft_dataset_and_model()
    args = SFTConfig(output_dir=str(tmp / f"sft-{sp}-{rank}"), max_steps=2, per_device_train_batch_size=2,
                     max_length=16, pad_to_multiple_of=2, report_to="none", save_strategy="no", fsdp="full_shard",
                     fsdp_config={"fsdp_version": 2}, bf16=False, disable_tqdm=True, logging_steps=1,
                     learning_rate=1e-2, lr_scheduler_type="constant")
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    mesh = record_of(trainer.model).mesh
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return dict(zip(mesh.mesh_dim_names, mesh.shape)), logs


def test_accelerate_prepare_and_trl_sft_with_sp_size_2_equal_one_process(tmp_path):
    """register(sp_size=2) on 2 ranks: both ranks load the same rows (one data-parallel rank), each trains on its
    half of every left-padded sequence (its embedding sees 8 of the 16 tokens), the loss summed over the sp ranks'
    valid tokens: losses equal one process's, full and LoRA; the loops run with GPU process-group semantics
    (NCCL_LIKE: nothing of SP's goes through the default group on CPU tensors). On 4 ranks (dp 2 x sp 2) each sp
    pair loads its data-parallel group's rows and trains as one process on them. TRL's SFTTrainer, which computes
    its loss itself from its fused LM head's per-token log-probabilities (gathered along the sequence by the
    model's forward): loss, gradient norm, entropy, token accuracy and token count equal one process's over 2 steps
    (its metrics gathered once per sp group)."""
    got = run_ranks(_accelerate_loops, 2, (False, True), tmp_path / "saved", timeout=300, backend=NCCL_LIKE)
    for lora_case in (False, True):
        want_steps, want_weights = _reference(lora_case, 1)
        want = [step[0] for step in want_steps]
        if not lora_case:  # the saved model: one process's trained weights, under the same names (atol: AdamW's
            saved = saved_tensors(tmp_path / "saved")  # step on a near-zero gradient magnifies float noise)
            assert saved.keys() == want_weights.keys()
            for name, tensor in saved.items():
                torch.testing.assert_close(tensor, want_weights[name], rtol=1e-4, atol=1e-4,
                                           msg=lambda m, name=name: f"{name}: {m}")
        for rank_report in got:
            out = rank_report[lora_case]
            assert out["mesh"] == {"dp_shard": 1, "sp": 2}
            assert out["lengths"] == [SEQ // 2]  # each rank embeds its half of every sequence
            assert out["losses"] == pytest.approx(want, rel=1e-4), lora_case
        assert got[0][lora_case]["rows"] == got[1][lora_case]["rows"]  # an sp group's ranks load the same rows
    # 4 ranks, dp 2 x sp 2: ranks 2d and 2d + 1 load data-parallel group d's rows
    got = run_ranks(_accelerate_loops, 4, (False,), timeout=300)
    want, _ = _reference(False, 2)
    for rank, rank_report in enumerate(got):
        out = rank_report[False]
        assert out["mesh"] == {"dp_shard": 2, "sp": 2}
        assert out["losses"] == pytest.approx([step[rank // 2] for step in want], rel=1e-4), rank
    assert got[0][False]["rows"] == got[1][False]["rows"] != got[2][False]["rows"] == got[3][False]["rows"]
    # TRL's SFT: on plain gloo (TRL's dataset preparation waits on the default group with CPU tensors, which the
    # NCCL-like group refuses: TRL's, not ours)
    (mesh, logs), _ = run_ranks(_sft, 2, tmp_path, 2, timeout=300)
    [(_, want)] = run_ranks(_sft, 1, tmp_path, 1, timeout=300)
    assert mesh == {"dp_shard": 1, "sp": 2} and len(logs) == len(want) == 2
    for got_step, want_step in zip(logs, want):
        for key in ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens"):
            assert got_step[key] == pytest.approx(want_step[key], rel=1e-4), key


def test_trainer_with_hf_fsdp2_sp_size_2_equals_one_process(tmp_path):
    """The Trainer under `--fsdp` with HF_FSDP2_SP_SIZE=2 on 2 ranks (one data-parallel rank of 8 rows): its
    token count over whole sequences, its loss scaling and gradient clipping as on one process; losses equal, and
    so does the evaluation loss (8 rows in batches of 3: gathered once per sp group, the last batch's remainder cut
    from its rows)."""
    from .launched_runs import forked_torchrun, run_script

    args = ("--fsdp", "full_shard", "--fsdp_config", str(ROOT / "accelerate_configs" / "fsdp2.json"),
            "--save_strategy", "no", "--eval", "true", "--eval_strategy", "steps", "--eval_steps", "3",
            "--per_device_eval_batch_size", "3")
    out = run_script(forked_torchrun(2, {"HF_FSDP2_SP_SIZE": "2"}), tmp_path / "sp.json", tmp_path / "sp", 1, 3,
                     *args)
    want = run_script(forked_torchrun(1), tmp_path / "one.json", tmp_path / "one", 1, 3, *args)
    assert out["world"] == 2 and out["mesh"] == {"dp_shard": 1, "sp": 2} and out["embedded_lengths"] == [8]
    # the sp pair's shared rows count once: the Trainer's total batch size (its log, its sample count and
    # train_samples_per_second under max_steps) as on one process
    assert out["total_train_batch_size"] == want["total_train_batch_size"] == 8
    assert out["losses"] == pytest.approx(want["losses"], rel=1e-4)
    assert out["eval_losses"].keys() == {"3"} and out["eval_losses"] == pytest.approx(want["eval_losses"], rel=1e-4)


def _unpadded_rows(groups: int) -> list[dict]:
    """2 steps of ROWS whole rows per data-parallel group (ring CP refuses padding)."""
    ids = torch.randint(0, 128, (2 * groups * ROWS, SEQ), generator=torch.Generator().manual_seed(3))
    return [{"input_ids": i, "labels": i.clone()} for i in ids]


def _ring_ulysses_loops(rank, world):
    """register(sp_size=2, cp_size=2) on 4 ranks, a plain Accelerate loop, full and LoRA: one cp x sp group."""
    from accelerate.state import AcceleratorState

    import hf_fsdp2

    hf_fsdp2.register(sp_size=2, cp_size=2)
    report = {}
    for use_lora in (False, True):
        accelerator, model, opt, data, lengths = _prepared(use_lora, _unpadded_rows(world // 4))
        losses = [_step(accelerator, model, opt, batch) for batch in data]
        report[use_lora] = {"losses": losses, "lengths": sorted(lengths), "mesh": _mesh_of(model)}
        AcceleratorState._reset_state(True)
    return report


def test_ring_cp_x_ulysses_from_accelerate_and_the_trainer_equal_one_process(tmp_path):
    """hf_fsdp2's own cp_size beside sp_size (HF_FSDP2_CP_SIZE / register(cp_size=...); Accelerate's
    parallelism_config cp_size stays refused with sp): a dp_shard x cp x sp mesh, the prepared data loader gives the
    4 ranks of the cp x sp group the same rows, each embeds 16 / 4 tokens of every sequence; a plain Accelerate loop
    (full and LoRA) and the Trainer (its total batch size too) equal one process. Before, the loader dealt rows per
    sp group (2 groups of different rows: losses off, half the steps)."""
    from torch.utils.data import DataLoader

    from hf_fsdp2.tools.check_config import check_accelerate_config_dict, load_config_file

    from .launched_runs import forked_torchrun, run_script

    got = run_ranks(_ring_ulysses_loops, 4, timeout=300)
    for use_lora in (False, True):
        model = _model(use_lora)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        want = []
        for batch in DataLoader(_unpadded_rows(1), batch_size=ROWS):
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            want.append(loss.item())
        for rank_report in got:
            out = rank_report[use_lora]
            assert out["mesh"] == {"dp_shard": 1, "cp": 2, "sp": 2} and out["lengths"] == [SEQ // 4]
            assert out["losses"] == pytest.approx(want, rel=1e-4), use_lora
    args = ("--fsdp", "full_shard", "--fsdp_config", str(ROOT / "accelerate_configs" / "fsdp2.json"),
            "--save_strategy", "no")
    out = run_script(forked_torchrun(4, {"HF_FSDP2_SP_SIZE": "2", "HF_FSDP2_CP_SIZE": "2"}), tmp_path / "spcp.json",
                     tmp_path / "spcp", 1, 3, *args)
    one = run_script(forked_torchrun(1), tmp_path / "one.json", tmp_path / "one", 1, 3, *args)
    assert out["mesh"] == {"dp_shard": 1, "cp": 2, "sp": 2} and out["embedded_lengths"] == [4]
    assert out["losses"] == pytest.approx(one["losses"], rel=1e-4)
    assert out["total_train_batch_size"] == one["total_train_batch_size"] == 8
    # check-config: hf_fsdp2's cp beside sp passes on 4 processes; Accelerate's own cp with sp is refused, naming ours
    cfg = dict(load_config_file(ROOT / "accelerate_configs" / "fsdp2.yaml"), num_processes=4)
    errors = [str(f) for f in check_accelerate_config_dict(cfg, {"HF_FSDP2_SP_SIZE": "2", "HF_FSDP2_CP_SIZE": "2"})
              if f.level == "error"]
    assert errors == []
    accelerate_cp = dict(cfg, parallelism_config={"parallelism_config_dp_shard_size": 2,
                                                  "parallelism_config_cp_size": 2})
    errors = [str(f) for f in check_accelerate_config_dict(accelerate_cp, {"HF_FSDP2_SP_SIZE": "2"})
              if f.level == "error"]
    assert any("not done under Accelerate's parallelism_config_cp_size" in e and "HF_FSDP2_CP_SIZE=2" in e
               for e in errors), errors


def test_sp_size_settings_checked_and_refused_by_name(monkeypatch):
    """Accelerate's parallelism_config sp_size (DeepSpeed's) names hf_fsdp2's setting, at prepare and in
    check-config; check-config takes HF_FSDP2_SP_SIZE as the launch does (sp dividing the shard ranks, not with the
    auto layout); hf_fsdp2's sp_size without FSDP2 (the model not ours to split) is refused by name."""
    from types import SimpleNamespace

    from hf_fsdp2.integrations import accelerate as backend
    from hf_fsdp2.sharding import engine
    from hf_fsdp2.tools.check_config import check_accelerate_config_dict, load_config_file

    with pytest.raises(ValueError, match="sp_size=2.*DeepSpeed.*HF_FSDP2_SP_SIZE"):
        engine.refuse_accelerate_parallelism(SimpleNamespace(sp_size=2, cp_size=1))
    cfg = load_config_file(ROOT / "accelerate_configs" / "fsdp2.yaml")  # num_processes: 2

    def errors(config, **environ):
        return [str(f) for f in check_accelerate_config_dict(config, environ) if f.level == "error"]

    assert errors(cfg, HF_FSDP2_SP_SIZE="2") == []
    assert "`sp_size`=3 must divide the shard size 2" in " ".join(errors(cfg, HF_FSDP2_SP_SIZE="3"))
    assert "`sp_size`=2 with `shard_size`='auto'" in " ".join(errors(cfg, HF_FSDP2_SP_SIZE="2",
                                                                     HF_FSDP2_SHARD_SIZE="auto"))
    deepspeed_sp = dict(cfg, parallelism_config={"parallelism_config_dp_shard_size": 1, "parallelism_config_sp_size": 2})
    assert any("parallelism_config_sp_size: 2" in e and "HF_FSDP2_SP_SIZE" in e for e in errors(deepspeed_sp))
    monkeypatch.setenv("HF_FSDP2_SP_SIZE", "2")
    with pytest.raises(ValueError, match="sp_size=2 .*needs FSDP2"):
        backend.ranks_sharing_rows(SimpleNamespace(is_fsdp2=False))


def test_hf_fsdp2_config_writes_the_sp_size_the_launch_needs(tmp_path, capsys):
    """`hf-fsdp2 config MODEL --sp-size 2`: HF_FSDP2_SP_SIZE=2 written for the launch (Accelerate's yaml cannot carry
    it), the file passing check-config with it; heads sp does not divide, and sp with a CP template, refused."""
    from hf_fsdp2.cli import main
    from hf_fsdp2.tools.check_config import check_accelerate_config
    from hf_fsdp2.tools.config_writer import write_config

    tiny = ROOT / "examples" / "tiny-llama"  # 4 attention heads
    assert main(["config", str(tiny), "--sp-size", "2", "-o", str(tmp_path / "sp.yaml")]) == 0
    text = (tmp_path / "sp.yaml").read_text()
    assert text.startswith("# Sequence parallelism: launch with HF_FSDP2_SP_SIZE=2 in the environment")
    assert check_accelerate_config(tmp_path / "sp.yaml", {"HF_FSDP2_SP_SIZE": "2"}) == []
    with pytest.raises(ValueError, match="`sp_size`=8 must divide the model's 4 attention heads"):
        write_config(tiny, sp_size=8, num_processes=8)
    with pytest.raises(ValueError, match="`sp_size`=2 with `cp_size`=2 is not done under Accelerate"):
        write_config(tiny, sp_size=2, template="fsdp2_cp")
    # hf_fsdp2's own ring CP around Ulysses: both variables written, the file passing check-config with them
    assert main(["config", str(tiny), "--sp-size", "2", "--cp-size", "2", "--num-processes", "4",
                 "-o", str(tmp_path / "spcp.yaml")]) == 0
    text = (tmp_path / "spcp.yaml").read_text()
    assert text.startswith("# Sequence parallelism: launch with HF_FSDP2_SP_SIZE=2 HF_FSDP2_CP_SIZE=2 in the environment")
    assert check_accelerate_config(tmp_path / "spcp.yaml", {"HF_FSDP2_SP_SIZE": "2", "HF_FSDP2_CP_SIZE": "2"}) == []
    with pytest.raises(ValueError, match="`cp_size`=2 without `sp_size`"):
        write_config(tiny, cp_size=2)
