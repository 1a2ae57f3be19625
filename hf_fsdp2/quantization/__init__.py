"""Quantized base weights under FSDP2: each technique in its own module (bnb_4bit: bitsandbytes NF4/FP4)."""
