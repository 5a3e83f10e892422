#!/usr/bin/env bash
# Create .venv and install kvstore with its test dependencies (idempotent; sourced by the other scripts).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
# torch first, pinned to the CPU build this machine kind keeps on disk: an unpinned "torch"
# would pull a multi-GB CUDA build. Engines with their own torch install kvstore beside it.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    "$VENV/bin/pip" install --quiet "torch==${KVSTORE_TORCH_VERSION:-2.13.0}"
fi
stamp="$VENV/.kvstore-installed"
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
    "$VENV/bin/pip" install --quiet -e "$ROOT[test]"
    touch "$stamp"
fi
