"""``--model ORG/NAME``: a model by Hugging Face Hub id, from a Hub cache laid out on disk.

There is no network here: every test runs with ``HF_HUB_OFFLINE=1`` (tests/conftest.py) over a
cache directory built the way huggingface_hub builds it (``models--ORG--NAME/snapshots/<commit>/``
plus ``refs/main``), holding a tiny generated checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hf_models import make_hf_model
from live_server import LiveServer

from tidal.hub import ModelNotAvailable, is_hub_id, resolve_hub_model

REPO_ID = "tidal-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_hub_cache(cache_dir: Path, repo_id: str = REPO_ID, commit: str = COMMIT) -> Path:
    """Write a tiny checkpoint where huggingface_hub looks for ``repo_id`` at ``main``."""
    repo = cache_dir / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    make_hf_model("llama", snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("hf_home")
    lay_out_hub_cache(home / "hub")
    return home


def test_hub_ids_and_local_names_are_told_apart(tmp_path, monkeypatch):
    assert is_hub_id("Qwen/Qwen3-8B") and is_hub_id("meta-llama/Llama-3.1-8B-Instruct")
    for local in ("tidal-tiny", "tidal-test", "/abs/model", "./org/name", "~/models/x", "a/b/c", "org/../x"):
        assert not is_hub_id(local), local
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name")  # an existing local directory always wins


def test_resolves_main_a_pinned_commit_and_a_download_dir(tmp_path):
    snapshot = lay_out_hub_cache(tmp_path)
    assert resolve_hub_model(REPO_ID, download_dir=str(tmp_path)) == str(snapshot)
    assert resolve_hub_model(REPO_ID, revision=COMMIT, download_dir=str(tmp_path)) == str(snapshot)
    with pytest.raises(ModelNotAvailable, match=r"tidal-org/tiny-llama@v9 is not in the Hub cache .* HF_HUB_OFFLINE"):
        resolve_hub_model(REPO_ID, revision="v9", download_dir=str(tmp_path))


def test_gated_and_unknown_repositories_say_what_to_do(monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    def raising(error_class):
        def snapshot_download(*args, **kwargs):
            error = error_class.__new__(error_class)  # their constructors want an HTTP response
            Exception.__init__(error, "401")
            raise error
        return snapshot_download

    monkeypatch.setattr(huggingface_hub, "snapshot_download", raising(GatedRepoError))
    with pytest.raises(ModelNotAvailable, match="gated .* set HF_TOKEN"):
        resolve_hub_model("org/gated")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", raising(RepositoryNotFoundError))
    with pytest.raises(ModelNotAvailable, match="no model org/unknown on the Hugging Face Hub"):
        resolve_hub_model("org/unknown")


def test_serves_a_hub_id_from_the_offline_cache_under_its_id(hf_home):
    env = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    with LiveServer("--model", REPO_ID, "--num-kv-blocks", "64", env=env) as server:
        models = httpx.get(server.url + "/v1/models").json()
        assert [m["id"] for m in models["data"]] == [REPO_ID]
        reply = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"model": REPO_ID, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4


def test_a_missing_model_is_one_clear_line_and_exit_code_3(tmp_path):
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "tidal", "serve", "--model", "tidal-org/no-such-model",
                             "--port", "0"], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 3  # as for a local directory that does not exist (tests/test_cli.py)
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "tidal-org/no-such-model is not in the Hub cache" in errors[0], result.stderr
    assert "HF_HUB_OFFLINE is set" in errors[0] and "Traceback" not in result.stderr


def test_no_network_is_one_line_worded_as_docs_scaling_shows(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "HF_HUB_OFFLINE"}
    env.update(HF_HOME=str(tmp_path), HF_ENDPOINT="http://127.0.0.1:9")  # nothing listens: no network
    result = subprocess.run([sys.executable, "-m", "tidal", "serve", "--model", "tidal-org/no-such-model",
                             "--port", "0"], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 3
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    said = errors[0].split("exiting: ", 1)[1]
    assert said == (f"model tidal-org/no-such-model is not in the Hub cache ({tmp_path / 'hub'}) and the Hugging "
                    "Face Hub cannot be reached; download it once with network access, or pass a local directory")
    documented = (Path(__file__).parent.parent / "docs" / "scaling.md").read_text()
    assert said.replace("tidal-org/no-such-model", "ORG/NAME").replace(str(tmp_path / "hub"), "DIR") in documented
