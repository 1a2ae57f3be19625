"""The planner: what a layout costs per rank and which one to take, before anything is allocated.

meta_model.py builds the model on meta; activation_trace.py and memory_report.py feed memory.py (per-rank
bytes of a layout: `estimate_memory`, `hf-fsdp2 estimate-memory`; a rank's TP blocks on paper are
sharding/tensor_parallel.py's); layout.py costs every candidate layout and picks the cheapest that fits (`shard_size="auto"`, `hf-fsdp2 plan`).
It reads sharding's groups and record; the engine (hf_fsdp2/sharding/engine.py) never imports it and is
handed the resolved layout (hf_fsdp2/shard.py).
"""
