#!/usr/bin/env bash
# Create .venv-lmcache: LMCache (a competitor's KV-cache store) in an environment of its own, on a CPU-only
# machine, for benchmarks/lmcache_driver.py (which imports only LMCache, torch and the standard library;
# kvstore is not installed here). Idempotent: a stamp in the venv records what was installed.
#   (the environment is .venv-lmcache at the repo root, where benchmarks/peers.py looks for it)
#   PYTHON                 the interpreter for it (default python3.11; lmcache 0.5.6 has cp310-cp313 wheels)
#
# Pinned: lmcache==0.5.6 and torch==2.13.0+cpu.
# torch: lmcache 0.5.6 declares a bare `torch`, but its wheel carries C++ extensions (lmcache_native,
# lmcache_fs, lmcache_redis, cuda_ops) linked against libtorch, and its release wheels are built against
# torch==2.13.0 (the build pin of its pyproject.toml): so exactly 2.13.0. The CPU build 2.13.0+cpu loads them
# (lmcache_native, which the storage layer imports, loads). PyPI has no "+cpu" builds: pip finds it among the
# local wheels this machine's pip is configured with, else at https://download.pytorch.org/whl/cpu.
#
# CPU-only: lmcache 0.5.6 still requires cupy-cuda13x, cuda-python, cufile-python and nvtx (hard requirements
# in its metadata); they install without a GPU and are not imported by the storage layer. What does not work
# on CPU is lmcache/cuda_ops*.so ("ImportError: libc10_cuda.so: cannot open shared object file"), which only
# the GPU connectors import. LMCache picks the CPU by itself (at import it logs
# "torch_dev=StubCPUDevice(device_type=cpu)"): no environment variable is needed. The storage layer
# (StorageManager with LocalCPUBackend, LocalDiskBackend, RemoteBackend over redis:// or s3://) then runs on
# CPU with LMCacheMetadata(role="worker"), its LocalCPUBackend allocating plain (unpinned) host memory.
# Its Redis connector imports redis (redis.asyncio) and its S3 connector awscrt, both lmcache's own
# requirements; LMCache's S3 connector does not use boto3 (only whoever creates the bucket does).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LMC_VENV="$ROOT/.venv-lmcache"
LMC_VERSION="0.5.6"
LMC_TORCH="2.13.0+cpu"
lmc_say() { echo "lmcache_env: $*" >&2; }

if [ -z "${PYTHON:-}" ]; then
    if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11
    elif [ -x /root/.pyenv/versions/3.11.7/bin/python3 ]; then PYTHON=/root/.pyenv/versions/3.11.7/bin/python3
    else PYTHON=python3
    fi
fi
if [ ! -x "$LMC_VENV/bin/python" ]; then
    lmc_say "creating $LMC_VENV with $PYTHON"
    "$PYTHON" -m venv "$LMC_VENV"
fi
# Out of git even where the repository's .gitignore is not read.
[ -f "$LMC_VENV/.gitignore" ] || echo "*" > "$LMC_VENV/.gitignore"
PY="$LMC_VENV/bin/python"
stamp="$LMC_VENV/.lmcache-installed"
want="lmcache==$LMC_VERSION torch==$LMC_TORCH"
if [ ! -f "$stamp" ] || [ "$(head -n1 "$stamp")" != "$want" ]; then
    lmc_say "installing $want into $LMC_VENV (~1.9 GB with cupy, cuda-python, transformers: a few minutes, once)"
    # torch first, so that lmcache's bare `torch` requirement is already met by the CPU build.
    if ! "$PY" -m pip install --quiet "torch==$LMC_TORCH" 2>/dev/null; then
        lmc_say "torch==$LMC_TORCH is not among the wheels pip is configured with: taking it from download.pytorch.org/whl/cpu"
        "$PY" -m pip install --quiet --extra-index-url https://download.pytorch.org/whl/cpu "torch==$LMC_TORCH"
    fi
    constraints="$(mktemp)"
    trap 'rm -f "$constraints"' EXIT
    echo "torch==$LMC_TORCH" > "$constraints"
    "$PY" -m pip install --quiet -c "$constraints" "lmcache==$LMC_VERSION"
    # The import check: the storage layer the driver uses (lmcache_native loads against this torch).
    LMCACHE_LOG_LEVEL=WARNING "$PY" -c "import torch, lmcache.lmcache_native, lmcache.v1.storage_backend.storage_manager, lmcache.v1.config"
    {
        echo "$want"
        "$PY" - <<'EOF'
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in ("lmcache", "torch", "redis", "awscrt", "numpy")))
EOF
    } > "$stamp"
    lmc_say "installed (recorded in $stamp)"
else
    lmc_say "$LMC_VENV already has $want (stamp $stamp)"
fi
echo "lmcache_env: $LMC_VENV: $(sed -n 2p "$stamp")"
