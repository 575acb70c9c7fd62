"""LoRA adapters through a live server, as vLLM's clients use them: a request's ``model`` picks the adapter on
every endpoint (chat, completions, Responses, Messages, WebSocket), /v1/models lists each with its parent and
root, adapters load and unload at runtime, and each bound and bad input is a clear error in the API's shape.

Rules for determinism: tidal-tiny, greedy sampling; adapters made offline with peft (tests/lora_adapters.py).
Requests held open for the in-use checks stream under --min-step-time, so they are still running when checked.
"""

from __future__ import annotations

import json
import os
import shutil

import anthropic
import httpx
import openai
import pytest
import trio

from live_server import LiveServer
from tidal.gpu.model import tiny_model
from tidal.tools.ws_client import open_tidal_ws

pytest.importorskip("peft")

STEP_TIME = 0.02
PROMPT = "The tide comes in and"


def make_tiny_adapter(out_dir, seed: int, r: int = 8, **config) -> str:
    """A peft adapter of tidal-tiny's shapes (a transformers model built from its config, random A and B)."""
    import peft
    import torch
    import transformers

    from lora_adapters import LORA_STD, ATTENTION_AND_MLP

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(tiny_model.asset_dir()))
    lora = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=ATTENTION_AND_MLP, init_lora_weights=False, **config)
    adapted = peft.get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(adapted.named_parameters()):
            if ".lora_" in name:
                param.copy_(LORA_STD * torch.randn(param.shape, generator=generator))
    adapted.save_pretrained(str(out_dir))
    return str(out_dir)


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    allowed = root / "allowed"
    allowed.mkdir()
    return {"a": make_tiny_adapter(root / "a", 1), "b": make_tiny_adapter(root / "b", 2),
            "c": make_tiny_adapter(root / "c", 3), "d": make_tiny_adapter(allowed / "d", 4),
            "rank32": make_tiny_adapter(allowed / "rank32", 5, r=32), "allowed": str(allowed), "outside": str(root)}


@pytest.fixture(scope="module")
def server(adapter_dirs):
    b = json.dumps({"name": "b", "path": adapter_dirs["b"], "base_model_name": "tiny-base"})
    with LiveServer("--enable-lora", "--lora-modules", f"a={adapter_dirs['a']}", b, f"c={adapter_dirs['c']}",
                    "--max-loras", "2", "--max-cpu-loras", "2", "--enable-lora-runtime-updates",
                    "--lora-allowed-dirs", adapter_dirs["allowed"], "--min-step-time", str(STEP_TIME),
                    "--no-ui") as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def complete(client, model: str, max_tokens: int = 12) -> openai.types.Completion:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0)


def chat_text(client, model: str) -> str:
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=12, temperature=0)
    assert answer.model == model
    return answer.choices[0].message.content


def test_models_lists_each_adapter_with_its_parent_and_root(server, adapter_dirs):
    cards = {card["id"]: card for card in httpx.get(server.url + "/v1/models").json()["data"]}
    assert cards["a"]["parent"] == "tidal-tiny" and cards["a"]["root"] == adapter_dirs["a"]
    assert cards["b"]["parent"] == "tiny-base" and cards["b"]["root"] == adapter_dirs["b"]
    assert cards["tidal-tiny"]["parent"] is None
    assert httpx.get(server.url + "/v1/models/c").json()["root"] == adapter_dirs["c"]


def test_the_model_field_picks_the_adapter(client):
    base, a, b = (complete(client, model) for model in ("tidal-tiny", "a", "b"))
    assert a.model == "a" and base.model == "tidal-tiny"
    assert len({base.choices[0].text, a.choices[0].text, b.choices[0].text}) == 3, "each adapter changes the text"
    assert complete(client, "a").choices[0].text == a.choices[0].text  # greedy: the same adapter, the same text


def test_every_endpoint_runs_through_the_adapter(server, client):
    through_a = chat_text(client, "a")
    assert through_a != chat_text(client, "tidal-tiny")
    response = client.responses.create(model="a", input=PROMPT, max_output_tokens=12, temperature=0)
    assert response.model == "a" and response.output_text == through_a
    with anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0) as claude:
        message = claude.messages.create(model="a", max_tokens=12, extra_body={"temperature": 0},
                                         messages=[{"role": "user", "content": PROMPT}])
    assert message.model == "a" and message.content[0].text == through_a

    async def over_websocket() -> str:
        async with open_tidal_ws(server.url.replace("http", "ws") + "/v1/ws") as ws:
            body = {"model": "a", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12,
                    "temperature": 0}
            async with ws.stream("chat.completions", body) as stream:
                return "".join([chunk["choices"][0]["delta"].get("content") or "" async for chunk in stream])

    assert trio.run(over_websocket) == through_a


