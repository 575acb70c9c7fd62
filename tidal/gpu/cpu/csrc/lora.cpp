// Each row's own LoRA product added to a linear's output on a CPU: out[t] += B[s] (A[s] x[t]) for row t's slot s
// (-1: a base-model row, nothing added).
//
// The layout is tidal's LoRA slots (tidal/gpu/model/lora.py): A [slots * width, K], width = parts * max_rank; slot
// s's part p (q/k/v of a fused qkv, gate/up of gate_up) owns A rows [(s * parts + p) * max_rank, + ranks[s]). B
// comes packed for this kernel (lora.py's pack_lora_b): [slots, blocks, max_rank, 16], the output's columns in
// blocks of 16, each part's blocks after the previous part's (its last one zero-padded), and in a block the 16
// columns of each rank side by side. So a part's B is one sequential stream, where B's [rank, N] rows read a part's
// columns 64-128 bytes at a time from 16 rows far apart: the expand waited on those loads, at ~9 GB/s.
//
// Why not torch: at decode these are [rows x K] @ [K x 16 * parts] products and back, and torch's bf16 matmuls of
// such shapes cost ~0.4-0.7 ms each, as much as a base linear reading 100x the bytes; a one-hot mask over every
// slot's product also reads every slot's weights for every row. Here each slot's A and B are read once per call
// for the rows that use it, and only its adapter's ranks and each part's own columns: the call costs about its
// bytes. The work is split by (slot, part, group of the slot's rows): each task runs the shrink (h = A x, a dot
// product per rank) and then the expand (out += h B) of its part, writing its own rows' and columns' h and out,
// so a call is one parallel pass with no wait between the two, and h is still in L1 for the expand. The shrink
// runs on vdpbf16ps where the CPU has AVX512-BF16 and the rows are bf16, the expand on 16-float vectors where it
// has AVX-512, else both on eight-float vectors (vec8.h); the sums are float32 throughout and the output is
// rounded once.

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "claims.h"
#include "isa.h"
#include "ops.h"
#include "vec8.h"

