"""GET /v1/models/{id}: the openai SDK's ``models.retrieve`` against a live server."""

from __future__ import annotations

import httpx
import openai
import pytest

from .support import API_KEY, AUTH, MAX_MODEL_LEN, SERVED_MODEL, assert_openai_error


def test_models_retrieve_returns_the_served_model(api_server):
    client = openai.OpenAI(base_url=api_server.url + "/v1", api_key=API_KEY, max_retries=0)
    model = client.models.retrieve(SERVED_MODEL)
    assert (model.id, model.object, model.owned_by) == (SERVED_MODEL, "model", "tidal")
    body = httpx.get(f"{api_server.url}/v1/models/{SERVED_MODEL}", headers=AUTH).json()
    assert body == httpx.get(api_server.url + "/v1/models", headers=AUTH).json()["data"][0]
    assert body["max_model_len"] == MAX_MODEL_LEN


@pytest.mark.parametrize("model_id", ["gpt-4o", "org/tidal-test", SERVED_MODEL.upper()])
def test_unknown_model_id_is_404_in_openai_shape(api_server, model_id):
    response = httpx.get(f"{api_server.url}/v1/models/{model_id}", headers=AUTH)
    error = assert_openai_error(response, 404, "model", "not_found_error")
    assert error["code"] == "model_not_found" and model_id in error["message"]
    client = openai.OpenAI(base_url=api_server.url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(model_id)


def test_model_retrieve_needs_the_api_key(api_server):
    assert_openai_error(httpx.get(f"{api_server.url}/v1/models/{SERVED_MODEL}"), 401, None, "authentication_error")
