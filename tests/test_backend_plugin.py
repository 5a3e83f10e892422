"""A backend from another package, installed as a real distribution: one module and one entry point.

The distributions are written here (a module and a ``*.dist-info`` with ``entry_points.txt``) into a
directory put on ``sys.path`` (and ``PYTHONPATH`` for the CLI), which is how pip leaves them, so
``importlib.metadata`` finds them as it would any installed package. The backend keeps one file per
object; its section is ``[flatfiles]``. A second distribution declares a backend whose module does
not exist: it must break only the configurations that name it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore import KVLayout, KVStore, StoreConfig, chunk_keys
from kvstore.backends.registry import lookup_backend, rescan_backends, unreachable_error_names
from kvstore.errors import ConfigError
from kvstore.keys import namespace_dir
from kvstore.testing.servers import RedisServer

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, chunk_tokens=16)
NAMESPACE = "plugin-test"
PLUGIN_MODULE = "kvstore_flatfiles_plugin"

PLUGIN_SOURCE = '''
"""A kvstore backend from another package: one file per object, under <root>/<namespace dir>/<key>."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field

from kvstore.backends.base import Backend
from kvstore.backends.maintenance import RemoveReport, StoredObject
from kvstore.backends.registry import BackendSpec
from kvstore.config import BackendSection
from kvstore.util.buffers import as_bytes_view


class FlatFilesConfig(BackendSection):
    section = "flatfiles"
    root: Path = Field(Path("flatfiles"), description="directory of the object files")


class FlatFilesBackend(Backend):
    name = "flatfiles"

    def __init__(self, root, namespace):
        self.root, self.namespace = Path(root), namespace

    def _path(self, key):
        return self.root / self.namespace / key

    async def fetch(self, key, byte_range):
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        return data if byte_range is None else data[byte_range[0] : byte_range[1]]

    async def set(self, key, parts):
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(path.name + ".partial")
        staged.write_bytes(b"".join(bytes(as_bytes_view(part)) for part in parts))
        os.replace(staged, path)

    async def exists(self, key):
        return self._path(key).is_file()

    async def delete(self, key):
        self._path(key).unlink(missing_ok=True)

    async def scan(self, namespaces=None):
        page = []
        for directory in sorted(self.root.iterdir()) if self.root.is_dir() else []:
            if namespaces is None or namespaces(directory.name):
                for file in sorted(directory.glob("[0-9a-f]*")):
                    if not file.name.endswith(".partial"):
                        stat = file.stat()
                        version = (stat.st_mtime_ns, stat.st_size)
                        page.append(StoredObject(directory.name, file.name, stat.st_size, stat.st_mtime, version))
        yield page

    async def read_object(self, item):
        try:
            return (self.root / item.namespace / item.key).read_bytes()
        except FileNotFoundError:
            return None

    async def remove_unchanged_batches(self, items):
        report = RemoveReport()
        for item in items:
            path = self.root / item.namespace / item.key
            try:
                stat = path.stat()
            except FileNotFoundError:
                report.gone += 1
                continue
            if (stat.st_mtime_ns, stat.st_size) != item.version:
                report.changed += 1
                continue
            path.unlink()
            report.removed += 1
            report.removed_bytes += item.size
        yield report


def make(section, timeouts, namespace, executor):
    return FlatFilesBackend(section.root, namespace)