def test_an_unknown_model_is_a_404_in_each_apis_shape(server, client):
    with pytest.raises(openai.NotFoundError) as caught:
        complete(client, "nope")
    assert caught.value.body["code"] == "model_not_found" and "`nope` does not exist" in caught.value.body["message"]
    with anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0) as claude:
        with pytest.raises(anthropic.NotFoundError) as caught:
            claude.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "not_found_error"


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_runtime_load_serve_and_unload(server, client, adapter_dirs):
    loaded = post(server, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": adapter_dirs["d"]})
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'd' added successfully."
    assert "d" in {card["id"] for card in httpx.get(server.url + "/v1/models").json()["data"]}
    assert complete(client, "d").model == "d"
    again = post(server, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": adapter_dirs["d"]})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    unloaded = post(server, "/v1/unload_lora_adapter", {"lora_name": "d"})
    assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'd' removed successfully."
    with pytest.raises(openai.NotFoundError):
        complete(client, "d")
    gone = post(server, "/v1/unload_lora_adapter", {"lora_name": "d"})
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("body, status, message", [
    ({"lora_name": "e", "lora_path": "/etc"}, 400, "outside the allowed directories"),
    ({"lora_name": "tidal-tiny", "lora_path": "/x"}, 400, "is the base model's"),
    ({"lora_name": "", "lora_path": "/x"}, 400, "lora_name"),
    ({"lora_name": "e"}, 400, "lora_path"),
    ({"lora_name": "e", "lora_path": "/tmp/a\x00b"}, 400, "NUL character"),
])
def test_a_bad_load_is_refused_naming_the_cause(server, body, status, message):
    answer = post(server, "/v1/load_lora_adapter", body)
    assert answer.status_code == status and message in answer.text, answer.text


def test_a_bad_adapter_is_refused_and_nothing_is_loaded(server, adapter_dirs, tmp_path):
    answer = post(server, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": adapter_dirs["rank32"]})
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == "LoRA adapter 'big': rank 32 exceeds --max-lora-rank 16"
    through_link = os.path.join(adapter_dirs["allowed"], "link")  # a link inside pointing outside: outside
    os.symlink(adapter_dirs["a"], through_link)
    answer = post(server, "/v1/load_lora_adapter", {"lora_name": "link", "lora_path": through_link})
    assert answer.status_code == 400 and "outside the allowed directories" in answer.text
    assert {"big", "link"}.isdisjoint(card["id"] for card in httpx.get(server.url + "/v1/models").json()["data"])


def test_an_adapter_in_use_cannot_unload_and_the_loaded_bound_holds(server, client, adapter_dirs):
    """Two streams hold a and b (--max-cpu-loras 2): c is refused with a 503, a cannot unload (409)."""
    streams = [client.completions.create(model=name, prompt=PROMPT, max_tokens=400, temperature=0, stream=True)
               for name in ("a", "b")]
    try:
        for stream in streams:
            next(iter(stream))  # each is running
        metrics = httpx.get(server.url + "/metrics").text
        info = next(line for line in metrics.splitlines() if line.startswith("vllm:lora_requests_info{"))
        assert 'max_lora="2"' in info and 'running_lora_adapters="a,b"' in info and 'waiting_lora_adapters=""' in info
        with pytest.raises(openai.APIStatusError) as caught:
            client.with_options(max_retries=0).completions.create(model="c", prompt=PROMPT, max_tokens=2)
        assert caught.value.status_code == 503 and "--max-cpu-loras 2" in caught.value.message
        busy = post(server, "/v1/unload_lora_adapter", {"lora_name": "a"})
        assert busy.status_code == 409 and "`a` is in use by 1 request(s)" in busy.json()["error"]["message"]
        assert complete(client, "a", 2).model == "a"  # an adapter in use takes more requests
    finally:
        for stream in streams:
            stream.close()
    server.wait_idle()
    assert complete(client, "c", 2).model == "c"  # once they end, the third loads