namespace tidal_cpu {
namespace {

constexpr int kRowTile = 4;             // rows of one slot served from each weight row loaded
constexpr int64_t kTaskRows = 4 * kRowTile;  // rows of a slot per task: a prefill chunk's rows still spread

// The rows of each slot, in row order: rows[starts[s], starts[s + 1]).
struct RowsBySlot {
  std::vector<int64_t> rows, starts;
};

// Into `by`, whose vectors keep their capacity from call to call (a decode step makes 4 calls a layer).
void rows_by_slot(const int32_t* slots, int64_t m, int64_t num_slots, RowsBySlot& by) {
  by.starts.assign(num_slots + 1, 0);
  for (int64_t t = 0; t < m; ++t)
    if (slots[t] >= 0) ++by.starts[slots[t] + 1];
  for (int64_t s = 0; s < num_slots; ++s) by.starts[s + 1] += by.starts[s];
  by.rows.resize(by.starts[num_slots]);
  for (int64_t t = 0; t < m; ++t)  // the count of rows placed so far, in each slot's next start
    if (slots[t] >= 0) by.rows[by.starts[slots[t]]++] = t;
  for (int64_t s = num_slots; s > 0; --s) by.starts[s] = by.starts[s - 1];  // each next start is the slot's end
  by.starts[0] = 0;
}

// *h[r] = x[r] . a (one A row of `k`) for `count` rows: dot products on eight-float vectors, float sums.
template <typename T>
void dots_vec8(const T* const* x, int count, const T* a, int64_t k, float* const* h) {
  const int64_t full = k / kWidth * kWidth;
  vec8 acc[kRowTile];
  for (int r = 0; r < count; ++r) acc[r] = splat(0.0f);
  for (int64_t i = 0; i < full; i += kWidth) {
    const vec8 w = load8(a + i);
    for (int r = 0; r < count; ++r) acc[r] += w * load8(x[r] + i);
  }
  for (int r = 0; r < count; ++r) {
    float sum = hsum(acc[r]);
    for (int64_t i = full; i < k; ++i) sum += static_cast<float>(a[i]) * static_cast<float>(x[r][i]);
    *h[r] = sum;
  }
}

// out[rows][c, c + valid) += h[rows][0, rank) @ one packed block of B (`rank` rows of 16 columns), on eight-float
// vectors; `valid` < 16 only in a part's last block, whose padding columns are not written.
template <typename T>
void expand_block_vec8(const float* const* h, int tile, const T* block, int64_t rank, int64_t valid, T* const* y) {
  vec8 acc[kRowTile][2];
  for (int r = 0; r < tile; ++r) acc[r][0] = acc[r][1] = splat(0.0f);
  for (int64_t j = 0; j < rank; ++j) {
    const vec8 w0 = load8(block + j * 16), w1 = load8(block + j * 16 + kWidth);
    for (int r = 0; r < tile; ++r) {
      const vec8 hj = splat(h[r][j]);
      acc[r][0] += w0 * hj;
      acc[r][1] += w1 * hj;
    }
  }
  for (int r = 0; r < tile; ++r) {
    if (valid == 16) {
      store8(y[r], load8(y[r]) + acc[r][0]);
      store8(y[r] + kWidth, load8(y[r] + kWidth) + acc[r][1]);
      continue;
    }
    float sums[16];
    store8(sums, acc[r][0]);
    store8(sums + kWidth, acc[r][1]);
    for (int64_t c = 0; c < valid; ++c) y[r][c] = static_cast<T>(static_cast<float>(y[r][c]) + sums[c]);
  }
}

#ifdef TIDAL_AVX512_BF16
#define TIDAL_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
// h[r][j] = x[r] . a[j] of R bf16 rows and J A rows (`k` apart) with AVX512-BF16: 32 products per instruction,
// exact, summed in float32; each x vector loaded serves J A rows and each A vector R rows. Out of line with its
// loops unrolled, so the R x J sums stay in registers.
template <int R, int J>
TIDAL_TARGET __attribute__((noinline)) void shrink_tile_bf16(const c10::BFloat16* const* x, const c10::BFloat16* a,
                                                             int64_t k, const char* ahead, float* const* h) {
  __m512 acc[J][R];
  _Pragma("GCC unroll 4") for (int j = 0; j < J; ++j)
    _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 32) {
    const __mmask32 mask = k - i >= 32 ? ~__mmask32(0) : (__mmask32(1) << (k - i)) - 1;
    __m512bh xv[R];
    _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) xv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x[r] + i);
    // the next tile's lines, as many as this one reads: its J rows' 64 bytes
    _Pragma("GCC unroll 4") for (int j = 0; j < J; ++j) _mm_prefetch(ahead + (i * 2 * J + j * 64), _MM_HINT_T0);
    _Pragma("GCC unroll 4") for (int j = 0; j < J; ++j) {
      const __m512bh w = (__m512bh)_mm512_maskz_loadu_epi16(mask, a + j * k + i);
      _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], w, xv[r]);
    }
  }
  _Pragma("GCC unroll 4") for (int j = 0; j < J; ++j)
    _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) h[r][j] = _mm512_reduce_add_ps(acc[j][r]);
}

// Prefetches as it goes the A rows of its next tile, and during the last the start of `next` (the part's B).
template <int R>
TIDAL_TARGET void shrink_rows_bf16(const c10::BFloat16* const* x, const c10::BFloat16* a, int64_t k, int64_t rank,
                                   const void* next, float* const* h) {
  float* hj[R];
  for (int64_t j = 0; j < rank; j += 4) {
    for (int r = 0; r < R; ++r) hj[r] = h[r] + j;
    const char* ahead = j + 4 < rank ? reinterpret_cast<const char*>(a + (j + 4) * k) : static_cast<const char*>(next);
    switch (std::min<int64_t>(4, rank - j)) {
      case 4: shrink_tile_bf16<R, 4>(x, a + j * k, k, ahead, hj); break;
      case 3: shrink_tile_bf16<R, 3>(x, a + j * k, k, ahead, hj); break;
      case 2: shrink_tile_bf16<R, 2>(x, a + j * k, k, ahead, hj); break;
      default: shrink_tile_bf16<R, 1>(x, a + j * k, k, ahead, hj);
    }
  }
}

TIDAL_TARGET inline __m512 load16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
TIDAL_TARGET inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
TIDAL_TARGET inline void add16(c10::BFloat16* p, __m512 v, __mmask16 mask) {
  const __m512 y = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
  _mm256_mask_storeu_epi16(p, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(y, v)));
}
TIDAL_TARGET inline void add16(float* p, __m512 v, __mmask16 mask) {
  _mm512_mask_storeu_ps(p, mask, _mm512_add_ps(_mm512_maskz_loadu_ps(mask, p), v));
}

