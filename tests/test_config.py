"""StoreConfig: keyword arguments > KVSTORE_* environment > TOML file > defaults, and errors that say
which key is wrong and how to fix it."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

import kvstore
from kvstore import ConfigError, KVLayout, KVStore, StoreConfig
from kvstore.codecs import CODECS, make_codec
from kvstore.util import memory
from kvstore.util.units import parse_duration, parse_size

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No KVSTORE_* variable from the outer shell (or another test) may leak into these tests."""
    for name in list(os.environ):
        if name.upper().startswith("KVSTORE"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    # monkeypatch restores the environment after each test, so nothing set here leaks out either.


def write_toml(tmp_path: Path, text: str, name: str = "kvstore.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_text(excinfo: pytest.ExceptionInfo[ConfigError]) -> str:
    assert excinfo.type is ConfigError
    return str(excinfo.value)


def assert_mentions(text: str, *fragments: str) -> None:
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} missing from error message:\n{text}"


# ---------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------


def test_defaults(tmp_path):
    config = StoreConfig()
    assert config.dram.capacity == GiB
    assert config.dram.pin_memory == "auto"
    assert config.disk.enabled is True
    assert config.disk.capacity == 16 * GiB
    assert config.disk.codec == "identity"
    assert config.disk.fsync is False
    assert config.disk.path == tmp_path / "xdg-cache" / "kvstore"
    assert (config.timeouts.get, config.timeouts.put, config.timeouts.close) == (5.0, 30.0, 10.0)
    assert (config.queue_depth, config.tier_workers, config.io_threads) == (64, 2, 4)
    assert StoreConfig.load() == config  # no path, no KVSTORE_CONFIG: defaults too


def test_keyword_arguments(tmp_path):
    config = StoreConfig(
        dram={"capacity": "64MiB", "pin_memory": "never"},
        disk={"path": tmp_path / "chunks", "codec": "bytesplit", "fsync": True},
        timeouts={"get": 0.25},
        queue_depth=8,
        tier_workers=3,
        io_threads=1,
    )
    assert config.dram.capacity == 64 * MiB
    assert config.dram.pin_memory == "never"
    assert config.disk.path == tmp_path / "chunks"
    assert config.disk.codec == "bytesplit"
    assert config.disk.fsync is True
    assert config.disk.capacity == 16 * GiB  # untouched keys keep their defaults
    assert config.timeouts.get == 0.25 and config.timeouts.put == 30.0
    assert (config.queue_depth, config.tier_workers, config.io_threads) == (8, 3, 1)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("64MiB", 64 * MiB),
        ("64 MiB", 64 * MiB),
        ("1GiB", GiB),
        ("1.5GiB", 3 * GiB // 2),
        ("512KiB", 512 * 1024),
        ("1GB", 10**9),
        ("4096", 4096),
        (4096, 4096),
    ],
)
def test_size_strings(text, expected):
    config = StoreConfig(dram={"capacity": text}, disk={"capacity": text})
    assert config.dram.capacity == expected
    assert config.disk.capacity == expected
    assert int(config.dram.capacity) == expected


def test_toml_file(tmp_path):
    path = write_toml(
        tmp_path,
        f"""
queue_depth = 5
io_threads = 8

[dram]
capacity = "64MiB"
pin_memory = "never"

[disk]
enabled = false
path = "{tmp_path / "disk"}"
capacity = "2GiB"
codec = "zstd:3"

[timeouts]
get = 1.5
""",
    )
    config = StoreConfig.load(path)
    assert config.queue_depth == 5 and config.io_threads == 8
    assert config.tier_workers == 2  # default
    assert config.dram.capacity == 64 * MiB and config.dram.pin_memory == "never"
    assert config.disk.enabled is False
    assert config.disk.path == tmp_path / "disk"
    assert config.disk.capacity == 2 * GiB
    assert config.disk.codec == "zstd:3"
    assert config.timeouts.get == 1.5 and config.timeouts.put == 30.0
    assert StoreConfig.load(str(path)) == config  # str or PathLike


def test_toml_path_with_tilde_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    write_toml(tmp_path, "queue_depth = 11\n")
    assert StoreConfig.load("~/kvstore.toml").queue_depth == 11


def test_environment_variables(monkeypatch):
    monkeypatch.setenv("KVSTORE_DRAM__CAPACITY", "128MiB")
    monkeypatch.setenv("KVSTORE_DRAM__PIN_MEMORY", "always")
    monkeypatch.setenv("KVSTORE_DISK__ENABLED", "false")
    monkeypatch.setenv("KVSTORE_DISK__CODEC", "bytesplit")
    monkeypatch.setenv("KVSTORE_TIMEOUTS__GET", "0.5")
    monkeypatch.setenv("KVSTORE_QUEUE_DEPTH", "9")
    config = StoreConfig()
    assert config.dram.capacity == 128 * MiB
    assert config.dram.pin_memory == "always"
    assert config.disk.enabled is False
    assert config.disk.codec == "bytesplit"
    assert config.timeouts.get == 0.5
    assert config.queue_depth == 9
    assert StoreConfig.load() == config