SPEC = BackendSpec(
    name="flatfiles",
    rank=150,  # between the disk (100) and Redis (200)
    section=FlatFilesConfig,
    make=make,
    unreachable_errors=frozenset({"FlatFilesOffline"}),
    endpoint=lambda backend: f"flat files in {backend.root}",
)
'''


def install(site: Path, dist: str, module: str | None, entry_points: str) -> None:
    """Leave in ``site`` what pip would: the module, and ``<dist>-1.0.dist-info`` declaring its entry points."""
    if module is not None:
        (site / f"{PLUGIN_MODULE}.py").write_text(textwrap.dedent(module))
    info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[kvstore.backends]\n{entry_points}\n")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A directory holding the two distributions, on sys.path for this module's tests."""
    site = tmp_path_factory.mktemp("site-packages")
    install(site, "kvstore-flatfiles", PLUGIN_SOURCE, f"flatfiles = {PLUGIN_MODULE}:SPEC")
    install(site, "kvstore-broken", None, "brokenfiles = kvstore_no_such_module:SPEC")
    sys.path.insert(0, str(site))
    rescan_backends()
    try:
        yield site
    finally:
        sys.path.remove(str(site))
        sys.modules.pop(PLUGIN_MODULE, None)
        rescan_backends()


def write_config(tmp_path: Path, disk: bool = True) -> Path:
    path = tmp_path / "kvstore.toml"
    path.write_text(
        f"[dram]\ncapacity = {8 * LAYOUT.chunk_nbytes}\n"
        f'[disk]\nenabled = {str(disk).lower()}\npath = "{tmp_path / "disk"}"\n'
        f'[flatfiles]\nenabled = true\nroot = "{tmp_path / "objects"}"\ncodec = "identity"\n'
    )
    (tmp_path / "disk").mkdir(exist_ok=True)
    return path


def make_chunk(seed: int) -> torch.Tensor:
    return torch.randn(LAYOUT.chunk_shape, generator=torch.Generator().manual_seed(seed)).to(LAYOUT.dtype)


async def put_chunks(config: StoreConfig, count: int) -> tuple[list[str], list[torch.Tensor]]:
    """Store ``count`` chunks through a store of ``config``; wait until every tier has them."""
    keys = chunk_keys(list(range(count * LAYOUT.chunk_tokens)), LAYOUT, namespace=NAMESPACE)
    chunks = [make_chunk(seed) for seed in range(count)]
    async with KVStore(config, LAYOUT, namespace=NAMESPACE) as store:
        for key, chunk in zip(keys, chunks, strict=True):
            await store.put(key, chunk)
        await store.flush()
    return keys, chunks


async def test_a_toml_section_of_an_installed_backend_gives_the_store_its_tier(site: Path, tmp_path: Path) -> None:
    path = write_config(tmp_path)
    config = StoreConfig.load(path)
    dumped = config.model_dump()  # what the vLLM connector compares and copies a configuration by
    assert dumped["flatfiles"]["root"] == tmp_path / "objects"
    assert StoreConfig.isolated(**dumped).backend_section("flatfiles") == config.backend_section("flatfiles")
    async with KVStore(config, LAYOUT, namespace=NAMESPACE) as store:
        assert [tier.name for tier in store.tiers] == ["disk", "flatfiles"]  # by rank: 100, then 150
    keys, chunks = await put_chunks(config, 2)
    assert len(list((tmp_path / "objects" / namespace_dir(NAMESPACE)).iterdir())) == 2
    only_plugin = StoreConfig.load(path, disk={"enabled": False})  # a fresh DRAM, no disk: flatfiles answers
    async with KVStore(only_plugin, LAYOUT, namespace=NAMESPACE) as store:
        assert [tier.name for tier in store.tiers] == ["flatfiles"]
        for key, chunk in zip(keys, chunks, strict=True):
            got = await store.get(key)
            assert got is not None and got.view(torch.uint8).equal(chunk.view(torch.uint8))
        assert store.stats()["flatfiles"]["hits"] == 2


async def test_environment_variables_configure_an_installed_backend(
    site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSTORE_DISK__ENABLED", "false")
    monkeypatch.setenv("KVSTORE_DRAM__CAPACITY", str(8 * LAYOUT.chunk_nbytes))
    monkeypatch.setenv("KVSTORE_FLATFILES__ENABLED", "true")
    monkeypatch.setenv("kvstore_flatfiles__root", str(tmp_path / "env-objects"))  # any case, as pydantic-settings
    config = StoreConfig()
    section = config.backend_section("flatfiles")
    assert section is not None and section.root == tmp_path / "env-objects"  # type: ignore[attr-defined]
    assert "FlatFilesOffline" in unreachable_error_names()  # the breaker knows the plugin's client errors
    keys, chunks = await put_chunks(config, 1)
    assert (tmp_path / "env-objects" / namespace_dir(NAMESPACE) / keys[0]).is_file()
    monkeypatch.setenv("KVSTORE_FLATFILES__ROOTS", "x")  # a typo in a plugin's key is caught like any other
    with pytest.raises(ConfigError, match="did you mean KVSTORE_FLATFILES__ROOT"):
        StoreConfig()


def kvstore_command(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The ``kvstore`` command in a fresh interpreter that finds the distributions on PYTHONPATH."""
    environment = {name: value for name, value in os.environ.items() if not name.upper().startswith("KVSTORE_")}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), environment.get("PYTHONPATH")]))
    command = [sys.executable, "-c", "import sys; from kvstore.cli import app; sys.exit(app())", *args]
    return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=300)


async def test_kvstore_ls_and_gc_list_and_remove_an_installed_backends_objects(site: Path, tmp_path: Path) -> None:
    path = write_config(tmp_path, disk=False)
    keys, _ = await put_chunks(StoreConfig.load(path), 3)
    listed = kvstore_command(site, "ls", "--chunks", "--json", "--config", str(path))
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert sorted((row["tier"], row["namespace"], row["key"]) for row in rows) == sorted(
        ("flatfiles", namespace_dir(NAMESPACE), key) for key in keys
    )
    assert {row["codec"] for row in rows} == {"identity"}  # headers read through the plugin's read_head
    assert f"flatfiles: flat files in {tmp_path / 'objects'}" in " ".join(listed.stderr.split())
    collected = kvstore_command(site, "gc", "--max-age", "0s", "--yes", "--config", str(path))
    assert collected.returncode == 0, collected.stdout + collected.stderr
    assert "deleted 3 chunks" in collected.stdout
    assert list((tmp_path / "objects" / namespace_dir(NAMESPACE)).iterdir()) == []


def test_a_broken_plugin_fails_only_the_configurations_that_name_it(
    site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    StoreConfig(disk={"enabled": False})  # installed but not named: nothing is imported, nothing fails
    StoreConfig.load(write_config(tmp_path))  # nor does another plugin's section
    entry = "'brokenfiles = kvstore_no_such_module:SPEC' (from kvstore-broken 1.0)"
    with pytest.raises(ConfigError) as raised:
        StoreConfig(brokenfiles={"enabled": True})
    assert entry in str(raised.value) and "ModuleNotFoundError" in str(raised.value)
    monkeypatch.setenv("KVSTORE_BROKENFILES__ENABLED", "true")
    with pytest.raises(ConfigError) as raised:
        StoreConfig()
    assert "KVSTORE_BROKENFILES__ENABLED" in str(raised.value) and entry in str(raised.value)


def test_an_unknown_section_is_still_refused_by_name(site: Path) -> None:
    with pytest.raises(ConfigError, match="flatfilez: unknown key"):
        StoreConfig(flatfilez={"enabled": True})
    with pytest.raises(ConfigError, match=r"flatfiles\.rooot: unknown key; did you mean 'flatfiles\.root'"):
        StoreConfig(flatfiles={"rooot": "/tmp"})


def test_the_built_in_backends_are_specs_whose_import_loads_no_client_library() -> None:
    """disk, Redis, S3 by rank, with today's breaker error names; the registry imports neither redis nor boto."""
    code = (
        "import sys\n"
        "from kvstore.backends.registry import backend_sections, unreachable_error_names, timeout_error_names\n"
        "from kvstore.config import StoreConfig\n"
        "print([spec.name for spec, _ in backend_sections(StoreConfig.isolated())])\n"
        "print(sorted(unreachable_error_names()), sorted(timeout_error_names()))\n"
        "print(sorted({'redis', 'aiobotocore', 'botocore'} & set(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    names, errors, loaded = done.stdout.splitlines()
    assert names == "['disk', 'redis', 's3']"
    unreachable = ["ConnectTimeoutError", "ConnectionClosedError", "ConnectionError", "EndpointConnectionError"]
    unreachable += ["ReadTimeoutError", "TimeoutError"]
    assert errors == f"{unreachable} ['ConnectTimeoutError', 'ReadTimeoutError', 'TimeoutError']"
    assert loaded == "[]"
    redis = lookup_backend("redis")
    assert redis is not None and redis.dev_server_factory() is RedisServer
