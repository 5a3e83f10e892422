#!/usr/bin/env bash
# The main job on a fresh clone: the full DRAM -> disk cascade, a restart, and the hits that came back.
# The first run makes .venv with torch (CPU build) and kvstore alone, no test extra: ~1-2 min, once.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KVSTORE_EXTRAS=""  # `kvstore demo` needs kvstore's own dependencies only (scripts/test.sh adds the test extra)
source "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
exec "$VENV/bin/kvstore" demo "$@"
