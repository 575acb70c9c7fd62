// Paged decode attention for the CPU: one query token per sequence, K/V read straight from the
// paged cache through the block table (no gather into a padded buffer).
//
// Work is split over (sequence, kv head). Each task loads the G = Hq / Hkv query heads that share
// its kv head, so every K/V row is read from memory once and used G times. Softmax is two-pass
// over a per-thread score buffer: scores, then max / exp / sum, then the weighted sum of V rows.
// Inner loops work on 8-float vectors (GCC vector extensions, so any x86 or ARM target builds it);
// no intrinsics. A bf16 cache on a CPU with AVX512-BF16 goes to paged_decode_bf16.cpp instead.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "claims.h"
#include "ops.h"
#include "paged_decode_bf16.h"
#include "vec8.h"

namespace tidal_cpu {
namespace {

// q . k as eight partial lane sums; two chains hide the FMA latency.
template <int kDim>
inline vec8 dot_lanes(const float* q, const float* k, int64_t dim_runtime) {
  const int64_t dim = kDim > 0 ? kDim : dim_runtime;
  vec8 even = splat(0.f), odd = splat(0.f);
  for (int64_t d = 0; d < dim; d += 2 * kWidth) {
    even += load8(q + d) * load8(k + d);
    odd += load8(q + d + kWidth) * load8(k + d + kWidth);
  }
  return even + odd;
}

// Ask for the next block's rows while this one is computed: blocks are scattered through the
// cache, so the hardware prefetcher cannot guess them.
template <typename scalar_t>
inline void prefetch_rows(const scalar_t* first, int64_t rows, int64_t dim, int64_t row_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    const char* row = reinterpret_cast<const char*>(first + r * row_stride);
    for (int64_t offset = 0; offset < dim * static_cast<int64_t>(sizeof(scalar_t)); offset += 64)
      __builtin_prefetch(row + offset);
  }
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline void from_float(float x, float* out) { *out = x; }
inline void from_float(float x, c10::BFloat16* out) { *out = c10::BFloat16(x); }

// A block's rows of one kv head as floats: fp32 rows are used in place (stride `row_stride`),
// others are converted into `scratch` (stride `dim`). Returns the rows; sets their stride.
inline const float* rows_as_float(const float* rows, int64_t, int64_t, int64_t row_stride, float*, int64_t& stride) {
  stride = row_stride;
  return rows;
}
inline const float* rows_as_float(const c10::BFloat16* rows, int64_t count, int64_t dim, int64_t row_stride,
                                  float* scratch, int64_t& stride) {
  for (int64_t r = 0; r < count; ++r)
    for (int64_t d = 0; d < dim; d += kWidth) store8(scratch + r * dim + d, load8(rows + r * row_stride + d));
  stride = dim;
  return scratch;
}

// One (sequence, kv head): its `group` query heads against the sequence's `seq_len` cached rows.
// kDim > 0 fixes the head dim at compile time (loops fully unrolled); kDim == 0 takes `dim_runtime`.
// The head dim is a multiple of 16 (checked by the caller).
template <typename scalar_t, int kDim>
void decode_one(const scalar_t* query, int64_t q_stride_b, int64_t q_stride_h, const scalar_t* k_cache,
                const scalar_t* v_cache, const int32_t* block_table, int64_t seq_len, int64_t block_size,
                int64_t num_kv_heads, int64_t kv_head, int64_t group, int64_t dim_runtime, float scale, int64_t seq,
                scalar_t* out, std::vector<float>& buf) {
  const int64_t dim = kDim > 0 ? kDim : dim_runtime;
  const int64_t padded_len = (seq_len + kWidth - 1) / kWidth * kWidth;
  // per-thread scratch: q [G, D], scores [G, padded L], acc [G, D], one converted block [block_size, D]
  buf.resize(static_cast<size_t>(group * (2 * dim + padded_len) + block_size * dim));
  float* q = buf.data();
  float* scores = q + group * dim;
  float* acc = scores + group * padded_len;
  float* scratch = acc + group * dim;
  for (int64_t g = 0; g < group; ++g) {
    const scalar_t* src = query + seq * q_stride_b + (kv_head * group + g) * q_stride_h;
    for (int64_t d = 0; d < dim; ++d) q[g * dim + d] = to_float(src[d]) * scale;
  }
  const int64_t row_stride = num_kv_heads * dim;  // between positions within a block
  const int64_t block_stride = block_size * row_stride;
  const int64_t num_blocks = (seq_len + block_size - 1) / block_size;

  // Scores, a block at a time: its rows stay in L1 while every query head of the group uses them.
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t first = b * block_size, count = std::min(block_size, seq_len - first);
    int64_t stride;
    const float* k = rows_as_float(k_cache + block_table[b] * block_stride + kv_head * dim, count, dim, row_stride,
                                   scratch, stride);
    if (b + 1 < num_blocks) prefetch_rows(k_cache + block_table[b + 1] * block_stride + kv_head * dim, block_size, dim,
                                          row_stride);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * dim;
      float* s = scores + g * padded_len + first;
      int64_t r = 0;
      for (; r + kWidth <= count; r += kWidth) {  // eight rows, their eight sums reduced together
        vec8 sums[kWidth];
        for (int64_t i = 0; i < kWidth; ++i) sums[i] = dot_lanes<kDim>(qg, k + (r + i) * stride, dim);
        store8(s + r, hsum8(sums));
      }
      for (; r < count; ++r) s[r] = hsum(dot_lanes<kDim>(qg, k + r * stride, dim));
    }
  }
  // Softmax numerators; the division by their sum is applied once to each output instead.
  float inv_total[64];
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * padded_len;
    const int64_t full = seq_len / kWidth * kWidth;
    const float max_score = row_max(s, seq_len);
    vec8 total = splat(0.f);
    for (int64_t i = 0; i < full; i += kWidth) {
      const vec8 e = exp_nonpositive(load8(s + i) - max_score);
      store8(s + i, e);
      total += e;
    }
    float tail_total = 0.f;
    if (full < seq_len) {  // the padding lanes are computed but neither summed nor used
      const vec8 e = exp_nonpositive(load8(s + full) - max_score);
      for (int64_t i = 0; i < seq_len - full; ++i) tail_total += e[i];
      store8(s + full, e);
    }
    inv_total[g] = 1.0f / (hsum(total) + tail_total);
  }

  // Weighted sum of V rows, 64 output dims at a time so the accumulators stay in registers.
  constexpr int64_t kChunk = 64;
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] = 0.f;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t first = b * block_size, count = std::min(block_size, seq_len - first);
    int64_t stride;
    if (b + 1 < num_blocks) prefetch_rows(v_cache + block_table[b + 1] * block_stride + kv_head * dim, block_size, dim,
                                          row_stride);
    const float* v = rows_as_float(v_cache + block_table[b] * block_stride + kv_head * dim, count, dim, row_stride,
                                   scratch, stride);
    for (int64_t g = 0; g < group; ++g) {
      const float* p = scores + g * padded_len + first;
      for (int64_t d0 = 0; d0 < dim; d0 += kChunk) {
        const int64_t lanes = std::min(kChunk, dim - d0) / kWidth;
        float* a = acc + g * dim + d0;
        vec8 sum[kChunk / kWidth];
        for (int64_t c = 0; c < lanes; ++c) sum[c] = load8(a + c * kWidth);
        for (int64_t r = 0; r < count; ++r) {
          const vec8 weight = splat(p[r]);
          const float* vr = v + r * stride + d0;
          for (int64_t c = 0; c < lanes; ++c) sum[c] += weight * load8(vr + c * kWidth);
        }
        for (int64_t c = 0; c < lanes; ++c) store8(a + c * kWidth, sum[c]);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    scalar_t* dst = out + (seq * group * num_kv_heads + kv_head * group + g) * dim;
    for (int64_t d = 0; d < dim; ++d) from_float(acc[g * dim + d] * inv_total[g], dst + d);
  }
}

