#!/usr/bin/env bash
# Create .venv-sglang: the real sglang package with kvstore installed into it, for tests/test_sglang.py
# (kvstore's HiCache storage backend, driven through sglang's own HiCacheStorage interface and host pools
# on the CPU). sglang pins its own torch and transformers, so it gets its own environment (sourced by test.sh).
#   KVSTORE_SGLANG_VERSION   the sglang release (default 0.5.23)
#
# Only what `sglang.srt.mem_cache.{hicache_storage,memory_pool,pool_host,storage.backend_factory}` import
# is installed: sglang itself with --no-deps (its full dependency set is GPU serving: flashinfer, CUDA
# kernels, ...), then each module those imports really need, pinned, at sglang's own pin where it has one.
#
# torch: sglang's configs package imports torchvision at import time (InternVL image transforms), and
# PyPI's torchvision does not load beside the CPU build of torch 2.13.0 ('operator torchvision::nms does
# not exist'). So this environment takes torch 2.14.1 (sglang 0.5.23's own pin) with torchvision 0.29.1,
# both from this machine kind's local wheel store: a CUDA build that runs on the CPU (~6 GB installed).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SGLANG_VENV="$ROOT/.venv-sglang"
SGLANG_VERSION="${KVSTORE_SGLANG_VERSION:-0.5.23}"
sglang_say() { echo "sglang_env: $*" >&2; }
if [ ! -x "$SGLANG_VENV/bin/python" ]; then
    sglang_say "creating $SGLANG_VENV"
    "${PYTHON:-python3}" -m venv "$SGLANG_VENV"
fi
sglang_stamp="$SGLANG_VENV/.kvstore-installed"
if [ ! -f "$sglang_stamp" ] || [ "$ROOT/pyproject.toml" -nt "$sglang_stamp" ] \
    || [ "$(cat "$sglang_stamp")" != "$SGLANG_VERSION" ]; then
    sglang_say "installing sglang $SGLANG_VERSION (--no-deps) with torch 2.14.1 into $SGLANG_VENV for the" \
        "SGLang tests (~6 GB installed: a few minutes, once)"
    "$SGLANG_VENV/bin/pip" install --quiet --no-deps "sglang==$SGLANG_VERSION"
    # What the mem_cache modules import, found by importing them; == sglang's pin where it has one.
    "$SGLANG_VENV/bin/pip" install --quiet "torch==2.14.1" "torchvision==0.29.1" \
        "transformers==5.19.0" "tokenizers==0.23.2" "compressed-tensors==0.18.0" \
        "sentencepiece==0.2.1" "apache-tvm-ffi==0.1.11" \
        "orjson==3.13.0" "pybase64==1.5.1" "starlette==1.10.0" "msgspec==0.22.0" "pyzmq==27.3.0" \
        "ipython==9.18.1" "traitlets==5.16.1" "dill==0.4.1" "loguru==0.7.3" "requests==2.34.2" \
        "pillow==11.3.0" "aiohttp==3.14.5" "gguf==0.19.0" "psutil==7.2.2"
    # pytest: tests/sglang_support/contract_hicache.py runs here (it needs sglang's pools)
    sglang_say "installing kvstore (editable) and pytest into $SGLANG_VENV"
    "$SGLANG_VENV/bin/pip" install --quiet -e "$ROOT" "pytest>=8.2" "torch==2.14.1"
    echo "$SGLANG_VERSION" > "$sglang_stamp"
    sglang_say "installed (recorded in $sglang_stamp)"
fi
