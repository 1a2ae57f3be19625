"""Gather-free Hugging Face checkpoints: saved on N gloo ranks, loaded by the real `from_pretrained`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import hf_fsdp2
from hf_fsdp2 import FSDP2Config, save_pretrained, shard_model

from .common import build_model, count_collectives, full_params, lora, plain_params
from .dist_harness import run_ranks

# Uneven: vocab 131 and head_dim 3 split over 4 ranks as 33/33/33/32 and 1/1/1/0 rows.
UNEVEN = dict(vocab_size=131, hidden_size=12, intermediate_size=20, num_attention_heads=4, num_key_value_heads=1,
              num_hidden_layers=2)


def _save_worker(rank, world, out_dir, model_kwargs, save_kwargs, config_kwargs):
    model = build_model(**model_kwargs)
    shard_model(model, FSDP2Config(**config_kwargs))
    from hf_fsdp2.checkpoint.safetensors_io import FileWriter

    written = {"bytes": 0}
    original = FileWriter.write_rows

    def counting(self, name, first_row, block):
        n = original(self, name, first_row, block)
        written["bytes"] += n
        return n

    FileWriter.write_rows = counting
    import os

    fsyncs = []
    real_fsync = os.fsync
    os.fsync = lambda fd: (fsyncs.append(fd), real_fsync(fd))[1]
    try:
        with count_collectives() as calls:
            hf_fsdp2.save_pretrained(model, out_dir, **save_kwargs)
    finally:
        FileWriter.write_rows = original
        os.fsync = real_fsync
    return {"calls": {k: v for k, v in calls.items() if v}, "written": written["bytes"], "fsyncs": len(fsyncs)}


def _assert_equals_reference(directory: Path, reference: dict[str, torch.Tensor], dtype=torch.float32):
    loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    got = plain_params(loaded)
    assert got.keys() == reference.keys()
    for k, v in reference.items():
        assert torch.equal(got[k], v.to(dtype).float()), k


@pytest.mark.parametrize("world", [2, 4])
def test_save_uneven_shards_loads_with_from_pretrained(tmp_path, world):
    out = run_ranks(_save_worker, world, str(tmp_path / "ckpt"), UNEVEN, {}, {})
    _assert_equals_reference(tmp_path / "ckpt", plain_params(build_model(**UNEVEN)))
    assert (tmp_path / "ckpt" / "config.json").exists() and (tmp_path / "ckpt" / "generation_config.json").exists()
    from safetensors import safe_open

    with safe_open(tmp_path / "ckpt" / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    # Only one-integer agreements (an errno or 0, in place of barriers): no gather, no broadcast.
    for r in out:
        assert set(r["calls"]) == {"all_reduce", "elements", "bytes"}, r["calls"]
        assert r["calls"]["elements"] == r["calls"]["all_reduce"] <= 3
    model_bytes = sum(t.numel() * 4 for t in plain_params(build_model(**UNEVEN)).values())
    assert sum(r["written"] for r in out) == model_bytes  # each byte written once
    assert all(r["fsyncs"] >= 1 for r in out)  # durable by default: every rank syncs its file


def test_save_without_fsync_still_commits_a_loadable_checkpoint(tmp_path):
    target = tmp_path / "ckpt"
    run_ranks(_save_worker, 2, str(target), UNEVEN, {}, {})
    (target / "tokenizer.json").write_text("{}")
    out = run_ranks(_save_worker, 2, str(target), UNEVEN, {"durable": False}, {})
    assert [r["fsyncs"] for r in out] == [0, 0]
    _assert_equals_reference(target, plain_params(build_model(**UNEVEN)))
    assert (target / "tokenizer.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging or old copies left


def test_save_bf16_several_files_with_index(tmp_path):
    run_ranks(_save_worker, 2, str(tmp_path / "ckpt"), {}, {"dtype": "bf16", "max_shard_size": "40KB"}, {})
    files = sorted(p.name for p in (tmp_path / "ckpt").glob("model-*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    reference = plain_params(build_model())
    assert index["metadata"]["total_size"] == sum(v.numel() * 2 for v in reference.values())
    assert all(t.dtype == torch.bfloat16 for f in files for t in load_file(tmp_path / "ckpt" / f).values())
    _assert_equals_reference(tmp_path / "ckpt", reference, dtype=torch.bfloat16)


def test_tied_embeddings_and_hsdp_writes_one_replica(tmp_path):
    out = run_ranks(_save_worker, 4, str(tmp_path / "ckpt"), {"tie_word_embeddings": True}, {},
                    {"replicate_size": 2})
    reference = build_model(tie_word_embeddings=True)
    _assert_equals_reference(tmp_path / "ckpt", plain_params(reference))
    assert "lm_head.weight" not in load_file(tmp_path / "ckpt" / "model.safetensors")
    # Mesh (replicate=2, shard=2): ranks 2 and 3 are the second replica and write nothing.
    assert out[2]["written"] == out[3]["written"] == 0 and out[0]["written"] > 0


# ---------------------------------------------------------------------------------------------


def _load_worker(rank, world, directory, model_kwargs):
    model = hf_fsdp2.from_pretrained(LlamaForCausalLM, directory)
    local = sum(p.to_local().numel() for p in model.parameters())
    params = full_params(model)
    inv_freq = model.model.rotary_emb.inv_freq
    return {"params": params if rank == 0 else None, "local": local, "inv_freq": inv_freq}


@pytest.mark.parametrize("max_shard_size", [pytest.param(None, marks=pytest.mark.oldest), "30KB"])
def test_from_pretrained_reads_transformers_own_save(tmp_path, max_shard_size):
    reference = build_model(**UNEVEN)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    reference.save_pretrained(tmp_path / "hf", **kwargs)
    out = run_ranks(_load_worker, 2, str(tmp_path / "hf"), UNEVEN)
    ref = plain_params(reference)
    assert out[0]["params"].keys() == ref.keys()
    for k in ref:
        assert torch.equal(out[0]["params"][k], ref[k]), k
    torch.testing.assert_close(out[0]["inv_freq"], reference.model.rotary_emb.inv_freq)
    total = sum(v.numel() for v in ref.values())
    assert all(r["local"] <= total // 2 + 200 for r in out)


def _replicated_tied_worker(rank, world, directory):
    from hf_fsdp2.sharding.replication import is_replicated

    model = hf_fsdp2.from_pretrained(LlamaForCausalLM, directory, hf_fsdp2.FSDP2Config(shard_size=1, replicate_size=2))
    ids = torch.arange(16).view(1, 16)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return {"replicated": is_replicated(model), "tied": model.lm_head.weight is model.model.embed_tokens.weight,
            "loss": loss.item()}


def test_from_pretrained_keeps_tied_weights_tied_on_the_reducer(tmp_path):
    """A tied model built on meta and replicated (shard size 1: DDP's reducer) had its tie broken by
    `to_empty`, so loading asked the checkpoint for `lm_head.weight`, which transformers does not save for a
    tied head: "missing keys (1): lm_head.weight" (found by benchmarks/real_size.py). Sharing survives now."""
    reference = build_model(tie_word_embeddings=True)
    reference.save_pretrained(tmp_path / "hf")
    ids = torch.arange(16).view(1, 16)
    out = run_ranks(_replicated_tied_worker, 2, str(tmp_path / "hf"))
    assert all(r["replicated"] and r["tied"] for r in out)
    assert out[0]["loss"] == pytest.approx(reference(input_ids=ids, labels=ids).loss.item(), abs=1e-5)


# ---------------------------------------------------------------------------------------------


def _peft_worker(rank, world, out_dir, merge):
    model = lora(build_model())
    shard_model(model)
    hf_fsdp2.save_pretrained(model, out_dir, merge_adapters=merge)
    return True


@pytest.mark.oldest
def test_adapter_matches_peft_own_save_and_reloads(tmp_path):
    from peft import PeftModel

    run_ranks(_peft_worker, 2, str(tmp_path / "ours"), False)
    reference = lora(build_model())
    reference.save_pretrained(tmp_path / "peft")
    ours = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    theirs = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys() and len(ours) > 0
    for k in theirs:
        assert torch.equal(ours[k], theirs[k]), k
    ours_cfg, peft_cfg = (json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("ours", "peft"))
    for cfg in (ours_cfg, peft_cfg):  # a set in PEFT: its JSON order varies between processes
        cfg["target_modules"] = sorted(cfg["target_modules"])
    assert ours_cfg == peft_cfg
    reloaded = PeftModel.from_pretrained(build_model(), tmp_path / "ours")
    ids = torch.arange(16).view(1, 16)
    torch.testing.assert_close(reloaded(input_ids=ids).logits, reference(input_ids=ids).logits)


@pytest.mark.oldest
def test_merged_adapter_equals_merge_and_unload(tmp_path):
    run_ranks(_peft_worker, 2, str(tmp_path / "merged"), True)
    expected = plain_params(lora(build_model()).merge_and_unload())
    loaded = plain_params(AutoModelForCausalLM.from_pretrained(tmp_path / "merged"))
    assert loaded.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(loaded[k], expected[k], atol=0, rtol=0, msg=k)  # bit for bit


# ---------------------------------------------------------------------------------------------


def test_overwrite_keeps_foreign_files_and_leaves_no_stale_shards(tmp_path):
    target = tmp_path / "ckpt"
    build_model().save_pretrained(target, max_shard_size="30KB")  # an old sharded checkpoint
    (target / "tokenizer.json").write_text("{}")
    (target / "checkpoint-5").mkdir()
    (target / "checkpoint-5" / "state.json").write_text("{}")
    run_ranks(_save_worker, 2, str(target), {}, {}, {})
    names = sorted(p.name for p in target.iterdir())
    assert names == ["checkpoint-5", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no staging leftovers
    _assert_equals_reference(target, plain_params(build_model()))


def _mismatch_worker(rank, world, directory):
    model = build_model(vocab_size=140)  # embed/lm_head rows differ from the saved model's 128
    shard_model(model)
    try:
        hf_fsdp2.load_pretrained(model, directory)
    except hf_fsdp2.CheckpointError as e:
        return str(e)
    return None


def test_mismatched_checkpoint_lists_every_problem_in_one_error(tmp_path):
    from safetensors.torch import save_file

    sd = {k: v for k, v in build_model().state_dict().items() if k != "model.norm.weight"}
    sd["extra.weight"] = torch.zeros(2)
    sd["model.layers.0.input_layernorm.weight"] = torch.zeros(64, dtype=torch.int64)
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    message = run_ranks(_mismatch_worker, 2, str(tmp_path))[0]
    assert message is not None
    assert "missing keys (1): model.norm.weight" in message
    assert "unexpected keys (1): extra.weight" in message
    assert "model.embed_tokens.weight: shape [128, 64] in model.safetensors, model has [140, 64]" in message
    assert "lm_head.weight: shape" in message
    assert "model.layers.0.input_layernorm.weight: dtype torch.int64" in message


@pytest.mark.parametrize("tied, dtype", [(False, None), (True, "bf16")])
def test_output_is_what_stock_save_pretrained_writes(tmp_path, tied, dtype):
    """Same files, index (incl. `total_parameters`), config.json (`architectures`, `dtype`), keys,
    shapes, dtypes and bytes as transformers' own `save_pretrained` for the same model."""
    import json

    from safetensors import safe_open

    model = build_model(tie_word_embeddings=tied)
    save_pretrained(model, tmp_path / "ours", max_shard_size="200KB", dtype=dtype)
    stock = build_model(tie_word_embeddings=tied)
    if dtype:
        stock = stock.to(torch.bfloat16)
    stock.save_pretrained(tmp_path / "stock", max_shard_size="200KB")
    ours_files = sorted(p.name for p in (tmp_path / "ours").iterdir())
    assert ours_files == sorted(p.name for p in (tmp_path / "stock").iterdir())
    for name in ours_files:
        if name.endswith(".json"):
            a, b = (json.loads((tmp_path / d / name).read_text()) for d in ("ours", "stock"))
            assert a == b, name
            continue
        with safe_open(tmp_path / "ours" / name, "pt") as a, safe_open(tmp_path / "stock" / name, "pt") as b:
            assert a.metadata() == b.metadata() and sorted(a.keys()) == sorted(b.keys()), name
            for key in a.keys():
                assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key


def _peft_after_worker(rank, world, base_dir, adapter_dir):
    """PEFT around what hf_fsdp2.from_pretrained returned: refused at shard_model and at Accelerate's prepare;
    the route the message gives (peft_config at load, then load_pretrained of the trained adapter) instead."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from peft import LoraConfig

    from .common import batches

    refusals = []
    for how in ("get_peft_model", "add_adapter"):  # (PeftModel.from_pretrained onto it fails in PEFT: shapes)
        model = hf_fsdp2.from_pretrained(LlamaForCausalLM, base_dir)
        if how == "get_peft_model":
            model = lora(model)
        else:  # transformers' own PEFT integration: adapters put into the model, no PeftModel around it
            model.add_adapter(LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        with pytest.raises(NotImplementedError) as at_shard:
            shard_model(model)
        hf_fsdp2.register()
        try:
            accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
                fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                transformer_cls_names_to_wrap=["LlamaDecoderLayer"]))  # the settings it was sharded with
            with pytest.raises(NotImplementedError) as at_prepare:
                accelerator.prepare(model, torch.optim.AdamW(p for p in model.parameters() if p.requires_grad))
        finally:
            hf_fsdp2.unregister()
        refusals += [str(at_shard.value), str(at_prepare.value)]
    config = LoraConfig(**json.loads((Path(adapter_dir) / "adapter_config.json").read_text()))
    model = hf_fsdp2.from_pretrained(LlamaForCausalLM, base_dir, peft_config=config)
    hf_fsdp2.load_pretrained(model, adapter_dir)
    ids = batches(1)[0]
    return {"refusals": refusals, "loss": model(input_ids=ids, labels=ids).loss.item()}


def test_peft_added_after_sharding_is_refused_with_a_route_that_works(tmp_path):
    """Issue 49's note: PEFT applied to what hf_fsdp2.from_pretrained returned (get_peft_model, or transformers'
    add_adapter) went through Accelerate's prepare as it was, its adapters plain tensors in no group (each rank
    training its own copy, unsynchronised); shard_model failed with a misleading wrap-class error (get_peft_model)
    or "already sharded" (add_adapter). Both refuse it now, naming the parameters and the way in that works, which
    gives the single process's loss for a trained adapter."""
    from peft import PeftModel

    from .common import batches

    build_model().save_pretrained(tmp_path / "base")
    lora(build_model(), seed=3).save_pretrained(tmp_path / "adapter")
    out = run_ranks(_peft_after_worker, 2, str(tmp_path / "base"), str(tmp_path / "adapter"))
    for message in out[0]["refusals"]:
        assert re.match(r"\d+ parameters appeared in the LlamaForCausalLM after hf_fsdp2 sharded it "
                        r"\(model\.layers\.0\.self_attn\.q_proj\.lora_A\.default\.weight, ", message), message
        assert "peft_config=LoraConfig(...)" in message and "hf_fsdp2.load_pretrained(model, adapter_dir)" in message
    reference = PeftModel.from_pretrained(build_model(), tmp_path / "adapter")
    ids = batches(1)[0]
    expected = reference(input_ids=ids, labels=ids).loss.item()
    assert expected != pytest.approx(build_model()(input_ids=ids, labels=ids).loss.item(), abs=1e-3)  # it matters
    assert [r["loss"] for r in out] == pytest.approx([expected] * 2, abs=1e-5)


