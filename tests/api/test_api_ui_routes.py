"""The chat page's routes: the page and /state need no API key, --no-ui turns the page off, and
a browser (which cannot send headers on a WebSocket) can give the key as a subprotocol."""

from __future__ import annotations

import base64
import json

import httpx
import pytest
import trio_websocket

from .support import API_KEY, SERVED_MODEL, assert_openai_error


def test_page_and_its_files_are_served_without_a_key(api_server):
    page = httpx.get(api_server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]  # nothing from elsewhere
    assert '<script src="/ui/app.js"' in page.text
    for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
        response = httpx.get(f"{api_server.url}/ui/{name}")
        assert response.status_code == 200 and response.headers["content-type"].startswith(kind)
    icon = httpx.get(api_server.url + "/favicon.ico")  # where a browser asks first: no 404 in its console
    assert icon.status_code == 200 and icon.headers["content-type"].startswith("image/svg+xml")
    assert icon.content.startswith(b"<svg") and '<link rel="icon" href="/ui/favicon.svg"' in page.text
    assert_openai_error(httpx.get(api_server.url + "/ui/index.htm"), 404)
    assert_openai_error(httpx.get(api_server.url + "/ui/../README.md"), 404)


def test_state_reports_the_engine_and_the_last_minute(api_server):
    state = httpx.get(api_server.url + "/state").json()
    assert state["model"] == SERVED_MODEL
    assert state["kv_blocks_total"] == 128 and 0 <= state["kv_usage"] <= 1
    assert set(state["aborted_last_minute"]) == {"client_disconnect", "client_cancel", "slow_client", "shutdown",
                                                 "engine_error"}
    assert set(state["rejected_last_minute"]) == {"queue_full", "queue_timeout", "preempted_by_priority", "shutdown"}


def test_no_ui_turns_the_page_off_but_not_state(ws_server):
    assert_openai_error(httpx.get(ws_server.url + "/"), 404)
    assert httpx.get(ws_server.url + "/state").status_code == 200


def bearer_subprotocol(key: str) -> str:
    return "tidal.bearer." + base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


async def test_websocket_key_as_a_subprotocol(api_server):
    url = f"ws://127.0.0.1:{api_server.port}/v1/ws"
    async with trio_websocket.open_websocket_url(url, subprotocols=["tidal", bearer_subprotocol(API_KEY)]) as ws:
        assert ws.subprotocol == "tidal"  # the key itself is never echoed back
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        await ws.send_message(json.dumps({"type": "request", "id": 1, "endpoint": "chat.completions",
                                          "body": body}))
        first = json.loads(await ws.get_message())
        assert (first["type"], first["id"]) == ("chunk", 1), first


async def test_a_wrong_key_in_the_subprotocol_is_refused(api_server):
    url = f"ws://127.0.0.1:{api_server.port}/v1/ws"
    async with trio_websocket.open_websocket_url(url, subprotocols=["tidal", bearer_subprotocol("sk-no")]) as ws:
        error = json.loads(await ws.get_message())
        assert (error["type"], error["id"], error["status"]) == ("error", None, 401)
        with pytest.raises(trio_websocket.ConnectionClosed):
            await ws.get_message()
        assert ws.closed.code == 1008
