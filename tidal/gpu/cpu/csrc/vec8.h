// Eight-float vectors (GCC/Clang vector extensions: one register on AVX, two on SSE, so any x86 or
// ARM target builds them; no intrinsics) and the helpers the CPU kernels share: lane sums, a
// branch-free exp, and bf16 <-> float conversion of eight values at a time.
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tidal_cpu {

// Eight floats as one value (GCC/Clang vector extension): a register on AVX, two on SSE. Keeps
// accumulators in registers where array loops left them on the stack, without intrinsics.
typedef float vec8 __attribute__((vector_size(32)));
typedef int32_t ivec8 __attribute__((vector_size(32)));
constexpr int64_t kWidth = 8;

inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store8(float* p, vec8 v) { std::memcpy(p, &v, sizeof(v)); }
inline vec8 splat(float x) { return vec8{x, x, x, x, x, x, x, x}; }

// Lane sum in a fixed tree order (results never depend on thread count or batch layout).
inline float hsum(vec8 v) {
  v += __builtin_shuffle(v, ivec8{4, 5, 6, 7, 0, 1, 2, 3});
  v += __builtin_shuffle(v, ivec8{2, 3, 0, 1, 6, 7, 4, 5});
  v += __builtin_shuffle(v, ivec8{1, 0, 3, 2, 5, 4, 7, 6});
  return v[0];
}
// Pairwise sums of neighbours: [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7].
inline vec8 hadd(vec8 a, vec8 b) {
  return __builtin_shuffle(a, b, ivec8{0, 2, 8, 10, 4, 6, 12, 14}) +
         __builtin_shuffle(a, b, ivec8{1, 3, 9, 11, 5, 7, 13, 15});
}
// The lane sums of eight vectors as one vector, in far fewer shuffles than eight hsum calls.
inline vec8 hsum8(const vec8* v) {
  const vec8 lo = hadd(hadd(v[0], v[1]), hadd(v[2], v[3]));  // per 128-bit half: sums of v0..v3
  const vec8 hi = hadd(hadd(v[4], v[5]), hadd(v[6], v[7]));
  return __builtin_shuffle(lo, hi, ivec8{0, 1, 2, 3, 8, 9, 10, 11}) +
         __builtin_shuffle(lo, hi, ivec8{4, 5, 6, 7, 12, 13, 14, 15});
}

inline vec8 vmax(vec8 a, vec8 b) { return a > b ? a : b; }
inline float hmax(vec8 v) {
  v = vmax(v, __builtin_shuffle(v, ivec8{4, 5, 6, 7, 0, 1, 2, 3}));
  v = vmax(v, __builtin_shuffle(v, ivec8{2, 3, 0, 1, 6, 7, 4, 5}));
  v = vmax(v, __builtin_shuffle(v, ivec8{1, 0, 3, 2, 5, 4, 7, 6}));
  return v[0];
}
// The largest of x[0, n) (-inf when n is 0): eight lanes at a time, then the tail.
inline float row_max(const float* x, int64_t n) {
  const int64_t full = n / kWidth * kWidth;
  float top = -INFINITY;
  if (full) {
    vec8 m = load8(x);
    for (int64_t i = kWidth; i < full; i += kWidth) m = vmax(m, load8(x + i));
    top = hmax(m);
  }
  for (int64_t i = full; i < n; ++i) top = top > x[i] ? top : x[i];
  return top;
}

// exp(x) for x <= 0, eight at a time, branch-free (std::exp does not vectorise without
// -ffast-math). Relative error about 2e-7; results below ~1e-38 are not exact but negligible.
inline vec8 exp_nonpositive(vec8 x) {
  x = vmax(x, splat(-87.0f));
  const vec8 shifter = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to the nearest integer
  const vec8 t = x * 1.44269504088896341f + shifter;
  const vec8 n = t - shifter;
  // x - n * ln2 in two parts (Cody-Waite) so the remainder stays exact
  vec8 r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  // exp(r) on [-ln2/2, ln2/2]: Taylor series to degree 7
  vec8 p = splat(1.0f / 5040.0f);
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // 2^n: n sits in t's low mantissa bits; move it (biased) into the exponent field
  const ivec8 bits = (reinterpret_cast<const ivec8&>(t) - 0x4B400000 + 127) << 23;
  return p * reinterpret_cast<const vec8&>(bits);
}

typedef uint16_t u16vec8 __attribute__((vector_size(16)));
typedef uint32_t uvec8 __attribute__((vector_size(32)));

// Eight bf16 bits widened to float bits (exact: bf16 is float's upper half). With AVX2 one vpmovzxwd:
// GCC splits the vector-extension conversion into two 4-lane halves and a merge.
inline vec8 widen_bf16(u16vec8 half) {
#if defined(__AVX2__)
  __m128i raw;
  std::memcpy(&raw, &half, sizeof(raw));
  const __m256i bits = _mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16);
  return reinterpret_cast<const vec8&>(bits);
#else
  const uvec8 bits = __builtin_convertvector(half, uvec8) << 16;
  return reinterpret_cast<const vec8&>(bits);
#endif
}
inline vec8 load8(const c10::BFloat16* p) {
  u16vec8 half;
  std::memcpy(&half, p, sizeof(half));
  return widen_bf16(half);
}
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
// One instruction rounds eight floats to bf16, to nearest even as c10::BFloat16(float) does (NaN stays
// NaN; only denormals differ: the instruction flushes them to zero).
inline void store8(c10::BFloat16* p, vec8 v) {
  const __m128bh half = _mm256_cvtneps_pbh(reinterpret_cast<const __m256&>(v));
  std::memcpy(p, &half, sizeof(half));
}
inline vec8 round_bf16(vec8 v) {
  const __m128bh half = _mm256_cvtneps_pbh(reinterpret_cast<const __m256&>(v));
  u16vec8 bits;
  std::memcpy(&bits, &half, sizeof(bits));
  return widen_bf16(bits);
}
#else
// Eight floats rounded to bf16, to nearest even, as c10::BFloat16(float) rounds them (NaN stays NaN).
inline void store8(c10::BFloat16* p, vec8 v) {
  const uvec8 bits = reinterpret_cast<const uvec8&>(v);
  const uvec8 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uvec8 is_nan = (uvec8)((bits & 0x7fffffffu) > 0x7f800000u);  // all ones where NaN
  const u16vec8 half = __builtin_convertvector((rounded & ~is_nan) | (0x7fc0u & is_nan), u16vec8);
  std::memcpy(p, &half, sizeof(half));
}
// v rounded to the nearest bf16 and widened back: what storing to a bf16 tensor and reading it keeps.
inline vec8 round_bf16(vec8 v) {
  const uvec8 bits = reinterpret_cast<const uvec8&>(v);
  const uvec8 is_nan = (uvec8)((bits & 0x7fffffffu) > 0x7f800000u);
  const uvec8 rounded = ((bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u) | (bits & is_nan);
  return reinterpret_cast<const vec8&>(rounded);
}
#endif
inline vec8 round_as(vec8 v, const float*) { return v; }
inline vec8 round_as(vec8 v, const c10::BFloat16*) { return round_bf16(v); }

}  // namespace tidal_cpu
