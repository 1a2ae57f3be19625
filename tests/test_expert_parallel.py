"""Expert parallelism x FSDP2 on 4 CPU ranks (issue 49), with transformers' own EP plan and token dispatch:
tiny Qwen3-MoE, Mixtral and DeepSeek-V3 models train like one process (losses, router auxiliary loss, every
gradient; full fine-tune and LoRA on the linear layers) with ep 2 x efsdp 2 and ep 4; checkpoints equal stock
save_pretrained's and resume across ep sizes; the entry points (shard_model, hf_fsdp2.from_pretrained, accelerate
launch, the Trainer, a model transformers split at load), GPU process-group semantics, the estimate, the plan and
check-config; what is not done yet is refused by name."""

from __future__ import annotations

import re

import pytest
import torch

from hf_fsdp2 import FSDP2Config, load_state, save_pretrained, save_state, shard_model

from .common import batches, global_mean, local_rows, saved_tensors
from .dist_harness import run_ranks

STEPS, SPLIT, WORLD = 3, 2, 4


def build_moe(seed: int = 0, arch: str = "qwen3_moe"):
    """A tiny MoE model with 8 experts, top-2: Qwen3-MoE (router auxiliary loss on), Mixtral (the same),
    DeepSeek-V3 (a dense first layer, a shared expert, grouped top-k routing with its expert bias, no
    auxiliary loss), or gpt-oss (transposed experts with biases, its clamped gated activation, attention sinks,
    router auxiliary loss)."""
    import transformers

    torch.manual_seed(seed)
    if arch == "gpt_oss":
        config = transformers.GptOssConfig(
            vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
            max_position_embeddings=64, tie_word_embeddings=False, output_router_logits=True,
            router_aux_loss_coef=0.01)
        model = transformers.GptOssForCausalLM(config).float()
        with torch.no_grad():  # transformers initialises the expert biases at zero: make them count
            for name, p in model.named_parameters():
                if name.endswith("_bias"):
                    p.normal_(0, 0.1)
        return model
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    aux = dict(output_router_logits=True, router_aux_loss_coef=0.01)
    if arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, **aux, moe_intermediate_size=32, num_experts=8,
                                             num_experts_per_tok=2)
        return transformers.Qwen3MoeForCausalLM(config).float()
    if arch == "mixtral":
        config = transformers.MixtralConfig(**common, **aux, num_local_experts=8, num_experts_per_tok=2)
        return transformers.MixtralForCausalLM(config).float()
    config = transformers.DeepseekV3Config(
        **common, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16)
    return transformers.DeepseekV3ForCausalLM(config).float()


EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # PEFT's names for fused experts


def with_lora(model, arch: str, use_lora: str = "linear"):
    """PEFT LoRA on the attention projections ("linear"), and also on the fused experts' parameters ("experts",
    PEFT's `target_parameters`); random B so it counts from step 0."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    targets = ["q_proj", "v_proj"] if arch != "deepseek_v3" else ["q_b_proj", "kv_b_proj", "o_proj"]
    on_experts = dict(target_parameters=EXPERT_TARGETS) if use_lora == "experts" else {}
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                                            init_lora_weights=False, **on_experts))


def _adapted(module):
    """The module PEFT's wrappers adapt (the experts module itself under `target_parameters`)."""
    while hasattr(module, "base_layer"):
        module = module.base_layer
    return module


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(model, rank: int, world: int, root: str | None = None, start: int = 0, opt=None, mean=global_mean
           ) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """AdamW steps `start`.. on this rank's rows (the reference averages the ranks' losses the same way); the
    first step's gradients, whole; the router auxiliary loss of each step. `root`: the training state saved
    after SPLIT steps (`root/state`), the model at the end (`root/final`)."""
    opt = opt if opt is not None else torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, aux, grads = [], [], {}
    for step, ids in enumerate(batches(STEPS)[start:], start):
        if root is not None and step == SPLIT:
            save_state(f"{root}/state", model, opt, step=SPLIT)
        ids = local_rows(ids, rank, world)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        if step == 0:
            grads = {name: _full(p.grad).detach().clone() for name, p in model.named_parameters() if p.requires_grad}
        opt.step()
        opt.zero_grad()
        losses.append(mean(out.loss))
        aux.append(mean(out.aux_loss) if out.aux_loss is not None else None)
    if root is not None:
        save_pretrained(model, f"{root}/final")  # a PeftModel: its adapter
        if hasattr(model, "peft_config"):
            save_pretrained(model, f"{root}/merged", merge_adapters=True)
    return losses, grads, aux


