"""Processes: the process group and device mesh (`distributed`), and a clean interpreter exit after
gloo collectives (`exit_guard`), FSDP2's private state on every supported torch (`fsdp_state`)."""
