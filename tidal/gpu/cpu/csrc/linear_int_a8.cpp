// The int8/int4 linear with int8 activations (quantization.py's w8a8 / w4a8): integer dot products instead of
// widening every weight to float.
//
// On a CPU without wide float conversion units (AVX2 hosts such as this project's AMD EPYC), widening int8/int4
// weights to float32 costs more than reading them: linear_int.cpp's float path runs at 2-5x the weight-read
// time there. Here each row of x is quantized on the fly to int8 in blocks of 32 inputs (scale = max|x| / 127,
// the arithmetic of llama.cpp's Q8_0 activations) and multiplied against the integer weights with vpmaddubsw
// (32 byte products per instruction), so a weight costs about one vector op per 32 and decode is bound by the
// read again. The result equals x' @ dequant(W).T + b, where x' is x rounded to those int8 blocks.
//
// Weights per output column: w = q * scale - offset per group of inputs (offset = zero_point * scale, and for
// int4, stored as u = q + 8, also + 8 * scale), so a column's sum is
//   sum_g scale_g * sum_{blocks b of g} sx_b * (integer dot of block b)  -  offset_g * sum_{i in g} x'_i.
// Layout (quantization.py packs it), output columns in blocks of 8 (one ymm of int32 sums):
//   int8: [blocks, K/4, 32]: for each 4 inputs, 8 columns x 4 consecutive inputs (signed bytes);
//   int4: [blocks, K/8, 32]: for each 8 inputs, 8 columns x 4 bytes, byte j = u(8t + j) | u(8t + 4 + j) << 4.
// scales, offsets: float32 [blocks, groups, 8]; symmetric int4 has no offsets (its 8 * scale comes off as 8 x each
// block's integer sum of x, exactly, one read stream fewer). K is padded to a multiple of 32 with zero weights; a group is a
// multiple of 32 inputs (the last may be shorter) or the whole row.
//
// 256-bit code on AVX2, with AVX512-VNNI's vpdpbusd where the CPU has it (the tiles below). Both multiply unsigned
// by signed bytes; int4's u is already unsigned. On AVX2 int8 weights go in as |q| with x's sign flipped where
// q < 0 (vpsignb), so vpmaddubsw's sums of two products stay within int16 (128 * 127 * 2 < 32768; int4's four:
// 15 * 127 * 4 < 32768). vpdpbusd sums into int32, so there an int8 weight goes in as q + 128 (an xor) and
// 128 x each block's sum of x comes off its int32 sum. Both paths sum the same integers exactly.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>

#include "claims.h"
#include "isa.h"
#include "ops.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace tidal_cpu {
namespace {

constexpr int64_t kCols = 8;              // output columns per packed block
constexpr int64_t kXBlock = 32;           // inputs per activation scale
// Bytes of one packed column block: 8 columns of K (padded) int8 or int4 weights.
inline int64_t block_bytes(int64_t k, int64_t bits) { return bits == 8 ? k * kCols : k * kCols / 2; }

struct Problem {
  const int8_t* qx;    // [M, K] x quantized
  const float* sx;     // [M, K / 32] its scales
  const int32_t* qsum; // [M, K / 32] the sum of each block of qx (the unsigned int8 tiles take 128 x it off)
  const float* sumx;   // [M, groups] sum of x' over each group (for the offsets)
  const uint8_t* w;    // packed weight
  const float* scales;
  const float* offsets;  // or null
  const float* bias;     // [N] or null
  float* out;            // [M, N], or null when out_bf16 takes the output
  int64_t m, n, k, bits, group_size, groups;  // k: K padded to a multiple of 32
  c10::BFloat16* out_bf16 = nullptr;  // [M, N] rounded to bf16 as each tile stores it (a bf16 model's rows)
};

#if defined(__x86_64__) || defined(__i386__)
#define TIDAL_TARGET __attribute__((target("avx2,fma")))

TIDAL_TARGET inline float horizontal_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

TIDAL_TARGET inline int horizontal_sum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

TIDAL_TARGET inline __m256 load8_float(const float* p) { return _mm256_loadu_ps(p); }
// eight bf16 widened exactly: a bf16 is the top half of a float32
TIDAL_TARGET inline __m256 load8_float(const c10::BFloat16* p) {
  const __m256i halves = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(halves, 16));
}

