"""The `kvstore` command as a new user meets it: one error style, no dangerous default, and it says what it read.

Each test here was written against a behaviour a new user hit: a bare ``--max-age 7`` read as seconds,
a disk path that does not exist listed as an empty cache, a demo that wrote to the servers the shell
pointed at, dev servers left running after SIGTERM, errors in two styles.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support import chunk_file, start_server
from typer.testing import CliRunner

import kvstore
from kvstore.cli import app
from kvstore.testing.servers import MotoServer

runner = CliRunner()
KVSTORE = [str(Path(sys.executable).parent / "kvstore")]  # the console script, as a user runs it
ADMIN = [["ls"], ["stats"], ["gc", "--max-age", "1d", "--yes"], ["verify"]]


@pytest.fixture(autouse=True)
def _no_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing from the shell: each test sets the variables it means."""
    for name in list(os.environ):
        if name.upper().startswith("KVSTORE") or name.startswith("AWS_") or name == "REDIS_URL":
            monkeypatch.delenv(name)


def disk_config(tmp_path: Path, root: Path) -> Path:
    config = tmp_path / "kvstore.toml"
    config.write_text(f'[disk]\npath = "{root}"\n')
    return config


def one_line_error(result, code: int = 2) -> str:
    """The error of a command that failed as every kvstore command does: exit ``code``, one line on stderr."""
    assert result.exit_code == code, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


# -- durations need a unit -----------------------------------------------------------------------


@pytest.mark.parametrize("age", ["7", "7.5", " 12 "])
def test_gc_max_age_without_a_unit_is_refused_and_deletes_nothing(tmp_path, age) -> None:
    root = tmp_path / "disk"
    kept = chunk_file(root, age=60)  # a minute old: "--max-age 7" read as seconds would delete it
    result = runner.invoke(app, ["gc", "--max-age", age, "--yes", "-c", str(disk_config(tmp_path, root))])
    line = one_line_error(result)
    number = age.strip()
    assert f"'{number}' has no unit: write {number}d, {number}h, {number}m or {number}s" in line
    assert line.startswith("kvstore gc: Invalid value for '--max-age'") and "kvstore gc --help" in line
    assert kept.exists()


# -- one error style -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["gc", "--max-bytes", "12,5GB"], "kvstore gc: Invalid value for '--max-bytes': '12,5GB' is not a size"),
        (["gcc"], "kvstore: No such command 'gcc'. Did you mean 'gc'?"),
        (["ls", "--limt", "3"], "kvstore ls: No such option: --limt"),
        (["dev-servers", "--s3", "minio"], "kvstore dev-servers: Invalid value for '--s3'"),
        (["bench", "--dir", "/nonexistent/kvstore-bench"], "kvstore bench: Invalid value for '--dir'"),
        (["demo", "--tokens", "100"], "kvstore demo: Invalid value for '--tokens'"),
    ],
)
def test_usage_errors_are_one_line_with_exit_2(args, expected) -> None:
    assert one_line_error(runner.invoke(app, args)).startswith(expected)


def test_version_option_and_help_without_torch() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout == f"{kvstore.__version__}\n"
    # A fresh interpreter: --help (and --version) must not wait for torch to import.
    code = (
        "import sys; from kvstore.cli import app\ntry:\n    app(['--help'])\nexcept SystemExit as e:\n    rc = e.code\n"
    )
    code += "print('torch' in sys.modules, rc)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().endswith("False 0"), done.stdout[-500:] + done.stderr[-2000:]


# -- the disk path: an error when it is not a tier's directory, and always said ---------------------