template <typename scalar_t>
void decode_all(const scalar_t* q, int64_t q_stride_b, int64_t q_stride_h, int64_t num_heads, const scalar_t* k,
                const scalar_t* v, int64_t block_size, int64_t num_kv_heads, int64_t dim, const int32_t* tables,
                int64_t table_stride, const std::vector<int64_t>& seq_lens, float scale, scalar_t* o) {
  const int64_t num_seqs = static_cast<int64_t>(seq_lens.size());
  const int64_t group = num_heads / num_kv_heads;

  int64_t total_len = 0;
  for (int64_t len : seq_lens) total_len += len;
  // enough (sequence, kv head) tasks per chunk that a chunk is worth a thread (kAttentionChunkFlops)
  const int64_t tasks = num_seqs * num_kv_heads;
  const int64_t flops_per_task = std::max<int64_t>(1, 4 * group * dim * total_len / std::max<int64_t>(1, num_seqs));
  const int64_t grain = std::max<int64_t>(1, kAttentionChunkFlops / flops_per_task);
  // a task per claim (claims.h): a thread that falls behind has its last tasks taken over
  tidal_cpu::parallel_claims(tasks, 1, (tasks + grain - 1) / grain, [&](int64_t begin, int64_t end, int64_t) {
    thread_local std::vector<float> buf;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int32_t* table = tables + seq * table_stride;
      if (dim == 64) {
        decode_one<scalar_t, 64>(q, q_stride_b, q_stride_h, k, v, table, seq_lens[seq], block_size, num_kv_heads,
                                 kv_head, group, dim, scale, seq, o, buf);
      } else if (dim == 128) {
        decode_one<scalar_t, 128>(q, q_stride_b, q_stride_h, k, v, table, seq_lens[seq], block_size, num_kv_heads,
                                  kv_head, group, dim, scale, seq, o, buf);
      } else {
        decode_one<scalar_t, 0>(q, q_stride_b, q_stride_h, k, v, table, seq_lens[seq], block_size, num_kv_heads,
                                kv_head, group, dim, scale, seq, o, buf);
      }
    }
  });
}

}  // namespace

