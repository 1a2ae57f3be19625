"""Checkpoints in Hugging Face format, written and read by every rank for its own rows.

`safetensors_io` (the file format, by row blocks) -> `tensor_export` (which tensors, under which
names, which rows are this rank's) -> `atomic_dir` (staging, commit, failure agreement) ->
`pretrained` (models and adapters) and `state` (training state); `convert` turns Accelerate's DCP
checkpoints into the same format.
"""
