"""kvstore/connectors/load_log.py: the engine's log says each load, at most one line every 10 s, nothing dropped."""

from __future__ import annotations

import logging

import pytest

from kvstore.connectors.load_log import LoadLog

LOGGER = "kvstore.test-load-log"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Said:
    """What the log said so far."""

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        self._caplog = caplog

    def __call__(self) -> list[str]:
        return self._caplog.messages


@pytest.fixture
def said(caplog: pytest.LogCaptureFixture) -> Said:
    caplog.set_level(logging.INFO, logger=LOGGER)
    return Said(caplog)


def test_a_quiet_engine_says_each_load_as_it_starts(said: Said) -> None:
    clock = Clock()
    log = LoadLog(logging.getLogger(LOGGER), clock=clock)
    log.load("r1", 4096, ["redis"] * 12 + ["dram"] * 4, "in the background")
    clock.now += 30
    log.load("r2", 256, ["disk"], "in the forward pass")
    assert said() == [
        "kvstore: request r1 loads 4,096 tokens (12 chunks from redis, 4 chunks from dram) in the background",
        "kvstore: request r2 loads 256 tokens (1 chunk from disk) in the forward pass",
    ]


def test_a_busy_engine_gets_one_line_per_interval_with_every_load_summed(said: Said) -> None:
    clock = Clock()
    log = LoadLog(logging.getLogger(LOGGER), clock=clock)
    log.load("r1", 512, ["dram", "dram"], "in the forward pass")
    for index in range(5):  # within 10 s of the first line: summed, not said
        clock.now += 1
        log.load(f"r{index + 2}", 256, ["redis"], "in the background")
        log.tick()
    assert len(said()) == 1
    clock.now += 5  # 10 s after the first line
    log.load("r7", 256, ["disk"], "in the forward pass")
    assert said()[1] == (
        "kvstore: request r7 loads 256 tokens (1 chunk from disk) in the forward pass; "
        "5 loads of 1,280 tokens (5 chunks from redis) in the last 10 s"
    )
    clock.now += 3
    log.load("r8", 256, ["s3"], "in the background")  # summed: then said by a step's tick once 10 s have passed
    log.tick()
    assert len(said()) == 2
    clock.now += 7
    log.tick()
    assert said()[2] == "kvstore: 1 load of 256 tokens (1 chunk from s3) in the last 10 s"
    log.tick()
    assert len(said()) == 3, "nothing left to say"
