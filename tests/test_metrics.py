"""Prometheus metrics: a real HTTP scrape of the exporter, checked against the stores' own counters."""

from __future__ import annotations

import dataclasses
import gc
import os
import socket
import urllib.request
import weakref
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvstore import ConfigError, KVLayout, KVStore, StoreConfig, chunk_keys
from kvstore.engine import metrics
from kvstore.storage.stats import LATENCY_BUCKETS, TierStats

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, chunk_tokens=32)
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No KVSTORE_* variable from the outer shell may change these stores."""
    for name in list(os.environ):
        if name.upper().startswith("KVSTORE"):
            monkeypatch.delenv(name)


def make_chunk(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.chunk_shape, generator=generator).to(LAYOUT.dtype)


def keys_for(namespace: str, n: int) -> list[str]:
    return chunk_keys(list(range(n * LAYOUT.chunk_tokens)), LAYOUT, namespace)


def config(disk: Path | None, **overrides: object) -> StoreConfig:
    values: dict[str, object] = {
        "dram": {"capacity": 8 * LAYOUT.chunk_nbytes},
        "disk": {"path": disk} if disk is not None else {"enabled": False},
        "metrics": {"enabled": True, "port": 0},  # one free port for the whole process
        "tier_workers": 1,
    }
    values.update(overrides)
    return StoreConfig(**values)


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            assert key not in samples, f"duplicate series {key}: Prometheus would reject the scrape"
            samples[key] = sample.value
    return samples


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        assert response.status == 200
        return parse(response.read().decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"{name}{labels} missing from the scrape"
    return samples[key]


def namespaces(samples: Samples) -> set[str]:
    return {dict(labels)["namespace"] for _, labels in samples if "namespace" in dict(labels)}


def check_histogram(samples: Samples, name: str, count: int, **labels: str) -> None:
    """``count`` observations, in cumulative buckets ending with +Inf == _count."""
    buckets = [value(samples, f"{name}_bucket", **labels, le=str(bound)) for bound in LATENCY_BUCKETS]
    buckets.append(value(samples, f"{name}_bucket", **labels, le="+Inf"))
    assert buckets == sorted(buckets), f"{name} buckets are not cumulative: {buckets}"
    assert buckets[-1] == value(samples, f"{name}_count", **labels) == count
    assert (value(samples, f"{name}_sum", **labels) > 0) == (count > 0)


async def test_scrape_matches_store_counters(tmp_path: Path) -> None:
    namespace = "metrics-scrape"
    keys = keys_for(namespace, 3)
    cfg = config(tmp_path / "disk")
    async with KVStore(cfg, LAYOUT, namespace) as first:
        port = first.metrics_port
        assert port is not None and port > 0
        for i, key in enumerate(keys[:2]):
            assert await first.put(key, make_chunk(i))
            await first.flush()  # one write (one timed tier operation) per chunk
        assert await first.get(keys[0]) is not None  # a DRAM hit: no tier operation
        samples = scrape(port)
        disk = {"namespace": namespace, "tier": "disk"}
        assert value(samples, "kvstore_puts_total", namespace=namespace) == 2
        assert value(samples, "kvstore_tier_writes_total", **disk) == 2
        assert value(samples, "kvstore_tier_written_bytes_total", **disk) == first.stats()["disk"]["bytes_written"] > 0
        check_histogram(samples, "kvstore_tier_write_seconds", 2, **disk)
        check_histogram(samples, "kvstore_tier_read_seconds", 0, **disk)
        check_histogram(samples, "kvstore_get_seconds", 1, namespace=namespace)
    assert namespace not in namespaces(scrape(port)), "a closed store must leave the scrape"

    async with KVStore(cfg, LAYOUT, namespace) as second:  # a fresh DRAM pool over the same files
        assert second.metrics_port == port  # one exporter per process
        assert await second.lookup(keys) == 2  # one tier lookup: every key DRAM lacks at once
        hit = await second.get(keys[0])  # a disk hit: one tier read
        assert hit is not None and torch.equal(hit, make_chunk(0))
        assert await second.get(keys[2]) is None  # a miss everywhere: one tier read
        assert all(r is not None for r in await second.get_many(keys[:2]))  # DRAM + disk: one tier read
        await second.flush()
        stats = second.stats()
        samples = scrape(port)

    outcomes = stats["store"]["hits"], stats["store"]["misses"], stats["disk"]["hits"], stats["disk"]["misses"]
    assert outcomes == (3, 1, 2, 1)
    for key, (name, _) in metrics.STORE_COUNTERS.items():
        assert value(samples, f"{name}_total", namespace=namespace) == stats["store"][key], key
    assert set(stats["store"]) <= set(metrics.STORE_COUNTERS), "a store counter has no metric"
    assert {f.name for f in dataclasses.fields(TierStats)} == set(metrics.TIER_COUNTERS), "a tier counter is missing"
    for key, (name, _) in metrics.TIER_COUNTERS.items():
        assert value(samples, f"{name}_total", **disk) == stats["disk"][key], key
    assert value(samples, "kvstore_tier_hits_total", **disk) == 2
    for key, (name, _) in metrics.BREAKER_COUNTERS.items():
        assert value(samples, f"{name}_total", **disk) == stats["disk"]["breaker"][key] == 0, key
    assert value(samples, "kvstore_tier_breaker_state", **disk, state="closed") == 1
    assert value(samples, "kvstore_tier_breaker_state", **disk, state="open") == 0
    assert value(samples, "kvstore_tier_queue_depth", **disk) == stats["disk"]["queued"] == 0
    assert value(samples, "kvstore_dram_chunks", namespace=namespace) == stats["dram"]["chunks"] == 2
    assert value(samples, "kvstore_dram_used_bytes", namespace=namespace) == 2 * LAYOUT.chunk_nbytes
    assert value(samples, "kvstore_dram_capacity_bytes", namespace=namespace) == 8 * LAYOUT.chunk_nbytes
    assert value(samples, "kvstore_dram_evictions_total", namespace=namespace) == stats["dram"]["evictions"]
    for key, (name, _) in metrics.ADAPTIVE_COUNTERS.items():
        assert value(samples, f"{name}_total", namespace=namespace) == stats["adaptive"][key], key
    assert value(samples, "kvstore_write_policy_second_sighting", namespace=namespace) == 0
    check_histogram(samples, "kvstore_tier_read_seconds", 3, **disk)
    check_histogram(samples, "kvstore_tier_lookup_seconds", 1, **disk)
    check_histogram(samples, "kvstore_tier_write_seconds", 0, **disk)
    check_histogram(samples, "kvstore_get_seconds", 3, namespace=namespace)
    check_histogram(samples, "kvstore_lookup_seconds", 1, namespace=namespace)


async def test_namespaces_are_labelled_apart_and_one_namespace_is_summed(tmp_path: Path) -> None:
    stores = [
        KVStore(config(tmp_path / "x"), LAYOUT, "metrics-x"),
        KVStore(config(tmp_path / "y1"), LAYOUT, "metrics-y"),
        KVStore(config(tmp_path / "y2"), LAYOUT, "metrics-y"),  # e.g. an engine's scheduler and worker
    ]
    for store in stores:
        await store.open()
    try:
        for store, count in zip(stores, (1, 2, 3), strict=True):
            for i, key in enumerate(keys_for(store.namespace, count)):
                assert await store.put(key, make_chunk(i))
                await store.flush()
        samples = scrape(stores[0].metrics_port)
    finally:
        for store in stores:
            await store.close()
    assert value(samples, "kvstore_puts_total", namespace="metrics-x") == 1
    assert value(samples, "kvstore_puts_total", namespace="metrics-y") == 5
    assert value(samples, "kvstore_dram_chunks", namespace="metrics-y") == 5
    assert value(samples, "kvstore_tier_writes_total", namespace="metrics-y", tier="disk") == 5
    check_histogram(samples, "kvstore_tier_write_seconds", 1, namespace="metrics-x", tier="disk")
    check_histogram(samples, "kvstore_tier_write_seconds", 5, namespace="metrics-y", tier="disk")


async def test_collector_in_an_own_registry_without_the_exporter() -> None:
    registry = CollectorRegistry()
    registry.register(metrics.KVStoreCollector())
    store = KVStore(config(None, metrics={"enabled": False}), LAYOUT, "metrics-own")
    async with store:
        assert store.metrics_port is None  # metrics.enabled is off: no exporter started for it
        assert await store.put(keys_for("metrics-own", 1)[0], make_chunk(0))
        samples = parse(generate_latest(registry).decode())
    assert value(samples, "kvstore_puts_total", namespace="metrics-own") == 1
    assert "metrics-own" not in namespaces(parse(generate_latest(registry).decode()))


async def test_a_store_never_closed_is_not_kept_alive() -> None:
    store = await KVStore(config(None, metrics={"enabled": False}), LAYOUT, "metrics-leak").open()
    assert store in metrics.registered_stores()
    ref = weakref.ref(store)
    del store
    gc.collect()
    assert ref() is None
    assert all(s.namespace != "metrics-leak" for s in metrics.registered_stores())


def test_exporter_starts_once_per_address_and_port() -> None:
    port = metrics.start_exporter("127.0.0.1", 0)
    assert metrics.start_exporter("127.0.0.1", 0) == port
    assert ("kvstore_tier_read_seconds_count", ()) not in scrape(port)  # only labelled series, none unlabelled
    assert b"# TYPE kvstore_tier_read_seconds histogram" in generate_latest(metrics.REGISTRY)


async def test_a_taken_port_stops_open_with_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        store = KVStore(config(tmp_path / "disk", metrics={"enabled": True, "port": port}), LAYOUT, "metrics-taken")
        with pytest.raises(ConfigError) as excinfo:
            await store.open()
    message = str(excinfo.value)
    for fragment in ("metrics.port", str(port), "in use", "KVSTORE_METRICS__PORT"):
        assert fragment in message, message
    assert store not in metrics.registered_stores()


def test_an_address_not_of_this_machine_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="metrics.address '203.0.113.1'"):
        metrics.start_exporter("203.0.113.1", 0)  # TEST-NET-3: no interface of ours has it


def test_metrics_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    default = StoreConfig().metrics
    assert (default.enabled, default.address, default.port) == (False, "127.0.0.1", 9464)
    with pytest.raises(ConfigError, match=r"metrics\.port = -1"):
        StoreConfig(metrics={"port": -1})
    with pytest.raises(ConfigError, match=r"metrics\.port = 65536"):
        StoreConfig(metrics={"port": 65536})
    with pytest.raises(ConfigError, match=r"metrics\.prot: unknown key; did you mean 'metrics\.port'\?"):
        StoreConfig(metrics={"prot": 9464})
    toml = tmp_path / "kvstore.toml"
    toml.write_text('[metrics]\nenabled = true\naddress = "0.0.0.0"\n')
    monkeypatch.setenv("KVSTORE_METRICS__PORT", "9100")
    loaded = StoreConfig.load(toml).metrics
    assert (loaded.enabled, loaded.address, loaded.port) == (True, "0.0.0.0", 9100)
    monkeypatch.setenv("KVSTORE_METRICS__ENABELD", "true")
    with pytest.raises(ConfigError, match="KVSTORE_METRICS__ENABELD.*KVSTORE_METRICS__ENABLED"):
        StoreConfig()


def test_every_metric_is_documented_in_the_metrics_page() -> None:
    page = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    section = page[page.index("## Every metric") :]
    rows = [
        f"| `{family.name}{'_total' if family.type == 'counter' else ''}` | {family.type} |"
        for family in metrics.KVStoreCollector().describe()
    ]
    assert len(rows) == 46
    missing = [row for row in rows if row not in section]
    assert not missing, f"docs/metrics.md's table lacks {missing}"
