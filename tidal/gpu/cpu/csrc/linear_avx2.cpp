// float32 linear (y = x @ W.T + b) on bf16-stored weights, for CPUs with AVX2+FMA and no native bf16.
//
// At decode a linear reads its whole weight to produce a few rows, so its speed is the speed of streaming
// the weight. Where the checkpoint holds bf16 weights, keeping them in bf16 halves the bytes of a float32
// weight and loses nothing: a bf16 value is the top half of a float32, so widening it is a 16-bit shift and
// the products and sums are the float32 model's (up to summation order). x, bias and y are float32.
//
// The weight is repacked once at load (layers.pack_avx2_weight) into groups of 32 output columns: for
// one input k, the group's 32 weights are one 64-byte cache line, so a group is one sequential stream of
// K lines. A line holds two blocks of 16 columns; in a block, 32-bit lane j holds column j in its low half
// and column 8 + j in its high half, so one 32-byte load gives both 8-column float32 vectors by a shift
// and a mask (no shuffles). A thread walks its groups one at a time: up to 3 rows of x take the whole
// group in one pass from memory; more rows walk it 6 rows at a time (12 accumulators, the classic 6x16
// AVX2 tile), the passes after the first reading it from L2. Where a group's slice would not stay in L2
// (long K with many rows), K is walked in chunks that do, the sums carried between chunks.
//
// The AVX2 code is compiled for that target whatever the build's flags (a function attribute); the Python
// side calls it only where linear_avx2_supported() (the CPU has AVX2 and FMA). In a build for AVX-512
// (tidal/gpu/cpu/kernels.py) the compiler may still use EVEX encodings here (the attribute adds to the build's ISA;
// "no-avx512f" breaks the inlining of the intrinsics), so a run forced on such a CPU is close to, not
// exactly, the AVX2-only code. Off x86 the op is built as a stub that reports itself unsupported, so the
// other kernels of the library still build.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "claims.h"
#include "isa.h"
#include "ops.h"