// Eight floats rounded to bf16 as c10::BFloat16(float) rounds them (to nearest even; NaN to 0x7FC0), stored.
TIDAL_TARGET inline void store8_bf16(c10::BFloat16* out, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  top = _mm256_blendv_epi8(top, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // the pack works per 128-bit lane: [0-3, 0-3 | 4-7, 4-7]; the permute puts 0-7 in the low half
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(top, top), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
}

// One row of x [K] (float32 or bf16) to int8 blocks of 32 (round half to even; a last partial block is padded with
// zeros), their scales, their integer sums and the per-group sums of x'. qx, sx and qsum have room for K rounded up
// to 32.
template <typename T>
TIDAL_TARGET void quantize_row(const T* x, int64_t k, int64_t group_size, int8_t* qx, float* sx, int32_t* qsum,
                               float* sumx) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b * kXBlock < k; ++b) {
    __m256 v[4];
    if ((b + 1) * kXBlock > k) {
      alignas(32) float tail[kXBlock] = {};
      for (int64_t i = b * kXBlock; i < k; ++i) tail[i - b * kXBlock] = static_cast<float>(x[i]);
      for (int j = 0; j < 4; ++j) v[j] = _mm256_load_ps(tail + 8 * j);
    } else {
      for (int j = 0; j < 4; ++j) v[j] = load8_float(x + b * kXBlock + 8 * j);
    }
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    const float top = horizontal_max(amax);
    const float scale = top / 127.0f;
    const __m256 inverse = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
    __m256i q[4];
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inverse));
    const int total = horizontal_sum(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    // pack 4 x 8 int32 to 32 int8; the packs interleave 128-bit lanes, the permute puts them back in order
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qx + b * kXBlock), _mm256_permutevar8x32_epi32(bytes, order));
    sx[b] = scale;
    qsum[b] = total;
    sumx[b * kXBlock / group_size] += scale * static_cast<float>(total);
  }
}

// What a tile prefetches while it computes: the next tile's weight bytes, spread evenly over its blocks of 32 inputs.
struct Ahead {
  const char* base = nullptr;
  int64_t bytes = 0, per_block = 0;  // per_block: bytes to prefetch per block of 32 inputs, whole cache lines
};

#undef TIDAL_TARGET

// The tiles, once per instruction set (linear_int_a8_tile.h). vpmaddubsw sums pairs of byte products into int16
// (saturating: the bounds above keep them exact) and vpmaddwd widens them, three instructions per 32 bytes;
// AVX512-VNNI's vpdpbusd (Zen 4, Ice Lake and later) does the same in one.
namespace avx2 {
#define TIDAL_TARGET __attribute__((target("avx2,fma")))
constexpr int kRowsCols = 1;  // 16 ymm registers: four rows' float and int sums of one block fill them
// vpmaddubsw's int16 pair sums would overflow on unsigned int8 weights (255 * 127 * 2): |q| and x's sign instead
constexpr bool kUnsignedInt8 = false;
TIDAL_TARGET inline __m256i dot(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
TIDAL_TARGET inline __m256i dot2(__m256i acc, __m256i u, __m256i s, __m256i v, __m256i t) {
  return _mm256_add_epi32(
      acc, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u, s), _mm256_maddubs_epi16(v, t)),
                             _mm256_set1_epi16(1)));
}
#include "linear_int_a8_tile.h"
#undef TIDAL_TARGET
}  // namespace avx2

namespace vnni {
#define TIDAL_TARGET __attribute__((target("avx512vnni,avx512vl,avx512bw,avx512f,avx2,fma")))
// 32 registers: two blocks, so eight vpdpbusd chains are in flight (one alone waits out its latency, ~5 cycles)
constexpr int kRowsCols = 2;
// vpdpbusd sums into int32: an int8 weight goes in as q + 128 (one xor), and 128 x the block's sum of x comes off
// after, instead of two sign ops per weight vector and row
constexpr bool kUnsignedInt8 = true;
TIDAL_TARGET inline __m256i dot(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
TIDAL_TARGET inline __m256i dot2(__m256i acc, __m256i u, __m256i s, __m256i v, __m256i t) {
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(acc, u, s), v, t);
}
#include "linear_int_a8_tile.h"
#undef TIDAL_TARGET
}  // namespace vnni

// Whether this CPU runs the vnni tiles, decided once (TIDAL_CPU_ISA=avx2 keeps the AVX2 ones: tests compare them).
bool vnni_tiles() {
  return isa().avx512_vnni;
}
#endif

}  // namespace

bool linear_int_a8_supported() {
  return isa().avx2_fma;
}

// The tiles this CPU runs: "avx512_vnni", "avx2", or "" (none: unsupported).
std::string linear_int_a8_isa() {
#if defined(__x86_64__) || defined(__i386__)
  return linear_int_a8_supported() ? (vnni_tiles() ? "avx512_vnni" : "avx2") : "";
#else
  return "";
#endif
}

