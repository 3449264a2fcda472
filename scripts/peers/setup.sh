#!/usr/bin/env bash
# Create one virtual environment per peer package (see recipes.py):
#   scripts/peers/setup.sh [peer ...]      (default: all)
# Logs go to ~/.cache/kvcodec/peers/<name>.log; a failed install is reported, not fatal.
set -uo pipefail
cd "$(dirname "$0")"
ROOT=${KVCODEC_PEERS:-$HOME/.cache/kvcodec/peers}
PY=${PYTHON:-python3}
mkdir -p "$ROOT"
peers=("$@")
[ ${#peers[@]} -eq 0 ] && mapfile -t peers < <("$PY" -c 'import recipes; print("\n".join(recipes.RECIPES))')
for p in "${peers[@]}"; do
    v="$ROOT/$p"
    [ -f "$v/.ok" ] && { echo "$p: ready"; continue; }
    echo "$p: installing (log: $v.log)"
    (
        set -e
        "$PY" -m venv "$v"
        echo "torch==2.13.0+cpu" > "$v/constraints.txt"
        "$v/bin/python" -m pip install -q --upgrade pip
        "$v/bin/python" -m pip install -q "torch==2.13.0"
        mapfile -t reqs < <("$PY" -c "import recipes; print('\n'.join(recipes.RECIPES['$p'] + recipes.COMMON))")
        "$v/bin/python" -m pip install -q -c "$v/constraints.txt" "${reqs[@]}"
        "$v/bin/python" -m pip freeze > "$v/freeze.txt"
        touch "$v/.ok"
    ) > "$v.log" 2>&1 && echo "$p: ok" || echo "$p: FAILED (see $v.log)"
done