def test_a_whole_section_as_json_in_one_variable(monkeypatch):
    monkeypatch.setenv("KVSTORE_DRAM", '{"capacity": "32MiB", "pin_memory": "never"}')
    config = StoreConfig()
    assert config.dram.capacity == 32 * MiB and config.dram.pin_memory == "never"


def test_kvstore_config_names_the_toml_file(tmp_path, monkeypatch):
    path = write_toml(tmp_path, 'tier_workers = 7\n[dram]\ncapacity = "3MiB"\n')
    monkeypatch.setenv("KVSTORE_CONFIG", str(path))
    config = StoreConfig.load()
    assert config.tier_workers == 7
    assert config.dram.capacity == 3 * MiB


def test_explicit_path_beats_kvstore_config(tmp_path, monkeypatch):
    from_env = write_toml(tmp_path, "tier_workers = 7\n", "env.toml")
    explicit = write_toml(tmp_path, "tier_workers = 9\n", "explicit.toml")
    monkeypatch.setenv("KVSTORE_CONFIG", str(from_env))
    assert StoreConfig.load(explicit).tier_workers == 9


def test_the_toml_file_does_not_stick_to_later_configs(tmp_path):
    path = write_toml(tmp_path, "tier_workers = 7\n")
    assert StoreConfig.load(path).tier_workers == 7
    assert StoreConfig().tier_workers == 2
    assert StoreConfig.load().tier_workers == 2


def test_precedence_kwargs_over_env_over_toml_over_defaults(tmp_path, monkeypatch):
    path = write_toml(
        tmp_path,
        """
queue_depth = 1
tier_workers = 11
io_threads = 21

[dram]
capacity = "1MiB"
pin_memory = "never"

[timeouts]
get = 1.0
put = 2.0
""",
    )
    monkeypatch.setenv("KVSTORE_QUEUE_DEPTH", "2")
    monkeypatch.setenv("KVSTORE_TIER_WORKERS", "12")
    monkeypatch.setenv("KVSTORE_DRAM__CAPACITY", "2MiB")
    monkeypatch.setenv("KVSTORE_TIMEOUTS__GET", "3")
    config = StoreConfig.load(path, queue_depth=3, dram={"capacity": "3MiB"})
    assert config.queue_depth == 3  # kwargs > env > toml
    assert config.tier_workers == 12  # env > toml
    assert config.io_threads == 21  # toml > default
    assert config.dram.capacity == 3 * MiB  # nested: kwargs > env > toml
    assert config.dram.pin_memory == "never"  # nested keys merge across sources
    assert config.timeouts.get == 3.0  # nested: env > toml
    assert config.timeouts.put == 2.0  # nested: toml > default
    assert config.timeouts.close == 10.0  # default
    assert StoreConfig.load(path).queue_depth == 2  # without kwargs, env wins over the file


def test_kwargs_beat_env_without_a_file(monkeypatch):
    monkeypatch.setenv("KVSTORE_IO_THREADS", "16")
    assert StoreConfig().io_threads == 16
    assert StoreConfig(io_threads=5).io_threads == 5


def test_valid_assignment_is_validated_and_converted():
    config = StoreConfig()
    config.queue_depth = 3
    config.dram.capacity = "2MiB"
    assert config.queue_depth == 3
    assert config.dram.capacity == 2 * MiB


# ---------------------------------------------------------------------------------------------
# Errors: always ConfigError, naming the key and a fix
# ---------------------------------------------------------------------------------------------


def test_config_error_is_a_public_value_error():
    assert kvstore.ConfigError is ConfigError
    assert issubclass(ConfigError, ValueError)


def test_unknown_top_level_keyword_suggests_the_right_one():
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig(queue_dept=3)
    assert_mentions(error_text(excinfo), "queue_dept", "unknown key", "did you mean 'queue_depth'")


def test_unknown_top_level_key_in_toml(tmp_path):
    path = write_toml(tmp_path, "io_thread = 3\n")
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig.load(path)
    assert_mentions(error_text(excinfo), "io_thread", "did you mean 'io_threads'")


def test_unknown_nested_key_in_toml_names_the_dotted_key(tmp_path):
    path = write_toml(tmp_path, '[dram]\ncapcity = "1GiB"\n')
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig.load(path)
    assert_mentions(error_text(excinfo), "dram.capcity", "unknown key", "did you mean 'dram.capacity'")