def _reference(world: int, arch: str, use_lora: str | None = None):
    """One process: each step the mean of the ranks' losses over their rows, as the ranks average gradients."""
    model = build_moe(arch=arch)
    model = with_lora(model, arch, use_lora) if use_lora else model
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, aux, grads = [], [], {}
    for step, ids in enumerate(batches(STEPS)):
        outs = [model(input_ids=local_rows(ids, r, world), labels=local_rows(ids, r, world)) for r in range(world)]
        loss = sum(o.loss for o in outs) / world
        loss.backward()
        if step == 0:
            grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        aux.append((sum(o.aux_loss for o in outs) / world).item() if outs[0].aux_loss is not None else None)
    return losses, grads, aux


def _ep_rank(rank, world, ep_size, root=None, arch="qwen3_moe", use_lora=None, local_losses=False):
    model = build_moe(arch=arch)
    model = with_lora(model, arch, use_lora) if use_lora else model
    shard_model(model, FSDP2Config(ep_size=ep_size))
    experts = _adapted((model.get_base_model() if use_lora else model).model.layers[-1].mlp.experts)
    weight = experts.gate_up_proj
    layout = {"mesh": list(weight.device_mesh.mesh_dim_names), "shape": list(weight.device_mesh.shape),
              "local_experts": experts.num_experts, "local_rows": weight.to_local().shape[0],
              "dense_mesh": list((model.get_base_model() if use_lora else model).model.layers[-1]
                                 .input_layernorm.weight.device_mesh.mesh_dim_names)}
    # local_losses: this rank's own (the test averages them), for a default group that refuses CPU tensors
    losses, grads, aux = _train(model, rank, world, root, mean=(lambda t: t.item()) if local_losses else global_mean)
    out = {"layout": layout, "losses": losses, "grads": grads, "aux": aux}
    if use_lora == "experts":  # adapters off (TRL's reference for a LoRA policy): the untouched base's loss
        ids = local_rows(batches(1)[0], rank, world)
        with model.disable_adapter():
            out["disabled_loss"] = global_mean(model(input_ids=ids, labels=ids).loss)
    if root is not None:  # the trained weights, whole (test-only gather), to hold the files against
        out["weights"] = {name: _full(p).detach().clone() for name, p in model.named_parameters()}
    return out


def _resume(rank, world, ep_size, directory, resave=None):
    model = build_moe(seed=123)  # other weights: everything must come from the state
    shard_model(model, FSDP2Config(ep_size=ep_size))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start, _ = load_state(directory, model, opt)
    if resave:
        save_state(resave, model, opt, step=start)
    return _train(model, rank, world, start=start, opt=opt)[0]


@pytest.mark.parametrize("arch,ep_size,use_lora", [("qwen3_moe", 2, None), ("qwen3_moe", 4, None),
                                                   ("mixtral", 2, None), ("deepseek_v3", 4, None),
                                                   ("qwen3_moe", 2, "linear"), ("deepseek_v3", 2, "linear"),
                                                   ("qwen3_moe", 2, "experts"), ("mixtral", 4, "experts"),
                                                   ("deepseek_v3", 2, "experts")])
def test_expert_parallel_trains_like_one_process(arch, ep_size, use_lora, tmp_path):
    """Full fine-tune, or PEFT LoRA on the linear layers with the experts frozen in their EP groups, or LoRA on
    the linear layers and the fused experts' parameters (`target_parameters`), added on each rank's experts:
    then the adapter and the merged model, written gather-free, equal what PEFT and transformers write."""
    ref_losses, ref_grads, ref_aux = _reference(WORLD, arch, use_lora)
    root = str(tmp_path) if use_lora == "experts" else None
    out = run_ranks(_ep_rank, WORLD, ep_size, root, arch, use_lora)
    layout = out[0]["layout"]
    assert layout["mesh"] == ["efsdp", "ep"] and layout["shape"] == [WORLD // ep_size, ep_size]
    assert layout["local_experts"] == 8 // ep_size  # E / ep experts per rank, as transformers sets it
    assert layout["dense_mesh"] == ["dp_shard"]  # attention, router, embeddings: sharded over all 4 ranks
    for rank in out:
        assert rank["losses"] == pytest.approx(ref_losses, rel=1e-5)
        if arch != "deepseek_v3":  # routed with an expert bias, no auxiliary loss
            assert rank["aux"] == pytest.approx(ref_aux, rel=1e-5) and all(a > 0 for a in ref_aux)
        assert rank["grads"].keys() == ref_grads.keys()
        for name, expected in ref_grads.items():
            torch.testing.assert_close(rank["grads"][name], expected, rtol=1e-5, atol=1e-7, msg=name)
    if root is not None:
        base = build_moe(arch=arch)
        ids = batches(1)[0]
        base_loss = sum(base(input_ids=local_rows(ids, r, WORLD), labels=local_rows(ids, r, WORLD)).loss.item()
                        for r in range(WORLD)) / WORLD
        assert out[0]["disabled_loss"] == pytest.approx(base_loss, rel=1e-5) and base_loss != ref_losses[0]
        expert_adapter_files_are_stock(tmp_path, arch, out[0]["weights"])


def expert_adapter_files_are_stock(tmp_path, arch: str, weights: dict):
    """The trained weights saved by PEFT itself (adapter) and merged by PEFT (`merge_and_unload`) then saved by
    transformers: the same tensors as ours (`tmp_path`/final, /merged: hf_fsdp2.save_pretrained's, gather-free);
    PEFT loads ours onto a fresh model with the trained values."""
    from peft import PeftModel

    stock = with_lora(build_moe(arch=arch), arch, "experts")
    missing, unexpected = stock.load_state_dict(weights, strict=False)  # `weights`: parameters; buffers stay stock's
    assert not unexpected and not set(missing) & dict(stock.named_parameters()).keys(), (missing, unexpected)
    stock.save_pretrained(tmp_path / "stock-adapter")
    ours = saved_tensors(tmp_path / "final", "adapter_model.safetensors")
    theirs = saved_tensors(tmp_path / "stock-adapter", "adapter_model.safetensors")
    assert ours.keys() == theirs.keys() and any(".experts." in k for k in ours)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    loaded = dict(PeftModel.from_pretrained(build_moe(arch=arch), tmp_path / "final").named_parameters())
    assert all(torch.equal(loaded[k], v) for k, v in weights.items() if "lora_" in k)
    stock.merge_and_unload().save_pretrained(tmp_path / "stock-merged")
    ours, theirs = saved_tensors(tmp_path / "merged"), saved_tensors(tmp_path / "stock-merged")
    assert ours.keys() == theirs.keys()
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-6, msg=key)


