"""What a web page in the user's browser may do to a local server (tidal/http/browser_gate.py).

Before: without --api-key any page's ``text/plain`` POST (no preflight) was served on every /v1/*
route and /tokenize, and DNS rebinding (the page's own name resolving to 127.0.0.1, so its Origin
matched the Host it sent) passed the WebSocket's Origin check. Each case below is what a browser
sends; the SDKs, curl with a JSON content type and the server's own page pass.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from live_server import LiveServer

from tidal.http.browser_gate import DRAIN_LIMIT

from .clients import Http1Connection, assert_openai_error

BODY = json.dumps({"prompt": "Hi", "max_tokens": 1}).encode()


def _post(server, path="/v1/completions", headers=(), content_type="application/json"):
    with Http1Connection(server.port) as conn:
        return conn.request("POST", path, BODY, headers=list(headers), content_type=content_type)


def test_a_foreign_pages_simple_post_is_refused_before_the_model_runs(server):
    status, headers, answer = _post(server, headers=[("Origin", "https://evil.example")], content_type="text/plain")
    assert_openai_error(status, headers, answer, 403)
    assert "--allowed-origins" in json.loads(answer)["error"]["message"]
    status, headers, answer = _post(server, "/tokenize", headers=[("Origin", "https://evil.example")])
    assert_openai_error(status, headers, answer, 403)
    status, _, answer = _post(server, "/v1/messages", headers=[("Origin", "null")])
    assert status == 403 and json.loads(answer)["type"] == "error"  # Anthropic's shape on its route


def test_json_routes_require_a_json_content_type(server):
    # form-urlencoded: curl -d's default; None: a fetch() of a Blob without a type
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        status, headers, answer = _post(server, content_type=content_type)
        assert_openai_error(status, headers, answer, 415)
    for content_type in ("application/json", "application/json; charset=utf-8", "application/merge-patch+json"):
        status, _, answer = _post(server, content_type=content_type)
        assert status == 200, answer


def test_a_refused_small_body_keeps_its_connection_and_a_large_one_closes_it(server):
    """curl -d without -H is a common slip: its 415 leaves the keep-alive connection usable."""
    with Http1Connection(server.port) as conn:
        for body in (b"", BODY, b" " * DRAIN_LIMIT):  # the last: a body at the drain limit, still read
            status, headers, answer = conn.request("POST", "/v1/completions", body, content_type=None)
            assert_openai_error(status, headers, answer, 415)
            assert conn.reusable
        assert conn.request("POST", "/v1/completions", BODY)[0] == 200
    with Http1Connection(server.port) as conn:  # past the drain limit the server stops reading and closes
        status, headers, _ = conn.request("POST", "/v1/completions", b" " * (1 << 20), content_type="text/plain")
        assert status == 415 and headers.get("connection") == "close"


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.2"])
def test_a_host_not_naming_the_loopback_is_refused(server, host):
    """DNS rebinding: the page's Origin matches the Host it sends, but the Host is not ours."""
    with httpx.Client() as client:
        answer = client.post(server.url + "/v1/completions", content=BODY,
                             headers={"Host": host, "Origin": f"http://{host}", "Content-Type": "application/json"})
        assert answer.status_code == 403 and "--allowed-hosts" in answer.json()["error"]["message"]
        for name in ("localhost", "127.0.0.1", "[::1]"):
            assert client.get(server.url + "/v1/models", headers={"Host": f"{name}:{server.port}"}).status_code == 200


def test_a_rebinding_page_cannot_open_the_websocket(server):
    handshake = (b"GET /v1/ws HTTP/1.1\r\nHost: evil.example\r\nOrigin: http://evil.example\r\n"
                 b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                 b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(handshake)
        assert sock.recv(4096).startswith(b"HTTP/1.1 403")


def test_a_foreign_preflight_is_refused_and_the_servers_own_origin_is_served(server):
    with httpx.Client() as client:
        preflight = client.options(server.url + "/v1/completions", headers={
            "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
        assert preflight.status_code == 403
        own = client.post(server.url + "/v1/completions", content=BODY,
                          headers={"Origin": server.url, "Content-Type": "application/json"})
        assert own.status_code == 200 and "access-control-allow-origin" not in own.headers


def test_allowed_origins_and_hosts_widen_the_policy_with_cors():
    with LiveServer("--allowed-origins", "https://app.example", "--allowed-hosts", "tidal.local",
                    "--no-ui", "--max-model-len", "64") as server, httpx.Client() as client:
        preflight = client.options(server.url + "/v1/chat/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert preflight.status_code == 204
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert "content-type" in preflight.headers["access-control-allow-headers"]
        answer = client.post(server.url + "/v1/completions", content=BODY,
                             headers={"Origin": "https://app.example", "Content-Type": "application/json"})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "https://app.example"
        named = client.get(server.url + "/v1/models", headers={"Host": f"tidal.local:{server.port}"})
        assert named.status_code == 200
        other = client.get(server.url + "/v1/models", headers={"Host": "other.local"})
        assert other.status_code == 403
