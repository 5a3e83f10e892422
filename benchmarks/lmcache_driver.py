"""Time LMCache's own storage backends (the competitor), for comparison with kvstore's tiers.

Run it with LMCache's environment (scripts/lmcache_env.sh makes it); it imports only LMCache, torch and the
standard library (kvstore is not installed there):

    .venv-lmcache/bin/python benchmarks/lmcache_driver.py '{"tier": "disk", "disk_path": "/tmp/x", "repeats": 3}'

Settings (JSON, first argument; every key but "tier" has a default):
    tier           "dram" | "disk" | "redis" | "s3"
    chunks         chunks stored per repeat (8)            repeats   rounds, fresh keys each (3)
    num_layers 32, num_kv_heads 8, head_dim 128, chunk_tokens 256, dtype "bfloat16"  (Llama-3-8B: 32 MiB a chunk)
    disk_path      directory for tier "disk" (LMCache's files go to a fresh sub-directory, removed at the end)
    fsync          tier "disk": LMCache 0.5.6 never fsyncs; true adds the driver's own os.fsync of each file and
                   of the directory to the timed put, so the put is durable (false: LMCache as it is)
    use_odirect    tier "disk": LMCache's extra_config use_odirect (false, LMCache's default)
    redis_url      tier "redis": "redis://HOST:PORT/DB"
    s3_endpoint    tier "s3": "http://HOST:PORT" (http: TLS off) or "https://..."
    s3_bucket      tier "s3": the bucket (it must exist)
    s3_region      tier "s3": default $AWS_DEFAULT_REGION or us-east-1; credentials from the AWS_* variables
    s3_virtual_host  tier "s3": the Host LMCache addresses (default BUCKET.localhost for a loopback endpoint,
                   else BUCKET.HOST), see below

Output: one JSON object a line on stdout: {"op": "setup", ...} once, then per repeat {"op": "put"}, {"op": "get"}
and, for disk, {"op": "get_cold"}: {"tier", "op", "repeat", "seconds", "bytes", "api"} (+ a few tier notes).
A tier LMCache cannot run here prints {"tier": ..., "error": "..."} and exits 0; data that does not read back
equal (torch.equal) or a put LMCache drops exits 1 with {"tier": ..., "error": ...}.

What is timed and how (the layer LMCache's vLLM connector uses: LMCacheEngine.store/retrieve call these):
  setup   LMCacheEngineConfig.from_defaults + LMCacheMetadata + StorageManager(config, metadata, EventManager())
          (creates LocalCPUBackend with its MixedMemoryAllocator, and LocalDiskBackend / RemoteBackend with its
          connector), plus one contains() probe so remote connections are open. Not in put/get.
  prep    (untimed) StorageManager.allocate(shape, dtype, fmt=KV_2LTD) per chunk and a copy of the random
          [layers, 2, tokens, kv_heads, head_dim] tensor into the MemoryObj (LMCache's layout [2, layers, tokens,
          kv_heads*head_dim]) -- in LMCacheEngine.store this copy is GPUConnector.batched_from_gpu, before put.
  put     StorageManager.batched_put(keys, memory_objs) (non-blocking: it only submits to the backends), then
          the wait until the tier has the data:
            dram   LocalCPUBackend keeps a reference in its hot cache (local_cpu=True) when batched_put returns;
            disk   LocalDiskBackend writes each chunk in its thread pool (open(path, "wb").write(buffer), no
                   fsync) and inserts the key after the write: the wait ends when contains() is true for all;
            redis/s3  RemoteBackend hands the chunks to the connector; the connector drops its reference to
                   a MemoryObj when the server has answered (the driver holds one more reference and waits
                   for it to be the only one left), then contains() confirms (untimed) that the server has them.
          local_cpu is True only for dram: for disk, redis and s3 LocalCPUBackend is only the staging allocator
          (local_cpu=False, as LMCache's docs configure S3 and its legacy "local_disk" preset does), so their
          gets read the tier itself, not a CPU copy.
  get     StorageManager.batched_get(keys, location=<backend>), then torch.equal against what was written.
  get_cold  (disk) as get, after the driver fsyncs each file and drops it from the page cache with
          os.posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED); the line reports how many of the files' pages
          mincore() saw resident before and after, i.e. whether dropping worked.

S3: LMCache 0.5.6's S3Connector (remote_url "s3://<host>", awscrt) addresses buckets virtual-hosted style
only: it sends "Host: <host>" and puts objects at "/<key>", with no bucket in the path. A bucket on a local
server (moto) is therefore reached as s3://BUCKET.localhost:PORT; when that name does not resolve and the driver
runs as root with unshare(1), it re-runs itself in a private mount namespace whose /etc/hosts maps the name to
the endpoint's address (the machine's /etc/hosts is not touched); otherwise it prints an error line.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import mmap
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse

# LMCache logs INFO lines to stderr by default; keep the warnings and errors (they are also captured, below).
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

MIB = 1 << 20
GIB = 1 << 30
_REEXEC_MARK = "LMCACHE_BENCH_DRIVER_IN_NS"
DEFAULTS = {
    "chunks": 8,
    "repeats": 3,
    "num_layers": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "chunk_tokens": 256,
    "dtype": "bfloat16",
    "fsync": False,
    "use_odirect": False,
}
BACKEND = {"dram": "LocalCPUBackend", "disk": "LocalDiskBackend", "redis": "RemoteBackend", "s3": "RemoteBackend"}
POLL_S = 0.0005


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


class TierError(Exception):
    """The tier cannot run here (exit 0 with an error line)."""


class Failure(Exception):
    """LMCache dropped or corrupted data (exit 1 with an error line)."""


class _Capture(logging.Handler):
    """Keeps LMCache's warnings and errors: its connectors log failures instead of raising them."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.records.append(f"{record.name}: {record.getMessage()}")
        except Exception:  # pragma: no cover - a record that does not format
            self.records.append(f"{record.name}: {record.msg!r}")

    def attach(self) -> None:
        # init_logger() sets propagate=False on each lmcache.* logger, so a root handler would see nothing.
        for name, lg in list(logging.Logger.manager.loggerDict.items()):
            if name.startswith("lmcache") and isinstance(lg, logging.Logger) and self not in lg.handlers:
                lg.addHandler(self)

    def take(self) -> list[str]:
        out, self.records = self.records, []
        return out