def test_expert_parallel_checkpoints_load_in_stock_transformers_and_resume_on_any_ep(tmp_path):
    """ep 2 x efsdp 2 writes, gather-free, what stock save_pretrained writes for the same weights (one file
    tensor per expert where the model's conversion splits them) and stock from_pretrained reads it; its
    training state resumes on plain FSDP (which saves it again) and on ep 4, and the plain one back on ep 2."""
    from transformers import AutoModelForCausalLM

    out = run_ranks(_ep_rank, WORLD, 2, str(tmp_path))[0]
    tail = out["losses"][SPLIT:]
    stock_model = build_moe(seed=7)
    stock_model.load_state_dict(out["weights"])  # the same trained weights, saved by transformers itself
    stock_model.save_pretrained(tmp_path / "stock")
    ours, stock = saved_tensors(tmp_path / "final"), saved_tensors(tmp_path / "stock")
    assert ours.keys() == stock.keys() and all(torch.equal(ours[k], stock[k]) for k in stock)
    # fused in memory, one tensor per expert and projection in the hub's files (the model's conversion)
    assert "model.layers.0.mlp.experts.gate_up_proj" in out["weights"] and "model.layers.0.mlp.experts.7.up_proj.weight" in ours
    loaded = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "final").named_parameters())
    assert all(torch.equal(loaded[name], value) for name, value in out["weights"].items())

    # hf_fsdp2.from_pretrained splits the experts on the meta device and reads each rank's rows of the files
    assert all(torch.equal(loaded[name], value) for name, value in run_ranks(
        _from_pretrained, WORLD, 4, str(tmp_path / "final"))[1].items())

    plain = run_ranks(_resume, WORLD, 1, str(tmp_path / "state"), str(tmp_path / "plain-state"))[0]
    assert plain == pytest.approx(tail, rel=1e-5)
    assert run_ranks(_resume, WORLD, 4, str(tmp_path / "state"))[0] == pytest.approx(tail, rel=1e-5)
    assert run_ranks(_resume, WORLD, 2, str(tmp_path / "plain-state"))[0] == pytest.approx(tail, rel=1e-5)
    ep_files, plain_files = saved_tensors(tmp_path / "state"), saved_tensors(tmp_path / "plain-state")
    assert ep_files.keys() == plain_files.keys() and all(torch.equal(ep_files[k], plain_files[k]) for k in ep_files)


def test_expert_parallel_with_a_default_group_that_refuses_cpu_tensors(tmp_path):
    """GPU semantics on CPU (tests/dist_harness.py NCCL_LIKE): the token all-to-alls, the efsdp reductions and the
    checkpoint's collectives all run on the expert and training meshes' own groups, none on the default group."""
    from .dist_harness import NCCL_LIKE

    ref_losses, _, _ = _reference(WORLD, "qwen3_moe")
    outs = run_ranks(_ep_rank, WORLD, 2, str(tmp_path), local_losses=True, backend=NCCL_LIKE)
    assert [sum(step) / WORLD for step in zip(*(o["losses"] for o in outs))] == pytest.approx(ref_losses, rel=1e-5)
    final = saved_tensors(tmp_path / "final")  # written by the ranks, equal to their trained weights
    stock_names = {name for name in final if ".experts." in name}
    assert len(stock_names) == 2 * 8 * 3  # 2 layers x 8 experts x gate, up, down


