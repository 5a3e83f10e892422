"""The online miss-ratio curve (kvstore.sizing.mrc) against exact LRU simulations of the same synthetic traffic."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import numpy as np
import pytest

from kvstore.sizing import workloads
from kvstore.sizing.mrc import ReuseProfile, ReuseSampler
from kvstore.sizing.traces import flatten

WORKLOADS: dict[str, Callable[[], list[np.ndarray]]] = {
    "zipf prefixes": lambda: workloads.zipf_prefixes(20_000, seed=1),
    "multi-turn": lambda: workloads.multi_turn(4545, seed=2),
    "rag": lambda: workloads.rag(13_333, seed=3),
    "all unique": lambda: workloads.all_unique(25_000, seed=4),
    "phase change": lambda: workloads.phase_change(
        workloads.zipf_prefixes(10_000, seed=5), workloads.all_unique(12_500, seed=6)
    ),
}


def profile_of(ids: np.ndarray, batch: int = 4096, **options) -> ReuseProfile:
    sampler = ReuseSampler(**options)
    for start in range(0, len(ids), batch):
        sampler.record(ids[start : start + batch])
    return sampler.profile()


@pytest.fixture(scope="module", params=list(WORKLOADS))
def workload(request: pytest.FixtureRequest) -> tuple[str, np.ndarray, list[int], list[float]]:
    """A workload's ids, five sizes from 1/512 to 1/4 of its distinct chunks, and the exact LRU hit rates there."""
    ids = flatten(WORKLOADS[request.param]())
    distinct = workloads.distinct(ids)
    sizes = [int(size) for size in np.geomspace(max(16, distinct / 512), distinct / 4, 5)]
    return request.param, ids, sizes, workloads.exact_lru_hit_rates(ids, sizes)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampled_curve_is_within_5_points_of_exact_lru(workload, seed: int) -> None:
    name, ids, sizes, exact = workload
    salted = ids ^ np.uint64(seed * 0x9E3779B97F4A7C15 % (1 << 64))  # other hashes, other sampled references
    start = time.perf_counter()
    profile = profile_of(salted, seed=seed)  # the store's defaults: 1 reference in 64 timed
    took = time.perf_counter() - start
    estimated = profile.hit_rates(sizes)
    errors = [abs(a - b) for a, b in zip(estimated, exact, strict=True)]
    print(f"{name}: {took / len(ids) * 1e9:.0f} ns/reference, worst error {max(errors):.1%}")
    assert max(errors) < 0.05, (name, sizes, estimated, exact)
    assert profile.cold_fraction == pytest.approx(workloads.cold_fraction(ids), abs=0.01)


def test_every_reuse_timed_is_within_a_point_or_two(workload) -> None:
    """Rate 1 leaves only the model's own error (AET assumes steady traffic: a phase change costs it most)."""
    name, ids, sizes, exact = workload
    estimated = profile_of(ids, rate=1.0, max_watches=len(ids), seed=0).hit_rates(sizes)
    bound = 0.03 if name == "phase change" else 0.02
    assert max(abs(a - b) for a, b in zip(estimated, exact, strict=True)) < bound, (estimated, exact)


def test_curve_rises_with_size_and_stays_a_rate() -> None:
    profile = profile_of(flatten(workloads.zipf_prefixes(5000, seed=7)), seed=0)
    rates = profile.hit_rates(np.geomspace(1, 1e9, 60))
    assert all(0.0 <= rate <= 1.0 for rate in rates)
    assert all(b >= a - 1e-12 for a, b in zip(rates, rates[1:], strict=False))
    assert profile.hit_rate(0) == 0.0
    assert rates[-1] == pytest.approx(1 - profile.cold_fraction, abs=0.03)  # everything that ever came back


def test_open_watches_are_bounded_and_count_as_survivors() -> None:
    sampler = ReuseSampler(rate=1 / 8, max_watches=1000, seed=0)
    ids = flatten(workloads.all_unique(125_000, seed=8))  # a million references, none repeated
    for start in range(0, len(ids), 4096):
        sampler.record(ids[start : start + 4096])
        assert len(sampler._watches) <= 1000
    profile = sampler.profile()
    assert profile.tracked <= 1000
    assert profile.hit_rate(1e12) == 0.0
    assert profile.censored.sum() > 100_000  # every watch given up, counted as having lasted at least its age


def test_half_life_lets_a_phase_change_show() -> None:
    zipf = flatten(workloads.zipf_prefixes(5000, seed=9))
    sampler = ReuseSampler(half_life=20_000, seed=0)
    sampler.record(zipf)
    before = sampler.profile().hit_rate(4000)
    unique = flatten(workloads.all_unique(25_000, seed=10))
    for start in range(0, len(unique), 4096):
        sampler.record(unique[start : start + 4096])
    after = sampler.profile()
    assert before > 0.3
    assert after.hit_rate(4000) < 0.05
    assert after.cold_fraction > 0.9


def test_second_sightings_are_told_apart() -> None:
    rng = np.random.default_rng(11)
    twice = rng.integers(0, 2**63, 20_000).astype(np.uint64)
    once_more = np.concatenate([twice[:10_000], twice[:10_000], twice[10_000:], twice[10_000:]])
    profile = profile_of(once_more, rate=1.0, max_watches=len(once_more), seed=0)
    for size in (5_000, 10_001, 1e6):
        assert profile.second_sighting_hit_rate(size) == pytest.approx(profile.hit_rate(size), rel=0.01)
    assert profile.hit_rate(1e6) == pytest.approx(0.5, abs=0.01)
    hot = np.tile(rng.integers(0, 2**63, 100).astype(np.uint64), 50)  # each chunk seen 50 times
    many = profile_of(hot, rate=1.0, max_watches=len(hot), seed=0)
    assert many.hit_rate(1000) > 0.95
    assert many.second_sighting_hit_rate(1000) < 0.03  # one reuse in 49 is a second sighting


def test_sightings_count_repeats_within_a_batch() -> None:
    sampler = ReuseSampler(seed=0)
    a, b, c = (np.uint64(x) for x in (12345, 2**40 + 7, 2**62 + 99))
    sampler.record(np.array([a, b, a, a], dtype=np.uint64))
    sampler.record(np.array([b, c], dtype=np.uint64))
    assert [sampler.sightings(int(x)) for x in (a, b, c)] == [3, 2, 1]
    assert sampler.sightings(424242) == 0
    assert sampler.first_sightings == 3


def test_profile_travels_as_json() -> None:
    profile = profile_of(flatten(workloads.rag(2000, seed=12)), seed=0)
    again = ReuseProfile.from_dict(json.loads(json.dumps(profile.as_dict())))
    sizes = [10, 100, 1000, 10_000]
    assert again.hit_rates(sizes) == profile.hit_rates(sizes)
    assert again.second_sighting_hit_rate(1000) == profile.second_sighting_hit_rate(1000)
    assert again.cold_fraction == profile.cold_fraction
    with pytest.raises(ValueError, match="buckets per octave"):
        ReuseProfile.from_dict({**profile.as_dict(), "buckets_per_octave": 8})


def test_rejects_nonsense_settings() -> None:
    with pytest.raises(ValueError, match="rate"):
        ReuseSampler(rate=0)
    with pytest.raises(ValueError, match="max_watches"):
        ReuseSampler(max_watches=1)
