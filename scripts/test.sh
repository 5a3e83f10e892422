#!/usr/bin/env bash
# The whole test suite on a fresh clone: installs what the tests need, then runs pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest "$@"
