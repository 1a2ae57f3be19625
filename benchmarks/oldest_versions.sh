#!/usr/bin/env bash
# The tests on the oldest supported versions (constraints-min.txt), in a second environment .venv-min/.
#   bash benchmarks/oldest_versions.sh --subset   # CI (.ci/run): sharding, save/load of every architecture,
#                                                 # the Accelerate launch, the Trainer flag, the main job
#   bash benchmarks/oldest_versions.sh            # the whole suite
# Extra arguments go to pytest. The environment is (re)built when constraints-min.txt changes. It sees
# the main environment's packages (--system-site-packages) and installs over them only what
# constraints-min.txt pins differently (transformers, peft): no second multi-GB torch.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-min
STAMP="$VENV/constraints-min.txt"
if [ ! -x "$VENV/bin/python" ] || ! cmp -s constraints-min.txt "$STAMP"; then
    rm -rf "$VENV"
    python -m venv --system-site-packages "$VENV"
    "$VENV/bin/python" -m pip install -q -c constraints-min.txt -e ".[test]"
    cp constraints-min.txt "$STAMP"
fi
"$VENV/bin/python" -m pip install -q --no-deps -e .  # this checkout, wherever the environment was made
"$VENV/bin/python" -c "import torch, transformers, accelerate, peft; print('oldest set:', 'torch', torch.__version__, \
'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'peft', peft.__version__)"
if [ "${1:-}" = "--subset" ]; then
    shift
    exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@" \
        "tests/test_sharding.py::test_full_finetune_matches_reference[2]" \
        tests/test_sharding.py::test_lora_frozen_and_adapters_gathered_together \
        tests/test_sharding.py::test_meta_device_deferred_init_materialises_only_local_shards \
        "tests/test_pretrained.py::test_from_pretrained_reads_transformers_own_save[None]" \
        tests/test_pretrained.py::test_adapter_matches_peft_own_save_and_reloads \
        tests/test_pretrained.py::test_merged_adapter_equals_merge_and_unload \
        tests/test_architectures.py \
        tests/test_accelerate.py::test_fsdp2_yaml_on_cpu_shards_trains_saves_and_resumes_elsewhere \
        tests/test_trainer.py::test_trainer_script_under_accelerate_launch_is_sharded_on_cpu \
        tests/test_examples.py::test_readme_main_job_trains_saves_reloads_and_samples
fi
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
