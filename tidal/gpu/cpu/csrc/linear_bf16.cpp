// Small-M bf16 linear (y = x @ W.T + b) for CPUs with AVX512-BF16: the decode GEMV/GEMM.
//
// At decode a linear reads its whole weight to produce a few rows, so its speed is the speed of
// streaming the weight. The weight is repacked once at load (layers.pack_gemv_weight): for a block of
// 16 output columns and one pair of inputs (k, k+1), the 16 columns' two weights side by side, one
// cache line, exactly the operand of _mm512_dpbf16_ps (16 pair products accumulated in float32). A
// thread walks its columns 4 blocks (64 columns) at a time; the 4 blocks are stored interleaved pair by
// pair, so a group is one sequential stream read once, and every weight line it loads serves up to 4
// rows of x. Rows beyond 4 re-read the group from L2 (64 columns x K x 2 bytes, 96 KB at K = 768; K is
// walked in chunks where a group's slice would not fit). float32 accumulation, bias added before the one
// rounding to bf16, as oneDNN does. On one Zen 4 core it runs at ~110 GMAC/s from M = 4 up (the
// instruction's peak is ~117) and matches oneDNN at prefill sizes (docs/performance.md).
//
// The AVX512 code is compiled for that target whatever the build's flags (function attributes); the
// Python side calls it only when the CPU has avx512_bf16 (tidal/gpu/model/precision.py), and
// linear_bf16_supported() checks again. Off x86, or with a compiler that does not know the target (GCC
// before 10, clang before 9), the op is built as a stub that reports itself unsupported, so the other
// kernels of the library still build.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "claims.h"
#include "isa.h"
#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace tidal_cpu {
namespace {

constexpr int64_t kBlock = 16;      // output columns per packed block (one zmm of float32 sums)
constexpr int kMaxBlocks = 4;       // blocks one tile walks together
constexpr int kMaxRows = 4;         // rows of x one tile serves from each weight line
// Cache lines ahead to prefetch. The group is one sequential stream, which the hardware prefetcher follows.
// On Zen 4 with the weights in 2 MiB pages (huge_pages.py), two threads streaming the small model's linears:
// 2 lines ~51-53 GB/s, 4 lines ~47 (batch 1), 0 slower at 16 rows; on 4 KiB pages all the same (~31).
constexpr int64_t kPrefetch = 2;
constexpr int64_t kChunkPairs = 1024;  // K pairs per pass with many rows: 4 blocks' slice is 256 KB, in L2
constexpr int64_t kTaskBytes = 1 << 20;  // weight bytes below which another thread costs more than it saves

struct Problem {
  const uint16_t* x;     // [M, K] bf16 bits, rows x_stride apart
  int64_t x_stride;
  const uint16_t* w;     // [blocks, pairs, 32] bf16 bits
  const uint16_t* bias;  // [N] or null
  uint16_t* out;         // [M, N]
  int64_t m, n, k, pairs;
};

#ifdef TIDAL_AVX512_BF16

#define TIDAL_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

TIDAL_TARGET inline __m512 widen_bias(const uint16_t* bias, int64_t col, int64_t valid) {
  const __mmask16 mask = valid >= kBlock ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, bias + col);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Rows [row, row + ROWS) by blocks [block, block + BLOCKS) of the output, over input pairs [first, last).
// When the pairs are a chunk of K, `partial` ([ROWS][kMaxBlocks * kBlock] floats, rows of the whole tile
// group) carries the sums between chunks; the last chunk adds the bias and stores the bf16 result.
// Weights to bring into L2 while a tile computes from L2: `lines_per_step` cache lines from `base` per step.
struct Ahead {
  const char* base = nullptr;
  int64_t lines_per_step = 0;
};

// Out of line and with every loop over rows and blocks unrolled, so the sums stay in registers (inlined
// into run_blocks, GCC kept them on the stack: 4x slower at one row).
template <int ROWS, int BLOCKS>
TIDAL_TARGET __attribute__((noinline)) void tile(const Problem& p, int64_t row, int64_t block, int64_t first, int64_t last, float* partial, Ahead ahead) {
  constexpr int64_t kPartialRow = kMaxBlocks * kBlock;
  __m512 acc[ROWS][BLOCKS];
  _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r)
    _Pragma("GCC unroll 4") for (int b = 0; b < BLOCKS; ++b)
      acc[r][b] = first == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(partial + r * kPartialRow + b * kBlock);
  // the group's blocks interleaved: pair i of block b at (i * BLOCKS + b) * 32, one sequential stream
  const uint16_t* w = p.w + block * p.pairs * 32;
  const uint16_t* x = p.x + row * p.x_stride;
  const int64_t full = p.k / 2;  // pairs with both inputs in x
  for (int64_t i = first; i < std::min(last, full); ++i) {
    __m512i wv[BLOCKS];
    for (int64_t j = 0; j < ahead.lines_per_step; ++j)
      _mm_prefetch(ahead.base + ((i - first) * ahead.lines_per_step + j) * 64, _MM_HINT_T1);
    _Pragma("GCC unroll 4") for (int b = 0; b < BLOCKS; ++b) {
      const uint16_t* line = w + (i * BLOCKS + b) * 32;
      _mm_prefetch(reinterpret_cast<const char*>(line + kPrefetch * 32), _MM_HINT_T0);
      wv[b] = _mm512_loadu_si512(line);
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * p.x_stride + 2 * i, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      _Pragma("GCC unroll 4") for (int b = 0; b < BLOCKS; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, (__m512bh)wv[b]);
    }
  }
  if (last > full) {  // odd K: the last pair holds x[K-1] and a zero (the packed weight is zero-padded too)
    _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r) {
      const int32_t pair = x[r * p.x_stride + p.k - 1];
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      _Pragma("GCC unroll 4") for (int b = 0; b < BLOCKS; ++b) {
        const __m512i wv = _mm512_loadu_si512(w + (full * BLOCKS + b) * 32);
        acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, (__m512bh)wv);
      }
    }
  }
  if (last < p.pairs) {
    _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r)
      _Pragma("GCC unroll 4") for (int b = 0; b < BLOCKS; ++b) _mm512_storeu_ps(partial + r * kPartialRow + b * kBlock, acc[r][b]);
    return;
  }
  _Pragma("GCC unroll 4") for (int b = 0; b < BLOCKS; ++b) {
    const int64_t col = (block + b) * kBlock;
    const int64_t valid = std::min<int64_t>(kBlock, p.n - col);
    const __mmask16 mask = valid >= kBlock ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    const __m512 bias = p.bias != nullptr ? widen_bias(p.bias, col, valid) : _mm512_setzero_ps();
    _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][b], bias));
      _mm256_mask_storeu_epi16(p.out + (row + r) * p.n + col, mask, (__m256i)rounded);
    }
  }
}

