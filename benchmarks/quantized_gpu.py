"""GPU benchmark of the quantized linears. Needs CUDA; on a CPU box it says so and exits 0.

    python benchmarks/quantized_gpu.py [--rows 1 16 64] [--skip-check]

For each decoder linear of Llama-3-8B (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336) and
each row count (1 = a decode step at batch 1): bf16 ``F.linear`` (cuBLAS), int8 per channel and int4 group 128
through tidal/kernels/linear_int.py (Triton, dequantized in registers), and FP8 per channel with per-token
activations through ``torch._scaled_mm`` (quantized_linear.Fp8Linear) on GPUs with compute capability 8.9+.
Each is first checked against its fp32 reference on the GPU, then timed (median, L2 flushed between calls)
against its bandwidth floor: the bytes it reads (weights, scales, activations) and writes (output) / the
device-to-device copy bandwidth measured in the same run.

A whole decode step with quantized weights: ``python benchmarks/gpu_decode.py --quantization int8|int4|fp8``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

HIDDEN, INTERMEDIATE, Q_SIZE, KV_SIZE = 4096, 14336, 4096, 1024
SHAPES = {  # name -> (N outputs, K inputs)
    "qkv": (Q_SIZE + 2 * KV_SIZE, HIDDEN),
    "o": (HIDDEN, Q_SIZE),
    "gate_up": (2 * INTERMEDIATE, HIDDEN),
    "down": (HIDDEN, INTERMEDIATE),
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--skip-check", action="store_true", help="skip the correctness check on the GPU")
    return p.parse_args(argv)


def bench_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a 2 GiB device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * (2 << 30) / (ms * 1e-3)


def variants(n: int, k: int, device: torch.device, fp8: bool) -> dict:
    """name -> (linear(x) callable, fp32 reference weight [N, K], bytes of the weight and its scales)."""
    from tidal.gpu.model import quantized_linear
    from tidal.gpu.model.quantization import ON_THE_FLY, quantize

    dense = torch.randn(n, k, device=device) * 0.02
    bf16 = dense.bfloat16()
    out = {"bf16": (lambda x: F.linear(x, bf16), bf16.float(), bf16.numel() * 2)}
    for name in ("int8", "int4"):
        weight = quantize(dense, ON_THE_FLY[name])
        packed = quantized_linear.TritonInt(weight, device)
        out[name] = (lambda x, p=packed: p.linear(x, None), weight.dequantize(), packed.nbytes)
    if fp8:
        weight = quantized_linear.quantize_fp8(dense)
        packed = quantized_linear.Fp8Linear(weight)
        out["fp8"] = (lambda x, p=packed: p.linear(x, None), weight, packed.nbytes)
    return out


def check(device: torch.device, fp8: bool, n: int = 1000, k: int = HIDDEN) -> None:
    """Each variant against its fp32 reference (bf16 activations, rows 1 and 17); exits on a wrong one."""
    from tidal.gpu.model.quantized_linear import fp8_linear_reference

    for rows in (1, 17):
        x = torch.randn(rows, k, device=device).bfloat16()
        for name, (linear, reference, _) in variants(n, k, device, fp8).items():
            expected = fp8_linear_reference(x, reference) if name == "fp8" else (x.float() @ reference.T).bfloat16()
            error = ((linear(x).float() - expected.float()).norm() / expected.float().norm()).item()
            status = "ok" if error < 1e-2 else "WRONG"
            print(f"   check {name:>5} rows {rows:>3}: relative error {error:.2e} {status}")
            if status != "ok":
                raise SystemExit(f"quantized_gpu: {name} disagrees with its reference")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("quantized_gpu: CUDA is not available here; this benchmark needs an NVIDIA GPU. Nothing run.")
        return 0
    from tidal.gpu.model.quantized_linear import fp8_runs_on

    device = torch.device("cuda")
    fp8 = fp8_runs_on(device)
    print(f"{torch.cuda.get_device_name(device)}, compute capability {torch.cuda.get_device_capability(device)}, "
          f"torch {torch.__version__}; fp8 {'through torch._scaled_mm' if fp8 else 'not supported here'}")
    if not args.skip_check:
        check(device, fp8)
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    print(f"{'linear':>8} {'rows':>5} {'scheme':>6} {'ms':>8} {'floor ms':>9} {'x floor':>8} {'GB/s':>7} {'vs bf16':>8}")
    for shape, (n, k) in SHAPES.items():
        linears = variants(n, k, device, fp8)
        for rows in args.rows:
            x = torch.randn(rows, k, device=device).bfloat16()
            bf16_ms = None
            for name, (linear, _, weight_bytes) in linears.items():
                ms = bench_ms(lambda linear=linear: linear(x))
                moved = weight_bytes + x.numel() * 2 + rows * n * 2
                floor = 1e3 * moved / bandwidth
                bf16_ms = bf16_ms or ms
                print(f"{shape:>8} {rows:>5} {name:>6} {ms:>8.4f} {floor:>9.4f} {ms / floor:>7.2f}x "
                      f"{moved / (ms * 1e-3) / 1e9:>7.0f} {bf16_ms / ms:>7.2f}x")
        del linears
        torch.cuda.empty_cache()
    print("floor = (weight + scale bytes + activations read + bf16 output written) / copy bandwidth")
    return 0


if __name__ == "__main__":
    sys.exit(main())