A8Linear a8_linear(const at::Tensor& packed, const at::Tensor& scales, const std::optional<at::Tensor>& offsets,
                   int64_t n, int64_t k, int64_t bits, int64_t group_size, const std::optional<at::Tensor>& bias) {
  static const bool supported = linear_int_a8_supported();
  TORCH_CHECK(supported, "int8 activations need a CPU with AVX2 and FMA");
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  const int64_t blocks = (n + kCols - 1) / kCols;
  // K is padded to whole blocks of 32 (the packed weight with zeros); groups of inputs are whole blocks
  const int64_t padded_k = (k + kXBlock - 1) / kXBlock * kXBlock;
  if (group_size >= k) group_size = padded_k;  // one scale per output channel
  TORCH_CHECK(group_size > 0 && group_size % kXBlock == 0,
              "int8 activations need a group size that is a multiple of 32 (K=", k, ", group ", group_size, ")");
  const int64_t groups = (padded_k + group_size - 1) / group_size;  // the last may be shorter
  const int64_t lines = bits == 8 ? padded_k / 4 : padded_k / 8;
  TORCH_CHECK(packed.scalar_type() == (bits == 8 ? at::kChar : at::kByte) && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == blocks && packed.size(1) == lines && packed.size(2) == 4 * kCols,
              "packed weight has shape ", packed.sizes(), ", expected [", blocks, ", ", lines, ", 32] for N=", n, " K=", k,
              " bits=", bits);
  auto check_per_group = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 3 && t.size(0) == blocks &&
                    t.size(1) == groups && t.size(2) == kCols,
                name, " has shape ", t.sizes(), ", expected float32 [", blocks, ", ", groups, ", 8]");
  };
  check_per_group(scales, "scales");
  if (offsets.has_value()) check_per_group(*offsets, "offsets");
  at::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "bias must have N=", n, " values");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  return A8Linear{packed, scales, offsets.has_value() ? *offsets : at::Tensor(), bias32,
                  n, k, padded_k, bits, group_size, groups};
}

namespace {

// x [M, K] float32 or bf16; the output float32 into `out` or, with out_bf16, rounded to bf16 as it is stored
template <typename T>
void run_a8(const T* x, int64_t m, const A8Linear& w, float* out, c10::BFloat16* out_bf16) {
#if defined(__x86_64__) || defined(__i386__)
  if (m <= 0 || w.n <= 0) return;
  // x rounded to int8 blocks: per-thread buffers reused across calls, since at batch 1 three allocations
  // cost about as much as a small layer's arithmetic
  thread_local std::vector<int8_t> qx;
  thread_local std::vector<float> sx, sumx;
  thread_local std::vector<int32_t> qsum;
  const int64_t xblocks = w.padded_k / kXBlock;
  qx.resize(m * w.padded_k);
  sx.resize(m * xblocks);
  qsum.resize(m * xblocks);
  sumx.assign(m * w.groups, 0.0f);
  for (int64_t r = 0; r < m; ++r)
    quantize_row(x + r * w.k, w.k, w.group_size, qx.data() + r * w.padded_k, sx.data() + r * xblocks,
                 qsum.data() + r * xblocks, sumx.data() + r * w.groups);
  const Problem p{qx.data(), sx.data(), qsum.data(), sumx.data(), static_cast<const uint8_t*>(w.packed.data_ptr()),
                  w.scales.data_ptr<float>(), w.offsets.defined() ? w.offsets.data_ptr<float>() : nullptr,
                  w.bias.defined() ? w.bias.data_ptr<float>() : nullptr, out,
                  m, w.n, w.padded_k, w.bits, w.group_size, w.groups, out_bf16};
  // chunks of whole 4-block tiles; every thread joins once the work is worth a second thread
  const int64_t blocks = (w.n + kCols - 1) / kCols;
  const int64_t threads = linear_threads(m * w.n * w.padded_k);
  const bool vnni = vnni_tiles();
  tidal_cpu::parallel_claims(blocks, 4, threads, [&](int64_t begin, int64_t end, int64_t ahead_end) {
    if (vnni) {
      if (w.bits == 8) vnni::run_blocks<8>(p, begin, end, ahead_end);
      else vnni::run_blocks<4>(p, begin, end, ahead_end);
    } else {
      if (w.bits == 8) avx2::run_blocks<8>(p, begin, end, ahead_end);
      else avx2::run_blocks<4>(p, begin, end, ahead_end);
    }
  });
#endif
}

}  // namespace

void linear_int_a8_into(const float* x, int64_t m, const A8Linear& w, float* out) { run_a8(x, m, w, out, nullptr); }

void linear_int_a8_into(const c10::BFloat16* x, int64_t m, const A8Linear& w, c10::BFloat16* out) {
  run_a8(x, m, w, nullptr, out);
}

at::Tensor linear_int_a8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                         const std::optional<at::Tensor>& offsets, int64_t n, int64_t bits, int64_t group_size,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a float32 or bf16 CPU tensor");
  const int64_t k = x.size(-1);
  const A8Linear w = a8_linear(packed, scales, offsets, n, k, bits, group_size, bias);
  at::Tensor rows = x.reshape({-1, k}).contiguous();  // float32 or bf16 rows, read as they are
  const int64_t m = rows.size(0);
  at::Tensor out = at::empty({m, n}, rows.options());
  if (rows.scalar_type() == at::kFloat)
    linear_int_a8_into(rows.data_ptr<float>(), m, w, out.data_ptr<float>());
  else
    linear_int_a8_into(rows.data_ptr<c10::BFloat16>(), m, w, out.data_ptr<c10::BFloat16>());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return out.view(shape);
}

}  // namespace tidal_cpu
