"""Beyond dense decoders: encoder-decoder (shared embeddings), encoder-only masked LM (tied decoder
weight and bias), vision (an embedding block in `_no_split_modules`) and MoE, each sharded on 2 gloo
ranks against a single-process reference, saved gather-free and read back by stock `from_pretrained`.

One spawn runs every architecture (the ranks are shared between cases to keep the suite fast).
"""

from __future__ import annotations

import os

import pytest
import torch

from .common import full_params, global_mean, local_rows
from .dist_harness import run_ranks

pytestmark = pytest.mark.oldest  # CI runs this file on every older version set too

STEPS = 2
BATCH = 4


def _build(arch: str, seed: int = 0):
    import transformers as tf

    torch.manual_seed(seed)
    if arch == "bart":  # encoder-decoder: encoder/decoder embed_tokens share model.shared, tied lm_head
        config = tf.BartConfig(vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                               decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                               max_position_embeddings=32, dropout=0.0, attention_dropout=0.0)
        return tf.BartForConditionalGeneration(config)
    if arch == "bert":  # encoder-only MLM: decoder weight tied to the word embeddings, decoder bias to the head's
        config = tf.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0)
        return tf.BertForMaskedLM(config)
    if arch == "vit":  # `_no_split_modules` lists ViTEmbeddings beside ViTLayer
        config = tf.ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
                              num_attention_heads=2, intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0,
                              attention_probs_dropout_prob=0.0)
        return tf.ViTForImageClassification(config)
    if arch == "mixtral":  # MoE: experts fused in memory (transformers 5)
        config = tf.MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                  num_experts_per_tok=2, max_position_embeddings=32, tie_word_embeddings=False)
        return tf.MixtralForCausalLM(config)
    if arch == "llava":  # multimodal: CLIP vision tower + Llama language model, renamed on disk
        vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     image_size=16, patch_size=8, projection_dim=32)
        text = tf.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
        return tf.LlavaForConditionalGeneration(tf.LlavaConfig(vision_config=vision, text_config=text,
                                                               image_token_index=95, image_seq_length=4))
    raise ValueError(arch)


def _batches(arch: str) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        if arch == "vit":
            out.append({"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g),
                        "labels": torch.randint(0, 5, (BATCH,), generator=g)})
        elif arch == "llava":  # 4 image tokens (2x2 patches) then text
            ids = torch.cat([torch.full((BATCH, 4), 95), torch.randint(4, 95, (BATCH, 8), generator=g)], dim=1)
            out.append({"input_ids": ids, "pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g),
                        "labels": ids})
        else:
            ids = torch.randint(4, 96, (BATCH, 12), generator=g)
            out.append({"input_ids": ids, "labels": ids})
    return out


def _train(model, data, rank=0, world=1) -> list[float]:
    # SGD: Adam would turn float noise in gradients that are mathematically zero (an attention key
    # bias) into full-size steps of either sign, and the comparison with the reference would be noise.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for batch in data:
        local = {k: local_rows(v, rank, world) for k, v in batch.items()}
        loss = model(**local).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss) if world > 1 else loss.item())
    return losses


ARCHS = ("bart", "bert", "vit", "mixtral", "llava")


def _worker(rank, world, root):
    import torch.distributed as dist

    from hf_fsdp2 import load_pretrained, save_pretrained, shard_model

    out = {}
    for arch in ARCHS:
        stock = os.path.join(root, f"{arch}-stock")
        if rank == 0:  # other weights, written by stock save_pretrained: our load must read them
            _build(arch, seed=1).save_pretrained(stock)
        dist.barrier()
        model = _build(arch)
        shard_model(model)
        losses = _train(model, _batches(arch), rank, world)
        params = full_params(model)
        save_pretrained(model, os.path.join(root, arch))
        load_pretrained(model, stock)
        loaded = full_params(model)
        out[arch] = {"losses": losses, "params": params if rank == 0 else None, "loaded": loaded if rank == 0 else None}
    for case in LORA_CASES:
        model = _lora(case)
        shard_model(model)
        save_pretrained(model, os.path.join(root, f"merged-{case}"), merge_adapters=True)
        save_pretrained(model, os.path.join(root, f"adapter-{case}"))
    return out


# LoRA on every architecture above, and on every layer type PEFT adapts that a merged export supports:
# Linear, ParamWrapper on fused 3-D experts (Mixtral `target_parameters`), Embedding, Conv2d (ViT's
# patch projection), Conv1D with fan_in_fan_out (GPT-2).
LORA_CASES = ("bart", "bert", "vit", "mixtral", "llava", "gpt2")
LORA_TARGETS = {"bart": ["q_proj", "v_proj"], "bert": ["query", "value"],
                "vit": ["q_proj", "v_proj", "query", "value", "projection"],  # 5.x | 4.x names; a Conv2d
                "llava": ["q_proj", "v_proj"]}


def _base(case: str):
    import transformers as tf

    if case == "gpt2":
        torch.manual_seed(0)
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=2, n_positions=32))
    return _build(case)


