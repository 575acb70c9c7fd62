"""A client that stops reading but keeps its connection open cannot hold the server up at
shutdown: SIGTERM drains, aborts, cuts that connection and exits 0."""

from __future__ import annotations

import json
import signal
import socket
import time

from live_server import LiveServer


def test_shutdown_is_not_pinned_by_a_client_that_stopped_reading():
    with LiveServer("--model", "tidal-test", "--min-step-time", "0.002", "--shutdown-timeout", "1",
                    "--stream-stall-timeout", "600", "--max-stream-buffer-bytes", str(64 << 20)) as server:
        body = json.dumps({"prompt": "hi", "max_tokens": 3000, "stream": True}).encode()
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
        time.sleep(3)  # the server fills both socket buffers and its send waits on this client
        start = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(30)
        elapsed = time.monotonic() - start
        sock.close()
        assert code == 0
        assert elapsed < 15, f"shutdown took {elapsed:.1f} s"