def test_unknown_nested_key_without_a_close_match_lists_the_valid_ones():
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig(timeouts={"zzzzzz": 1})
    assert_mentions(error_text(excinfo), "timeouts.zzzzzz", "timeouts.get", "timeouts.put", "timeouts.close")


def test_unknown_section_suggests_the_right_one(tmp_path):
    path = write_toml(tmp_path, '[dramm]\ncapacity = "1GiB"\n')
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig.load(path)
    assert_mentions(error_text(excinfo), "dramm", "did you mean 'dram'")


@pytest.mark.parametrize("codec", ["snappy", "zstd+snappy", "ZSTD"])
def test_unknown_codec_lists_the_valid_ones(codec):
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig(disk={"codec": codec})
    text = error_text(excinfo)
    assert_mentions(text, "disk.codec", repr(codec))
    for name in CODECS:
        assert_mentions(text, name)


@pytest.mark.parametrize(
    "codec, fragment",
    [
        ("zstd:99", "between"),
        ("bytesplit:99", "between"),
        ("zstd:fast", "integer"),
        ("lz4:3", "takes no level"),
        ("zstd+bytesplit", "must come first"),
        ("", "valid stages"),
    ],
)
def test_bad_codec_pipelines_fail_at_load_not_at_first_use(codec, fragment):
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig(disk={"codec": codec})
    assert_mentions(error_text(excinfo), "disk.codec", fragment)


def test_bad_codec_from_env(monkeypatch):
    monkeypatch.setenv("KVSTORE_DISK__CODEC", "brotli")
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig()
    assert_mentions(error_text(excinfo), "disk.codec", "brotli", "bytesplit")


# -- lossy codecs: never chosen silently ---------------------------------------------------------------

LOSSY_CODECS = ["fp8", "int8+zstd", "int4", "hadamard+int4", "hadamard"]


@pytest.mark.parametrize("section", ["disk", "redis", "s3"])
@pytest.mark.parametrize("codec", LOSSY_CODECS)
def test_a_lossy_codec_without_allow_lossy_is_refused_naming_the_option(section, codec):
    extra = {"bucket": "kv"} if section == "s3" else {}
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig(**{section: {"codec": codec, **extra}})
    assert_mentions(
        error_text(excinfo),
        f"{section}.codec {codec!r} is lossy",
        f"set {section}.allow_lossy = true",
        f"KVSTORE_{section.upper()}__ALLOW_LOSSY=true",
        "byteplanes",
    )
    config = StoreConfig(**{section: {"codec": codec, "allow_lossy": True, **extra}})
    assert getattr(config, section).codec == codec and getattr(config, section).allow_lossy


def test_lossless_codecs_need_no_opt_in_and_the_defaults_are_lossless():
    config = StoreConfig(disk={"codec": "bytesplit+lz4"}, redis={"codec": "zstd:3"})
    assert not config.disk.allow_lossy and not config.redis.allow_lossy and not config.s3.allow_lossy
    for section in (config.disk, config.redis, config.s3):
        assert make_codec(section.codec).lossless, section


def test_allow_lossy_from_toml_and_env(tmp_path, monkeypatch):
    path = write_toml(tmp_path, '[disk]\ncodec = "int8+zstd"\nallow_lossy = true\n')
    assert StoreConfig.load(path).disk.codec == "int8+zstd"
    monkeypatch.setenv("KVSTORE_REDIS__CODEC", "int4")
    with pytest.raises(ConfigError, match="redis.allow_lossy = true"):
        StoreConfig()
    monkeypatch.setenv("KVSTORE_REDIS__ALLOW_LOSSY", "true")
    assert StoreConfig().redis.codec == "int4"


def test_assigning_a_lossy_codec_is_refused_and_changes_nothing():
    config = StoreConfig()
    with pytest.raises(ConfigError) as excinfo:
        config.disk.codec = "int4"
    assert_mentions(error_text(excinfo), "disk.codec 'int4' is lossy", "disk.allow_lossy = true")
    assert config.disk.codec == "identity"
    config.disk.allow_lossy = True
    config.disk.codec = "int4"
    with pytest.raises(ConfigError, match="disk.allow_lossy"):
        config.disk.allow_lossy = False  # would leave a lossy codec without its opt-in
    assert config.disk.allow_lossy and config.disk.codec == "int4"