def _adopt(rank, world, directory, root):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from hf_fsdp2.sharding import record_of

    model = AutoModelForCausalLM.from_pretrained(directory, distributed_config=DistributedConfig(fsdp_size=4, ep_size=2))
    shard_model(model)  # taken as transformers sharded it
    losses = _train(model, rank, world, root)[0]
    ids = local_rows(batches(1)[0], rank, world)
    model(input_ids=ids, labels=ids).loss.backward()  # its experts' gradients on transformers' expert mesh
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        clip_refusal = None
    except ValueError as error:
        clip_refusal = str(error)
    # PEFT added afterwards (here LoRA on the experts it split): its adapters are in none of transformers' groups
    split = AutoModelForCausalLM.from_pretrained(directory, distributed_config=DistributedConfig(fsdp_size=4, ep_size=2))
    try:
        shard_model(with_lora(split, "qwen3_moe", "experts"))
        refusal = None
    except NotImplementedError as error:
        refusal = str(error)
    return {"losses": losses, "ep_size": record_of(model).config.ep_size, "refusal": refusal, "clip": clip_refusal,
            "weights": {name: _full(p).detach().clone() for name, p in model.named_parameters()}}


def test_a_model_transformers_split_with_ep_at_load_is_adopted(tmp_path):
    """`from_pretrained(distributed_config=DistributedConfig(fsdp_size=4, ep_size=2))`: transformers' own EP x
    FSDP2, taken as it is (its ep size recorded); it trains like one process and gets our gather-free files."""
    build_moe().save_pretrained(tmp_path / "src")
    out = run_ranks(_adopt, WORLD, str(tmp_path / "src"), str(tmp_path))[0]
    assert out["ep_size"] == 2
    assert out["losses"] == pytest.approx(_reference(WORLD, "qwen3_moe")[0], rel=1e-5)
    assert re.search(r"PEFT wraps a FSDPQwen3MoeForCausalLM that transformers sharded at load .* Load the model "
                     r"without `distributed_config`", out["refusal"]), out["refusal"]
    assert "use hf_fsdp2.clip_grad_norm_(model, max_norm)" in out["clip"]  # torch's cannot combine its meshes
    stock_model = build_moe(seed=7)
    stock_model.load_state_dict(out["weights"])
    stock_model.save_pretrained(tmp_path / "stock")
    ours, stock = saved_tensors(tmp_path / "final"), saved_tensors(tmp_path / "stock")
    assert ours.keys() == stock.keys() and all(torch.equal(ours[k], stock[k]) for k in stock)


def _from_pretrained(rank, world, ep_size, directory):
    import hf_fsdp2
    from transformers import AutoModelForCausalLM

    model = hf_fsdp2.from_pretrained(AutoModelForCausalLM, directory, FSDP2Config(ep_size=ep_size), progress=False)
    assert model.model.layers[0].mlp.experts.gate_up_proj.device_mesh.mesh_dim_names == ("efsdp", "ep")
    return {name: _full(p).detach().clone() for name, p in model.named_parameters()}


def test_accelerate_launch_with_hf_fsdp2_ep_size_matches_one_process(tmp_path):
    """`accelerate launch` (fsdp2.yaml with the model's decoder layer class, 4 processes) of a plain Accelerate
    loop over a hub-format Qwen3-MoE, HF_FSDP2_EP_SIZE=2 (Accelerate 1.15's ParallelismConfig has no EP):
    the experts split over ep 2 x efsdp 2, `accelerator.clip_grad_norm_` over the dense and expert meshes,
    losses equal one process's; the state it saves resumes on plain FSDP over 2 processes."""
    import os

    from transformers import AutoModelForCausalLM

    from hf_fsdp2.tools.config_writer import write_config

    from .launched_runs import launch, launch_forked, reference_losses

    model = build_moe()
    model.config.output_router_logits = False  # the loss over the whole batch is one process's
    model.save_pretrained(tmp_path / "src")
    yaml = tmp_path / "fsdp2_moe.yaml"  # hf-fsdp2 config: the model's decoder layer class, the EP note
    yaml.write_text(write_config(tmp_path / "src", num_processes=4, ep_size=2))
    env = {**os.environ, "HF_FSDP2_EP_SIZE": "2"}
    out = launch(str(yaml), 4, tmp_path / "ep.json", "--steps", "3", "--from-pretrained", str(tmp_path / "src"),
                 "--save-state", str(tmp_path / "state"), env=env)
    assert out["expert_mesh"] == [[["efsdp", "ep"], [2, 2]]] and out["mesh"] == [4]
    expected = reference_losses(4, model=AutoModelForCausalLM.from_pretrained(tmp_path / "src"))
    assert out["losses"] == pytest.approx(expected[:3], rel=1e-5)
    resumed = launch_forked(str(yaml), 2, tmp_path / "resumed.json", "--start", "3", "--steps", "1",
                            "--from-pretrained", str(tmp_path / "src"), "--load-state", str(tmp_path / "state"))
    assert resumed["expert_mesh"] == [] and resumed["losses"] == pytest.approx(expected[3:], rel=1e-5)


