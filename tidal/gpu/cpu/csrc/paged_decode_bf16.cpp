// Paged decode attention over a bf16 KV cache for CPUs with AVX512-BF16.
//
// The generic kernel (paged_decode.cpp) widens every cached row to float and multiplies in 8-float
// vectors: at decode it reached ~15 GMAC/s on a Zen 4 core, the conversions and lane sums costing more
// than the arithmetic. Here both products run on _mm512_dpbf16_ps, which multiplies bf16 pairs exactly
// and accumulates in float32, 32 products per instruction:
//
// * q.k: the query head and a cached row are both bf16, so a row's dot product is dim/32 instructions
//   straight from the cache, then one lane sum (eight rows' sums reduced together).
// * p.V: the softmax weights are rounded to bf16 (as flash attention rounds P before its second GEMM)
//   and two cached rows are interleaved into (v[r][d], v[r+1][d]) pairs, so one instruction adds two
//   rows' contributions to 16 output dims. The weights' sum is taken over the rounded weights, so the
//   output stays an exact weighted mean of the rows.
//
// A task is one sequence (split by kv heads only when there are fewer sequences than threads), walked
// block by block: a block's rows for all its kv heads are one contiguous read, used by every query head.
// Two passes over the blocks (the scores, then the weighted sum), each prefetching what the next pass
// reads. At decode the reads dominate: at batch 16 the cache streams ~3 MB per layer, the arithmetic
// from L2 is ~2.6x faster than the generic kernel's (docs/performance.md). Compiled for the target by
// function attributes whatever the build's flags; called only where paged_decode_bf16_supported() says
// the CPU runs it.

#include "paged_decode_bf16.h"

#include "claims.h"
#include "isa.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace tidal_cpu {
namespace {

constexpr int64_t kMaxDim = 256;

#ifdef TIDAL_AVX512_BF16

#define TIDAL_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

struct Task {
  const uint16_t* k;        // the cache, as bf16 bits
  const uint16_t* v;
  const int32_t* table;     // this sequence's block table
  int64_t len;              // cached rows
  int64_t block_size;
  int64_t row_stride;       // between two rows of a block (Hkv * D)
  int64_t block_stride;     // between two blocks (block_size * Hkv * D)
  int64_t first_kv_head;    // the task's kv heads: [first, first + kv_heads)
  int64_t kv_heads;
  int64_t group;            // query heads per kv head
  int64_t dim;
};

// The lane sums of eight vectors as one vector: lane i is the sum of v[i]'s lanes.
TIDAL_TARGET inline __m256 sum_lanes8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// q . row over V * 32 dims, folded to 8 partial sums.
template <int V>
TIDAL_TARGET inline __m256 row_dot(const uint16_t* row, const __m512bh* q) {
  __m512 acc = _mm512_setzero_ps();
  _Pragma("GCC unroll 8") for (int j = 0; j < V; ++j)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(row + 32 * j), q[j]);
  return _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
}

// The task's slice of block b: its rows, from the task's first kv head on.
inline const uint16_t* block_rows(const Task& t, const uint16_t* cache, int64_t b) {
  return cache + t.table[b] * t.block_stride + t.first_kv_head * t.dim;
}

// Blocks are scattered through the cache, so the hardware prefetcher cannot guess the next one. Each
// pass over a task's blocks asks for the data of the pass after it (the scores pass for this task's V
// rows, the weighted-sum pass for the next task's K rows), a share per block, so that pass finds its
// rows in cache: the reads overlap the arithmetic instead of alternating with it.
struct Ahead {
  const Task* task = nullptr;  // whose rows to bring in, or none
  const uint16_t* cache = nullptr;
  int64_t blocks = 0;
};

inline Ahead ahead_of(const Task* task, const uint16_t* cache) {
  return task == nullptr ? Ahead{} : Ahead{task, cache, (task->len + task->block_size - 1) / task->block_size};
}

// The share of `ahead`'s blocks to prefetch while this pass is at block b of `blocks_here`.
TIDAL_TARGET inline void prefetch_share(const Ahead& ahead, int64_t b, int64_t blocks_here) {
  if (ahead.task == nullptr) return;
  const Task& t = *ahead.task;
  const int64_t bytes = t.kv_heads * t.dim * 2, stride = t.row_stride * 2;
  for (int64_t j = b * ahead.blocks / blocks_here; j < (b + 1) * ahead.blocks / blocks_here; ++j) {
    const char* rows = reinterpret_cast<const char*>(block_rows(t, ahead.cache, j));
    for (int64_t r = 0; r < t.block_size; ++r)
      for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch(rows + r * stride + offset, _MM_HINT_T1);
  }
}

