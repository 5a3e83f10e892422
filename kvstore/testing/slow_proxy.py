"""A TCP proxy that slows a real server down on purpose: a delay per request, bandwidth caps, a held gate.

For tests and benchmarks of what a slow tier costs (the load planner, timeouts): put it in front
of ``redis-server`` or an S3 server and point the tier at ``proxy.port``. The server stays real;
only the path to it is slow, like a congested link.

    with SlowProxy("127.0.0.1", redis.port, delay=0.02, bytes_per_s=20e6) as proxy:
        config = StoreConfig(redis={"enabled": True, "url": f"redis://127.0.0.1:{proxy.port}/0"})

Threads, not asyncio: it serves whatever loop or thread the client runs on. ``delay`` is added
once before each burst the client sends (a request); ``bytes_per_s`` paces what the server sends
back on each connection, ``total_bytes_per_s`` what it sends back on all of them together (one
congested link, however many connections a client opens). All may be changed while it runs (a
tier that turns slow).

:meth:`SlowProxy.hold` stops the server's replies beyond a small allowance per connection until
:meth:`SlowProxy.release`: small replies (a lookup's) still pass, a chunk's bytes wait. A test
holds a load in flight for as long as it needs, without depending on how long anything takes.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

HOST = "127.0.0.1"
BURST = 64 << 10  # bytes forwarded per paced step


class SlowProxy:
    """Forward ``HOST:port`` to ``target_host:target_port``, slowed by ``delay`` and ``bytes_per_s`` (None: no cap)."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        delay: float = 0.0,
        bytes_per_s: float | None = None,
        total_bytes_per_s: float | None = None,
    ) -> None:
        self.target = (target_host, target_port)
        self.delay, self.bytes_per_s, self.total_bytes_per_s = delay, bytes_per_s, total_bytes_per_s
        self._link_free_at = 0.0  # monotonic time when the shared link has sent what it was given
        self._released = threading.Event()
        self._released.set()
        self._allowance = 0  # bytes a connection's replies may pass while held
        self._holds = 0  # holds so far: a connection counts what it passed since the latest
        self._listener = socket.create_server((HOST, 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="slow-proxy", daemon=True)

    def start(self) -> SlowProxy:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop accepting and cut every connection (blocking, briefly)."""
        self._closed = True
        self._released.set()  # no reply waits on a proxy that is gone
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self._sockets.clear()

    def hold(self, allowance: int = 16 << 10) -> None:
        """From now on, each connection's replies pass ``allowance`` bytes more, then wait for :meth:`release`."""
        self._allowance = allowance
        self._holds += 1
        self._released.clear()

    def release(self) -> None:
        """Let every held reply go on."""
        self._released.set()

    def _pace_link(self, nbytes: int) -> None:
        """Wait for the shared link (``total_bytes_per_s``) to send ``nbytes``, after what it was given before."""
        rate = self.total_bytes_per_s
        if not rate:
            return
        with self._lock:
            start = max(time.monotonic(), self._link_free_at)
            self._link_free_at = start + nbytes / rate
            done = self._link_free_at
        time.sleep(max(0.0, done - time.monotonic()))

    def __enter__(self) -> SlowProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(self.target)
            except OSError:  # the server is down: this client's connection fails, the proxy goes on
                client.close()
                continue
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, upstream: bool) -> None:
        """Copy ``source`` to ``sink``: requests after ``delay``; replies paced, and held while :meth:`hold` says."""
        passed_while_held, hold = 0, self._holds
        try:
            while True:
                data = source.recv(BURST)
                if not data:
                    break
                if upstream and self.delay:
                    time.sleep(self.delay)
                if not upstream:
                    if not self._released.is_set():
                        if hold != self._holds:
                            passed_while_held, hold = 0, self._holds
                        passed_while_held += len(data)
                        if passed_while_held > self._allowance:
                            self._released.wait()
                    rate = self.bytes_per_s
                    if rate:
                        time.sleep(len(data) / rate)
                    self._pace_link(len(data))
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)