def test_trainer_with_hf_fsdp2_ep_size_matches_one_process(tmp_path):
    """The Trainer's own flags (`--fsdp full_shard --fsdp_config` naming the model's decoder layer) under torchrun,
    HF_FSDP2_EP_SIZE=2 (what the Trainer's arguments cannot carry): the Trainer's Accelerator prepares the model,
    hf_fsdp2 splits the experts; losses equal the Trainer on one process (gradient clipping included)."""
    from .launched_runs import CONFIGS, forked_torchrun, run_script

    model = build_moe()
    model.config.output_router_logits = False
    model.save_pretrained(tmp_path / "src")
    fsdp_json = tmp_path / "fsdp2_moe.json"
    fsdp_json.write_text((CONFIGS / "fsdp2.json").read_text().replace("LlamaDecoderLayer", "Qwen3MoeDecoderLayer"))
    common = ("--save_strategy", "no", "--model_dir", str(tmp_path / "src"))
    single = run_script(forked_torchrun(1), tmp_path / "single.json", tmp_path / "single", 1, 3, *common)
    ep = run_script(forked_torchrun(4, {"HF_FSDP2_EP_SIZE": "2"}), tmp_path / "ep.json", tmp_path / "ep", 4, 3,
                    "--fsdp", "full_shard", "--fsdp_config", str(fsdp_json), *common)
    assert ep["expert_mesh"] == [[["efsdp", "ep"], [2, 2]]] and ep["world"] == 4
    assert ep["losses"] == pytest.approx(single["losses"], rel=1e-5)


