"""Quantized weights under FSDP2: each technique in its own module (bnb_4bit: bitsandbytes NF4/FP4 bases;
fp8: torchao float8 training; bnb_optimizers: 8-bit optimizer states). The rest of hf_fsdp2 reaches a
quantized base only through quantized.py, the interface bnb_4bit implements."""