template <typename T>
void paged_decode_rows(const T* query, int64_t q_stride_b, int64_t q_stride_h, int64_t num_heads, const T* k_cache,
                       const T* v_cache, int64_t block_size, int64_t num_kv_heads, int64_t dim,
                       const int32_t* block_tables, int64_t table_stride, const std::vector<int64_t>& seq_lens,
                       float scale, T* out) {
  if (seq_lens.empty()) return;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (paged_decode_bf16_supported(dim)) {
      paged_decode_bf16(query, q_stride_b, q_stride_h, k_cache, v_cache, block_tables, table_stride, seq_lens,
                        num_heads, num_kv_heads, dim, block_size, scale, out);
      return;
    }
  }
  decode_all<T>(query, q_stride_b, q_stride_h, num_heads, k_cache, v_cache, block_size, num_kv_heads, dim,
                block_tables, table_stride, seq_lens, scale, out);
}
template void paged_decode_rows<float>(const float*, int64_t, int64_t, int64_t, const float*, const float*, int64_t,
                                       int64_t, int64_t, const int32_t*, int64_t, const std::vector<int64_t>&, float,
                                       float*);
template void paged_decode_rows<c10::BFloat16>(const c10::BFloat16*, int64_t, int64_t, int64_t, const c10::BFloat16*,
                                               const c10::BFloat16*, int64_t, int64_t, int64_t, const int32_t*, int64_t,
                                               const std::vector<int64_t>&, float, c10::BFloat16*);

// Validate every block id the kernel will touch up front: a bad table must raise, not read wild memory.
std::vector<int64_t> checked_lengths(const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_seqs,
                                     int64_t block_size, int64_t num_blocks) {
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.stride(1) == 1,
              "block_tables must be [B, max_blocks] int32 with contiguous rows");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.is_contiguous(),
              "seq_lens must be [B] int32");
  TORCH_CHECK(block_tables.size(0) >= num_seqs && seq_lens.size(0) >= num_seqs, "fewer block tables than queries");
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  std::vector<int64_t> lengths(num_seqs);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = lens[s];
    TORCH_CHECK(len >= 1 && (len + block_size - 1) / block_size <= max_blocks, "sequence ", s, " has length ", len,
                " outside [1, ", max_blocks * block_size, "]");
    for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b) {
      const int32_t id = tables[s * block_tables.stride(0) + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "sequence ", s, " names block ", id, " outside the cache");
    }
    lengths[s] = len;
  }
  return lengths;
}

