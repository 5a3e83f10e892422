"""The harness of the SGLang tests: SGLang's own environment, and pytest run inside it.

SGLang lives in its own virtual environment (``.venv-sglang``, made by scripts/sglang_env.sh: it
pins its own torch and transformers), so the tests that import SGLang's types
(tests/sglang_support/) run under that environment's Python, all in one interpreter: importing
SGLang's memory pools costs ~13 s. ``TEST_SGLANG_PYTHON`` points at another Python with sglang and
kvstore installed. The ``sglang_python`` fixture is registered for every test module by
tests/conftest.py.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SGLANG_SUPPORT = Path(__file__).resolve().parent / "sglang_support"
# Not KVSTORE_*: StoreConfig refuses unknown KVSTORE_* variables.
SGLANG_PYTHON = Path(os.environ.get("TEST_SGLANG_PYTHON", ROOT / ".venv-sglang" / "bin" / "python"))
SGLANG_TIMEOUT = 600


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    if not SGLANG_PYTHON.exists():
        pytest.fail(
            f"{SGLANG_PYTHON} is missing: the SGLang tests need SGLang's own environment; run scripts/test.sh, "
            "which creates it with scripts/sglang_env.sh (or point TEST_SGLANG_PYTHON at a Python with sglang "
            "and kvstore installed)",
            pytrace=False,
        )
    return SGLANG_PYTHON


def run_sglang_support_tests(python: Path, *names: str) -> str:
    """pytest on ``tests/sglang_support/<name>`` files under SGLang's environment, in one interpreter; its
    output, after asserting it passed."""
    command = [
        str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", "-c", os.devnull,
        "--rootdir", str(SGLANG_SUPPORT), "-W", "ignore::UserWarning:sglang",
        *(str(SGLANG_SUPPORT / name) for name in names),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=SGLANG_TIMEOUT, cwd=ROOT)
    print(result.stdout[-2000:])
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    return result.stdout