// out[rows][16 V columns] += h[rows][0, rank) @ V packed blocks of B (`stride` elements apart, each `rank` rows of
// 16 columns): per rank, the V blocks' vectors widened once serve every row. `valid`: the columns to write (the
// part's last block may be partly padding). Prefetches the same lines of the next V blocks (`ahead`, or null).
template <int R, int V, typename T>
TIDAL_TARGET __attribute__((noinline)) void expand_tile16(const float* const* h, const T* blocks, int64_t stride,
                                                          int64_t rank, int64_t valid, const T* ahead, T* const* y) {
  __m512 acc[R][V];
  _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 4") for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < rank; ++j) {
    __m512 w[V];
    _Pragma("GCC unroll 4") for (int v = 0; v < V; ++v) {
      if (ahead != nullptr) _mm_prefetch(reinterpret_cast<const char*>(ahead + v * stride + j * 16), _MM_HINT_T0);
      w[v] = load16(blocks + v * stride + j * 16);
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {
      const __m512 hj = _mm512_set1_ps(h[r][j]);
      _Pragma("GCC unroll 4") for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(w[v], hj, acc[r][v]);
    }
  }
  _Pragma("GCC unroll 4") for (int v = 0; v < V; ++v) {
    const int64_t left = valid - v * 16;
    const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) add16(y[r] + v * 16, acc[r][v], mask);
  }
}

// One row tile over a part's `blocks` packed blocks (from `b`), 4 blocks (64 columns) at a time; `columns`: the
// part's own (the last block's rest is padding).
template <int R, typename T>
TIDAL_TARGET void expand_rows16(const float* const* h, const T* b, int64_t blocks, int64_t stride, int64_t rank,
                                int64_t columns, T* const* y) {
  T* out[R];
  int64_t i = 0;
  for (; i < blocks; i += 4) {
    const int64_t v = std::min<int64_t>(4, blocks - i);
    for (int r = 0; r < R; ++r) out[r] = y[r] + i * 16;
    const T* ahead = i + 4 < blocks ? b + (i + 4) * stride : nullptr;
    const int64_t valid = columns - i * 16;
    switch (v) {
      case 4: expand_tile16<R, 4, T>(h, b + i * stride, stride, rank, valid, ahead, out); break;
      case 3: expand_tile16<R, 3, T>(h, b + i * stride, stride, rank, valid, ahead, out); break;
      case 2: expand_tile16<R, 2, T>(h, b + i * stride, stride, rank, valid, ahead, out); break;
      default: expand_tile16<R, 1, T>(h, b + i * stride, stride, rank, valid, ahead, out);
    }
  }
}
#undef TIDAL_TARGET
#endif

// h[r][0, rank) = A rows [0, rank) (`k` apart from `a`) x rows x[r] of a tile: the shrink.
template <typename T>
void shrink(const T* const* x, int tile, const T* a, int64_t k, int64_t rank, const void* next, float* const* h) {
#ifdef TIDAL_AVX512_BF16
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (isa().avx512_bf16) {
      switch (tile) {
        case 1: return shrink_rows_bf16<1>(x, a, k, rank, next, h);
        case 2: return shrink_rows_bf16<2>(x, a, k, rank, next, h);
        case 3: return shrink_rows_bf16<3>(x, a, k, rank, next, h);
        default: return shrink_rows_bf16<4>(x, a, k, rank, next, h);
      }
    }
  }
#endif
  for (int64_t j = 0; j < rank; ++j) {
    float* sums[kRowTile];
    for (int r = 0; r < tile; ++r) sums[r] = h[r] + j;
    dots_vec8<T>(x, tile, a + j * k, k, sums);
  }
}

