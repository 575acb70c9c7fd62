"""A newcomer's first minutes: every mistake is one line naming its cause and fix, and the docs that list
things list what the code has."""

from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys

import pytest
import trio

from tidal.cli import add_serve_arguments
from tidal.tools import bench
from tidal.tools.ws_client import TidalWSConnectError, open_tidal_ws

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _flags(add_arguments) -> set[str]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return {flag for action in parser._actions if action.help != argparse.SUPPRESS
            for flag in action.option_strings if flag.startswith("--") and flag != "--help"}


@pytest.mark.parametrize("command,add_arguments", [("serve", add_serve_arguments), ("bench", bench.add_arguments)])
def test_the_configuration_page_lists_every_flag(command, add_arguments):
    page = (ROOT / "docs" / "configuration.md").read_text()
    section = page.split(f"## `tidal {command}`", 1)[1].split("\n## ", 1)[0]
    missing = sorted(flag for flag in _flags(add_arguments) if not re.search(f"`{re.escape(flag)}[ `]", section))
    assert not missing, f"docs/configuration.md's tidal {command} section lacks {missing}"


def test_the_exit_codes_the_server_uses_are_documented():
    page = " ".join((ROOT / "docs" / "configuration.md").read_text().split())
    for code in ("0 after a graceful stop", "1 after a second signal", "2 for a flag that cannot work", "3 when"):
        assert code in page


def _serve(*args: str, env_path: str | None = None) -> subprocess.CompletedProcess:
    env = None
    if env_path is not None:
        import os

        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [env_path, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "tidal", "serve", "--port", "0", *args], capture_output=True,
                          text=True, timeout=300, env=env)


def test_tracing_without_the_otel_extra_is_one_line_saying_what_to_install(tmp_path):
    shadow = tmp_path / "shadow"
    (shadow / "opentelemetry").mkdir(parents=True)
    (shadow / "opentelemetry" / "__init__.py").write_text("")  # an install without the exporter
    result = _serve("--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces", env_path=str(shadow))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "tidal serve: error: --otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP/HTTP exporter: "
        "pip install 'tidal[otel]'")


def test_a_model_directory_without_its_tokenizer_is_one_line_naming_the_file(tmp_path):
    from hf_models import make_hf_model

    make_hf_model("llama", tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    result = _serve("--model", str(tmp_path))
    assert result.returncode == 3
    assert "Traceback" not in result.stderr
    said = [line for line in result.stderr.splitlines() if "tokenizer.json" in line]
    assert len(said) == 1 and f"{tmp_path} has no tokenizer.json" in said[0], result.stderr


async def test_the_websocket_client_against_no_server_says_connection_refused():
    with trio.socket.socket() as probe:  # a port nothing listens on
        await probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"ws://127.0.0.1:{port}/v1/ws"
    with pytest.raises(TidalWSConnectError) as caught:
        async with open_tidal_ws(url):
            pass
    assert str(caught.value) == f"could not connect to {url}: connection refused (is `tidal serve` running there?)"
    example = subprocess.run([sys.executable, str(ROOT / "examples" / "ws_client_example.py"), "--url", url,
                              "--model", "tidal-tiny"], capture_output=True, text=True, timeout=120)
    assert example.returncode == 1
    assert example.stderr.strip().splitlines() == [f"ws_client_example: {caught.value}"]
