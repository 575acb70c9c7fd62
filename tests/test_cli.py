"""`tidal serve` as an operator meets it: --help, and clear failures at start (no tracebacks)."""

from __future__ import annotations

import pathlib
import re
import socket
import subprocess
import sys
import time

import pytest

from hf_models import make_hf_model


def run_serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tidal", "serve", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_help_explains_every_flag():
    out = subprocess.run([sys.executable, "-m", "tidal", "serve", "--help"], capture_output=True, text=True).stdout
    for flag in ("--model", "--host", "--port", "--served-model-name", "--max-model-len", "--max-num-seqs",
                 "--max-num-batched-tokens", "--block-size", "--kv-cache-memory", "--stream-interval",
                 "--api-key", "--tokenizer-workers", "--device", "--dtype", "--max-queued-requests",
                 "--scheduling-policy", "--max-queue-wait", "--max-stream-buffer-bytes", "--stream-stall-timeout",
                 "--shutdown-timeout", "--attention-backend", "--revision", "--download-dir", "--data-parallel-size",
                 "--engine-restarts", "--enforce-eager", "--tensor-parallel-size", "--tp-size", "--nnodes",
                 "--node-rank", "--master-addr", "--master-port", "--dist-init-addr"):
        assert flag in out, flag
    text = " ".join(out.split())  # argparse wraps the help lines
    assert "requests without a 'seed' (default 0)" in text
    assert "Log level of the server (default info)" in text


def test_a_misspelt_flag_gets_serves_usage_and_the_nearest_flag():
    result = run_serve("--prot", "8011")
    assert result.returncode == 2
    assert result.stderr.startswith("usage: tidal serve ")
    assert "tidal serve: error: unrecognized arguments: --prot 8011" in result.stderr
    assert "--prot: did you mean --port?" in result.stderr


def test_an_abbreviated_flag_is_an_error_with_a_short_usage_and_the_nearest_flag():
    result = run_serve("--max-num-seq", "8", "--port", "0")  # argparse would take it as --max-num-seqs
    assert result.returncode == 2
    assert "unrecognized arguments: --max-num-seq 8" in result.stderr
    assert "--max-num-seq: did you mean --max-num-seqs?" in result.stderr
    assert len(result.stderr.splitlines()) <= 4, result.stderr  # not the whole usage before the hint


def test_version_prints_the_package_version():
    import tidal

    result = subprocess.run([sys.executable, "-m", "tidal", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == f"tidal {tidal.__version__}"


def test_build_kernels_says_where_the_build_is_cached():
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "tidal", "build-kernels"], capture_output=True, text=True,
                            timeout=900)  # cached by the suite's first kernel load; a cold build takes minutes
    elapsed = time.monotonic() - started
    if result.returncode == 1 and "not available here" in result.stderr:
        pytest.skip("the CPU kernels cannot be built here (no compiler)")
    assert result.returncode == 0, result.stderr
    seconds, directory = re.fullmatch(r"CPU kernels ready in ([0-9.]+) s, cached in (\S+)\n", result.stdout).groups()
    assert float(seconds) <= elapsed and any(pathlib.Path(directory).glob("tidal_cpu_*.so"))


def test_unsupported_architecture_fails_at_start_with_a_clear_message(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(tmp_path)
    result = run_serve("--model", str(tmp_path), "--port", "0")
    assert result.returncode == 3
    assert "GPT2LMHeadModel" in result.stderr and "LlamaForCausalLM" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_model_directory_and_bad_flags():
    result = run_serve("--model", "/no/such/model", "--port", "0")
    assert result.returncode == 3 and "no model directory" in result.stderr
    assert result.stderr.count("no model directory") == 1, result.stderr  # logged once
    assert "Traceback" not in result.stderr
    bad = run_serve("--max-num-seqs", "0")
    assert bad.returncode == 2 and "--max-num-seqs must be at least 1" in bad.stderr


def test_port_in_use_is_a_clear_error():
    with socket.socket() as other:  # another program listening on the port
        other.bind(("127.0.0.1", 0))
        other.listen()
        result = run_serve("--model", "tidal-test", "--port", str(other.getsockname()[1]))
        assert result.returncode == 2
        assert "Address already in use" in result.stderr and "Traceback" not in result.stderr
        assert "engine ready" not in result.stderr  # refused before the model was loaded


def test_tensor_parallel_flags_that_cannot_work_are_refused_before_anything_starts():
    for args, message in [
        (("--tensor-parallel-size", "0"), "--tensor-parallel-size must be at least 1"),
        (("--tp-size", "2", "--nnodes", "3"), "--nnodes must be at least 1 and divide --tensor-parallel-size (2)"),
        (("--tp-size", "2", "--nnodes", "2", "--node-rank", "2"), "--node-rank must be in [0, --nnodes) = [0, 2)"),
        (("--master-port", "65535", "--dp-size", "2"), "--master-port (+ replicas - 1) must be a port number"),
        (("--dist-init-addr", "10.0.0.1"), "--dist-init-addr must be HOST:PORT, not '10.0.0.1'"),
    ]:
        result = run_serve(*args)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)


def test_lora_flags_that_cannot_work_are_refused_before_anything_starts(tmp_path):
    for args, message in [
        (("--lora-modules", "a=/x"), "--lora-modules and --enable-lora-runtime-updates need --enable-lora"),
        (("--enable-lora", "--lora-modules", "a"), "--lora-modules 'a': expected name=path or a JSON object"),
        (("--enable-lora", "--lora-modules", '{"name": "a"}'), 'the JSON form needs string "name" and "path"'),
        (("--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"), "--max-cpu-loras (2) must be at least --max-loras (4)"),
        (("--enable-lora", "--lora-modules", "a=/x", "a=/y"), "each adapter needs its own name"),
        (("--enable-lora", "--max-lora-rank", "0"), "--max-loras and --max-lora-rank must be at least 1"),
    ]:
        result = run_serve(*args)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
    # a bad adapter stops the start with the engine's one line, no traceback
    (tmp_path / "adapter_config.json").write_text('{"r": 8, "use_dora": true}')
    bad = run_serve("--model", "tidal-tiny", "--enable-lora", "--lora-modules", f"d={tmp_path}", "--port", "0")
    assert bad.returncode == 3 and "LoRA adapter 'd': use_dora (True) is not supported" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr


def test_lora_flags_reach_the_config():
    from tidal.cli import add_serve_arguments, server_config
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    config = server_config(parser.parse_args([
        "--enable-lora", "--lora-modules", "a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}',
        "--max-loras", "3", "--max-lora-rank", "32", "--max-cpu-loras", "5", "--enable-lora-runtime-updates",
        "--lora-allowed-dirs", "/d1, /d2"]))
    assert config.lora_modules == (("a", "/x", None), ("b", "/y", "m")) and config.lora_runtime_updates
    assert (config.engine.max_loras, config.engine.max_lora_rank, config.engine.max_cpu_loras) == (3, 32, 5)
    assert config.lora_allowed_dirs == ("/d1", "/d2") and config.max_loaded_adapters == 5
