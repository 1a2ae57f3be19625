"""Command-line tools behind `hf-fsdp2`: `check_config` (an Accelerate config, checked for hf_fsdp2)
and `memory` (per-rank memory estimate)."""