// out[rows][0, columns) += h[rows][0, rank) @ a part's packed B (`blocks` blocks `stride` elements apart), for
// a tile of rows (h and out: each row's own, at the part's first rank and column).
template <typename T>
void expand(const float* const* h, int tile, const T* b, int64_t blocks, int64_t stride, int64_t rank,
            int64_t columns, T* const* y) {
#ifdef TIDAL_AVX512_BF16
  if (isa().avx512) {
    switch (tile) {
      case 1: return expand_rows16<1, T>(h, b, blocks, stride, rank, columns, y);
      case 2: return expand_rows16<2, T>(h, b, blocks, stride, rank, columns, y);
      case 3: return expand_rows16<3, T>(h, b, blocks, stride, rank, columns, y);
      default: return expand_rows16<4, T>(h, b, blocks, stride, rank, columns, y);
    }
  }
#endif
  T* out[kRowTile];
  for (int64_t i = 0; i < blocks; ++i) {
    for (int r = 0; r < tile; ++r) out[r] = y[r] + i * 16;
    expand_block_vec8<T>(h, tile, b + i * stride, rank, std::min<int64_t>(16, columns - i * 16), out);
  }
}

// One slot's part over a group of its rows (rows [first_row, last_row) of the slot's list in RowsBySlot).
struct LoraTask {
  int64_t slot, part, first_row, last_row;
};

// h: kRowTile * max_rank floats, the tile's A x between the shrink and the expand.
template <typename T>
void run_task(const LoraTask& task, const T* x, const LoraLinear& w, const RowsBySlot& by, int64_t rank, float* h,
              T* out) {
  const int64_t width = static_cast<int64_t>(w.part_sizes.size()) * w.max_rank;
  const T* a = w.a.data_ptr<T>() + (task.slot * width + task.part * w.max_rank) * w.k;
  const int64_t stride = w.max_rank * kLoraBlock;  // elements of one packed block
  const T* b = w.b.data_ptr<T>() + (task.slot * w.blocks + w.part_blocks[task.part]) * stride;
  const int64_t blocks = w.part_blocks[task.part + 1] - w.part_blocks[task.part];
  const int64_t* rows = by.rows.data() + by.starts[task.slot] + task.first_row;
  for (int64_t r0 = task.first_row; r0 < task.last_row; r0 += kRowTile, rows += kRowTile) {
    const int tile = static_cast<int>(std::min<int64_t>(kRowTile, task.last_row - r0));
    const T* xs[kRowTile];
    float* hs[kRowTile];
    T* ys[kRowTile];
    for (int r = 0; r < tile; ++r)
      xs[r] = x + rows[r] * w.k, hs[r] = h + r * w.max_rank, ys[r] = out + rows[r] * w.n + w.part_starts[task.part];
    shrink<T>(xs, tile, a, w.k, rank, b, hs);
    expand<T>(hs, tile, b, blocks, stride, rank, w.part_sizes[task.part], ys);
  }
}

}  // namespace

LoraLinear lora_linear(const at::Tensor& a, const at::Tensor& b, const at::Tensor& ranks,
                       std::vector<int64_t> part_sizes, int64_t max_rank) {
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous() && b.is_contiguous() && a.scalar_type() == b.scalar_type(),
              "A must be contiguous [slots * width, K], B contiguous and packed (pack_lora_b), of A's dtype");
  TORCH_CHECK(a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16, "LoRA weights are float32 or bf16");
  TORCH_CHECK(!part_sizes.empty() && max_rank > 0, "part_sizes must name at least one part, max_rank be positive");
  const int64_t parts = static_cast<int64_t>(part_sizes.size()), width = parts * max_rank;
  std::vector<int64_t> part_starts{0}, part_blocks{0};
  for (int64_t size : part_sizes) {
    TORCH_CHECK(size > 0, "every part has columns");
    part_starts.push_back(part_starts.back() + size);
    part_blocks.push_back(part_blocks.back() + (size + kLoraBlock - 1) / kLoraBlock);
  }
  TORCH_CHECK(a.size(0) % width == 0, "A's ", a.size(0), " rows are not whole slots of ", width);
  const int64_t num_slots = a.size(0) / width, blocks = part_blocks.back();
  TORCH_CHECK(b.dim() == 4 && b.size(0) == num_slots && b.size(1) == blocks && b.size(2) == max_rank &&
                  b.size(3) == kLoraBlock,
              "packed B must be [", num_slots, ", ", blocks, ", ", max_rank, ", ", kLoraBlock, "], not ", b.sizes());
  TORCH_CHECK(ranks.dim() == 1 && ranks.size(0) == num_slots && ranks.scalar_type() == at::kInt && ranks.is_contiguous(),
              "ranks must be [", num_slots, "] int32");
  const int64_t n = part_starts.back();
  return LoraLinear{a, b, ranks, std::move(part_sizes), std::move(part_starts), std::move(part_blocks), max_rank,
                    a.size(1), n, num_slots, blocks};
}

