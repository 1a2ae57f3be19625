"""Command-line tools behind `hf-fsdp2`: `check_config` (an Accelerate config, checked for hf_fsdp2).
The memory estimate and the layout planner live in `hf_fsdp2.sharding` (the engine uses them)."""
