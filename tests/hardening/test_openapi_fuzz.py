"""The fuzz suite over every endpoint and field: schemathesis against the OpenAPI document.

The document is generated from the app's routes and the request types (tidal/http/openapi.py),
so a new route or field is fuzzed as soon as it exists; ``test_the_document_covers_every_route_
and_field`` fails for one that the document (and so the fuzzer) would miss, and checks that the
document the fuzzer reads is the one the live server serves at ``GET /openapi.json``. The schema is
built at collection from that generator rather than fetched through a fixture: schemathesis' lazy
fixture mode reads a private pytest attribute that pytest 9.2 removed. The property, for
every generated request (valid and invalid bodies, path parameters): never a 5xx, an error is
OpenAI's shape (Anthropic's on /v1/messages), and afterwards the server is alive and idle (every KV block free). The
WebSocket's messages are fuzzed by test_fuzz.py. Bounded time: 12 generated examples per route (17 routes:
253 s with 20 on a 2-core host at load 15, hence 12), besides schemathesis' boundary cases.
"""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings

from tidal.http.openapi import app_routes, openapi_document
from tidal.http.routes import REQUEST_BODIES, create_app
from tidal.registry.adapters import AdapterRegistry
from tidal.ui import register_state, register_ui


def _app():
    """The app as ``tidal serve`` assembles it (no engine: only its routes are read)."""
    api = SimpleNamespace(tokenizer=None, model_name="tidal-tiny", max_model_len=64, vocab_size=8192,
                          adapters=AdapterRegistry("tidal-tiny"))
    app = create_app(api, None, 1 << 20, lambda: b"", None)  # type: ignore[arg-type]
    register_state(app, None)  # type: ignore[arg-type]
    register_ui(app)
    return app


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The package's server without its 20 ms step floor, which only the tests acting beside a stream need: the
    fuzz reads each answer's status, and schemathesis' boundary cases make ~450 valid requests on a route such as
    /v1/responses (96 s at that floor)."""
    from live_server import LiveServer

    from hardening.conftest import server_args

    with LiveServer(*server_args(tmp_path_factory.mktemp("lora-allowed"), step_time=0)) as live:
        yield live


schema = schemathesis.openapi.from_dict(openapi_document(app_routes(_app()), REQUEST_BODIES))


def _fields(struct_type: type) -> set[str]:
    return {field.name for field in msgspec.inspect.type_info(struct_type).fields}


def test_the_document_covers_every_route_and_field(server):
    live = server.client.get(server.url + "/openapi.json").json()
    routes = app_routes(_app())
    document = openapi_document(routes, REQUEST_BODIES)  # raises for a POST route without a body type
    assert set(live["paths"]) == set(document["paths"])
    assert live == msgspec.json.decode(msgspec.json.encode(schema.raw_schema))  # what the fuzzer reads
    for path in _app().config["SERVICE_ROUTES"]:  # served in front of quart (completion_route.py): still in the document
        assert "requestBody" in live["paths"][path]["post"], path
    schemas = live["components"]["schemas"]
    for body_type in set(REQUEST_BODIES.values()):
        assert _fields(body_type) <= set(schemas[body_type.__name__]["properties"]), body_type
    assert ("GET", "/openapi.json") in routes


@schema.parametrize()
@settings(max_examples=12, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
def test_every_route_and_field_never_answers_5xx(case, server):
    response = case.call(base_url=server.url, timeout=60)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    content_type = {name.lower(): value for name, value in response.headers.items()}.get("content-type", [""])
    content_type = content_type[0] if isinstance(content_type, list) else content_type  # schemathesis: lists
    if response.status_code >= 400 and content_type.startswith("application/json"):
        if case.path.startswith("/v1/messages"):  # Anthropic's API answers in Anthropic's error shape
            body = response.json()
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, response.text[:500]
        else:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}, response.text[:500]


def test_after_the_fuzz_the_server_is_alive_and_idle(server):
    assert server.process.poll() is None
    server.wait_idle(timeout=30)