// scores[h][t] = scale * q_h . k_t for the task's query heads, block by block: a block is read once,
// every kv head's rows of it in turn, each by the query heads that share it.
template <int V>
TIDAL_TARGET void scores(const Task& t, const uint16_t* query, int64_t q_stride_h, float scale, float* out,
                         int64_t out_stride, const Ahead& ahead) {
  const __m256 scale8 = _mm256_set1_ps(scale);
  const int64_t num_blocks = (t.len + t.block_size - 1) / t.block_size;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t first = b * t.block_size, count = std::min(t.block_size, t.len - first);
    prefetch_share(ahead, b, num_blocks);
    const uint16_t* block = block_rows(t, t.k, b);
    for (int64_t h = 0; h < t.kv_heads * t.group; ++h) {
      const uint16_t* rows = block + (h / t.group) * t.dim;
      __m512bh q[V];
      _Pragma("GCC unroll 8") for (int j = 0; j < V; ++j)
        q[j] = (__m512bh)_mm512_loadu_si512(query + h * q_stride_h + 32 * j);
      float* s = out + h * out_stride + first;
      for (int64_t r = 0; r < count; r += 8) {
        const int64_t n = std::min<int64_t>(8, count - r);
        __m256 dots[8];
        _Pragma("GCC unroll 8") for (int i = 0; i < 8; ++i)
          dots[i] = i < n ? row_dot<V>(rows + (r + i) * t.row_stride, q) : _mm256_setzero_ps();
        _mm256_mask_storeu_ps(s + r, __mmask8((1u << n) - 1), _mm256_mul_ps(sum_lanes8(dots), scale8));
      }
    }
  }
}

// exp(x) for x <= 0, 16 lanes: Cody-Waite range reduction, degree-7 Taylor, then p * 2^n.
TIDAL_TARGET inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

TIDAL_TARGET inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
}

// One head's softmax numerators exp(s - max), rounded to bf16 into `weights`; returns 1 / their sum.
TIDAL_TARGET float softmax_weights(const float* s, int64_t len, uint16_t* weights) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < len; i += 16)
    top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), first_lanes(len - i), s + i));
  const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 total = _mm512_setzero_ps();
  for (int64_t i = 0; i < len; i += 16) {
    const __mmask16 lanes = first_lanes(len - i);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, s + i), max));
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(e);
    _mm256_mask_storeu_epi16(weights + i, lanes, rounded);
    const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16));
    total = _mm512_mask_add_ps(total, lanes, total, back);
  }
  return 1.0f / _mm512_reduce_add_ps(total);
}

// acc[h] += sum_r w_h[r] * v_r over one block's `count` rows of one kv head, for H query heads, two
// rows per instruction. acc holds each head's 2 * V vectors in the unpack order (see finish_head).
template <int V, int H>
TIDAL_TARGET void weighted_rows(const uint16_t* rows, int64_t row_stride, int64_t count, const uint16_t* weights,
                                int64_t weights_stride, float* acc) {
  __m512 sum[H][2 * V];
  _Pragma("GCC unroll 8") for (int h = 0; h < H; ++h)
    _Pragma("GCC unroll 16") for (int j = 0; j < 2 * V; ++j) sum[h][j] = _mm512_loadu_ps(acc + (h * 2 * V + j) * 16);
  for (int64_t r = 0; r < count; r += 2) {
    const bool pair = r + 1 < count;  // a lone last row pairs with zeros (never with the block's unused rows)
    __m512i lo[V], hi[V];
    _Pragma("GCC unroll 8") for (int j = 0; j < V; ++j) {
      const __m512i a = _mm512_loadu_si512(rows + r * row_stride + 32 * j);
      const __m512i b = pair ? _mm512_loadu_si512(rows + (r + 1) * row_stride + 32 * j) : _mm512_setzero_si512();
      lo[j] = _mm512_unpacklo_epi16(a, b);  // per 128-bit lane: dims 0-3 of its 8, as (row r, row r+1) pairs
      hi[j] = _mm512_unpackhi_epi16(a, b);  // dims 4-7
    }
    _Pragma("GCC unroll 8") for (int h = 0; h < H; ++h) {
      const uint16_t* w = weights + h * weights_stride + r;
      const uint32_t both = uint32_t(w[0]) | (pair ? uint32_t(w[1]) << 16 : 0u);
      const __m512bh wv = (__m512bh)_mm512_set1_epi32(int32_t(both));
      _Pragma("GCC unroll 8") for (int j = 0; j < V; ++j) {
        sum[h][2 * j] = _mm512_dpbf16_ps(sum[h][2 * j], (__m512bh)lo[j], wv);
        sum[h][2 * j + 1] = _mm512_dpbf16_ps(sum[h][2 * j + 1], (__m512bh)hi[j], wv);
      }
    }
  }
  _Pragma("GCC unroll 8") for (int h = 0; h < H; ++h)
    _Pragma("GCC unroll 16") for (int j = 0; j < 2 * V; ++j) _mm512_storeu_ps(acc + (h * 2 * V + j) * 16, sum[h][j]);
}

