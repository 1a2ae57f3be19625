"""Processes: the process group and device mesh (`distributed`), and a clean interpreter exit after
gloo collectives (`exit_guard`)."""