void check_lora_slots(const int32_t* slots, int64_t m, int64_t num_slots) {
  for (int64_t t = 0; t < m; ++t)
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, "row ", t, "'s LoRA slot ", slots[t], " is not -1 or below ",
                num_slots);
}

template <typename T>
void lora_add_rows(const T* x, int64_t m, const int32_t* slots, const LoraLinear& w, T* out) {
  // the call's bookkeeping, reused by the calling thread's next call: no allocation per call once warm. Named
  // through references: inside the parallel body, a thread_local's own name would be the worker's copy.
  thread_local RowsBySlot by_storage;
  thread_local std::vector<LoraTask> tasks_storage;
  RowsBySlot& by = by_storage;
  std::vector<LoraTask>& tasks = tasks_storage;
  rows_by_slot(slots, m, w.num_slots, by);
  if (by.rows.empty()) return;
  const int64_t parts = static_cast<int64_t>(w.part_sizes.size());
  const int32_t* ranks = w.ranks.data_ptr<int32_t>();
  tasks.clear();
  int64_t multiply_adds = 0;
  for (int64_t s = 0; s < w.num_slots; ++s) {
    const int64_t count = by.starts[s + 1] - by.starts[s], rank = std::min<int64_t>(ranks[s], w.max_rank);
    if (count == 0 || rank <= 0) continue;
    for (int64_t p = 0; p < parts; ++p)
      for (int64_t r = 0; r < count; r += kTaskRows) tasks.push_back({s, p, r, std::min(count, r + kTaskRows)});
    multiply_adds += count * rank * (parts * w.k + w.n);
  }
  parallel_claims(static_cast<int64_t>(tasks.size()), 1, linear_threads(multiply_adds),
                  [&](int64_t begin, int64_t end, int64_t) {
                    thread_local std::vector<float> h;  // each thread's own
                    h.resize(kRowTile * w.max_rank);
                    for (int64_t t = begin; t < end; ++t)
                      run_task<T>(tasks[t], x, w, by, std::min<int64_t>(ranks[tasks[t].slot], w.max_rank), h.data(),
                                  out);
                  });
}

template void lora_add_rows<float>(const float*, int64_t, const int32_t*, const LoraLinear&, float*);
template void lora_add_rows<c10::BFloat16>(const c10::BFloat16*, int64_t, const int32_t*, const LoraLinear&,
                                           c10::BFloat16*);

// out [M, N] += each row's slot's B (A x) (x [M, K]; slots [M] int32, -1 for a base-model row; B packed), in place.
at::Tensor& lora_add_(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b_packed,
                      const at::Tensor& slots, const at::Tensor& ranks, std::vector<int64_t> part_sizes,
                      int64_t max_rank) {
  const LoraLinear w = lora_linear(a, b_packed, ranks, std::move(part_sizes), max_rank);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == w.k && x.scalar_type() == a.scalar_type(),
              "x must be contiguous [M, ", w.k, "] of the weights' dtype");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == x.size(0) && out.size(1) == w.n &&
                  out.scalar_type() == a.scalar_type(),
              "out must be contiguous [M, ", w.n, "] of the weights' dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == x.size(0) && slots.scalar_type() == at::kInt &&
                  slots.is_contiguous(),
              "slots must be [M] int32");
  check_lora_slots(slots.data_ptr<int32_t>(), x.size(0), w.num_slots);
  if (a.scalar_type() == at::kFloat)
    lora_add_rows<float>(x.data_ptr<float>(), x.size(0), slots.data_ptr<int32_t>(), w, out.data_ptr<float>());
  else
    lora_add_rows<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), x.size(0), slots.data_ptr<int32_t>(), w,
                                 out.data_ptr<c10::BFloat16>());
  return out;
}

}  // namespace tidal_cpu

TORCH_LIBRARY_FRAGMENT(tidal_cpu, m) {
  m.def("lora_add_(Tensor(a!) out, Tensor x, Tensor a, Tensor b_packed, Tensor slots, Tensor ranks, int[] part_sizes, "
        "int max_rank) -> Tensor(a!)",
        &tidal_cpu::lora_add_);
}