def test_plan_proposes_expert_parallelism_for_a_moe_model(tmp_path, capsys):
    """`hf-fsdp2 plan` on a MoE model whose budget needs sharding: the chosen layout again with each ep size
    that splits its experts, each gathering less; nothing proposed for a dense model."""
    import json

    from hf_fsdp2.cli import main
    from hf_fsdp2.planner.layout import plan_layout
    from hf_fsdp2.planner.memory import prepare_meta_model

    from .common import tiny_config

    config = build_moe().config
    config.to_json_file(tmp_path / "config.json")
    every = plan_layout(prepare_meta_model(config, FSDP2Config()), WORLD, FSDP2Config(), budget_bytes=1 << 40,
                        device_type="cpu", batch_size=1, seq_len=16).candidates
    budget = min(c.needed_bytes for c in every if c.shard_size == WORLD)  # only one group over all 4 ranks fits
    assert budget < min(c.needed_bytes for c in every if c.shard_size < WORLD)
    args = ["plan", "--model", str(tmp_path / "config.json"), "--world-size", "4", "--memory", str(budget),
            "--device", "cpu", "--seq-len", "16", "--batch-size", "1"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["chosen"]["shard_size"] == WORLD
    proposals = {p["ep_size"]: p for p in out["expert_parallel"]}
    assert sorted(proposals) == [2, 4]
    assert proposals[4]["gathered_peak_bytes"] < proposals[2]["gathered_peak_bytes"]
    assert main(args) == 0
    assert "ep_size=2: all-gather peak" in capsys.readouterr().out
    tiny_config().to_json_file(tmp_path / "dense.json")
    main(["plan", "--model", str(tmp_path / "dense.json"), "--world-size", "4", "--memory", "100GB", "--json"])
    assert json.loads(capsys.readouterr().out)["expert_parallel"] == []


def test_check_config_reads_the_ep_size_the_launch_environment_sets(monkeypatch):
    """The yaml cannot carry ep_size (Accelerate's launcher drops keys it does not know): check-config reads
    HF_FSDP2_EP_SIZE as the launch will, and names what cannot hold on the yaml's processes."""
    from hf_fsdp2.tools.check_config import check_accelerate_config

    from .launched_runs import CONFIGS

    monkeypatch.setenv("HF_FSDP2_EP_SIZE", "2")
    assert check_accelerate_config(CONFIGS / "fsdp2.yaml") == []  # 2 processes: ep 2 x efsdp 1
    monkeypatch.setenv("HF_FSDP2_EP_SIZE", "4")
    (finding,) = check_accelerate_config(CONFIGS / "fsdp2.yaml")
    assert finding.level == "error" and "`ep_size`=4 must divide the shard size 2" in finding.message
    assert "with HF_FSDP2_EP_SIZE" in finding.message


def _refusal(rank, world, config_fields, wrap):
    model = build_moe()
    if wrap:  # LoRA on the experts, marked merged as PEFT's merge_adapter() would: the forward would add it again
        model = with_lora(model, "qwen3_moe", "experts")
    try:
        shard_model(model, FSDP2Config(**config_fields))
        if wrap:
            model.base_model.model.model.layers[0].mlp.experts.merged_adapters.append("default")
            model(input_ids=batches(1)[0])
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("fields,wrap,message", [
    (dict(ep_size=2), True, r"LoRA merged into split experts \(down_proj, `merge_adapter\(\)`\) is not done in hf_fsdp2 "
                            r"under expert parallelism"),
    (dict(ep_size=2, replicate_size=2), False, r"`ep_size`=2 with HSDP \(`replicate_size`=2\) is not done"),
    (dict(ep_size=3), False, r"`ep_size`=3 must divide the shard size 4"),
])
def test_what_expert_parallelism_does_not_do_yet_is_refused_by_name(fields, wrap, message):
    errors = run_ranks(_refusal, WORLD, fields, wrap)
    assert all(e is not None for e in errors), errors
    assert re.search(message, errors[0]), errors[0]


def test_ep_without_transformers_expert_parallelism_is_refused_by_name(monkeypatch):
    """transformers before its expert_parallel module (e.g. the GPU image's 5.17): one error naming the setting."""
    import sys

    from hf_fsdp2.planner.memory import estimate_memory

    monkeypatch.setitem(sys.modules, "transformers.distributed.expert_parallel", None)  # import raises ImportError
    with pytest.raises(ValueError, match=r"`ep_size`=2 applies the model's EP plan with transformers' expert "
                                         r"parallelism .* install transformers 5.23 or later"):
        estimate_memory(build_moe().config, WORLD, FSDP2Config(ep_size=2), batch_size=None)


def test_ep_with_another_wrap_policy_is_refused_by_name():
    with pytest.raises(ValueError, match=r"`ep_size`=2 makes each decoder layer's experts a group"):
        FSDP2Config(ep_size=2, wrap_policy="size")


def _auto(rank, world):
    from hf_fsdp2.sharding import record_of

    model = build_moe()
    shard_model(model, FSDP2Config(ep_size=2, shard_size="auto", memory_budget="20GB", plan_seq_len=16))
    record = record_of(model)
    return {"losses": _train(model, rank, world)[0], "shard_size": record.config.shard_size,
            "candidates": sorted({(c.shard_size, c.cpu_offload) for c in record.layout.candidates})}


def test_the_auto_layout_plans_with_the_ep_size_given():
    """shard_size="auto" with ep_size: every candidate one shard group over all ranks (EP splits the experts
    within it), none offloaded (not done with EP); the chosen one trains like one process."""
    out = run_ranks(_auto, WORLD)[0]
    assert out["shard_size"] == WORLD and out["candidates"] == [(WORLD, False)]
    assert out["losses"] == pytest.approx(_reference(WORLD, "qwen3_moe")[0], rel=1e-5)


def test_moe_bench_tiny_mode_runs_every_contestant():
    """benchmarks/moe_bench.py on tiny shapes, so it cannot rot: every contestant trains the same losses, EP
    all-gathers less than FSDP2 alone's parameters and moves tokens, reading nothing to the host in its MoE layers
    where transformers' own EP reads its split sizes (the real shape is run by hand)."""
    from .common import tiny_benchmark_results

    # ep 4 is the same code path as ep 2 (and its numerics are tested above); three contestants keep CI shorter
    results = tiny_benchmark_results("moe_bench.py", "--contestants", "fsdp2", "ep2", "transformers")
    assert set(results) == {"fsdp2", "ep2", "transformers"}
    base = results["fsdp2"]
    for name, r in results.items():
        assert r["losses"] == pytest.approx(base["losses"], rel=1e-5), name
    assert results["ep2"]["all_gather_bytes"] < base["all_gather_bytes"]
    assert base["dispatch_bytes"] == 0 < results["ep2"]["dispatch_bytes"]
    # issue 64: hf_fsdp2's dispatch reads nothing to the host in the MoE layers, transformers' AllToAllEP its splits
    assert results["ep2"]["host_reads_per_layer"] == 0 < results["transformers"]["host_reads_per_layer"]


def test_estimate_counts_each_ranks_experts_and_the_token_exchange(tmp_path, capsys):
    """estimate-memory with ep_size: the same bytes per rank at rest (rows / shard either way), a layer's
    gather holds only its rank's E / ep experts, and one layer's token dispatch (tokens gathered from the ep ranks and
    summed back, and their top-k pair rows, x hidden) joins the backward-start point; ep must divide the shard group
    (named)."""
    from hf_fsdp2.cli import main
    from hf_fsdp2.planner.memory import estimate_memory

    config = build_moe().config
    plain = estimate_memory(config, WORLD, FSDP2Config(), batch_size=2, seq_len=16)
    ep2 = estimate_memory(config, WORLD, FSDP2Config(ep_size=2), batch_size=2, seq_len=16)
    assert ep2.param_bytes == plain.param_bytes and ep2.optimizer_bytes == plain.optimizer_bytes
    hidden, inter, experts = config.hidden_size, config.moe_intermediate_size, config.num_experts
    expert_bytes = experts * 3 * hidden * inter * 4  # gate_up_proj [E, 2I, H] + down_proj [E, H, I], fp32
    layer = next(g for g in plain.groups if g.name.endswith("layers.0"))
    layer_ep = next(g for g in ep2.groups if g.name.endswith("layers.0"))
    assert layer.gathered_bytes - layer_ep.gathered_bytes == expert_bytes // 2
    # sharding/expert_parallel/dispatch.py: ep 2 x batch 2 x 16 tokens gathered and summed back, and as many x top-2 pair rows
    top_k = config.num_experts_per_tok
    assert ep2.all_to_all_bytes == 2 * 2 * 16 * (2 + top_k) * hidden * 4 and plain.all_to_all_bytes == 0
    assert ep2.backward_start_bytes - plain.backward_start_bytes == ep2.all_to_all_bytes
    with pytest.raises(ValueError, match="`ep_size`=3 must divide the shard size 4"):
        estimate_memory(config, WORLD, FSDP2Config(ep_size=3), batch_size=2, seq_len=16)
    with pytest.raises(ValueError, match="`ep_size`=2 with `cp_size` > 1 is not done"):
        estimate_memory(config, WORLD, FSDP2Config(ep_size=2), batch_size=2, seq_len=16, cp_size=2)
    config.to_json_file(tmp_path / "config.json")
    assert main(["estimate-memory", "--model", str(tmp_path / "config.json"), "--world-size", "4", "--ep-size", "2",
                 "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    assert "experts over ep 2 x efsdp 2" in out and "EP dispatch: one layer's gathered tokens" in out


# Issue 65: what EP left to the user on 2 ranks (one run: generation, from_pretrained's keywords, clipping,
# merging, ignored_modules).
PROMPTS = [torch.tensor([[5, 9, 13, 17]]), torch.tensor([[3, 6, 9, 12]])]  # one per rank
NEW_TOKENS, MAX_NORM = 12, 0.05


def _greedy(model, ids, eos=None):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                              do_sample=False, eos_token_id=eos, pad_token_id=0)


def _refused(call) -> str | None:
    try:
        call()
    except ValueError as error:
        return str(error)
    return None


def _issue65_rank(rank, world, directory, eos):
    import hf_fsdp2
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from transformers import AutoModelForCausalLM

    out = {"refusals": {}}
    refusals = out["refusals"]
    # FSDP2Config fields as keywords: honoured (transformers' config would drop them), or refused by name
    refusals["config_and_keyword"] = _refused(lambda: hf_fsdp2.from_pretrained(
        AutoModelForCausalLM, directory, FSDP2Config(), ep_size=2))
    refusals["unknown_keyword"] = _refused(lambda: hf_fsdp2.from_pretrained(
        AutoModelForCausalLM, directory, ep_sise=2))
    model = hf_fsdp2.from_pretrained(AutoModelForCausalLM, directory, ep_size=2, activation_checkpointing=True,
                                     progress=False)
    out["mesh"] = model.model.layers[0].mlp.experts.gate_up_proj.device_mesh.mesh_dim_names
    out["checkpointed"] = all(isinstance(layer, CheckpointWrapper) for layer in model.model.layers)
    # generate(): this rank's prompt; one rank's sequence ends at `eos` after 2 tokens, the other's runs 12
    model.eval()
    out["generated"] = _greedy(model, PROMPTS[rank], eos)
    refusals["unsynced"] = _refused(lambda: model.generate(input_ids=PROMPTS[rank], max_new_tokens=2,
                                                           synced_gpus=False))
    # clipping: torch's refuses by name, ours gives one process's norm and update
    model.train()
    ids = local_rows(batches(1)[0], rank, world)
    model(input_ids=ids, labels=ids).loss.backward()
    refusals["torch_clip"] = _refused(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
    out["norm"] = hf_fsdp2.clip_grad_norm_(model, MAX_NORM).item()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    out["weights"] = {name.replace("._checkpoint_wrapped_module", ""): _full(p).detach().clone()
                      for name, p in model.named_parameters()}
    # merge_and_unload / merge_adapter with LoRA on split experts: refused before anything changes
    peft_model = with_lora(build_moe(), "qwen3_moe", "experts")
    shard_model(peft_model, FSDP2Config(ep_size=2))
    before = global_mean(peft_model(input_ids=ids, labels=ids).loss)
    refusals["merge_and_unload"] = _refused(peft_model.merge_and_unload)
    refusals["merge_adapter"] = _refused(peft_model.merge_adapter)
    out["intact"] = global_mean(peft_model(input_ids=ids, labels=ids).loss) == before
    # ignored_modules that take in the experts: EP would split them all the same
    refusals["ignored_experts"] = _refused(lambda: shard_model(build_moe(), FSDP2Config(
        ep_size=2, ignored_modules=r"model\.layers\.1\.mlp\.experts")))
    return out


def test_ep_generation_clipping_keywords_merging_and_ignored_modules_on_two_ranks(tmp_path):
    """Issue 65 on 2 ranks. generate() where one rank's sequence stops early (EOS after 2 tokens, 12 on the
    other): each rank's tokens are one process's for its prompt, no hang (every rank keeps stepping through the
    experts' all-to-alls: synced_gpus; `synced_gpus=False` refused). `hf_fsdp2.from_pretrained(..., ep_size=2,
    activation_checkpointing=True)` splits and checkpoints (keywords transformers' config would drop); with
    `config=` too, or an unknown keyword, refused by name. torch's clip_grad_norm_ refuses gradients on two meshes
    naming hf_fsdp2.clip_grad_norm_, which gives one process's norm and update. merge_and_unload()/merge_adapter()
    with LoRA on split experts, and `ignored_modules` taking in experts, refused by name."""
    from transformers import AutoModelForCausalLM

    build_moe().save_pretrained(tmp_path / "src")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "src").eval()
    free = [_greedy(reference, ids)[0, ids.shape[1]:].tolist() for ids in PROMPTS]
    eos = next(t for t in free[0][1:] if t not in free[1])  # rank 0's 2nd token or later, never rank 1's
    expected = [_greedy(reference, ids, eos) for ids in PROMPTS]
    assert expected[0].shape[1] - PROMPTS[0].shape[1] < NEW_TOKENS == expected[1].shape[1] - PROMPTS[1].shape[1]

    out = run_ranks(_issue65_rank, 2, str(tmp_path / "src"), eos, timeout=300, pg_timeout=60)
    for rank, result in enumerate(out):
        assert torch.equal(result["generated"], expected[rank]), (rank, result["generated"], expected[rank])
        assert result["mesh"] == ("efsdp", "ep") and result["checkpointed"]

    # one process: the mean of the ranks' losses, torch's clipping, the same SGD step
    reference.train()
    ids = batches(1)[0]
    loss = sum(reference(input_ids=local_rows(ids, r, 2), labels=local_rows(ids, r, 2)).loss for r in range(2)) / 2
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM).item()
    torch.optim.SGD(reference.parameters(), lr=1.0).step()
    assert norm > MAX_NORM and all(r["norm"] == pytest.approx(norm, rel=1e-5) for r in out)
    for name, value in reference.named_parameters():
        torch.testing.assert_close(out[0]["weights"][name], value.detach(), rtol=1e-5, atol=1e-6, msg=name)

    refusals = out[0]["refusals"]
    assert out[1]["refusals"] == refusals and all(refusals.values()), refusals
    assert re.search(r"got `config` and FSDP2Config fields as keywords \(ep_size=2\).*config\.replace\(ep_size=2\)",
                     refusals["config_and_keyword"])
    assert "`ep_sise`=2 is neither an FSDP2Config field nor a setting of Qwen3MoeConfig" in refusals["unknown_keyword"]
    assert "`synced_gpus`=False with expert parallelism (`ep_size`=2)" in refusals["unsynced"]
    assert re.search(r"torch\.nn\.utils\.clip_grad_norm_ cannot combine gradients on 2 device meshes .* use "
                     r"hf_fsdp2\.clip_grad_norm_\(model, max_norm\)", refusals["torch_clip"])
    for method in ("merge_and_unload", "merge_adapter"):
        assert re.search(rf"`{method}\(\)` with LoRA on experts that expert parallelism split \(`ep_size`=2: "
                         r"model\.layers\.0\.mlp\.experts.*save_pretrained\(model, directory, merge_adapters=True\)",
                         refusals[method])
    assert all(r["intact"] for r in out)
    assert re.search(r"`ignored_modules`='model\\\\.layers\\\\.1\\\\.mlp\\\\.experts' takes in the experts "
                     r"model\.layers\.1\.mlp\.experts, which `ep_size`=2 splits", refusals["ignored_experts"])
