"""Every ``KVSTORE_*`` variable that kvstore's code, tests or examples read is one StoreConfig accepts.

tests/test_vllm.py once read ``KVSTORE_VLLM_PYTHON``, but StoreConfig refuses unknown
``KVSTORE_*`` variables (a typo there must not pass silently), so setting it broke every store
the tests opened. Helper variables live outside the prefix (``TEST_VLLM_PYTHON``).
"""

from __future__ import annotations

import re
from pathlib import Path

from kvstore import StoreConfig
from kvstore.config import CONFIG_FILE_ENV
from kvstore.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
READ = re.compile(r"""(?:environ\.get\(|environ\[|getenv\()\s*["'](KVSTORE_\w+)""")


def test_no_kvstore_variable_read_anywhere_is_one_storeconfig_refuses(monkeypatch):
    names = {
        name
        for folder in ("kvstore", "tests", "examples")
        for path in (ROOT / folder).rglob("*.py")
        for name in READ.findall(path.read_text(errors="replace"))
    } - {CONFIG_FILE_ENV}
    refused = []
    for name in sorted(names):
        monkeypatch.setenv(name, "1")
        try:
            StoreConfig()
        except ConfigError as exc:
            if "unknown environment variable" in str(exc):
                refused.append(name)
        monkeypatch.delenv(name)
    assert refused == [], f"rename these outside the KVSTORE_ prefix: {refused}"


def test_the_set_up_scripts_variables_do_not_stop_a_store(monkeypatch):
    """``KVSTORE_TORCH_VERSION=2.13.0 ./scripts/test.sh`` once made every store in the suite refuse to open."""
    names = {
        name
        for path in [*(ROOT / "scripts").glob("*.sh"), *(ROOT / "localstack").glob("*.sh")]
        for name in re.findall(r"\$\{?(KVSTORE_\w+)", path.read_text())
    }
    assert "KVSTORE_TORCH_VERSION" in names
    for name in sorted(names):
        monkeypatch.setenv(name, "1")
    StoreConfig()
