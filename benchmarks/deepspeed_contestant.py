"""train_bench.py's `deepspeed` contestant: DeepSpeed ZeRO-3 behind the benchmark's plain loop (checked on this
machine: CPU-only, gloo, 2 ranks, deepspeed 0.19.8, torch 2.13.0+cpu, transformers 5.23.0, peft 0.21.2; losses
equal a one-process torch AdamW run to 1e-6 in fp32, full and LoRA). DeepSpeed is not a dependency: install it
in an environment that sees this one's packages and run the benchmark with that interpreter:

    python -m venv --system-site-packages /tmp/dsenv && DS_BUILD_OPS=0 /tmp/dsenv/bin/pip install deepspeed
    /tmp/dsenv/bin/python benchmarks/train_bench.py --contestants ... deepspeed

Two settings keep it comparable: `gradient_clipping: 0.0` (DeepSpeed 0.19 clips at 1.0 by default; the loop
does not clip) and no shared-memory all-reduce op build (a ~50 s g++ build at init on the CPU accelerator,
used only by inference).

Loop changes compared with a plain torch loop:

    model = wrap_deepspeed(model, ctx)                       # instead of DDP/FSDP wrapping
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, fused=True)
    opt = model.adopt_optimizer(opt)                         # <-- the one added line
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss         # unchanged (DeepSpeedEngine.forward)
        loss.backward()                                      # unchanged (or model.backward(loss))
        opt.step()                                           # now DeepSpeedEngine.step(): reduce-scatter + AdamW + zero grads
        opt.zero_grad(set_to_none=True)                      # now a no-op (engine.step already cleared the grads)

`adopt_optimizer` has to run before the first forward: it is where deepspeed.initialize() runs,
because ZeRO-3 has to take over the optimizer (it re-points the param groups at the flat fp32
partitions). After that, the torch optimizer you built must not be stepped directly; use the
returned object. `model.make_optimizer(lr=..., fused=True)` does both lines at once.
"""
import importlib
import tempfile
import os

import torch


class _DSOptimizer:
    """Optimizer-like handle: step() -> engine.step(); zero_grad() -> no-op."""

    def __init__(self, engine):
        self.engine = engine

    def step(self, closure=None):
        assert closure is None
        self.engine.step()

    def zero_grad(self, set_to_none=True):
        # ZeRO-3 clears its gradient partitions at the end of engine.step(); the module's .grad
        # fields stay None under ZeRO-3, so there is nothing left to clear here.
        pass

    @property
    def param_groups(self):  # so an LR scheduler or the lr-logging code can still read/set lr
        return self.engine.optimizer.param_groups

    def state_dict(self):
        return self.engine.optimizer.state_dict()


class DeepSpeedAdapter:
    def __init__(self, model, ctx):
        self.model = model
        self.ctx = ctx
        self.engine = None
        self.optimizer = None

    # ---- things the benchmark calls ---------------------------------------------------------
    def parameters(self, recurse=True):
        return self.module.parameters(recurse)

    def named_parameters(self, *a, **k):
        return self.module.named_parameters(*a, **k)

    @property
    def module(self):
        return self.engine.module if self.engine is not None else self.model

    def adopt_optimizer(self, opt):
        """Hand the torch optimizer (built on this object's parameters()) to deepspeed.initialize."""
        if self.engine is not None:
            raise RuntimeError("adopt_optimizer called twice")
        import deepspeed
        mb = int(self.ctx["micro_batch"])
        ws = torch.distributed.get_world_size()
        config = {
            "train_micro_batch_size_per_gpu": mb,
            "gradient_accumulation_steps": 1,
            "train_batch_size": mb * ws,
            "zero_optimization": {"stage": 3},
            # deepspeed 0.19.x defaults gradient_clipping to 1.0 (!); a plain torch loop does not clip.
            "gradient_clipping": 0.0,
            # a client torch.optim optimizer under ZeRO
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
            # fp32: no "bf16"/"fp16" sections
        }
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.engine, ds_opt, _, _ = deepspeed.initialize(model=self.model, model_parameters=trainable,
                                                         optimizer=opt, config=config)
        self.engine.train()
        self.optimizer = _DSOptimizer(self.engine)
        return self.optimizer

    def make_optimizer(self, lr, weight_decay=0.0, fused=True, **kw):
        params = [p for p in self.model.parameters() if p.requires_grad]
        return self.adopt_optimizer(torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused, **kw))

    def __call__(self, *args, **kwargs):
        if self.engine is None:
            raise RuntimeError("DeepSpeedAdapter: call adopt_optimizer(opt) / make_optimizer(...) before the first forward")
        return self.engine(*args, **kwargs)

    def backward(self, loss):
        """Optional: DeepSpeed's own backward. Plain loss.backward() gives the same result here."""
        return self.engine.backward(loss)

    def train(self, mode=True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def __getattr__(self, name):  # config, generation_config, etc. fall through to the module
        if name in ("model", "ctx", "engine", "optimizer"):
            raise AttributeError(name)
        return getattr(self.module, name)


def _prepare_env(ctx):
    dev = ctx.get("device", torch.device("cpu"))
    if torch.device(dev).type == "cpu":
        # Must be set before deepspeed first resolves its accelerator (at import). Without
        # intel_extension_for_pytorch/oneccl the CPU accelerator uses 'gloo'.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    rank = int(ctx.get("rank", os.environ.get("RANK", 0)))
    if torch.distributed.is_initialized():
        os.environ.setdefault("RANK", str(torch.distributed.get_rank()))
        os.environ.setdefault("WORLD_SIZE", str(torch.distributed.get_world_size()))
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])  # single node
    if "WORLD_SIZE" in os.environ:
        # cpu accelerator's device_count() reads LOCAL_SIZE (else counts NUMA nodes)
        os.environ.setdefault("LOCAL_SIZE", os.environ["WORLD_SIZE"])
    # Any JIT op build (should not happen with the settings below) stays out of ~/.cache.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(tempfile.gettempdir(), "hf_fsdp2_deepspeed_ext"))


def wrap_deepspeed(model, ctx) -> object:
    """ctx: {"device": torch.device, "rank": int, "mode": "lora"|"full", "micro_batch": int}.

    Works whether or not torch.distributed is already initialised (gloo); if it is not, the
    usual env vars RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT must be set.
    mode needs no special handling: frozen (requires_grad=False) params are partitioned but not optimised.
    """
    _prepare_env(ctx)
    import deepspeed
    # DeepSpeed's TorchBackend JIT-compiles a C++ shared-memory allreduce op on the CPU accelerator
    # at init (roughly 50 s of g++ on 2 cores, into ~/.cache/torch_extensions). That op is only used by
    # inference_all_reduce, never by ZeRO training, so skip it. (Use importlib: the attribute
    # deepspeed.comm.torch is the torch module, not deepspeed/comm/torch.py.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
    return DeepSpeedAdapter(model, ctx)
