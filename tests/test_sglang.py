"""kvstore as an SGLang HiCache storage backend (kvstore.connectors.sglang), against the real sglang package.

The contract (tests/sglang_support/contract_hicache.py) runs under SGLang's environment, in one
interpreter: backends built by SGLang's StorageBackendFactory from a user's extra config, SGLang's
own device and host pools on the CPU (MHA in the layer_first, page_first and page_first_direct
layouts, and MLA). It asserts byte-exact page round trips through kvstore's DRAM and disk tiers,
the leading-run answer of batch_exists, the model and tensor-parallel namespaces, MLA's rank-0
writes, a corrupt chunk read as a miss, a frozen tier answered within its timeout, SGLang's
storage metrics, and the errors a wrong option or layout gets. No GPU run is made here.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from sglang_env import run_sglang_support_tests

CONTRACT_TESTS = 14


def test_hicache_backend_keeps_sglangs_storage_contract(sglang_python: Path) -> None:
    output = run_sglang_support_tests(sglang_python, "contract_hicache.py")
    assert re.search(rf"\b{CONTRACT_TESTS} passed\b", output), output[-2000:]


def test_without_sglang_the_backend_says_what_to_install() -> None:
    """kvstore's own environment has no sglang: importing the backend names the package and version to install."""
    probe = (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('sglang') is None, 'this test needs an environment without sglang'\n"
        "import kvstore\n"
        "try:\n"
        "    import kvstore.connectors.sglang\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert "needs SGLang's HiCache (0.5.23 is the version tested): pip install sglang" in result.stdout
