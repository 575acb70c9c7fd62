"""``GET /openapi.json``: the API's schema, generated from the app's routes and the request types.

Every route the app serves is a path here (so a new one is fuzzed from the day it exists:
tests/hardening/test_openapi_fuzz.py runs schemathesis against this document), and every body
a route takes is described by the msgspec struct it is decoded into, bounds and all
(``msgspec.json.schema_components``): the schema the fuzzer reads is the one the server checks.
The WebSocket (``/v1/ws``) has no OpenAPI form; its messages are fuzzed by test_fuzz.py.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer", "null"]}}}}}
_PATH_PARAMETER = re.compile(r"<(?:[a-z]+:)?([A-Za-z_]\w*)>")


def openapi_document(routes: list[tuple[str, str]], bodies: dict[tuple[str, str], type],
                     title: str = "tidal", version: str = "0") -> dict[str, Any]:
    """OpenAPI 3.1 for ``routes`` ((METHOD, quart rule) pairs), with the request body of each
    (METHOD, rule) in ``bodies`` (a msgspec struct). A POST without a body type is an error:
    it could not be fuzzed."""
    missing = [f"{method} {rule}" for method, rule in routes if method == "POST" and (method, rule) not in bodies]
    if missing:
        raise ValueError(f"routes without a request body type for /openapi.json: {missing}")
    types = sorted(set(bodies.values()), key=lambda t: t.__name__)
    schemas, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    by_type = dict(zip(types, schemas))
    paths: dict[str, dict[str, Any]] = {}
    for method, rule in sorted(set(routes)):
        path = _PATH_PARAMETER.sub(r"{\1}", rule)
        operation: dict[str, Any] = {
            "operationId": f"{method.lower()} {path}",
            "responses": {"default": {"description": "The answer, or an error in OpenAI's shape",
                                      "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}},
        }
        parameters = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                      for name in _PATH_PARAMETER.findall(rule)]
        if parameters:
            operation["parameters"] = parameters
        body_type = bodies.get((method, rule))
        if body_type is not None:
            operation["requestBody"] = {"required": True,
                                        "content": {"application/json": {"schema": by_type[body_type]}}}
        paths.setdefault(path, {})[method.lower()] = operation
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": {"schemas": {**components, "Error": _ERROR}}}


def app_routes(app) -> list[tuple[str, str]]:
    """(METHOD, rule) of every HTTP route a quart app serves (HEAD and OPTIONS left out: quart adds them)."""
    out = []
    for rule in app.url_map.iter_rules():
        if getattr(rule, "websocket", False) or rule.endpoint == "static":
            continue
        out.extend((method, rule.rule) for method in sorted(rule.methods or ()) if method not in ("HEAD", "OPTIONS"))
    return out