CAPTURE = _Capture()


def one_line(text: str) -> str:
    return " ".join(str(text).split())


# ---------------------------------------------------------------- page cache (mmap + mincore through ctypes)
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_pages(path: str) -> tuple[int, int]:
    """(resident, total) pages of a file in the page cache: mmap(PROT_READ) + mincore, which reads nothing."""
    size = os.path.getsize(path)
    npages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    if size == 0:
        return 0, 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, "mmap: " + os.strerror(err))
        try:
            vec = (ctypes.c_ubyte * npages)()
            if _libc.mincore(addr, size, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, "mincore: " + os.strerror(err))
            return sum(v & 1 for v in vec), npages
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- S3 host name
def s3_target(settings: dict) -> tuple[str, str, bool, str]:
    """(remote_url, virtual host, tls, address the host must resolve to) for LMCache's S3Connector."""
    endpoint = settings.get("s3_endpoint")
    bucket = settings.get("s3_bucket")
    if not endpoint or not bucket:
        raise TierError("tier s3 needs s3_endpoint and s3_bucket")
    parsed = urllib.parse.urlparse(endpoint)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise TierError(f"s3_endpoint must be http(s)://HOST[:PORT], got {endpoint!r}")
    host = parsed.hostname
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    loopback = host in ("localhost", "::1") or host.startswith("127.")
    vhost = settings.get("s3_virtual_host") or (f"{bucket}.localhost" if loopback else f"{bucket}.{host}")
    address = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    return f"s3://{vhost}:{port}", vhost, parsed.scheme == "https", address


def ensure_s3_name_resolves(settings: dict, argv: list[str]) -> None:
    """Re-run in a private mount namespace with the bucket's virtual host in /etc/hosts, if it does not resolve."""
    _, vhost, _, address = s3_target(settings)
    try:
        socket.getaddrinfo(vhost, None)
        return
    except socket.gaierror as e:
        reason = f"{vhost!r} does not resolve ({e})"
    unshare = shutil.which("unshare")
    if os.environ.get(_REEXEC_MARK) or os.geteuid() != 0 or not unshare:
        raise TierError(
            "LMCache 0.5.6's S3Connector addresses the bucket virtual-hosted style (Host: BUCKET.HOST, objects at "
            f"/<key>), and {reason}; map it to {address} in /etc/hosts or pass s3_virtual_host"
        )
    with open("/etc/hosts") as f:
        hosts = f.read()
    fd, hosts_path = tempfile.mkstemp(prefix="lmcache-driver-hosts-")
    with os.fdopen(fd, "w") as f:
        f.write(hosts.rstrip("\n") + f"\n{address} {vhost}\n")
    os.chmod(hosts_path, 0o644)
    env = dict(os.environ, **{_REEXEC_MARK: "1"})
    script = 'mount --bind "$0" /etc/hosts && exec "$@"'
    cmd = [unshare, "-m", "sh", "-c", script, hosts_path, sys.executable, *argv]
    try:
        rc = subprocess.call(cmd, env=env)
    finally:
        os.unlink(hosts_path)
    sys.exit(rc)