def _lora(case: str):
    from peft import LoraConfig, get_peft_model

    model = _base(case)
    if case == "mixtral":
        config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "embed_tokens"],
                            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                            init_lora_weights=False)
    elif case == "gpt2":
        config = LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
                            init_lora_weights=False)
    else:
        config = LoraConfig(r=2, lora_alpha=4, target_modules=LORA_TARGETS[case], init_lora_weights=False)
    torch.manual_seed(5)  # the adapter's random init (non-zero B: the merge must change the weights)
    return get_peft_model(model, config)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    return root, run_ranks(_worker, 2, str(root), timeout=400)[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_architecture_matches_reference_and_round_trips_through_stock_from_pretrained(sharded, arch):
    root, out = sharded
    reference = _build(arch)
    ref_losses = _train(reference, _batches(arch))
    assert out[arch]["losses"] == pytest.approx(ref_losses, abs=1e-4)
    ref_params = {k: v.detach() for k, v in reference.named_parameters()}
    for name, value in out[arch]["params"].items():
        torch.testing.assert_close(value, ref_params[name].float(), atol=1e-4, rtol=1e-4, msg=name)
    loaded = type(reference).from_pretrained(root / arch)
    for name, value in loaded.state_dict().items():
        if name in ref_params:
            torch.testing.assert_close(value, ref_params[name], atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("arch", ARCHS)
def test_architecture_files_are_stock_files_and_stock_files_load(sharded, arch, tmp_path):
    """Same keys, shapes, dtypes, index and config as stock `save_pretrained` of the same model (for
    Mixtral: transformers' conversion reverted, one tensor per expert, gather-free), and our load of
    a stock checkpoint gives stock's weights."""
    from safetensors import safe_open

    root, out = sharded
    reference = _build(arch)
    _train(reference, _batches(arch))
    reference.save_pretrained(tmp_path)
    ours = {}
    with safe_open(root / arch / "model.safetensors", "pt") as f:
        for key in f.keys():
            ours[key] = f.get_tensor(key)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert sorted(ours) == sorted(f.keys())
        for key in f.keys():
            theirs = f.get_tensor(key)
            assert (ours[key].dtype, ours[key].shape) == (theirs.dtype, theirs.shape), key
            torch.testing.assert_close(ours[key], theirs, atol=1e-4, rtol=1e-4, msg=key)
        assert f.metadata() == safe_open(root / arch / "model.safetensors", "pt").metadata()
    other = {k: v.detach() for k, v in _build(arch, seed=1).named_parameters()}
    for name, value in out[arch]["loaded"].items():
        torch.testing.assert_close(value, other[name].float(), atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("case", LORA_CASES)
def test_merged_lora_is_what_peft_merges_and_stock_saves(sharded, case, tmp_path):
    from safetensors import safe_open

    root, _ = sharded
    reference = _lora(case).merge_and_unload()
    reference.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as theirs, \
            safe_open(root / f"merged-{case}" / "model.safetensors", "pt") as ours:
        assert sorted(ours.keys()) == sorted(theirs.keys())
        for key in theirs.keys():
            torch.testing.assert_close(ours.get_tensor(key), theirs.get_tensor(key), atol=1e-6, rtol=1e-6, msg=key)
    from peft.tuners.lora import LoraLayer

    merged, base = dict(reference.named_parameters()), dict(_base(case).named_parameters())
    changed = [k for k in base if not torch.equal(merged[k], base[k])]  # the merge changed what LoRA targets:
    adapted = [m for m in _lora(case).modules() if isinstance(m, LoraLayer)]  # one weight per LoRA layer
    assert len(changed) == len(adapted) > 0, changed


def test_final_norm_is_the_one_before_the_output_head():
    """Several layer stacks: the norm grouped with the head is the last stack's (the language model's),
    never a norm applied to embeddings."""
    from hf_fsdp2 import FSDP2Config
    from hf_fsdp2.sharding import plan_groups
    from hf_fsdp2.sharding.model_parts import model_parts

    llava = _build("llava")
    plan = plan_groups(model_parts(llava), FSDP2Config())
    assert any(m is llava.model.language_model.norm for m in plan.head)
    assert len(plan.layers) == 4  # 2 CLIP encoder layers + 2 Llama decoder layers
    bart = _build("bart")
    plan = plan_groups(model_parts(bart), FSDP2Config())
    assert not any(m is bart.model.decoder.layernorm_embedding or m is bart.model.encoder.layernorm_embedding
                   for m in plan.head)


@pytest.mark.parametrize("case", LORA_CASES)
def test_lora_adapter_is_what_peft_saves_and_reloads(sharded, case, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    root, _ = sharded
    reference = _lora(case)
    reference.save_pretrained(tmp_path)
    ours, theirs = (load_file(d / "adapter_model.safetensors") for d in (root / f"adapter-{case}", tmp_path))
    assert sorted(ours) == sorted(theirs) and ours
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key
    reloaded = PeftModel.from_pretrained(_base(case), root / f"adapter-{case}")
    reference.eval()  # GPT-2 has dropout; PeftModel.from_pretrained returns an eval-mode model
    if case == "gpt2":
        inputs = {"input_ids": torch.randint(4, 90, (1, 8), generator=torch.Generator().manual_seed(3))}
    else:
        inputs = {k: v for k, v in _batches(case)[0].items() if k != "labels"}
    torch.testing.assert_close(reloaded(**inputs).logits, reference(**inputs).logits)
