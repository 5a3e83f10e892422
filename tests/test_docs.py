"""The documentation site builds strictly (a broken link or anchor fails it) and says what the code does.

- ``mkdocs build --strict`` succeeds (about 5 s: the API reference is read statically by griffe; the
  configuration page's hook imports ``kvstore.config``);
- the configuration page, generated from ``StoreConfig`` by ``docs/hooks/config_reference.py``,
  names every key and the environment variable that sets it, and StoreConfig accepts that variable;
- the README stays short, and neither it nor the docs refer to internal work items;
- the ``vllm serve --kv-transfer-config`` snippets are valid JSON whose kvstore options and
  configuration kvstore accepts.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from pydantic import BaseModel

from kvstore import StoreConfig
from kvstore.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
WORK_ITEM = re.compile(r"\b(?:issue|stop)s?\s+#?\d+|\bsession\b", re.IGNORECASE)
TRANSFER_CONFIG = re.compile(r"--kv-transfer-config '(\{.*?\})'", re.DOTALL)


def config_hook() -> ModuleType:
    path = DOCS / "hooks" / "config_reference.py"
    spec = importlib.util.spec_from_file_location("kvstore_docs_config_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up while it is being made
    spec.loader.exec_module(module)
    return module


def leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every leaf key of the configuration, dotted, walked here apart from the hook's own walk."""
    keys = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += leaf_keys(annotation, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        print(done.stdout[-4000:])
        print(done.stderr[-8000:])
    assert done.returncode == 0, f"mkdocs build --strict failed ({done.returncode}):\n{done.stderr[-8000:]}"
    return out


def test_the_site_builds_strictly(site: Path) -> None:
    for page in ("index.html", "configuration/index.html", "api/index.html", "vllm/index.html"):
        assert (site / page).is_file(), page
    api = (site / "api" / "index.html").read_text()
    assert "get_many" in api and "SyncKVStore" in api, "the API reference lacks the store's methods"


def test_the_site_wraps_long_code_lines_and_keeps_names_in_tables_whole(site: Path) -> None:
    """Code blocks wrap at the page's width (not cut, to be scrolled sideways), and a key or variable in a
    table cell never breaks mid-name (``dram.capaci ty``): docs/stylesheets/extra.css, on every page."""
    css = (site / "stylesheets" / "extra.css").read_text()
    assert re.search(r"pre > code\s*\{[^}]*white-space:\s*pre-wrap", css), css
    assert re.search(r"table:not\(\[class\]\) code\s*\{[^}]*white-space:\s*nowrap", css), css
    for page in ("index.html", "configuration/index.html", "vllm/index.html"):
        assert "stylesheets/extra.css" in (site / page).read_text(), f"{page} does not link the stylesheet"


def test_the_configuration_page_names_every_key_and_its_environment_variable(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    html = (site / "configuration" / "index.html").read_text()
    keys = leaf_keys(StoreConfig)
    assert "queue_depth" in keys and "planner.prefill_tokens_per_s" in keys and "s3.connect_timeout" in keys
    for key in keys:
        env = "KVSTORE_" + key.replace(".", "__").upper()
        assert f"<code>{key}</code>" in html, f"the configuration page lacks {key}"
        assert f"<code>{env}</code>" in html, f"the configuration page lacks {env}"
        monkeypatch.setenv(env, "1")  # StoreConfig reads it: a bad value may be refused, the name may not
        try:
            StoreConfig()
        except ConfigError as exc:
            assert "unknown environment variable" not in str(exc), f"{env} is not read by StoreConfig"
        monkeypatch.delenv(env)


def test_the_configuration_reference_gives_every_key_a_meaning_and_a_default() -> None:
    rows = [row for section in config_hook().reference_rows().values() for row in section]
    assert sorted(row.key for row in rows) == sorted(leaf_keys(StoreConfig))
    assert not [row.key for row in rows if not row.meaning.strip()], "keys without a meaning"
    assert not [row.key for row in rows if not row.default.strip()], "keys without a default"
    capacity = next(row for row in rows if row.key == "dram.capacity")
    assert (capacity.env, capacity.default) == ("KVSTORE_DRAM__CAPACITY", "`1GiB`")


def test_the_readme_is_short() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) < 160, f"README.md has {len(lines)} lines: move the detail into docs/"


def test_no_page_refers_to_internal_work_items() -> None:
    found = [
        f"{page.relative_to(ROOT)}:{number}: {line.strip()}"
        for page in PAGES
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if WORK_ITEM.search(line)
    ]
    assert not found, "references to internal work items:\n" + "\n".join(found)


def test_the_readmes_relative_links_resolve() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local)
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def vllm_options() -> set[str]:
    """The option names kvstore's vLLM integrations accept (read from the source: vLLM may not be installed)."""
    tree = ast.parse((ROOT / "kvstore" / "connectors" / "vllm" / "_common.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "OPTIONS" for t in node.targets):
            return {key.value for key in node.value.keys}  # type: ignore[attr-defined]
    raise AssertionError("OPTIONS not found in kvstore/connectors/vllm/_common.py")


def kvstore_sections(value: object) -> list[dict]:
    """Every dict under a ``kvstore_*`` option key, anywhere in a transfer config; checks the option names."""
    found = []
    if isinstance(value, dict):
        for key, item in value.items():
            if key.startswith("kvstore_"):
                assert key in vllm_options(), f"{key} is not an option of kvstore's vLLM integrations"
                if key == "kvstore_config":
                    found.append(item)
            found += kvstore_sections(item)
    elif isinstance(value, list):
        for item in value:
            found += kvstore_sections(item)
    return found


def test_the_vllm_snippets_are_valid_configurations() -> None:
    snippets = [(page, text) for page in PAGES for text in TRANSFER_CONFIG.findall(page.read_text())]
    assert len(snippets) >= 3
    for page, text in snippets:
        config = json.loads(text)
        sections = kvstore_sections(config)
        assert sections, f"a snippet in {page.name} configures no kvstore tier"
        for section in sections:
            StoreConfig(**section)  # raises ConfigError naming the key
            for tier in ("disk", "redis", "s3"):
                assert section.get(tier, {}).get("codec", "byteplanes") in ("byteplanes", "identity"), (
                    f"{page.name}: recommend a lossless codec of today (byteplanes or identity)"
                )