at::Tensor paged_decode_attention(const at::Tensor& query_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query_in.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(query_in.dim() == 3, "query must be [B, Hq, D]");
  const at::Tensor query = query_in.stride(2) == 1 ? query_in : query_in.contiguous();
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must be contiguous [num_blocks, block_size, Hkv, D] of the same shape");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(query.size(2) == k_cache.size(3), "head_dim mismatch");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0 && query.size(1) / k_cache.size(2) <= 64,
              "query heads must be a multiple (at most 64) of kv heads");
  TORCH_CHECK(query.size(2) % (2 * kWidth) == 0, "head_dim must be a multiple of ", 2 * kWidth);
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "paged_decode_attention supports float32 and bfloat16, got ", query.scalar_type());
  const int64_t num_seqs = query.size(0);
  const std::vector<int64_t> lengths = checked_lengths(block_tables, seq_lens, num_seqs, k_cache.size(1), k_cache.size(0));

  at::Tensor out = at::empty({num_seqs, query.size(1), query.size(2)}, query.options());
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    paged_decode_rows<T>(query.data_ptr<T>(), query.stride(0), query.stride(1), query.size(1), k_cache.data_ptr<T>(),
                         v_cache.data_ptr<T>(), k_cache.size(1), k_cache.size(2), query.size(2),
                         block_tables.data_ptr<int32_t>(), block_tables.stride(0), lengths, static_cast<float>(scale),
                         out.data_ptr<T>());
  };
  if (query.scalar_type() == at::kFloat)
    run(static_cast<float*>(nullptr));
  else
    run(static_cast<c10::BFloat16*>(nullptr));
  return out;
}

// Each row's K and V [T, Hkv, D] into its cache slot (slot = block * block_size + offset): what two
// index_copy_ calls and their views did, as one op (at decode, a layer's torch ops cost their dispatch,
// ~10 us a layer for these six, not their copies).
void write_kv_cache_(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                     const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu() && k_cache.device().is_cpu() &&
                  v_cache.device().is_cpu() && slot_mapping.device().is_cpu(),
              "CPU tensors only");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must be contiguous [num_blocks, block_size, Hkv, D] of the same shape");
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.size(1) == k_cache.size(2) &&
                  key.size(2) == k_cache.size(3),
              "key and value must be [T, Hkv, D] matching the cache's heads and head_dim");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == v_cache.scalar_type() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "key, value and the caches must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == key.size(0),
              "slot_mapping must be [T] int64");
  // key and value are usually row-strided views of the qkv projection: copy from them in place when each
  // row's heads are contiguous, rather than making a contiguous copy first
  auto rows_of = [](const at::Tensor& x) {
    return x.stride(2) == 1 && x.stride(1) == x.size(2) ? x : x.contiguous();
  };
  const at::Tensor k = rows_of(key), v = rows_of(value), slots = slot_mapping.contiguous();
  const int64_t rows = k.size(0), num_slots = k_cache.size(0) * k_cache.size(1);
  const size_t row_bytes = size_t(k.size(1) * k.size(2)) * k.element_size();
  const size_t k_stride = size_t(k.stride(0)) * k.element_size(), v_stride = size_t(v.stride(0)) * v.element_size();
  const int64_t* slot = slots.data_ptr<int64_t>();
  check_slots(slot, rows, num_slots);
  write_kv_rows(static_cast<const char*>(k.data_ptr()), k_stride, static_cast<const char*>(v.data_ptr()), v_stride,
                rows, row_bytes, slot, static_cast<char*>(k_cache.data_ptr()), static_cast<char*>(v_cache.data_ptr()));
}

void check_slots(const int64_t* slots, int64_t rows, int64_t num_slots) {
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "row ", t, " names slot ", slots[t], " outside the cache");
}

void write_kv_rows(const char* k, size_t k_stride, const char* v, size_t v_stride, int64_t rows, size_t row_bytes,
                   const int64_t* slots, char* k_cache, char* v_cache) {
  for (int64_t t = 0; t < rows; ++t) {
    std::memcpy(k_cache + slots[t] * row_bytes, k + t * k_stride, row_bytes);
    std::memcpy(v_cache + slots[t] * row_bytes, v + t * v_stride, row_bytes);
  }
}

}  // namespace tidal_cpu

using namespace tidal_cpu;

static bool paged_decode_bf16_runs(int64_t head_dim) { return tidal_cpu::paged_decode_bf16_supported(head_dim); }

TORCH_LIBRARY(tidal_cpu, m) {
  m.def("write_kv_cache_(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()",
        &write_kv_cache_);
  m.def("paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale) -> Tensor",
        &paged_decode_attention);
  // whether a bf16 cache with this head dim runs paged_decode_bf16.cpp (AVX512-BF16) here
  m.def("paged_decode_bf16_runs(int head_dim) -> bool", &paged_decode_bf16_runs);
}