# ---------------------------------------------------------------- the benchmark
def run(settings: dict) -> None:
    tier = settings["tier"]
    s = dict(DEFAULTS, **settings)

    import lmcache.v1.storage_backend.connector.instrumented_connector  # noqa: F401 (its logger, for CAPTURE)
    import lmcache.v1.storage_backend.remote_backend  # noqa: F401
    import torch
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    CAPTURE.attach()
    dtype = getattr(torch, s["dtype"])
    layers, heads, head_dim, tokens = s["num_layers"], s["num_kv_heads"], s["head_dim"], s["chunk_tokens"]
    chunks, repeats = int(s["chunks"]), int(s["repeats"])
    chunk_bytes = layers * 2 * tokens * heads * head_dim * dtype.itemsize
    backend_name = BACKEND[tier]

    # Pool sizes: dram keeps every repeat's chunks in LocalCPUBackend's pool; the other tiers use the pool for
    # staging only (the put's chunks until written, the get's chunks until verified).
    held = chunks * (repeats + 1) if tier == "dram" else chunks * 3
    cpu_gb = (held * chunk_bytes + 256 * MIB) / GIB
    cfg: dict = {
        "chunk_size": tokens,
        "local_cpu": tier == "dram",
        "max_local_cpu_size": cpu_gb,
        "save_unfull_chunk": False,
        "remote_serde": "naive",
        "blocking_timeout_secs": 120,
    }
    extra: dict = {}
    notes: dict = {}
    workdir = None
    if tier == "disk":
        if not s.get("disk_path"):
            raise TierError("tier disk needs disk_path")
        os.makedirs(s["disk_path"], exist_ok=True)
        workdir = tempfile.mkdtemp(prefix="lmcache-bench-", dir=s["disk_path"])
        cfg["local_disk"] = workdir
        cfg["max_local_disk_size"] = (chunks * repeats * chunk_bytes * 1.25 + 256 * MIB) / GIB
        extra["use_odirect"] = bool(s["use_odirect"])
    elif tier == "redis":
        if not s.get("redis_url"):
            raise TierError("tier redis needs redis_url")
        cfg["remote_url"] = s["redis_url"]
    elif tier == "s3":
        remote_url, vhost, tls, _ = s3_target(s)
        cfg["remote_url"] = remote_url
        extra.update(
            s3_region=s.get("s3_region") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
            disable_tls=not tls,
            s3_prefer_http2=tls,
            s3_num_io_threads=int(s.get("s3_num_io_threads", 8)),
            save_chunk_meta=False,
        )
        notes["s3_url"] = remote_url
    elif tier != "dram":
        raise TierError(f"unknown tier {tier!r}")
    if extra:
        cfg["extra_config"] = extra

    # ---- setup (timed separately)
    t0 = time.perf_counter()
    try:
        config = LMCacheEngineConfig.from_defaults(**cfg)
        metadata = LMCacheMetadata(
            model_name="kvstore-bench/lmcache",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=dtype,
            kv_shape=(layers, 2, tokens, heads, head_dim),
            use_mla=False,
            role="worker",
            chunk_size=tokens,
        )
        sm = StorageManager(config, metadata, event_manager=EventManager())
    except Exception as e:
        raise TierError(f"StorageManager setup failed: {type(e).__name__}: {one_line(e)}") from e
    try:
        _after_setup(sm, s, tier, cfg, notes, backend_name, t0, dtype)
    finally:
        close_storage_manager(sm)
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def _after_setup(sm, s, tier, cfg, notes, backend_name, t0, dtype) -> None:
    """Everything after StorageManager(...): the setup line, then put, get (and get_cold) per repeat."""
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat

    layers, heads, head_dim, tokens = s["num_layers"], s["num_kv_heads"], s["head_dim"], s["chunk_tokens"]
    chunks, repeats = int(s["chunks"]), int(s["repeats"])
    metadata = sm.metadata
    CAPTURE.attach()
    if backend_name not in sm.storage_backends:
        raise TierError(
            f"StorageManager has no {backend_name} (has {list(sm.storage_backends)}); "
            + one_line(" | ".join(CAPTURE.take()))
        )
    backend = sm.storage_backends[backend_name]
    if tier in ("redis", "s3"):
        if getattr(backend, "connection", None) is None:
            raise TierError("RemoteBackend has no connection: " + one_line(" | ".join(CAPTURE.take())))
        probe = CacheEngineKey("kvstore-bench/probe", 1, 0, secrets.randbits(63), dtype)
        backend.contains(probe)  # opens the connection; a server that does not answer logs a warning
        problems = [r for r in CAPTURE.take() if "fail" in r.lower() or "error" in r.lower()]
        if problems:
            raise TierError("remote probe (RemoteBackend.contains) failed: " + one_line(problems[0]))
    setup_s = time.perf_counter() - t0
    CAPTURE.take()
    shown_cfg = ", ".join(f"{k}={v!r}" for k, v in cfg.items() if k != "max_local_cpu_size")
    probe_note = "; RemoteBackend.contains probe" if tier in ("redis", "s3") else ""
    emit(
        {
            "tier": tier,
            "op": "setup",
            "seconds": setup_s,
            "api": f"LMCacheEngineConfig.from_defaults({shown_cfg}) + LMCacheMetadata + StorageManager(config, "
            f"metadata, EventManager()) -> backends {list(sm.storage_backends)}{probe_note}",
            **notes,
        }
    )

    shapes = metadata.get_shapes()  # [2, layers, tokens, heads * head_dim]
    odirect = " (O_DIRECT)" if s["use_odirect"] else ""
    driver_fsync = "; + driver os.fsync(file) each and os.fsync(dir)" if s["fsync"] else ""
    put_api = {
        "dram": "StorageManager.batched_put(keys, memory_objs) -> LocalCPUBackend.batched_submit_put_task "
        "(hot cache keeps a reference; no copy)",
        "disk": "StorageManager.batched_put(keys, memory_objs) -> LocalDiskBackend.batched_submit_put_task -> "
        f"async_save_bytes_to_disk in its thread pool: open(path,'wb').write(MemoryObj.byte_array){odirect}, no "
        f"fsync by LMCache{driver_fsync}; waited on LocalDiskBackend.contains(key) for all keys",
        "redis": "StorageManager.batched_put(keys, memory_objs) -> RemoteBackend.batched_submit_put_task -> "
        "RedisConnector.batched_put (redis.asyncio SET <key>kv_bytes then SET <key>metadata per chunk, "
        "concurrently); waited until the connector released each MemoryObj (server replied), then "
        "RemoteBackend.contains (EXISTS) checked untimed",
        "s3": "StorageManager.batched_put(keys, memory_objs) -> RemoteBackend.submit_put_task per key -> "
        "S3Connector.put (awscrt S3Client PUT_OBJECT of MemoryObj.byte_array, which the CRT sends as a multipart "
        "upload of 8 MiB parts); waited until the connector "
        "released each MemoryObj (request finished), then RemoteBackend.contains checked untimed",
    }[tier]
    put_api += (
        "; before it, prep_copy_seconds: the engine's tensor copied into MemoryObjs from "
        "StorageManager.allocate(fmt=KV_2LTD) (LMCacheEngine.store's GPUConnector.batched_from_gpu copy)"
    )
    get_api = {
        "dram": "StorageManager.batched_get(keys, location='LocalCPUBackend') -> LocalCPUBackend.get_blocking "
        "per key (returns the stored MemoryObj, ref_count_up; no copy)",
        "disk": "StorageManager.batched_get(keys, location='LocalDiskBackend') -> "
        "LocalDiskBackend.batched_get_blocking (LocalCPUBackend.allocate per chunk, file.readinto(byte_array) "
        "in a 4-thread pool)",
        "redis": "StorageManager.batched_get(keys, location='RemoteBackend') -> RemoteBackend.batched_get_blocking "
        "-> RedisConnector.get per key, concurrently (GET <key>metadata, LocalCPUBackend.allocate, GET "
        "<key>kv_bytes, copy into the MemoryObj)",
        "s3": "StorageManager.batched_get(keys, location='RemoteBackend') -> RemoteBackend.batched_get_blocking "
        "-> S3Connector.batched_get (LocalCPUBackend.allocate, awscrt GET_OBJECT in ranged parts, each written "
        "into the MemoryObj with ctypes.memmove)",
    }[tier]
    get_api += "; then copy_out_seconds: each MemoryObj into the engine's layout; verified untimed with torch.equal"

    gen = torch.Generator().manual_seed(int(s.get("seed", 0)))
    outs = [torch.zeros((layers, 2, tokens, heads, head_dim), dtype=dtype) for _ in range(chunks)]  # pre-touched
    for rep in range(repeats):
        # ---- prep (untimed): fresh keys, random contents, MemoryObjs from LMCache's allocator
        keys = [CacheEngineKey("kvstore-bench/lmcache", 1, 0, secrets.randbits(63), dtype) for _ in range(chunks)]
        sources = []
        objs = []
        copy_s = 0.0
        for _ in range(chunks):
            src = torch.randn((layers, 2, tokens, heads, head_dim), generator=gen, dtype=torch.float32).to(dtype)
            obj = sm.allocate(shapes, [dtype], fmt=MemoryFormat.KV_2LTD, busy_loop=False)
            if obj is None:
                raise Failure("StorageManager.allocate returned None (LocalCPUBackend pool full)")
            tc = time.perf_counter()
            obj.tensor.copy_(src.permute(1, 0, 2, 3, 4).reshape(shapes[0]))  # a view: one strided copy
            copy_s += time.perf_counter() - tc
            obj.ref_count_up()  # the driver's own reference: tells when the backend has let go
            sources.append(src)
            objs.append(obj)
        nbytes = sum(o.get_size() for o in objs)

        # ---- put
        t0 = time.perf_counter()
        sm.batched_put(keys, objs)
        deadline = time.monotonic() + 300
        if tier == "disk":
            pending = list(keys)
            while pending:
                pending = [k for k in pending if not backend.contains(k)]
                if pending:
                    if time.monotonic() > deadline:
                        raise Failure("disk put did not finish in 300 s: " + one_line(" | ".join(CAPTURE.take())))
                    time.sleep(POLL_S)
            if s["fsync"]:
                for k in keys:
                    fd = os.open(backend._key_to_path(k), os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                dfd = os.open(backend.path, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        elif tier in ("redis", "s3"):
            while any(o.get_ref_count() > 1 for o in objs):
                if time.monotonic() > deadline:
                    raise Failure("remote put did not finish in 300 s: " + one_line(" | ".join(CAPTURE.take())))
                time.sleep(POLL_S)
        put_s = time.perf_counter() - t0
        for o in objs:
            o.ref_count_down()
        missing = [k for k in keys if not backend.contains(k)]
        if missing:
            raise Failure(
                f"{len(missing)} of {chunks} chunks not in {backend_name} after put: "
                + one_line(" | ".join(CAPTURE.take()) or "no LMCache log")
            )
        line = {"tier": tier, "op": "put", "repeat": rep, "seconds": put_s, "bytes": nbytes, "api": put_api}
        # Not in "seconds": the copy of the [layers, 2, tokens, heads, head_dim] tensors into the MemoryObjs
        # (CPU to CPU here; LMCacheEngine.store does it from the GPU in GPUConnector.batched_from_gpu).
        line["prep_copy_seconds"] = copy_s
        if tier == "disk":
            line["fsync"] = "driver (os.fsync per file + directory)" if s["fsync"] else "none (LMCache does none)"
        emit(line)
        del objs

        # ---- get (warm), and for disk get_cold
        variants = ["get"] + (["get_cold"] if tier == "disk" else [])
        for op in variants:
            extra_line: dict = {}
            if op == "get_cold":
                extra_line.update(drop_page_cache([backend._key_to_path(k) for k in keys]))
            t0 = time.perf_counter()
            got = sm.batched_get(keys, location=backend_name)
            get_s = time.perf_counter() - t0
            # Not in "seconds": the copy out of the MemoryObjs into the engine's [layers, 2, tokens, heads,
            # head_dim] tensors (LMCacheEngine.retrieve does it to the GPU in GPUConnector.batched_to_gpu).
            t0 = time.perf_counter()
            for obj, out in zip(got, outs, strict=True):
                if obj is not None:
                    out.copy_(obj.tensor.view(2, layers, tokens, heads, head_dim).permute(1, 0, 2, 3, 4))
            extra_line["copy_out_seconds"] = time.perf_counter() - t0
            try:
                check(got, sources, shapes[0], tier, op, rep)
                if not all(torch.equal(out, src) for out, src in zip(outs, sources, strict=True)):
                    raise Failure(f"{op} repeat {rep}: the copy out of LMCache's objects differs from what was written")
            finally:
                for o in got:
                    if o is not None:
                        o.ref_count_down()
            emit(
                {
                    "tier": tier,
                    "op": op,
                    "repeat": rep,
                    "seconds": get_s,
                    "bytes": sum(o.get_size() for o in got if o is not None),
                    "api": get_api,
                    **extra_line,
                }
            )
            del got
        del sources


def close_storage_manager(sm) -> None:
    """StorageManager.close(), given a few seconds.

    In LMCache 0.5.6 it never returns with a RemoteBackend: RedisConnector.close() and S3Connector.close() are
    coroutines run on the StorageManager's event loop that call AsyncPQExecutor.shutdown(wait=True), which
    blocks on a future scheduled on that same loop (a deadlock). Then the process must leave with os._exit,
    since the loop's thread is not a daemon thread.
    """
    import threading

    t = threading.Thread(target=sm.close, name="lmcache-close", daemon=True)
    t.start()
    t.join(5.0)
    if t.is_alive():
        print(
            "lmcache_driver: StorageManager.close() did not return in 5 s (LMCache 0.5.6 deadlocks closing a "
            "RemoteBackend's connector); exiting with os._exit",
            file=sys.stderr,
            flush=True,
        )


def check(got, sources, shape, tier, op, rep) -> None:
    import torch

    if len(got) != len(sources):
        raise Failure(f"batched_get returned {len(got)} objects for {len(sources)} keys")
    for i, (obj, src) in enumerate(zip(got, sources, strict=True)):
        if obj is None:
            raise Failure(
                f"{op} repeat {rep}: chunk {i} missing (batched_get returned None): "
                + one_line(" | ".join(CAPTURE.take()) or "no LMCache log")
            )
        want = src.permute(1, 0, 2, 3, 4).reshape(shape)
        if tuple(obj.tensor.shape) != tuple(want.shape) or not torch.equal(obj.tensor, want):
            raise Failure(f"{op} repeat {rep}: chunk {i} read back from {tier} differs from what was written")


def drop_page_cache(paths: list[str]) -> dict:
    """fsync + POSIX_FADV_DONTNEED each file; report the resident pages before and after (mincore)."""
    before = after = total = 0
    err = None
    for p in paths:
        try:
            r, n = resident_pages(p)
            before += r
            total += n
        except OSError as e:
            err = f"mincore: {e}"
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        try:
            after += resident_pages(p)[0]
        except OSError as e:
            err = f"mincore: {e}"
    out = {
        "drop": "fsync + posix_fadvise(POSIX_FADV_DONTNEED) per file",
        "resident_pages_before": before,
        "resident_pages_after": after,
        "file_pages": total,
        "dropped": total > 0 and after < before,
    }
    if err:
        out["mincore_error"] = err
    return out


USAGE = (
    "usage: python -m benchmarks.lmcache_driver '<json settings>'\n"
    "  (with LMCache's environment: .venv-lmcache/bin/python benchmarks/lmcache_driver.py '<json settings>';\n"
    "   scripts/lmcache_env.sh makes it)"
)


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        print(__doc__)
        raise SystemExit(0)
    if len(argv) != 1:
        print(USAGE, file=sys.stderr)
        return 2
    settings = json.loads(argv[0])
    tier = settings.get("tier")
    try:
        if tier == "s3":
            ensure_s3_name_resolves(settings, [os.path.abspath(__file__), *argv])
        run(settings)
    except TierError as e:
        emit({"tier": tier, "error": one_line(e)})
        return 0
    except Failure as e:
        emit({"tier": tier, "error": one_line(e)})
        return 1
    return 0


if __name__ == "__main__":
    rc = main(sys.argv[1:])
    # LMCache's StorageManager runs its event loop in a non-daemon thread that a failed or hung close() leaves
    # running, so leave with os._exit once the output is flushed (the disk tier's files are already removed).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
