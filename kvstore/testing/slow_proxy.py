"""A TCP proxy that slows a real server down on purpose: a delay per request and a bandwidth cap.

For tests and benchmarks of what a slow tier costs (the load planner, timeouts): put it in front
of ``redis-server`` or an S3 server and point the tier at ``proxy.port``. The server stays real;
only the path to it is slow, like a congested link.

    with SlowProxy("127.0.0.1", redis.port, delay=0.02, bytes_per_s=20e6) as proxy:
        config = StoreConfig(redis={"enabled": True, "url": f"redis://127.0.0.1:{proxy.port}/0"})

Threads, not asyncio: it serves whatever loop or thread the client runs on. ``delay`` is added
once before each burst the client sends (a request) and ``bytes_per_s`` paces what the server
sends back. Both may be changed while it runs (a tier that turns slow).
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
        self, target_host: str, target_port: int, *, delay: float = 0.0, bytes_per_s: float | None = None
    ) -> None:
        self.target = (target_host, target_port)
        self.delay, self.bytes_per_s = delay, bytes_per_s
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
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self._sockets.clear()

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
        """Copy ``source`` to ``sink``: requests after ``delay``, replies paced at ``bytes_per_s``."""
        try:
            while True:
                data = source.recv(BURST)
                if not data:
                    break
                if upstream and self.delay:
                    time.sleep(self.delay)
                rate = self.bytes_per_s
                if not upstream and rate:
                    time.sleep(len(data) / rate)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)