#if defined(__x86_64__) || defined(__i386__)
#define TIDAL_AVX2_FMA 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace tidal_cpu {
namespace {

constexpr int64_t kGroup = 32;     // output columns per packed group: 64 bytes of bf16 per input
constexpr int kMaxRows = 6;        // rows of x one tile computes (12 accumulators of 16 ymm registers)
constexpr int64_t kChunk = 2048;   // inputs per pass with many rows: a group's slice is 128 KB, in L2
// Rows up to which later passes prefetch the next slice. Above, the arithmetic hides the weight read anyway,
// and the prefetches measured 10-20% slower at 64-512 rows (prefill).
constexpr int64_t kPrefetchRows = 32;
constexpr int64_t kTaskBytes = 1 << 20;  // weight bytes below which another thread costs more than it saves

struct Problem {
  const float* x;  // [M, K], rows x_stride apart
  int64_t x_stride;
  const uint16_t* w;  // [groups, K, 32] bf16 bits
  const float* bias;  // [N] or null
  float* out;         // [M, N]
  int64_t m, n, k;
};

#ifdef TIDAL_AVX2_FMA

#define TIDAL_TARGET __attribute__((target("avx2,fma")))

// Block b of a group's line: 16 bf16 widened to float32, columns 0-7 of the block in lo, 8-15 in hi.
TIDAL_TARGET inline void widen(const uint16_t* line, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

TIDAL_TARGET inline __m256i lanes_below(int64_t valid) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Weights to bring into L2 while a tile computes from cache: `lines` cache lines from `base`,
// `lines_per_step` per input.
struct Ahead {
  const char* base = nullptr;
  int64_t lines_per_step = 0;
  int64_t lines = 0;
};

// Rows [row, row + ROWS) by blocks [b0, b0 + BLOCKS) of group `group`, over inputs [first, last). When the
// inputs are a chunk of K, `partial` ([ROWS][32] floats) carries the sums between chunks; the last chunk
// adds the bias and stores. Out of line, loops unrolled, so the sums stay in registers.
template <int ROWS, int BLOCKS>
TIDAL_TARGET __attribute__((noinline)) void tile(const Problem& p, int64_t row, int64_t group, int b0, int64_t first,
                                                 int64_t last, float* partial, Ahead ahead) {
  // with few sums, two sets over alternate inputs, so enough FMA chains are in flight (latency 4, 2 a cycle)
  constexpr int S = ROWS * BLOCKS <= 3 ? 2 : 1;
  __m256 acc[S][ROWS][BLOCKS][2];
  _Pragma("GCC unroll 2") for (int s = 0; s < S; ++s)
    _Pragma("GCC unroll 6") for (int r = 0; r < ROWS; ++r)
      _Pragma("GCC unroll 2") for (int b = 0; b < BLOCKS; ++b)
        _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h)
          acc[s][r][b][h] = s == 0 && first > 0 ? _mm256_loadu_ps(partial + r * kGroup + (b0 + b) * 16 + h * 8)
                                                : _mm256_setzero_ps();
  const uint16_t* w = p.w + group * p.k * kGroup + b0 * 16;
  const float* x = p.x + row * p.x_stride;
  int64_t i = first;
  for (; i + S <= last; i += S) {
    for (int64_t j = 0; j < ahead.lines_per_step * S; ++j) {
      const int64_t line = (i - first) * ahead.lines_per_step + j;
      if (line < ahead.lines) _mm_prefetch(ahead.base + line * 64, _MM_HINT_T1);
    }
    _Pragma("GCC unroll 2") for (int s = 0; s < S; ++s) {
      _Pragma("GCC unroll 2") for (int b = 0; b < BLOCKS; ++b) {
        __m256 lo, hi;
        widen(w + (i + s) * kGroup + b * 16, lo, hi);
        _Pragma("GCC unroll 6") for (int r = 0; r < ROWS; ++r) {
          const __m256 xv = _mm256_broadcast_ss(x + r * p.x_stride + i + s);
          acc[s][r][b][0] = _mm256_fmadd_ps(xv, lo, acc[s][r][b][0]);
          acc[s][r][b][1] = _mm256_fmadd_ps(xv, hi, acc[s][r][b][1]);
        }
      }
    }
  }
  for (; i < last; ++i) {  // the odd input left with two sets
    _Pragma("GCC unroll 2") for (int b = 0; b < BLOCKS; ++b) {
      __m256 lo, hi;
      widen(w + i * kGroup + b * 16, lo, hi);
      _Pragma("GCC unroll 6") for (int r = 0; r < ROWS; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x + r * p.x_stride + i);
        acc[0][r][b][0] = _mm256_fmadd_ps(xv, lo, acc[0][r][b][0]);
        acc[0][r][b][1] = _mm256_fmadd_ps(xv, hi, acc[0][r][b][1]);
      }
    }
  }
  if constexpr (S == 2) {
    _Pragma("GCC unroll 6") for (int r = 0; r < ROWS; ++r)
      _Pragma("GCC unroll 2") for (int b = 0; b < BLOCKS; ++b)
        _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h)
          acc[0][r][b][h] = _mm256_add_ps(acc[0][r][b][h], acc[1][r][b][h]);
  }
  if (last < p.k) {
    _Pragma("GCC unroll 6") for (int r = 0; r < ROWS; ++r)
      _Pragma("GCC unroll 2") for (int b = 0; b < BLOCKS; ++b)
        _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h)
          _mm256_storeu_ps(partial + r * kGroup + (b0 + b) * 16 + h * 8, acc[0][r][b][h]);
    return;
  }
  _Pragma("GCC unroll 2") for (int b = 0; b < BLOCKS; ++b) {
    _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {
      const int64_t col = group * kGroup + (b0 + b) * 16 + h * 8;
      const int64_t valid = std::min<int64_t>(8, p.n - col);
      if (valid <= 0) continue;  // padding columns of the last group
      const __m256i mask = lanes_below(valid);
      const __m256 bias = p.bias == nullptr ? _mm256_setzero_ps()
                          : valid == 8      ? _mm256_loadu_ps(p.bias + col)
                                            : _mm256_maskload_ps(p.bias + col, mask);
      _Pragma("GCC unroll 6") for (int r = 0; r < ROWS; ++r) {
        const __m256 y = _mm256_add_ps(acc[0][r][b][h], bias);
        float* dst = p.out + (row + r) * p.n + col;
        if (valid == 8) {
          _mm256_storeu_ps(dst, y);
        } else {
          _mm256_maskstore_ps(dst, mask, y);
        }
      }
    }
  }
}

// Up to 3 rows cover the whole group (both blocks) in one pass; 4-6 rows take it a block (`half`) a pass.
inline int passes_for(int64_t rows) { return rows <= 3 ? 1 : 2; }

TIDAL_TARGET void tile_pass(const Problem& p, int64_t row, int64_t rows, int half, int64_t group, int64_t first,
                            int64_t last, float* partial, Ahead ahead) {
  switch (rows) {
    case 1: return tile<1, 2>(p, row, group, 0, first, last, partial, ahead);
    case 2: return tile<2, 2>(p, row, group, 0, first, last, partial, ahead);
    case 3: return tile<3, 2>(p, row, group, 0, first, last, partial, ahead);
    case 4: return tile<4, 1>(p, row, group, half, first, last, partial, ahead);
    case 5: return tile<5, 1>(p, row, group, half, first, last, partial, ahead);
    default: return tile<6, 1>(p, row, group, half, first, last, partial, ahead);
  }
}