@pytest.mark.parametrize(
    "kwargs, key, fix",
    [
        ({"tier_workers": 0}, "tier_workers", "greater than or equal to 1"),
        ({"tier_workers": 65}, "tier_workers", "less than or equal to 64"),
        ({"io_threads": 0}, "io_threads", "greater than or equal to 1"),
        ({"io_threads": 257}, "io_threads", "less than or equal to 256"),
        ({"queue_depth": 0}, "queue_depth", "greater than or equal to 1"),
        ({"queue_depth": -5}, "queue_depth", "greater than or equal to 1"),
        ({"timeouts": {"get": 0}}, "timeouts.get", "greater than 0"),
        ({"timeouts": {"put": -1.0}}, "timeouts.put", "a duration is 0 or more"),
        ({"timeouts": {"close": float("nan")}}, "timeouts.close", "must be finite"),
        ({"queue_depth": "many"}, "queue_depth", "valid integer"),
        ({"dram": {"pin_memory": "sometimes"}}, "dram.pin_memory", "'auto'"),
        ({"disk": {"fsync": "perhaps"}}, "disk.fsync", "valid boolean"),
    ],
)
def test_out_of_range_or_mistyped_values_name_the_key_and_the_bound(kwargs, key, fix):
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig(**kwargs)
    text = error_text(excinfo)
    assert_mentions(text, f"{key} = ", fix)


@pytest.mark.parametrize("size", ["64 potatoes", "lots", "-1GiB", "MiB", "1.5.3MiB", "12,5GB", "4GiB of RAM", "64MiB!"])
def test_unparseable_size_names_the_key_and_an_example(size):
    """Includes text that pydantic's ByteSize alone would half-read ('12,5GB' as 12 bytes)."""
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig(dram={"capacity": size})
    assert_mentions(error_text(excinfo), "dram.capacity", repr(size), "e.g. '4GiB'")


# One parser for sizes and one for durations (kvstore.util.units), for the configuration and the CLI alike:
# a value parses whole, or fails with a message that shows a valid one.
SIZES = [
    ("12.5GB", 12_500_000_000),  # a decimal point is fine
    ("5 GB", 5 * 10**9),
    ("5GiB", 5 * GiB),
    ("5gib", 5 * GiB),
    (" 4096 ", 4096),
    (".5KiB", 512),
    (4096, 4096),  # a number (TOML, JSON) is bytes
    (float(2**53 - 1), 2**53 - 1),  # a float, while every whole number is one
    ("7EiB", 7 << 60),
    (2**63 - 1, 2**63 - 1),  # the largest size
]
BAD_SIZES = [
    ("12,5GB", "decimal point as '.'"),  # pydantic's ByteSize read this as 12 bytes
    ("1,000", "no thousands separator"),
    ("1e3", "rather than an exponent"),
    ("-5", "cannot be negative"),
    ("5 XB", "unknown unit 'XB'"),
    ("", "an empty size"),
    ("   ", "an empty size"),
    ("1_000", "not a size"),
    ("inf", "not a size"),
    (1.5, "whole number of bytes"),
    (float("inf"), "finite"),
    (True, "not a size"),
    (1e30, "rather than an exponent"),  # refused as '1e30B' is: one rule for both forms
    (float(2**53), "a float holds exactly"),
    (2**63, "too large"),
    (2**70, "too large"),
    ("8EiB", "too large"),
    ("9" * 30, "too large"),
]
DURATIONS = [
    ("10m", 600.0),
    ("10 minutes", 600.0),
    ("10 min", 600.0),
    ("1h30m", 5400.0),
    ("1h 30m", 5400.0),
    ("1.5h", 5400.0),
    ("500ms", 0.5),
    ("7d", 7 * 86400.0),
    ("2w", 14 * 86400.0),
    ("3600", 3600.0),  # a bare number is seconds
    (2.5, 2.5),
]
BAD_DURATIONS = [
    ("-5", "cannot be negative"),
    ("", "an empty duration"),
    ("10 fortnights", "unknown unit 'fortnights'"),
    ("1e3", "unknown unit 'e'"),
    ("1h30", "a number without a unit"),
    ("inf", "not a duration"),
    ("soon", "not a duration"),
    (-1, "0 or more"),
    (float("nan"), "finite"),
]


@pytest.mark.parametrize("text, expected", SIZES)
def test_sizes_parse_whole(text, expected):
    assert parse_size(text) == expected
    assert StoreConfig(disk={"capacity": text}).disk.capacity == expected


@pytest.mark.parametrize("text, problem", BAD_SIZES)
def test_bad_sizes_fail_with_the_problem_and_an_example(text, problem):
    with pytest.raises(ValueError) as parsed:
        parse_size(text)
    assert_mentions(str(parsed.value), problem, "e.g. 500GiB")
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig(s3={"multipart_threshold": text})
    assert_mentions(error_text(excinfo), "s3.multipart_threshold = ", problem, "e.g. 500GiB")


@pytest.mark.parametrize("text, expected", DURATIONS)
def test_durations_parse_whole_in_every_duration_key(text, expected):
    assert parse_duration(text) == expected
    config = StoreConfig(timeouts={"get": text, "put": text}, redis={"ttl": text, "connect_timeout": text})
    assert config.timeouts.get == config.timeouts.put == config.redis.ttl == config.redis.connect_timeout == expected


