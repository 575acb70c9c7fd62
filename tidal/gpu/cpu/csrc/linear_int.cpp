// Weight-only quantized linear (y = x @ dequant(W).T + b): int8 or int4 weights, float32 arithmetic.
//
// At decode a linear's time is the time to stream its weight, so one byte (int8) or half a byte (int4) per
// weight reads 2-4x less than bf16. The weights stay integers in memory and are widened to float32 in
// registers, scaled by their column's scale (per output channel, or per group of `group_size` inputs) minus an
// offset: w = q * scale - offset, where offset = zero_point * scale (int4 stores q + 8 unsigned, so its offset
// also holds 8 * scale). Symmetric int8 per channel has no offset: its columns' scales multiply the integer sums
// once at the end. Bias and sums are float32. A bf16 x is widened first (it is a few KB at decode), except
// against int4 weights on a CPU with AVX512-BF16, whose tile multiplies the bf16 rows as they are
// (namespace avx512bf16 below); the tensor entry rounds the result back to bf16.
//
// Layout (tidal/gpu/model/quantization.py packs it): output columns in blocks of 16; a block is one sequential
// stream over the inputs. int8: 16 bytes per input ([blocks, K, 16]). int4: 64 bytes per chunk of 8 inputs, each
// group's inputs in whole chunks ([blocks, groups * chunks, 64]); a chunk's 16-bit word 2j + h holds column j's
// inputs 2t + h in its nibbles t = 0..3, so a shift and a mask per vector bring out 16 columns' input (as 32-bit
// lanes) or 16 columns' input pair (as 16-bit lanes, the bf16 pairs below). Scales and offsets are float32
// [blocks, groups, 16]. N is zero-padded to whole blocks (padding scales are 0).
//
// The same loops (linear_int_tile.h) are compiled for AVX-512 (one zmm per block) and for AVX2+FMA (two ymm),
// each under its own target attribute whatever the build's flags; which runs is decided once from the CPU
// (isa.h), so a build on one host runs the fast path of whichever CPU loads it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "claims.h"
#include "isa.h"
#include "ops.h"

#if defined(__x86_64__) || defined(__i386__)
#define TIDAL_X86 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace tidal_cpu {
namespace {

constexpr int64_t kBlock = 16;  // output columns per packed block

struct Problem {
  const float* x;  // [M, K], rows x_stride apart (null on the bf16 int4 path, which reads xb)
  int64_t x_stride;
  const uint16_t* xb;   // bf16 rows, x_stride apart (the bf16 int4 path only)
  const float* xsum;    // [M, groups]: each row's sum of x over each group (the bf16 int4 path only)
  const uint8_t* w;        // packed weight
  const float* scales;     // [blocks, groups, 16]
  const float* offsets;    // [blocks, groups, 16] or null (symmetric int8 per channel)
  const float* bias;       // [N] or null
  float* out;              // [M, N]
  int64_t m, n, k, bits, group_size, groups;
  int64_t chunks;          // int4: chunks of 8 inputs per group
};

// int4's chunks of 8 inputs per group (the last one zero-padded).
int64_t int4_chunks(int64_t k, int64_t group_size) { return (std::min(group_size, k) + 7) / 8; }

#ifdef TIDAL_X86

namespace avx512 {
#define TIDAL_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))
using V = __m512;
TIDAL_TARGET inline V zero() { return _mm512_setzero_ps(); }
TIDAL_TARGET inline V splat(float v) { return _mm512_set1_ps(v); }
TIDAL_TARGET inline V load(const float* p) { return _mm512_loadu_ps(p); }
TIDAL_TARGET inline V add(V a, V b) { return _mm512_add_ps(a, b); }
TIDAL_TARGET inline V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
TIDAL_TARGET inline V fmsub(V a, V b, V c) { return _mm512_fmsub_ps(a, b, c); }
TIDAL_TARGET inline V widen_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
using U4 = __m512i;
TIDAL_TARGET inline U4 load_u4(const uint8_t* p) { return _mm512_loadu_si512(p); }
TIDAL_TARGET inline V nibbles(U4 v, int shift) {
  return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, shift), _mm512_set1_epi32(0xF)));
}
TIDAL_TARGET inline void store(float* dst, V v, int64_t valid) {
  _mm512_mask_storeu_ps(dst, valid >= kBlock ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1), v);
}
#include "linear_int_tile.h"
#undef TIDAL_TARGET
}  // namespace avx512