// Heads per weighted_rows call: their sums (2 * V zmm each) stay within 16 registers.
template <int V>
constexpr int64_t kHeadsAtOnce = V <= 2 ? 4 : (V <= 4 ? 2 : 1);

template <int V>
TIDAL_TARGET void weighted_heads(const uint16_t* rows, int64_t row_stride, int64_t count, const uint16_t* weights,
                                 int64_t weights_stride, int64_t heads, float* acc) {
  for (int64_t h = 0; h < heads; h += kHeadsAtOnce<V>) {
    const int64_t n = std::min(kHeadsAtOnce<V>, heads - h);
    const uint16_t* w = weights + h * weights_stride;
    float* a = acc + h * 2 * V * 16;
    if constexpr (kHeadsAtOnce<V> >= 4) {
      if (n == 4) { weighted_rows<V, 4>(rows, row_stride, count, w, weights_stride, a); continue; }
      if (n == 3) { weighted_rows<V, 3>(rows, row_stride, count, w, weights_stride, a); continue; }
    }
    if constexpr (kHeadsAtOnce<V> >= 2) {
      if (n == 2) { weighted_rows<V, 2>(rows, row_stride, count, w, weights_stride, a); continue; }
    }
    weighted_rows<V, 1>(rows, row_stride, count, w, weights_stride, a);
  }
}

// One head's output: its sums back in dim order, times 1 / the weights' sum, rounded to bf16.
template <int V>
TIDAL_TARGET void finish_head(const float* acc, float inv_sum, uint16_t* out) {
  // lane 4l+i of an unpacklo sum holds dim 8l+i of its 32, of an unpackhi sum dim 8l+4+i
  alignas(64) static const int32_t kFirstHalf[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
  alignas(64) static const int32_t kSecondHalf[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
  const __m512i first_half = _mm512_load_si512(kFirstHalf), second_half = _mm512_load_si512(kSecondHalf);
  const __m512 inv = _mm512_set1_ps(inv_sum);
  _Pragma("GCC unroll 8") for (int j = 0; j < V; ++j) {
    const __m512 lo = _mm512_loadu_ps(acc + 2 * j * 16), hi = _mm512_loadu_ps(acc + (2 * j + 1) * 16);
    const __m512 low = _mm512_mul_ps(_mm512_permutex2var_ps(lo, first_half, hi), inv);
    const __m512 high = _mm512_mul_ps(_mm512_permutex2var_ps(lo, second_half, hi), inv);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * j), (__m256i)_mm512_cvtneps_pbh(low));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * j + 16), (__m256i)_mm512_cvtneps_pbh(high));
  }
}

struct Scratch {
  std::vector<float> scores;     // [heads, padded len]
  std::vector<uint16_t> weights; // [heads, padded len] bf16 softmax numerators
  std::vector<float> acc;        // [heads, 2 * V * 16] weighted sums in unpack order
  std::vector<float> inv_sums;   // [heads]
};

// A task: its query heads against the sequence's rows; writes out[h] for each (contiguous heads).
template <int V>
TIDAL_TARGET void attend(const Task& t, const Task* next, const uint16_t* query, int64_t q_stride_h, float scale,
                         uint16_t* out, Scratch& scratch) {
  const int64_t heads = t.kv_heads * t.group, padded = (t.len + 15) / 16 * 16;
  scratch.scores.resize(static_cast<size_t>(heads * padded));
  scratch.weights.resize(static_cast<size_t>(heads * padded));
  scratch.acc.assign(static_cast<size_t>(heads * 2 * V * 16), 0.0f);
  scratch.inv_sums.resize(static_cast<size_t>(heads));
  scores<V>(t, query, q_stride_h, scale, scratch.scores.data(), padded, ahead_of(&t, t.v));
  for (int64_t h = 0; h < heads; ++h)
    scratch.inv_sums[h] = softmax_weights(scratch.scores.data() + h * padded, t.len, scratch.weights.data() + h * padded);
  // the weighted sum, block by block like the scores: each block's V rows are read from memory once
  const Ahead ahead = ahead_of(next, t.k);
  const int64_t num_blocks = (t.len + t.block_size - 1) / t.block_size;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t first = b * t.block_size, count = std::min(t.block_size, t.len - first);
    prefetch_share(ahead, b, num_blocks);
    const uint16_t* block = block_rows(t, t.v, b);
    for (int64_t kv = 0; kv < t.kv_heads; ++kv)
      weighted_heads<V>(block + kv * t.dim, t.row_stride, count, scratch.weights.data() + kv * t.group * padded + first,
                        padded, t.group, scratch.acc.data() + kv * t.group * 2 * V * 16);
  }
  for (int64_t h = 0; h < heads; ++h)
    finish_head<V>(scratch.acc.data() + h * 2 * V * 16, scratch.inv_sums[h], out + h * t.dim);
}

