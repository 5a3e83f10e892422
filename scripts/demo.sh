#!/usr/bin/env bash
# The main job on a fresh clone: the full DRAM -> disk cascade, a restart, and the hits that came back.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
exec "$VENV/bin/kvstore" demo "$@"