template <int BLOCKS>
TIDAL_TARGET void tile_rows(const Problem& p, int64_t row, int64_t rows, int64_t block, int64_t first, int64_t last,
               float* partial, Ahead ahead) {
  switch (rows) {
    case 1: return tile<1, BLOCKS>(p, row, block, first, last, partial, ahead);
    case 2: return tile<2, BLOCKS>(p, row, block, first, last, partial, ahead);
    case 3: return tile<3, BLOCKS>(p, row, block, first, last, partial, ahead);
    default: return tile<4, BLOCKS>(p, row, block, first, last, partial, ahead);
  }
}

// Output blocks [begin, end) for every row, 4 blocks at a time: each group of blocks for all rows before
// the next, so rows past the first 4 find the group's weights in L2. Where a group's slice of the weight
// would not stay in L2 (long K and many rows: prefill of a large model), K is walked in chunks that do.
// With more than 4 rows, the passes after the first (computing from L2) prefetch the next slice into L2,
// so its first pass does not wait on memory: the weight read overlaps the arithmetic. The next group's
// slice is prefetched when it lies below ahead_end (the thread's likely next work, claims.h).
TIDAL_TARGET void run_blocks(const Problem& p, int64_t begin, int64_t end, int64_t ahead_end) {
  const int64_t chunk = p.m > kMaxRows ? kChunkPairs : p.pairs;
  const int64_t passes = (p.m + kMaxRows - 1) / kMaxRows;
  std::vector<float> partial(chunk < p.pairs ? p.m * kMaxBlocks * kBlock : 0);
  for (int64_t block = begin; block < end; block += kMaxBlocks) {
    const int64_t blocks = std::min<int64_t>(kMaxBlocks, end - block);
    const uint16_t* group = p.w + block * p.pairs * 32;
    for (int64_t first = 0; first < p.pairs; first += chunk) {
      const int64_t last = std::min(p.pairs, first + chunk);
      // the slice the next first pass reads: this group's next K chunk, or the next group's first
      const uint16_t* next = nullptr;
      int64_t next_lines = 0;
      if (last < p.pairs) {
        next = group + last * blocks * 32;
        next_lines = (std::min(p.pairs, last + chunk) - last) * blocks;
      } else if (block + kMaxBlocks < ahead_end) {
        next = p.w + (block + kMaxBlocks) * p.pairs * 32;
        next_lines = std::min(chunk, p.pairs) * std::min<int64_t>(kMaxBlocks, ahead_end - block - kMaxBlocks);
      }
      const int64_t share = passes > 1 ? (next_lines + passes - 2) / (passes - 1) : 0;  // lines per later pass
      for (int64_t row = 0; row < p.m; row += kMaxRows) {
        const int64_t rows = std::min<int64_t>(kMaxRows, p.m - row);
        float* rows_partial = partial.empty() ? nullptr : partial.data() + row * kMaxBlocks * kBlock;
        Ahead ahead;
        const int64_t pass = row / kMaxRows;
        if (next != nullptr && pass > 0) {
          ahead.base = reinterpret_cast<const char*>(next) + (pass - 1) * share * 64;
          ahead.lines_per_step = (share + (last - first) - 1) / (last - first);
        }
        switch (blocks) {
          case 1: tile_rows<1>(p, row, rows, block, first, last, rows_partial, ahead); break;
          case 2: tile_rows<2>(p, row, rows, block, first, last, rows_partial, ahead); break;
          case 3: tile_rows<3>(p, row, rows, block, first, last, rows_partial, ahead); break;
          default: tile_rows<4>(p, row, rows, block, first, last, rows_partial, ahead); break;
        }
      }
    }
  }
}