// Groups [begin, end), each for every row before the next, so the passes after the first find its weights
// in cache. Those passes, computing from cache, prefetch the next slice (this group's next K chunk, or the
// next group) into L2, shared out between them, so the next first pass does not wait on memory: the
// weight read overlaps the arithmetic (at 4 rows the two passes took 2.1x one row's time without it). The
// next group is prefetched when it lies below ahead_end (the thread's likely next work, claims.h).
TIDAL_TARGET void run_groups(const Problem& p, int64_t begin, int64_t end, int64_t ahead_end) {
  const int64_t chunk = p.m > kMaxRows ? kChunk : p.k;
  std::vector<float> partial(chunk < p.k ? p.m * kGroup : 0);
  int64_t passes = 0;
  for (int64_t row = 0; row < p.m; row += kMaxRows) passes += passes_for(std::min<int64_t>(kMaxRows, p.m - row));
  for (int64_t group = begin; group < end; ++group) {
    for (int64_t first = 0; first < p.k; first += chunk) {
      const int64_t last = std::min(p.k, first + chunk);
      // the slice the next first pass reads: one 64-byte line per input
      const uint16_t* next = nullptr;
      int64_t next_lines = 0;
      if (last < p.k) {
        next = p.w + (group * p.k + last) * kGroup;
        next_lines = std::min(p.k, last + chunk) - last;
      } else if (group + 1 < ahead_end) {
        next = p.w + (group + 1) * p.k * kGroup;
        next_lines = std::min(chunk, p.k);
      }
      const int64_t share = passes > 1 ? (next_lines + passes - 2) / (passes - 1) : 0;  // lines per later pass
      int64_t pass = 0;
      for (int64_t row = 0; row < p.m; row += kMaxRows) {
        const int64_t rows = std::min<int64_t>(kMaxRows, p.m - row);
        float* rows_partial = partial.empty() ? nullptr : partial.data() + row * kGroup;
        for (int half = 0; half < passes_for(rows); ++half, ++pass) {
          Ahead ahead;
          if (next != nullptr && pass > 0 && (pass - 1) * share < next_lines && p.m <= kPrefetchRows) {
            ahead.base = reinterpret_cast<const char*>(next) + (pass - 1) * share * 64;
            ahead.lines = std::min(share, next_lines - (pass - 1) * share);
            ahead.lines_per_step = (ahead.lines + (last - first) - 1) / (last - first);
          }
          tile_pass(p, row, rows, half, group, first, last, rows_partial, ahead);
        }
      }
    }
  }
}

bool cpu_has_avx2_fma() { return isa().avx2_fma; }

#else

bool cpu_has_avx2_fma() { return false; }
void run_groups(const Problem&, int64_t, int64_t, int64_t) {}

#endif  // TIDAL_AVX2_FMA

}  // namespace

// x [..., K] float32 with a contiguous last dim; packed [ceil(N/32), K, 32] bf16 from pack_avx2_weight;
// bias [N] float32 or None. Returns [..., N] float32, as F.linear(x, W.float(), bias) would.
at::Tensor linear_avx2(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias) {
  static const bool supported = cpu_has_avx2_fma();
  TORCH_CHECK(supported, "linear_avx2 needs a CPU with AVX2 and FMA");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1, "x must be a float32 CPU tensor");
  const int64_t k = x.size(-1), groups = (n + kGroup - 1) / kGroup;
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == groups && packed.size(1) == k && packed.size(2) == kGroup,
              "packed weight has shape ", packed.sizes(), ", expected [", groups, ", ", k, ", 32] for N=", n, " K=", k);
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "bias must be a contiguous float32 [N] tensor");
  }
  at::Tensor rows = x.dim() == 2 && x.stride(1) == 1 ? x : x.reshape({-1, k});
  if (rows.stride(1) != 1) rows = rows.contiguous();
  const int64_t m = rows.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  if (m == 0 || n == 0) return out;
  if (k == 0) {  // no inputs: y is the bias
    out.zero_();
    if (bias.has_value()) out.add_(*bias);
    return out;
  }
  Problem p{rows.data_ptr<float>(),
            rows.stride(0),
            reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>()),
            bias.has_value() ? bias->data_ptr<float>() : nullptr,
            out.data_ptr<float>(),
            m,
            n,
            k};
  // split the groups over threads only where each gets enough weight to stream; a group per claim
  const int64_t group_bytes = k * kGroup * 2;
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(1, group_bytes * m));
  tidal_cpu::parallel_claims(groups, 1, (groups + grain - 1) / grain,
                             [&](int64_t begin, int64_t end, int64_t ahead_end) { run_groups(p, begin, end, ahead_end); });
  return out;
}

bool linear_avx2_supported() { return cpu_has_avx2_fma(); }

}  // namespace tidal_cpu

using namespace tidal_cpu;

TORCH_LIBRARY_FRAGMENT(tidal_cpu, m) {
  m.def("linear_avx2(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor", &linear_avx2);
  m.def("linear_avx2_supported() -> bool", &linear_avx2_supported);
}