@pytest.mark.parametrize("text, problem", BAD_DURATIONS)
def test_bad_durations_fail_with_the_problem_and_an_example(text, problem):
    with pytest.raises(ValueError) as parsed:
        parse_duration(text)
    assert_mentions(str(parsed.value), problem, "e.g. 90s")
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig(adaptive={"interval": text})
    assert_mentions(error_text(excinfo), "adaptive.interval = ", problem)


def test_durations_from_env_and_toml(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_TIMEOUTS__GET", "1500ms")
    path = write_toml(tmp_path, '[timeouts]\nclose = "1m"\n[s3]\nconnect_timeout = 3\n')
    config = StoreConfig.load(path)
    assert (config.timeouts.get, config.timeouts.close, config.s3.connect_timeout) == (1.5, 60.0, 3.0)
    monkeypatch.setenv("KVSTORE_TIMEOUTS__GET", "5 sec0nds")
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig()
    assert_mentions(error_text(excinfo), "timeouts.get = '5 sec0nds'", "e.g. 90s")


@pytest.mark.parametrize("section", ["disk", "dram"])
@pytest.mark.parametrize("value", [0, -5, "-5", "0GiB"])
def test_a_capacity_below_one_chunk_names_the_key_and_the_minimum(section, value):
    """disk.capacity = 0 was accepted, and opening the store then evicted every file in the directory."""
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig(**{section: {"capacity": value}})
    text = error_text(excinfo)
    assert_mentions(text, f"{section}.capacity = ", "at least one chunk", "e.g. 500GiB")
    assert "could not parse" not in text


@pytest.mark.parametrize("capacity", [1e30, "1e30B"])
def test_a_float_disk_capacity_with_an_exponent_is_refused_as_its_text_is(capacity):
    """1e30 as a number was accepted (and '1e30B' refused): one rule for sizes in both forms."""
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig(disk={"capacity": capacity})
    assert_mentions(error_text(excinfo), "disk.capacity = ", "write 1000 or 1KB rather than an exponent")


@pytest.mark.parametrize(("capacity", "problem"), [(1e30, "rather than an exponent"), (2**70, "too large")])
def test_a_dram_capacity_no_machine_can_hold_is_refused_naming_the_key(capacity, problem):
    """Each was accepted, and opening the store then raised OverflowError or an empty MemoryError."""
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig(dram={"capacity": capacity})
    assert_mentions(error_text(excinfo), "dram.capacity = ", problem)


@pytest.mark.parametrize("capacity", ["1PiB", "64TiB"])
def test_a_dram_capacity_this_machine_cannot_hold_is_refused_at_open_before_anything_is_allocated(capacity):
    """The configuration takes it (``kvstore gc`` may read the engines' file on a small host); the store does not,
    naming the key and the memory available, and allocating nothing first (it set up one entry per slot)."""
    config = StoreConfig(dram={"capacity": capacity}, disk={"enabled": False})
    with pytest.raises(ConfigError) as excinfo:
        KVStore(config, KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, chunk_tokens=16), "memory")
    assert_mentions(str(excinfo.value), "dram.capacity", "the memory available now", "lower dram.capacity")


