#!/usr/bin/env bash
# The tests on an older version set, in a second environment kept outside the checkout (see VENV below).
#   bash benchmarks/oldest_versions.sh SET --subset   # CI (.ci/run): the tests marked `oldest` (pytest -m oldest):
#                                                     # sharding, save/load of every architecture, the Accelerate
#                                                     # launch, the Trainer flag, the main job, the upstream contracts
#   bash benchmarks/oldest_versions.sh SET            # the whole suite
# SET names a pin file: oldest (= llamafactory) -> constraints-min.txt (the oldest versions we support:
# LLaMA-Factory 0.9.5's caps), NAME -> constraints-NAME.txt (axolotl: axolotl 0.21's pins, in CI; torch215: torch 2.15,
# not in CI: several GB; transformers524: transformers 5.24.0, by hand; gpu-image: the GPU machine's stack, torch 2.11 on
# Python 3.12, by hand).
# A pin file whose first line is `# python: X.Y` is built with pyenv's Python X.Y as a whole environment of its own
# (another Python cannot share the main environment's packages).
# Extra arguments go to pytest. The environment lives in $HF_FSDP2_VENVS (default ~/.cache/hf_fsdp2/venvs),
# one per set, pin file and base Python: a clean clone (CI's) reuses the one an earlier run built instead of
# spending ~50 s (oldest) to ~90 s (axolotl) rebuilding it. It is (re)built when its pin file changes. It sees the main
# environment's packages (--system-site-packages) and installs over them only what the pin file pins
# differently: no second multi-GB torch.
set -euo pipefail
cd "$(dirname "$0")/.."
SET="${1:-}"
case "$SET" in
    oldest|llamafactory) PINS=constraints-min.txt ;;  # the oldest supported set is LLaMA-Factory 0.9.5's caps
    ""|-*) echo "usage: bash benchmarks/oldest_versions.sh SET [--subset] [pytest args]; SET: oldest, or NAME for constraints-NAME.txt" >&2; exit 2 ;;
    *) PINS="constraints-$SET.txt" ;;
esac
shift
[ -f "$PINS" ] || { echo "no pin file $PINS for set '$SET'" >&2; exit 2; }
# Keyed by the pin file's content and the base interpreter (a --system-site-packages environment sees its
# packages): another pin file or Python gets its own environment, never a stale one.
KEY="$( (cat "$PINS"; python -c 'import sys; print(sys.executable, sys.version)') | sha256sum | cut -c1-12)"
VENV="${HF_FSDP2_VENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/hf_fsdp2/venvs}/$SET-$KEY"
mkdir -p "$(dirname "$VENV")"
STAMP="$VENV/$(basename "$PINS")"
if [ ! -x "$VENV/bin/python" ] || ! cmp -s "$PINS" "$STAMP"; then
    rm -rf "$VENV"
    PY_WANTED="$(sed -n '1s/^# python: *\([0-9.]*\).*/\1/p' "$PINS")"
    if [ -n "$PY_WANTED" ]; then
        PYENV_PY="$(ls -d "$(pyenv root 2>/dev/null || echo ~/.pyenv)"/versions/"$PY_WANTED"*/bin/python 2>/dev/null | tail -1)"
        [ -x "$PYENV_PY" ] || { echo "$PINS wants Python $PY_WANTED, which pyenv does not have" >&2; exit 2; }
        "$PYENV_PY" -m venv "$VENV"
    else
        python -m venv --system-site-packages "$VENV"
    fi
    # PIP_CONSTRAINT: the pin file replaces any machine-wide constraint (one here caps torch at 2.14.1).
    PIP_CONSTRAINT="$PINS" "$VENV/bin/python" -m pip install -q -c "$PINS" -e ".[test]"
    cp "$PINS" "$STAMP"
fi
# This checkout, wherever the environment was made (it is shared by checkouts: one run at a time uses it).
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" -c "from importlib.metadata import version as v; print('set $SET:', \
*(f'{p} {v(p)}' for p in ('torch', 'transformers', 'accelerate', 'peft', 'trl', 'bitsandbytes')))"
if [ "${1:-}" = "--subset" ]; then
    shift
    exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m oldest "$@"
fi
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