def _modules_to_save_worker(rank, world, directory):
    from peft import LoraConfig
    from torch.distributed.tensor import DTensor

    model = hf_fsdp2.from_pretrained(AutoModelForCausalLM, directory, FSDP2Config(),
                                     peft_config=LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters() if "lm_head" in n}


def test_from_pretrained_fills_the_layer_peft_keeps_beside_a_modules_to_save_copy(tmp_path):
    """Issue 65: with `peft_config`'s modules_to_save, PEFT keeps the loaded layer as `original_module` (what runs
    under `disable_adapter()`) beside its trainable copy; the read filled the copy only, and the original held the
    uninitialised memory the sharding allocated. Both hold the checkpoint's lm_head now."""
    build_model().save_pretrained(tmp_path)
    head = build_model().lm_head.weight
    got = run_ranks(_modules_to_save_worker, 2, str(tmp_path))[0]
    assert sorted(got) == ["base_model.model.lm_head.modules_to_save.default.weight",
                           "base_model.model.lm_head.original_module.weight"]
    assert all(torch.equal(t, head) for t in got.values())


def test_from_pretrained_keywords_are_honoured_or_refused_by_name(tmp_path):
    """Issue 65: `hf_fsdp2.from_pretrained(cls, dir, ep_size=2)` passed the keyword on to transformers' config,
    which drops keys it does not know: no EP, no word (so did `activation_checkpointing=True`). An FSDP2Config
    field is honoured now (tests/test_expert_parallel.py: ep_size and activation_checkpointing on 2 ranks), with
    `config=` too refused; a keyword the model's config takes still goes to it; any other is refused by name,
    before anything distributed starts."""
    from hf_fsdp2.checkpoint.pretrained import build_on_meta

    build_model().save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match=r"`use_cahce`=False is neither an FSDP2Config field nor a setting of "
                                         r"LlamaConfig, so nothing would take it"):
        hf_fsdp2.from_pretrained(LlamaForCausalLM, tmp_path / "hf", use_cahce=False)
    with pytest.raises(ValueError, match=r"got `config` and FSDP2Config fields as keywords \(activation_checkpointing="
                                         r"True\); give one: `config=config\.replace\(activation_checkpointing="):
        hf_fsdp2.from_pretrained(AutoModelForCausalLM, tmp_path / "hf", FSDP2Config(), activation_checkpointing=True)
    with pytest.raises(TypeError, match=r"`config` must be an FSDP2Config \(how to shard\), got LlamaConfig"):
        hf_fsdp2.from_pretrained(LlamaForCausalLM, tmp_path / "hf", config=build_model().config)
    assert build_on_meta(AutoModelForCausalLM, tmp_path / "hf", use_cache=False).config.use_cache is False