bool cpu_has_avx512_bf16() { return isa().avx512_bf16; }

#else

bool cpu_has_avx512_bf16() { return false; }
void run_blocks(const Problem&, int64_t, int64_t, int64_t) {}

#endif  // TIDAL_AVX512_BF16

}  // namespace

// x [..., K] bf16 with a contiguous last dim; packed [ceil(N/16), ceil(K/2), 32] bf16 from
// pack_gemv_weight; bias [N] bf16 or None. Returns [..., N] bf16, as F.linear(x, W, bias) would.
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                       const std::optional<at::Tensor>& bias) {
  static const bool supported = cpu_has_avx512_bf16();
  TORCH_CHECK(supported, "linear_bf16 needs a CPU with AVX512-BF16");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() >= 1,
              "x must be a bf16 CPU tensor");
  const int64_t k = x.size(-1), pairs = (k + 1) / 2, blocks = (n + kBlock - 1) / kBlock;
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == blocks && packed.size(1) == pairs && packed.size(2) == 32,
              "packed weight has shape ", packed.sizes(), ", expected [", blocks, ", ", pairs, ", 32] for N=", n,
              " K=", k);
  at::Tensor rows = x.dim() == 2 && x.stride(1) == 1 ? x : x.reshape({-1, k});
  if (rows.stride(1) != 1) rows = rows.contiguous();
  const int64_t m = rows.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == n,
                "bias must be a contiguous bf16 [N] tensor");
  }
  if (m == 0 || n == 0) return out;
  Problem p{reinterpret_cast<const uint16_t*>(rows.data_ptr<c10::BFloat16>()),
            rows.stride(0),
            reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>()),
            bias.has_value() ? reinterpret_cast<const uint16_t*>(bias->data_ptr<c10::BFloat16>()) : nullptr,
            reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()),
            m,
            n,
            k,
            pairs};
  // split the columns over threads only where each gets enough weight to stream; a group per claim
  const int64_t groups = (blocks + kMaxBlocks - 1) / kMaxBlocks, group_bytes = pairs * 64 * kMaxBlocks;
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(1, group_bytes * m));
  tidal_cpu::parallel_claims(groups, 1, (groups + grain - 1) / grain, [&](int64_t begin, int64_t end, int64_t ahead_end) {
    run_blocks(p, begin * kMaxBlocks, std::min(blocks, end * kMaxBlocks), std::min(blocks, ahead_end * kMaxBlocks));
  });
  return out;
}

bool linear_bf16_supported() { return cpu_has_avx512_bf16(); }

}  // namespace tidal_cpu

using namespace tidal_cpu;

TORCH_LIBRARY_FRAGMENT(tidal_cpu, m) {
  m.def("linear_bf16(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor", &linear_bf16);
  m.def("linear_bf16_supported() -> bool", &linear_bf16_supported);
}
