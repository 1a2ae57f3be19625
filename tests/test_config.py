"""Config validation and group planning: single process, no process group needed."""

import pytest
import torch

from hf_fsdp2 import FSDP2Config
from hf_fsdp2.sharding import find_layers, plan_groups, resolve_layer_class_names
from hf_fsdp2.sharding.model_parts import model_parts

from .common import build_model, lora


@pytest.mark.parametrize("kwargs, field", [
    ({"param_dtype": "int8"}, "param_dtype"),
    ({"reduce_dtype": torch.int32}, "reduce_dtype"),
    ({"frozen_dtype": 3}, "frozen_dtype"),
    ({"reshard_after_forward": 1}, "reshard_after_forward"),
    ({"reshard_after_forward": "maybe"}, "reshard_after_forward"),
    ({"forward_prefetch": -1}, "forward_prefetch"),
    ({"replicate_size": 0}, "replicate_size"),
    ({"activation_checkpointing": "sometimes"}, "activation_checkpointing"),
    ({"layer_cls_names": ""}, "layer_cls_names"),
    ({"layer_cls_names": 5}, "layer_cls_names"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises((ValueError, TypeError), match=f"`{field}`"):
        FSDP2Config(**kwargs)


def test_values_are_normalised():
    c = FSDP2Config(layer_cls_names="LlamaDecoderLayer, LlamaDecoderLayer,X", param_dtype="bf16",
                    reshard_after_forward="false", cpu_offload="true")
    assert c.layer_cls_names == ("LlamaDecoderLayer", "X")
    assert c.param_dtype is torch.bfloat16 and c.reduce_dtype is torch.float32
    assert c.reshard_after_forward is False and c.cpu_offload is True
    assert FSDP2Config(layer_cls_names=["A", "B"]).layer_cls_names == ("A", "B")


def test_hsdp_shape_must_fit_world():
    assert FSDP2Config(replicate_size=2).mesh_shape(4) == (2, 2)
    with pytest.raises(ValueError, match="`replicate_size`=3 does not divide the world size 4"):
        FSDP2Config(replicate_size=3).mesh_shape(4)
    with pytest.raises(ValueError, match="does not match the world size 8"):
        FSDP2Config(replicate_size=2, shard_size=3).mesh_shape(8)
    with pytest.raises(ValueError, match="`reshard_after_forward`=4 must divide the shard size 2"):
        FSDP2Config(replicate_size=2, reshard_after_forward=4).mesh_shape(4)


def test_from_dict_rejects_unknown_keys_with_suggestion():
    with pytest.raises(ValueError, match=r"`param_dtyp` \(did you mean `param_dtype`\?\)"):
        FSDP2Config.from_dict({"param_dtyp": "bf16"}, source="HF_FSDP2_* environment")


def test_unknown_class_name_lists_what_the_model_contains():
    model = build_model()
    with pytest.raises(ValueError, match="matches no module of LlamaForCausalLM.*LlamaDecoderLayer"):
        resolve_layer_class_names(model_parts(model), FSDP2Config(layer_cls_names="GPT2Block"))


def test_default_layer_classes_come_from_no_split_modules_through_peft():
    model = lora(build_model())
    assert resolve_layer_class_names(model_parts(model), FSDP2Config()) == ("LlamaDecoderLayer",)
    plan = plan_groups(model_parts(model), FSDP2Config())
    assert len(plan.layers) == 3
    base = model.base_model.model
    # The final norm is found under the PeftModel too (Accelerate's lookup misses it there).
    assert plan.head == [base.model.norm, base.lm_head] and plan.embedding == [base.model.embed_tokens]


def test_layers_found_through_checkpoint_wrappers():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = build_model()
    model.model.layers[1] = checkpoint_wrapper(model.model.layers[1])
    layers = find_layers(model, ("LlamaDecoderLayer",))
    assert layers[1] is model.model.layers[1] and len(layers) == 3


def test_tied_weights_planned_into_one_group():
    model = build_model(tie_word_embeddings=True)
    plan = plan_groups(model_parts(model), FSDP2Config())
    assert plan.tied and plan.embedding is None
    assert plan.head == [model.model.embed_tokens, model.model.norm, model.lm_head]