namespace avx2 {
#define TIDAL_TARGET __attribute__((target("avx2,fma")))
struct V {
  __m256 lo, hi;  // columns 0-7, 8-15 of the block
};
TIDAL_TARGET inline V zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
TIDAL_TARGET inline V splat(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
TIDAL_TARGET inline V load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
TIDAL_TARGET inline V add(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
TIDAL_TARGET inline V fmadd(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
TIDAL_TARGET inline V fmsub(V a, V b, V c) { return {_mm256_fmsub_ps(a.lo, b.lo, c.lo), _mm256_fmsub_ps(a.hi, b.hi, c.hi)}; }
TIDAL_TARGET inline V widen_i8(const int8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v)))};
}
struct U4 {
  __m256i lo, hi;  // columns 0-7, 8-15 of the chunk
};
TIDAL_TARGET inline U4 load_u4(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
TIDAL_TARGET inline V nibbles(U4 v, int shift) {
  const __m256i mask = _mm256_set1_epi32(0xF);
  return {_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v.lo, shift), mask)),
          _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v.hi, shift), mask))};
}
TIDAL_TARGET inline __m256i lanes_below(int64_t valid) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
TIDAL_TARGET inline void store(float* dst, V v, int64_t valid) {
  if (valid >= kBlock) {
    _mm256_storeu_ps(dst, v.lo);
    _mm256_storeu_ps(dst + 8, v.hi);
    return;
  }
  _mm256_maskstore_ps(dst, lanes_below(valid), v.lo);
  if (valid > 8) _mm256_maskstore_ps(dst + 8, lanes_below(valid - 8), v.hi);
}
#include "linear_int_tile.h"
#undef TIDAL_TARGET
}  // namespace avx2

// int4 weights against bf16 rows, on a CPU with AVX512-BF16 (the activations `--dtype auto` gives there): a chunk
// of 8 inputs by a block's 16 columns (64 bytes) becomes four vectors of 16 bf16 pairs in seven integer ops (a
// shift and a mask-and-OR per vector), and one `vdpbf16ps` per vector and row multiplies them, where the float
// tile spends ~13 ops per 32 weights widening and scaling (compute-bound at one row). A nibble q becomes the bf16
// 128 + q exactly (q in the mantissa under 128's exponent, 0x4300), so a group's sums are D = sum(x q) + 128 X,
// with X the row's sum of x over the group; its weights q * scale - offset then give
// scale * D - (128 * scale + offset) * X. The products are exact and the sums float32, as in the float tile.
namespace avx512bf16 {
#define TIDAL_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))

TIDAL_TARGET inline __m512bh x_pair(const uint16_t* x) {
  int32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  return (__m512bh)_mm512_set1_epi32(pair);
}

// Rows [row, row + ROWS) by the 16 columns of `block`. Each row keeps four sums in flight, one per vector of a
// chunk (vdpbf16ps' latency: with one sum per row, four rows ran at 0.7x the rate).
template <int ROWS>
TIDAL_TARGET __attribute__((noinline)) void tile(const Problem& p, int64_t row, int64_t block) {
  const __m512i nibble = _mm512_set1_epi16(0x000F), exponent = _mm512_set1_epi16(0x4300);
  __m512 y[ROWS];
  _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r) y[r] = _mm512_setzero_ps();
  const uint16_t* x = p.xb + row * p.x_stride;
  const float* xsum = p.xsum + row * p.groups;
  const uint8_t* w = p.w + block * p.groups * p.chunks * 64;
  const float* scales = p.scales + block * p.groups * kBlock;
  const float* offsets = p.offsets + block * p.groups * kBlock;
  for (int64_t g = 0; g < p.groups; ++g) {
    const int64_t first = g * p.group_size, size = std::min(p.k, first + p.group_size) - first;
    __m512 acc[4][ROWS];
    _Pragma("GCC unroll 4") for (int c = 0; c < 4; ++c)
      _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r) acc[c][r] = _mm512_setzero_ps();
    const uint8_t* chunk = w + g * p.chunks * 64;
    for (int64_t i = 0; i < size; i += 8, chunk += 64) {
      const int64_t pairs = std::min<int64_t>(4, (size - i) / 2);
      const __m512i v = _mm512_loadu_si512(chunk);
      const __m512i q[4] = {  // (v >> 4t) & 0xF | 0x4300 per 16-bit lane: ternary-logic 0xEA is (a & b) | c
          _mm512_ternarylogic_epi32(v, nibble, exponent, 0xEA),
          _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), nibble, exponent, 0xEA),
          _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 8), nibble, exponent, 0xEA),
          _mm512_or_si512(_mm512_srli_epi16(v, 12), exponent)};
      _Pragma("GCC unroll 4") for (int t = 0; t < 4; ++t) {
        if (t >= pairs) break;
        _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r)
          acc[t][r] = _mm512_dpbf16_ps(acc[t][r], x_pair(x + r * p.x_stride + first + i + 2 * t), (__m512bh)q[t]);
      }
    }
    const __m512 scale = _mm512_loadu_ps(scales + g * kBlock);
    const __m512 x_weight = _mm512_fmadd_ps(scale, _mm512_set1_ps(128.0f), _mm512_loadu_ps(offsets + g * kBlock));
    _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r) {
      __m512 d = acc[0][r];
      _Pragma("GCC unroll 4") for (int c = 1; c < 4; ++c) d = _mm512_add_ps(d, acc[c][r]);
      y[r] = _mm512_fmadd_ps(scale, d, y[r]);
      y[r] = _mm512_fnmadd_ps(x_weight, _mm512_set1_ps(xsum[r * p.groups + g]), y[r]);
    }
  }
  const int64_t col = block * kBlock;
  const int64_t valid = std::min<int64_t>(kBlock, p.n - col);
  const __mmask16 lanes = valid >= kBlock ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  const __m512 bias = p.bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(lanes, p.bias + col);
  _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r)
    _mm512_mask_storeu_ps(p.out + (row + r) * p.n + col, lanes, _mm512_add_ps(y[r], bias));
}

