"""Put this folder on PYTHONPATH to run any script with hf_fsdp2's Accelerate backend registered,
unmodified (Python imports `sitecustomize` at start-up). Used to run Accelerate's own test scripts."""

import hf_fsdp2

hf_fsdp2.register()
