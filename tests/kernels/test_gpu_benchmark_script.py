from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels_gpu.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs the real benchmark")
def test_gpu_benchmark_exits_cleanly_without_cuda():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "CUDA is not available" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs the real benchmark")
def test_gpu_decode_benchmark_exits_cleanly_without_cuda():
    script = SCRIPT.parent / "gpu_decode.py"
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "CUDA is not available" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the suite runs everything")
def test_gpu_suite_exits_cleanly_without_cuda(tmp_path):
    suite = SCRIPT.parent / "gpu_suite.sh"
    result = subprocess.run(["bash", str(suite)], capture_output=True, text=True, timeout=120,
                            cwd=SCRIPT.parents[1], env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable})
    assert result.returncode == 0, result.stderr
    assert "CUDA is not available" in (tmp_path / "summary.txt").read_text()


def load_script(name: str):
    """A benchmark script as a module (its ``main`` does not run)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", SCRIPT.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_gpu_decode_stands_in_for_the_loader_with_its_signature():
    """gpu_decode.py swaps ``load_model`` for its random draw; ModelRunner calls it with the loader's
    arguments, so the two must take the same ones (they drifted apart once: the script died at start)."""
    from tidal.gpu import model_runner
    from tidal.gpu.model import loader

    script = load_script("gpu_decode")
    try:
        assert list(inspect.signature(script.random_model).parameters) == list(
            inspect.signature(loader.load_model).parameters)
    finally:
        model_runner.load_model = loader.load_model  # importing the script swapped it


def test_gpu_decode_runs_its_forward_harness_on_a_cpu():
    """The script's own CPU check (--shape tiny --device cpu): ModelRunner over random weights, one row."""
    script = SCRIPT.parent / "gpu_decode.py"
    result = subprocess.run([sys.executable, str(script), "--shape", "tiny", "--device", "cpu", "--batches", "1",
                             "--context", "32", "--iters", "1", "--skip-engine", "--skip-torch-layers"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.split()[:1] == ["1"]]
    assert len(rows) == 1 and float(rows[0][1]) > 0, result.stdout  # batch 1: an eager time in ms


def test_kernels_gpu_paged_batch_points_each_sequence_at_its_own_last_slot():
    script = load_script("kernels_gpu")
    paged = script.paged_batch(3, 40, torch.device("cpu"))
    assert sorted(paged.block_tables.flatten().tolist()) == list(range(paged.num_blocks))  # distinct blocks
    assert paged.seq_lens.tolist() == [40, 40, 40]
    block_size = script.BLOCK_SIZE
    for row in range(3):  # position 39 lives in the row's third block, at offset 39 % block_size
        expected = int(paged.block_tables[row, 39 // block_size]) * block_size + 39 % block_size
        assert int(paged.slot_mapping[row]) == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs the real benchmark")
def test_quantized_gpu_benchmark_exits_cleanly_without_cuda():
    result = subprocess.run([sys.executable, str(SCRIPT.parent / "quantized_gpu.py")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "CUDA is not available" in result.stdout


def test_quantized_gpu_check_passes_its_linears_on_this_device(capsys):
    """The script's correctness check over small shapes: int8/int4 through the Triton kernel (the interpreter
    on a CPU), fp8 through torch._scaled_mm (which torch 2.13 also runs on CPU)."""
    script = load_script("quantized_gpu")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    script.check(device, fp8=device.type == "cpu" or torch.cuda.get_device_capability() >= (8, 9), n=40, k=256)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 * 4 and all(line.endswith(" ok") for line in lines), lines


def test_gpu_decode_quantizes_its_decoder_linears_on_a_cpu():
    """--quantization int8 through the same harness (the C++ int kernel on a CPU; Triton on a GPU)."""
    from tidal.gpu.model.quantization import int_linear_ops

    if int_linear_ops("cpu") is None:
        pytest.skip("the CPU int kernel needs AVX2+FMA and the C++ kernels built")
    script = SCRIPT.parent / "gpu_decode.py"
    result = subprocess.run([sys.executable, str(script), "--shape", "tiny", "--device", "cpu", "--batches", "1",
                             "--context", "32", "--iters", "1", "--skip-engine", "--skip-torch-layers",
                             "--quantization", "int8"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "bf16 + int8 decoder linears" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if line.split()[:1] == ["1"]]
    assert len(rows) == 1 and float(rows[0][1]) > 0, result.stdout
