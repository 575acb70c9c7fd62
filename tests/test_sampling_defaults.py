"""The model's own sampling defaults (--generation-config, as vLLM's): a generation_config.json's temperature, top_p,
top_k and repetition_penalty apply to requests that leave them unset; 'vllm' ignores them; the ready log and
GET /v1/models say which apply."""

from __future__ import annotations

import json
import subprocess
import sys

from live_server import LiveServer
from tidal import sampling_defaults


def test_auto_reads_the_models_file_and_vllm_ignores_it(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1, "do_sample": True, "eos_token_id": 2}))
    assert sampling_defaults.read(str(tmp_path)) == {"temperature": 0.2, "top_p": 0.9, "top_k": 40,
                                                     "repetition_penalty": 1.1}
    assert sampling_defaults.read(str(tmp_path), "vllm") == {}
    assert sampling_defaults.read("/nonexistent", str(tmp_path))["temperature"] == 0.2
    assert sampling_defaults.read(str(tmp_path / "none")) == {}  # auto without a file: OpenAI's defaults


def test_a_default_a_request_could_not_set_is_ignored_and_named():
    from tidal.openai.requests import within_request_bounds
    kept, refused = within_request_bounds({"temperature": 0.7, "top_p": 5.0, "top_k": 50.0, "repetition_penalty": 0})
    assert kept == {"temperature": 0.7, "top_k": 50}
    assert [line.split(":", 1)[0] for line in refused] == ["top_p 5.0", "repetition_penalty 0"]


def test_a_served_models_defaults_apply_to_requests_that_leave_them_unset(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    with LiveServer("--model", "tidal-tiny", "--generation-config", str(tmp_path)) as server:
        card = server.client.get(server.url + "/v1/models").json()["data"][0]
        assert card["sampling_defaults"] == {"temperature": 0.0}
        assert f"sampling defaults from {tmp_path}/generation_config.json: temperature 0.0" in server.log()
        body = {"model": "tidal-tiny", "prompt": "Once upon a time", "max_tokens": 12}
        texts = {server.client.post(server.url + "/v1/completions", json=body).json()["choices"][0]["text"]
                 for _ in range(3)}
        assert len(texts) == 1  # greedy, though no request said so
        hot = {server.client.post(server.url + "/v1/completions", json={**body, "temperature": 2.0, "seed": s}).json()[
            "choices"][0]["text"] for s in range(3)}
        assert len(hot) > 1  # a request's own temperature still wins


def test_a_directory_without_the_file_is_refused_at_start(tmp_path):
    result = subprocess.run([sys.executable, "-m", "tidal", "serve", "--generation-config", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "no generation_config.json there" in result.stderr