bool cpu_has_avx512_bf16() { return isa().avx512_bf16; }

#endif  // TIDAL_AVX512_BF16

}  // namespace

bool paged_decode_bf16_supported(int64_t dim) {
#ifdef TIDAL_AVX512_BF16
  static const bool cpu = cpu_has_avx512_bf16();
  return cpu && dim % 32 == 0 && dim >= 32 && dim <= kMaxDim;
#else
  (void)dim;
  return false;
#endif
}

void paged_decode_bf16(const c10::BFloat16* query, int64_t q_stride_b, int64_t q_stride_h,
                       const c10::BFloat16* k_cache, const c10::BFloat16* v_cache, const int32_t* block_tables,
                       int64_t table_stride, const std::vector<int64_t>& seq_lens, int64_t num_heads,
                       int64_t num_kv_heads, int64_t dim, int64_t block_size, float scale, c10::BFloat16* out) {
#ifdef TIDAL_AVX512_BF16
  const int64_t num_seqs = static_cast<int64_t>(seq_lens.size()), group = num_heads / num_kv_heads;
  const auto* q = reinterpret_cast<const uint16_t*>(query);
  auto* o = reinterpret_cast<uint16_t*>(out);
  // A task is a sequence's kv heads, so each of its blocks is one contiguous read. With fewer sequences
  // than threads the kv heads are split too (a batch of one still uses every core).
  const int64_t splits = num_seqs >= at::get_num_threads() ? 1 : num_kv_heads;
  const int64_t kv_per_task = num_kv_heads / splits, tasks = num_seqs * splits;
  int64_t total_len = 0;
  for (int64_t len : seq_lens) total_len += len;
  // enough tasks per chunk that a chunk is worth a thread (kAttentionChunkFlops, paged_decode_bf16.h)
  const int64_t flops_per_task = std::max<int64_t>(1, 4 * num_heads / splits * dim * total_len / std::max<int64_t>(1, num_seqs));
  const int64_t grain = std::max<int64_t>(1, kAttentionChunkFlops / flops_per_task);
  // a task per claim (claims.h): a thread that falls behind has its last sequences taken over
  parallel_claims(tasks, 1, (tasks + grain - 1) / grain, [&](int64_t begin, int64_t end, int64_t ahead_end) {
    thread_local Scratch scratch;
    auto task_at = [&](int64_t task) {
      const int64_t seq = task / splits, first_kv = task % splits * kv_per_task;
      return Task{reinterpret_cast<const uint16_t*>(k_cache), reinterpret_cast<const uint16_t*>(v_cache),
                  block_tables + seq * table_stride, seq_lens[seq], block_size, num_kv_heads * dim,
                  block_size * num_kv_heads * dim, first_kv, kv_per_task, group, dim};
    };
    Task t = task_at(begin), next{};
    for (int64_t task = begin; task < end; ++task, t = next) {
      const bool more = task + 1 < ahead_end;  // the next task is likely this thread's: prefetch its rows
      if (more) next = task_at(task + 1);
      const int64_t seq = task / splits;
      const uint16_t* q_task = q + seq * q_stride_b + t.first_kv_head * group * q_stride_h;
      uint16_t* o_task = o + (seq * num_heads + t.first_kv_head * group) * dim;
      const Task* after = more ? &next : nullptr;
      switch (dim / 32) {
        case 1: attend<1>(t, after, q_task, q_stride_h, scale, o_task, scratch); break;
        case 2: attend<2>(t, after, q_task, q_stride_h, scale, o_task, scratch); break;
        case 3: attend<3>(t, after, q_task, q_stride_h, scale, o_task, scratch); break;
        case 4: attend<4>(t, after, q_task, q_stride_h, scale, o_task, scratch); break;
        case 5: attend<5>(t, after, q_task, q_stride_h, scale, o_task, scratch); break;
        case 6: attend<6>(t, after, q_task, q_stride_h, scale, o_task, scratch); break;
        case 7: attend<7>(t, after, q_task, q_stride_h, scale, o_task, scratch); break;
        default: attend<8>(t, after, q_task, q_stride_h, scale, o_task, scratch); break;
      }
    }
  });
#else
  (void)query, (void)q_stride_b, (void)q_stride_h, (void)k_cache, (void)v_cache, (void)block_tables,
      (void)table_stride, (void)seq_lens, (void)num_heads, (void)num_kv_heads, (void)dim, (void)block_size,
      (void)scale, (void)out;
#endif
}

}  // namespace tidal_cpu