TIDAL_TARGET void run(const Problem& p, int64_t begin, int64_t end) {
  for (int64_t block = begin; block < end; ++block) {
    for (int64_t row = 0; row < p.m; row += 4) {
      switch (std::min<int64_t>(4, p.m - row)) {
        case 1: tile<1>(p, row, block); break;
        case 2: tile<2>(p, row, block); break;
        case 3: tile<3>(p, row, block); break;
        default: tile<4>(p, row, block); break;
      }
    }
  }
}
#undef TIDAL_TARGET
}  // namespace avx512bf16

// The instruction set the kernel runs with on this CPU: "avx512", "avx2", or "" (none: unsupported).
const char* cpu_isa() { return isa().avx512 ? "avx512" : isa().avx2_fma ? "avx2" : ""; }

// Whether int4 weights against bf16 rows run on the bf16 dot products (avx512bf16 above).
bool bf16_dots() { return isa().avx512_bf16; }

#else

const char* cpu_isa() { return ""; }
bool bf16_dots() { return false; }

#endif  // TIDAL_X86

void run(const Problem& p, int64_t begin, int64_t end) {
#ifdef TIDAL_X86
  static const bool wide = std::string(cpu_isa()) == "avx512";
  if (wide) return avx512::run(p, begin, end);
  return avx2::run(p, begin, end);
#endif
}

}  // namespace

IntLinear int_linear(const at::Tensor& packed, const at::Tensor& scales, const std::optional<at::Tensor>& offsets,
                     int64_t n, int64_t k, int64_t bits, int64_t group_size, const std::optional<at::Tensor>& bias) {
  static const bool supported = *cpu_isa() != '\0';
  TORCH_CHECK(supported, "linear_int needs a CPU with AVX2 and FMA");
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  TORCH_CHECK(group_size > 0 && (bits == 8 || (k % 2 == 0 && group_size % 2 == 0)),
              "int4 needs an even K and group size (K=", k, ", group ", group_size, ")");
  const int64_t groups = (k + group_size - 1) / group_size;
  const int64_t lines = bits == 8 ? k : groups * int4_chunks(k, group_size), line_bytes = bits == 8 ? kBlock : 64;
  TORCH_CHECK(packed.scalar_type() == (bits == 8 ? at::kChar : at::kByte) && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == blocks && packed.size(1) == lines && packed.size(2) == line_bytes,
              "packed weight has shape ", packed.sizes(), ", expected [", blocks, ", ", lines, ", ", line_bytes,
              "] for N=", n, " K=", k, " bits=", bits, " group ", group_size);
  auto check_per_group = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 3 && t.size(0) == blocks &&
                    t.size(1) == groups && t.size(2) == kBlock,
                name, " has shape ", t.sizes(), ", expected float32 [", blocks, ", ", groups, ", 16]");
  };
  check_per_group(scales, "scales");
  if (offsets.has_value()) check_per_group(*offsets, "offsets");
  TORCH_CHECK(offsets.has_value() || (bits == 8 && groups == 1), "only int8 per channel may omit the offsets");
  at::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "bias must have N=", n, " values");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  return IntLinear{packed, scales, offsets.has_value() ? *offsets : at::Tensor(), bias32, n, k, bits, group_size, groups};
}