@pytest.mark.parametrize("args", ADMIN, ids=lambda a: a[0])
@pytest.mark.parametrize("kind", ["missing", "file", "namespace"])
def test_a_disk_path_that_is_not_a_tier_directory_is_an_error(tmp_path, args, kind) -> None:
    root = tmp_path / "disk"
    chunk = chunk_file(root, "model", age=3 * 86400)
    path = {"missing": tmp_path / "nowhere", "file": chunk, "namespace": root / "model"}[kind]
    line = one_line_error(runner.invoke(app, [*args, "-c", str(disk_config(tmp_path, path))]))
    problem = {"missing": "does not exist", "file": "is not a directory", "namespace": "is one namespace"}[kind]
    assert str(path) in line and problem in line, line
    assert chunk.exists()


@pytest.mark.parametrize("args", ADMIN, ids=lambda a: a[0])
def test_the_admin_commands_say_which_directory_they_read(tmp_path, args) -> None:
    root = tmp_path / "disk"
    root.mkdir()  # empty: a tier nothing has been written to yet
    result = runner.invoke(app, [*args, "-c", str(disk_config(tmp_path, root))], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert f"read from disk: {root}" in result.stdout


def test_ls_chunks_shows_sizes_in_the_units_ls_uses(tmp_path) -> None:
    root = tmp_path / "disk"
    chunk_file(root, size=3 * 1024 * 1024)
    config = str(disk_config(tmp_path, root))
    by_namespace = runner.invoke(app, ["ls", "-c", config], env={"COLUMNS": "300"}).stdout
    by_chunk = runner.invoke(app, ["ls", "--chunks", "-c", config], env={"COLUMNS": "300"}).stdout
    assert "3.0 MiB" in by_namespace and "3.0 MiB" in by_chunk and "3,145,728" not in by_chunk


def as_a_user_without_access(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``kvstore ARGS`` run by a user who cannot read what :func:`deny_access` closed: when we are root, root
    without the capabilities that read past permissions (so the checkout, ours, stays readable wherever it is)."""
    no_override = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
    return subprocess.run([*no_override, *KVSTORE, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def deny_access(path: Path, mode: int) -> None:
    """Make ``path`` unreadable to us (to root too, once it runs without overrides): another user's, ``mode``."""
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)  # nobody's: root without dac_override is only "other" there
        path.chmod(mode)
    else:
        path.chmod(0)


def test_an_unreadable_directory_or_config_is_one_line_not_a_traceback(tmp_path) -> None:
    root = tmp_path / "disk"
    chunk_file(root)
    deny_access(root, 0o700)
    config = disk_config(tmp_path, root)
    done = as_a_user_without_access("verify", "-c", str(config), cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        f"disk tier directory {root} cannot be read (permission denied); run as its owner"
    ]
    deny_access(config, 0o600)
    done = as_a_user_without_access("ls", "-c", str(config), cwd=tmp_path)
    (line,) = done.stderr.splitlines()
    assert done.returncode == 2 and str(config) in line and "read" in line, done.stderr
    for path in (root, config):  # ours again, for pytest to clean up
        if os.geteuid() == 0:
            os.chown(path, 0, 0)
        path.chmod(0o700)


def test_verify_delete_without_a_terminal_says_to_pass_yes(tmp_path) -> None:
    root = tmp_path / "disk"
    damaged = chunk_file(root)  # no chunk header: damaged
    result = runner.invoke(app, ["verify", "--delete", "-c", str(disk_config(tmp_path, root))])
    assert result.exit_code == 2, result.output
    assert "not removing without --yes" in result.stderr
    assert damaged.exists()
    result = runner.invoke(app, ["verify", "--delete", "--yes", "-c", str(disk_config(tmp_path, root))])
    assert result.exit_code == 0 and not damaged.exists(), result.output


# -- remote settings: a malformed URL is bad configuration; a missing bucket says who creates it --------


@pytest.mark.parametrize(
    ("variables", "named"),
    [
        ({"KVSTORE_REDIS__ENABLED": "true", "REDIS_URL": "localhost:6379"}, "$REDIS_URL 'localhost:6379'"),
        ({"KVSTORE_REDIS__ENABLED": "true", "KVSTORE_REDIS__URL": "redis://:pw-1234@host:port/0"}, "'redis://:***@"),
        (
            {"KVSTORE_S3__ENABLED": "true", "KVSTORE_S3__BUCKET": "b", "AWS_ENDPOINT_URL_S3": "127.0.0.1:9000"},
            "$AWS_ENDPOINT_URL_S3 '127.0.0.1:9000'",
        ),
    ],
)
def test_a_malformed_server_url_is_a_configuration_error_not_an_unreachable_server(
    tmp_path, monkeypatch, variables, named
) -> None:
    for name, value in {"KVSTORE_DISK__ENABLED": "false", **variables}.items():
        monkeypatch.setenv(name, value)
    result = runner.invoke(app, ["ls"])
    assert result.exit_code == 2, result.output
    assert named in result.stderr and "e.g." in result.stderr and "pw-1234" not in result.output


@pytest.fixture(scope="module")
def moto() -> MotoServer:
    server = MotoServer()
    start_server(server)
    yield server
    server.close()


def test_a_missing_bucket_says_the_commands_never_create_one(tmp_path, monkeypatch, moto) -> None:
    for name, value in {
        **moto.credentials_env(),
        "KVSTORE_DISK__ENABLED": "false",
        "KVSTORE_S3__ENABLED": "true",
        "KVSTORE_S3__BUCKET": "no-such-bucket",
        "KVSTORE_S3__CREATE_BUCKET": "true",
    }.items():
        monkeypatch.setenv(name, value)
    line = one_line_error(runner.invoke(app, ["ls"]), code=5)
    assert "'no-such-bucket'" in line and "never create one" in line and "create_bucket=True" not in line


# -- the demo: its own store, whatever the shell holds -------------------------------------------------


def test_the_demo_ignores_the_settings_in_the_shell(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVSTORE_DISK__ENABLED", "false")  # was a 62-line traceback
    monkeypatch.setenv("KVSTORE_REDIS__ENABLED", "true")  # was: the demo's chunks written to the server
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:9/0")  # nothing listens there
    monkeypatch.setenv("KVSTORE_CONFIG", str(tmp_path / "missing.toml"))
    result = runner.invoke(app, ["demo", "--prompts", "2", "--tokens", "1024", "--dir", str(tmp_path / "d")])
    assert result.exit_code == 0, result.output
    assert "8/8 bit-exact" in result.output, result.output
    assert len(list((tmp_path / "d").rglob("*.kvc"))) == 6


# -- dev-servers: SIGTERM and SIGHUP stop what it started ---------------------------------------------


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found += [int(child) for child in text]
    return found


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_dev_servers_stop_their_servers_and_remove_their_data_on(sig) -> None:
    process = subprocess.Popen(
        [*KVSTORE, "dev-servers", "--s3", "none"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        lines = []
        while not any(line.startswith("# running") for line in lines):
            line = process.stdout.readline()
            assert line, "dev-servers ended early: " + "".join(lines) + process.stderr.read()
            lines.append(line)
        (server,) = _children(process.pid)
        workdir = Path(os.readlink(f"/proc/{server}/cwd"))
        assert workdir.is_dir() and re.search(r"^export REDIS_URL=redis://127\.0\.0\.1:\d+", "".join(lines), re.M)
        process.send_signal(sig)
        assert process.wait(timeout=60) == 0, process.stderr.read()
    finally:
        process.kill()
    assert not Path(f"/proc/{server}").exists()
    assert not workdir.exists()


def test_a_configuration_with_several_problems_is_one_line_naming_each(monkeypatch) -> None:
    monkeypatch.setenv("KVSTORE_DRAM__CAPACITY", "abc")
    monkeypatch.setenv("KVSTORE_IO_THREADS", "0")
    line = one_line_error(runner.invoke(app, ["ls"]))
    assert line.startswith("invalid kvstore configuration: dram.capacity = 'abc'") and "; io_threads = '0'" in line
