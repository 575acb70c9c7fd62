"""Draw docs/performance.md's plots from the figures recorded there (no benchmark runs here).

    python benchmarks/plot_performance.py            # writes docs/performance-vs-vllm.png and docs/performance-gpu.png

The numbers are copied from the tables in docs/performance.md (and, verbatim, docs/performance-history.md),
each with the host it was measured on; change them together.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on a benchmark box
import matplotlib.pyplot as plt  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs"
ROWS = ("tiny, c=1", "tiny, c=64", "small, c=1", "small, c=16")

# Output tok/s, `bash benchmarks/vs_vllm.sh`, sixth round (code 04cf338/8368eda, 2026-12-01), 2 cores of an
# AMD EPYC with avx2 avx512f avx512_bf16 (no amx_bf16). Native: vLLM bf16 against tidal's defaults (two
# rounds: the lower tidal/vLLM ratio's pair is drawn). AVX2 path: ISA=avx2 on the same host (vLLM float32,
# tidal's float32-on-bf16-weights path), one round.
NATIVE = {"vLLM-CPU 0.32 (bf16)": (454.1, 3213.2, 93.1, 668.2), "tidal": (1980.8, 6234.5, 139.7, 967.9)}
AVX2 = {"vLLM-CPU 0.32 (fp32, AVX2)": (253.1, 2463.2, 48.3, 345.0), "tidal (AVX2 path)": (1782.7, 3969.2, 158.2, 487.0)}

# python benchmarks/gpu_decode.py on one H200 (2026-11-30): a Llama-3-8B-shaped decode step, context 1024.
GPU_BATCH = (1, 8, 32, 64, 128, 256)
GPU_GRAPH_MS = (5.17, 5.42, 6.23, 7.12, 9.67, 15.87)
GPU_EAGER_MS = (26.49, 26.18, 26.33, 23.63, 23.11, 22.58)
GPU_FLOOR_MS = (3.57, 3.79, 4.56, 5.57, 7.60, 11.67)


def bars(axis, series: dict[str, tuple[float, ...]], title: str) -> None:
    width = 0.38
    (old_name, old), (new_name, new) = series.items()
    for offset, name, values, color in ((-width / 2, old_name, old, "tab:gray"),
                                        (width / 2, new_name, new, "tab:blue")):
        axis.bar([i + offset for i in range(len(ROWS))], values, width, label=name, color=color)
    for i, (a, b) in enumerate(zip(old, new)):
        axis.annotate(f"{b / a:.2f}x", (i + width / 2, b), ha="center", va="bottom", fontsize=9)
    axis.set_xticks(range(len(ROWS)), ROWS)
    axis.set_yscale("log")
    axis.set_ylim(min(min(old), min(new)) / 2, max(max(old), max(new)) * 6)  # room for the legend above
    axis.set_ylabel("output tok/s (log scale)")
    axis.set_title(title, fontsize=10)
    axis.legend(fontsize=8, loc="upper right")


def plot_vs_vllm(path: Path) -> None:
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    bars(axes[0], NATIVE, "host with avx512_bf16: vLLM bf16 vs tidal defaults")
    bars(axes[1], AVX2, "same host held to AVX2 (ISA=avx2): vLLM fp32 vs tidal's AVX2 path")
    figure.suptitle("tidal vs vLLM-CPU 0.32, vllm bench serve, 128 in / 128 out, 2 cores (AMD EPYC)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_gpu(path: Path) -> None:
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(GPU_BATCH, GPU_EAGER_MS, "o-", color="tab:gray", label="eager")
    axis.plot(GPU_BATCH, GPU_GRAPH_MS, "o-", color="tab:blue", label="CUDA graph replay")
    axis.plot(GPU_BATCH, GPU_FLOOR_MS, "--", color="black", label="bandwidth floor (4.24 TB/s)")
    axis.set_xscale("log", base=2)
    axis.set_xticks(GPU_BATCH, [str(b) for b in GPU_BATCH])
    axis.set_xlabel("batch (sequences decoding, context 1024)")
    axis.set_ylabel("ms per decode step")
    axis.set_title("Llama-3-8B-shaped decode step on one H200 (bf16)", fontsize=10)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DOCS, help="folder for the PNGs (default docs/)")
    args = parser.parse_args()
    plot_vs_vllm(args.out / "performance-vs-vllm.png")
    plot_gpu(args.out / "performance-gpu.png")
    print(f"wrote {args.out / 'performance-vs-vllm.png'} and {args.out / 'performance-gpu.png'}")


if __name__ == "__main__":
    main()