namespace {

// The problem over w with no rows yet (the caller sets x or xb and xsum).
Problem problem(const IntLinear& w, int64_t m, int64_t x_stride, float* out) {
  return Problem{nullptr, x_stride, nullptr, nullptr, static_cast<const uint8_t*>(w.packed.data_ptr()),
                 w.scales.data_ptr<float>(), w.offsets.defined() ? w.offsets.data_ptr<float>() : nullptr,
                 w.bias.defined() ? w.bias.data_ptr<float>() : nullptr, out, m, w.n, w.k, w.bits, w.group_size,
                 w.groups, w.bits == 4 ? int4_chunks(w.k, w.group_size) : 0};
}

// The blocks over the threads the linear's arithmetic is worth (claims.h).
void run_threads(const Problem& p, bool bf16_rows) {
  const int64_t blocks = (p.n + kBlock - 1) / kBlock;
  tidal_cpu::parallel_claims(blocks, 1, linear_threads(p.m * p.n * p.k), [&](int64_t begin, int64_t end, int64_t) {
#ifdef TIDAL_X86
    if (bf16_rows) return avx512bf16::run(p, begin, end);
#endif
    run(p, begin, end);
  });
}

}  // namespace

void linear_int_into(const float* x, int64_t m, int64_t x_stride, const IntLinear& w, float* out) {
  if (m <= 0 || w.n <= 0) return;
  Problem p = problem(w, m, x_stride, out);
  p.x = x;
  run_threads(p, false);
}

void linear_int_bf16_into(const c10::BFloat16* x, int64_t m, int64_t x_stride, const IntLinear& w, float* out) {
  if (m <= 0 || w.n <= 0) return;
  static const bool bf16_path = bf16_dots();
  if (!bf16_path || w.bits != 4) {  // int8, or a CPU without bf16 dot products: the float tile on x widened
    thread_local std::vector<float> x32;
    x32.resize(m * w.k);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t i = 0; i < w.k; ++i) x32[r * w.k + i] = static_cast<float>(x[r * x_stride + i]);
    return linear_int_into(x32.data(), m, w.k, w, out);
  }
  // int4 against bf16 rows multiplies them as they are (bf16 dot products), with each row's sum per group
  thread_local std::vector<float> xsum;
  xsum.resize(m * w.groups);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < w.groups; ++g) {
      const c10::BFloat16* first = x + r * x_stride + g * w.group_size;
      const int64_t size = std::min(w.group_size, w.k - g * w.group_size);
      float sum = 0.0f;
      for (int64_t i = 0; i < size; ++i) sum += static_cast<float>(first[i]);
      xsum[r * w.groups + g] = sum;
    }
  }
  Problem p = problem(w, m, x_stride, out);
  p.xb = reinterpret_cast<const uint16_t*>(x);
  p.xsum = xsum.data();
  run_threads(p, true);
}

// x [..., K] float32 or bf16 (last dim contiguous); packed, scales, offsets as above; bits 8 or 4; group_size
// inputs per scale (K for per channel); activation_bits 16 (x stays float) or 8 (x quantized to int8 blocks,
// linear_int_a8.cpp, with its own layout). Returns [..., N] in x's dtype.
at::Tensor linear_int(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                      const std::optional<at::Tensor>& offsets, int64_t n, int64_t bits, int64_t group_size,
                      int64_t activation_bits, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(activation_bits == 16 || activation_bits == 8, "activation_bits must be 16 or 8, got ", activation_bits);
  if (activation_bits == 8) return linear_int_a8(x, packed, scales, offsets, n, bits, group_size, bias);
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a float32 or bf16 CPU tensor");
  const int64_t k = x.size(-1);
  const IntLinear w = int_linear(packed, scales, offsets, n, k, bits, group_size, bias);
  at::Tensor rows = x.reshape({-1, k});
  if (rows.stride(1) != 1) rows = rows.contiguous();
  const int64_t m = rows.size(0);
  at::Tensor out = at::empty({m, n}, rows.options().dtype(at::kFloat));
  if (rows.scalar_type() == at::kFloat)
    linear_int_into(rows.data_ptr<float>(), m, rows.stride(0), w, out.data_ptr<float>());
  else
    linear_int_bf16_into(rows.data_ptr<at::BFloat16>(), m, rows.stride(0), w, out.data_ptr<float>());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  out = out.view(shape);
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

std::string linear_int_isa() { return cpu_isa(); }

}  // namespace tidal_cpu

using namespace tidal_cpu;

TORCH_LIBRARY_FRAGMENT(tidal_cpu, m) {
  m.def("linear_int(Tensor x, Tensor packed, Tensor scales, Tensor? offsets, int n, int bits, int group_size, "
        "int activation_bits, Tensor? bias) -> Tensor", &linear_int);
  m.def("linear_int_isa() -> str", &linear_int_isa);
  m.def("linear_int_a8_isa() -> str", &linear_int_a8_isa);
}