def test_the_machines_memory_is_the_smaller_of_its_ram_and_the_cgroup_limit(tmp_path, monkeypatch):
    cgroups = tmp_path / "sys-fs-cgroup"
    pod = cgroups / "kubepods" / "pod1"
    pod.mkdir(parents=True)
    (pod.parent / "memory.max").write_text(f"{8 * GiB}\n")  # the limit is set above this process's group
    (pod.parent / "memory.current").write_text(f"{3 * GiB}\n")
    (pod / "memory.max").write_text("max\n")
    (pod / "memory.current").write_text(f"{GiB}\n")
    own = tmp_path / "proc-self-cgroup"
    own.write_text("0::/kubepods/pod1\n")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       {64 * GiB // 1024} kB\nMemAvailable:   {32 * GiB // 1024} kB\n")
    monkeypatch.setattr(memory, "CGROUP_ROOT", cgroups)
    monkeypatch.setattr(memory, "PROC_CGROUP", own)
    monkeypatch.setattr(memory, "MEMINFO", meminfo)
    monkeypatch.setattr(memory, "physical_memory", lambda: 64 * GiB)
    assert memory.machine_memory() == 8 * GiB  # cgroup v2
    assert memory.available_memory() == 5 * GiB  # what the limit leaves, below MemAvailable
    (pod.parent / "memory.stat").write_text(f"active_file {GiB}\ninactive_file {2 * GiB}\n")
    assert memory.available_memory() == 7 * GiB  # the inactive page cache is reclaimed first: not taken
    v1 = cgroups / "memory" / "docker" / "abc"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{2 * GiB}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{GiB // 2}\n")
    (cgroups / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    own.write_text("4:memory:/docker/abc\n0::/\n")
    assert (memory.machine_memory(), memory.available_memory()) == (2 * GiB, 3 * GiB // 2)  # cgroup v1
    own.write_text("0::/\n")  # no limit anywhere: the machine's RAM, and MemAvailable
    assert (memory.machine_memory(), memory.available_memory()) == (64 * GiB, 32 * GiB)
    monkeypatch.setattr(memory, "PROC_CGROUP", tmp_path / "absent")
    monkeypatch.setattr(memory, "MEMINFO", tmp_path / "absent")
    assert (memory.machine_memory(), memory.available_memory()) == (64 * GiB, None)


@pytest.mark.parametrize("path", ["", "   ", "\t"])
def test_an_empty_disk_path_is_refused_not_read_as_the_current_directory(path, monkeypatch):
    """'' was taken as '.': chunk files went into whatever directory the engine started in."""
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig(disk={"path": path})
    fix = ["disk.path", "current directory", "absolute directory", "leave it out", "~/.cache/kvstore"]
    assert_mentions(error_text(excinfo), *fix)
    monkeypatch.setenv("KVSTORE_DISK__PATH", path)
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig()
    assert_mentions(error_text(excinfo), *fix)


def test_a_huge_value_or_key_is_quoted_short():
    """A 1 MB value (or key) in the configuration must not come back as a 1 MB error message."""
    huge = "9" * 10**6 + "X"
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig(disk={"capacity": huge, "k" * 10**6: 1})
    text = error_text(excinfo)
    assert len(text) < 2000, len(text)
    assert_mentions(text, "disk.capacity = ", "1,000,003 characters", "unknown key")


def test_unparseable_size_from_env_and_toml(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_DISK__CAPACITY", "huge")
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig()
    assert_mentions(error_text(excinfo), "disk.capacity", "'huge'")
    monkeypatch.delenv("KVSTORE_DISK__CAPACITY")
    path = write_toml(tmp_path, '[dram]\ncapacity = "12 parsecs"\n')
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig.load(path)
    assert_mentions(error_text(excinfo), "dram.capacity", "12 parsecs")


def test_several_problems_are_reported_together():
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig(tier_workers=0, dram={"capacity": "lots"}, bogus=1)
    assert_mentions(error_text(excinfo), "tier_workers", "dram.capacity", "bogus")


@pytest.mark.parametrize(
    "name, fix",
    [
        ("KVSTORE_DRAM__CAPACTY", "did you mean KVSTORE_DRAM__CAPACITY?"),
        ("KVSTORE_QUEUE_DEPT", "did you mean KVSTORE_QUEUE_DEPTH?"),
        ("KVSTORE_DISK_CODEC", "did you mean KVSTORE_DISK__CODEC?"),  # single underscore
        ("KVSTORE_COMPLETELY_UNRELATED_THING", "valid:"),
    ],
)
def test_unknown_kvstore_env_var(monkeypatch, name, fix):
    monkeypatch.setenv(name, "1")
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig()
    assert_mentions(error_text(excinfo), name, fix)
    with pytest.raises(ConfigError):
        StoreConfig.load()  # every way in checks the environment


def test_unknown_lowercase_env_var_is_not_silently_ignored(monkeypatch):
    """pydantic-settings matches env names case-insensitively, so a lowercase typo must fail too."""
    monkeypatch.setenv("kvstore_dram__capcity", "1GiB")
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig()
    assert_mentions(error_text(excinfo), "kvstore_dram__capcity", "did you mean KVSTORE_DRAM__CAPACITY?")


@pytest.mark.parametrize(
    "name, fix",
    [
        ("kvstore_queue_dept", "did you mean KVSTORE_QUEUE_DEPTH?"),
        ("Kvstore_Io_Thread", "did you mean KVSTORE_IO_THREADS?"),
        ("kvstore_config", "did you mean KVSTORE_CONFIG?"),  # only read spelled exactly so
    ],
)
def test_unknown_env_var_in_any_case_is_an_error(monkeypatch, name, fix):
    monkeypatch.setenv(name, "3")
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig()
    assert_mentions(error_text(excinfo), name, fix)


def test_known_env_var_in_another_case_is_read(monkeypatch):
    """pydantic-settings reads names case-insensitively; the typo check must agree with it."""
    monkeypatch.setenv("kvstore_io_threads", "5")
    monkeypatch.setenv("Kvstore_Dram__Capacity", "7MiB")
    config = StoreConfig()
    assert config.io_threads == 5
    assert config.dram.capacity == 7 * MiB


def test_section_variable_that_is_not_json(monkeypatch):
    monkeypatch.setenv("KVSTORE_DRAM", "4GiB")
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig()
    assert_mentions(error_text(excinfo), "KVSTORE_DRAM", "JSON", "KVSTORE_SECTION__KEY")


def test_missing_config_file_from_path(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig.load(missing)
    assert_mentions(error_text(excinfo), str(missing), "does not exist", "existing TOML file")


def test_missing_config_file_from_kvstore_config(tmp_path, monkeypatch):
    missing = tmp_path / "nope.toml"
    monkeypatch.setenv("KVSTORE_CONFIG", str(missing))
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig.load()
    assert_mentions(error_text(excinfo), str(missing), "KVSTORE_CONFIG", "unset")


def test_config_path_that_is_a_directory(tmp_path):
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig.load(tmp_path)
    assert_mentions(error_text(excinfo), str(tmp_path))


@pytest.mark.parametrize(
    "content",
    [
        b"[dram\ncapacity = 1\n",
        b'queue_depth = "unterminated\n',
        b"queue_depth = 1\nqueue_depth = 2\n",
        b"\xff\xfe\x00",
    ],
    ids=["bad-table", "bad-string", "duplicate-key", "not-utf8"],
)
def test_malformed_toml_is_a_config_error_naming_the_file(tmp_path, content):
    path = tmp_path / "broken.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig.load(path)
    assert_mentions(error_text(excinfo), str(path), "TOML")


def test_wrong_type_for_a_section_in_toml(tmp_path):
    path = write_toml(tmp_path, "dram = 5\n")
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig.load(path)
    assert_mentions(error_text(excinfo), "dram")


def test_invalid_assignment_raises_config_error_and_keeps_the_old_value():
    config = StoreConfig()
    with pytest.raises(ConfigError) as excinfo:
        config.tier_workers = 0
    assert_mentions(error_text(excinfo), "tier_workers", "greater than or equal to 1")
    assert config.tier_workers == 2
    with pytest.raises(ConfigError) as excinfo:
        config.dram.capacity = "lots"
    assert_mentions(error_text(excinfo), "capacity", "e.g. '4GiB'")
    assert config.dram.capacity == GiB
    with pytest.raises(ConfigError) as excinfo:
        config.disk.codec = "snappy"
    assert_mentions(error_text(excinfo), "codec", "bytesplit")
    assert config.disk.codec == "identity"
    with pytest.raises(ConfigError):
        config.no_such_field = 1


def test_errors_chain_no_pydantic_traceback():
    """The ConfigError is the whole story: no pydantic ValidationError chained behind it."""
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig(queue_depth=0)
    assert excinfo.value.__cause__ is None
    assert excinfo.value.__suppress_context__ is True


def test_plain_constructor_reads_the_file_named_by_kvstore_config(tmp_path, monkeypatch):
    file = tmp_path / "kvstore.toml"
    file.write_text('queue_depth = 5\n[disk]\npath = "~/kv-cache"\n')
    monkeypatch.setenv("KVSTORE_CONFIG", str(file))
    config = StoreConfig(tier_workers=3)
    assert config.queue_depth == 5 and config.tier_workers == 3
    assert config.disk.path == Path.home() / "kv-cache"  # ~ expanded
    monkeypatch.setenv("KVSTORE_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError, match="KVSTORE_CONFIG"):
        StoreConfig()


# -- remote tiers and encryption --------------------------------------------------------------------


def test_remote_tiers_are_off_by_default_and_configurable_from_toml(tmp_path):
    assert not StoreConfig().s3.enabled and not StoreConfig().redis.enabled
    path = write_toml(
        tmp_path,
        '[s3]\nenabled = true\nbucket = "kv-archive"\nendpoint_url = "http://127.0.0.1:9000"\n'
        'part_size = "16MiB"\ncodec = "fp8+zstd"\nallow_lossy = true\n[redis]\nenabled = true\nurl = "redis://cache:6379/2"\n'
        "cluster = true\nttl = 3600\n",
    )
    config = StoreConfig.load(path)
    assert config.s3.bucket == "kv-archive" and config.s3.part_size == 16 * MiB and config.s3.codec == "fp8+zstd"
    assert config.s3.addressing_style == "auto" and config.s3.prefix == "kvstore"
    assert config.redis.cluster and config.redis.ttl == 3600 and config.redis.url == "redis://cache:6379/2"


def test_s3_without_a_bucket_names_the_key_and_the_fix(monkeypatch):
    monkeypatch.setenv("KVSTORE_S3__ENABLED", "true")
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig()
    assert_mentions(error_text(excinfo), "s3", "bucket", "KVSTORE_S3__BUCKET")


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"s3": {"part_size": "1MiB"}}, "s3.part_size"),
        ({"s3": {"addressing_style": "sideways"}}, "s3.addressing_style"),
        ({"s3": {"codec": "gzip"}}, "s3.codec"),
        ({"redis": {"ttl": -5}}, "redis.ttl"),
        ({"redis": {"max_connections": 0}}, "redis.max_connections"),
    ],
)
def test_bad_remote_values_name_the_key(kwargs, key):
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig(**kwargs)
    assert key in error_text(excinfo)


@pytest.mark.parametrize("threshold", ["1MiB", "4.5MiB", "6GiB"])
def test_a_multipart_threshold_outside_s3_limits_names_the_option_and_the_fix(threshold):
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig(s3={"multipart_threshold": threshold})
    assert_mentions(error_text(excinfo), "s3.multipart_threshold = ", "5MiB and 5GiB", "e.g. '64MiB'")


def test_the_multipart_threshold_keeps_a_typical_chunk_in_one_put_by_default():
    assert StoreConfig().s3.multipart_threshold == 64 * MiB  # a Llama-3-8B chunk is 32 MiB
    assert StoreConfig(s3={"multipart_threshold": "5MiB"}).s3.multipart_threshold == 5 * MiB
    assert StoreConfig(s3={"multipart_threshold": "5GiB"}).s3.multipart_threshold == 5 << 30


def test_redis_url_with_a_password_is_not_in_the_repr():
    config = StoreConfig(redis={"url": "redis://user:hunter2@cache:6379/0"})
    assert "hunter2" not in repr(config) and "hunter2" not in str(config)


def test_encryption_key_from_env_in_hex_or_base64(monkeypatch):
    import base64

    key = os.urandom(32)
    monkeypatch.setenv("KVSTORE_ENCRYPTION__KEY", key.hex())
    config = StoreConfig()
    assert config.encryption.resolve_key() == key
    assert key.hex() not in repr(config)
    monkeypatch.setenv("KVSTORE_ENCRYPTION__KEY", base64.b64encode(key).decode())
    assert StoreConfig().encryption.resolve_key() == key


def test_encryption_key_file(tmp_path):
    key = os.urandom(32)
    (tmp_path / "key").write_text(key.hex() + "\n")
    assert StoreConfig(encryption={"key_file": tmp_path / "key"}).encryption.resolve_key() == key
    with pytest.raises(ConfigError, match="cannot be read"):
        StoreConfig(encryption={"key_file": tmp_path / "missing"}).encryption.resolve_key()
    with pytest.raises(ConfigError, match="both set"):
        StoreConfig(encryption={"key_file": tmp_path / "key", "key": key.hex()}).encryption.resolve_key()


@pytest.mark.parametrize("bad", ["too-short", "00" * 31, "zz" * 32, "c2VjcmV0"])
def test_a_bad_encryption_key_is_rejected_without_echoing_it(bad):
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig(encryption={"key": bad})
    text = error_text(excinfo)
    assert_mentions(text, "encryption.key", "32 bytes")
    assert bad not in text


def test_no_encryption_key_means_no_encryption():
    assert StoreConfig().encryption.resolve_key() is None


def test_a_disk_capacity_below_one_chunk_fails_at_open_and_deletes_nothing(tmp_path):
    """The config cannot know the chunk size; the store can, and must refuse before the disk tier evicts to budget."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, chunk_tokens=256)  # 256 KiB chunks in bf16
    others = tmp_path / "disk" / "another-model" / "ab" / "cd" / ("abcd" + "0" * 60 + ".kvc")
    others.parent.mkdir(parents=True)
    others.write_bytes(b"x" * 1000)  # another namespace's chunk file: opening must not touch it
    small = layout.chunk_nbytes - 1
    config = StoreConfig(dram={"capacity": "4MiB"}, disk={"path": tmp_path / "disk", "capacity": small})
    store = KVStore(config, layout, "mine")

    async def open_and_close() -> None:
        try:
            await store.open()
        finally:
            await store.close()

    with pytest.raises(ConfigError) as excinfo:
        asyncio.run(open_and_close())
    text = error_text(excinfo)
    assert_mentions(text, "disk.capacity", f"{small:,} bytes", f"{layout.chunk_nbytes:,} bytes", "256.0 KiB")
    assert others.exists()


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("url", ["http://cache:6379/0", "valkey://cache:6379", "cache:6379", "redis:/cache:6379"])
def test_a_redis_url_with_another_scheme_is_refused_with_the_key_and_the_fix(url, enabled):
    """Also while the tier is off: it is turned on later (or read by the tools) with the same URL."""
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig(redis={"enabled": enabled, "url": url})
    message = str(excinfo.value)
    assert "redis.url" in message and "set redis.url to e.g. redis://127.0.0.1:6379/0" in message, message
