// Each row's own LoRA product added to a linear's output on a CPU: out[t] += B[s] (A[s] x[t]) for row t's slot s
// (-1: a base-model row, nothing added).
//
// The layout is tidal's LoRA slots (tidal/gpu/model/lora.py): A [slots * width, K] and B [slots * width, N], width
// = parts * max_rank; slot s's part p (q/k/v of a fused qkv, gate/up of gate_up) owns rows
// [(s * parts + p) * max_rank, + ranks[s]) of both, and its B rows are non-zero only in part p's columns.
//
// Why not torch: at decode these are [rows x K] @ [K x 16 * parts] products and back, and torch's bf16 matmuls of
// such shapes cost ~0.4-0.7 ms each, as much as a base linear reading 100x the bytes; a one-hot mask over every
// slot's product also reads every slot's weights for every row. Here each slot's A and B are read once per call
// for the rows that use it, and only its adapter's ranks and each part's own columns: the call costs about its
// bytes. The shrink (x A^T, a dot product per rank) runs on vdpbf16ps where the CPU has AVX512-BF16 and the rows
// are bf16, else on eight-float vectors (vec8.h); the sums are float32 throughout and the output is rounded once.

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

constexpr int kRowTile = 4;          // rows of one slot served from each weight row loaded
constexpr int64_t kColumnChunk = 64;  // the expand's columns per claim

// The rows of each slot, in row order: rows[starts[s], starts[s + 1]).
struct RowsBySlot {
  std::vector<int64_t> rows, starts;
};

RowsBySlot rows_by_slot(const int32_t* slots, int64_t m, int64_t num_slots) {
  RowsBySlot by{std::vector<int64_t>(), std::vector<int64_t>(num_slots + 1, 0)};
  for (int64_t t = 0; t < m; ++t)
    if (slots[t] >= 0) ++by.starts[slots[t] + 1];
  for (int64_t s = 0; s < num_slots; ++s) by.starts[s + 1] += by.starts[s];
  by.rows.resize(by.starts[num_slots]);
  std::vector<int64_t> next(by.starts.begin(), by.starts.end() - 1);
  for (int64_t t = 0; t < m; ++t)
    if (slots[t] >= 0) by.rows[next[slots[t]]++] = t;
  return by;
}

// h[j] of `count` rows (x rows `k` apart at `x`, listed in `rows`) against one A row: dot products, float sums.
template <typename T>
void dots_vec8(const T* x, const int64_t* rows, int count, const T* a, int64_t k, float* const* h) {
  const int64_t full = k / kWidth * kWidth;
  vec8 acc[kRowTile];
  for (int r = 0; r < count; ++r) acc[r] = splat(0.0f);
  for (int64_t i = 0; i < full; i += kWidth) {
    const vec8 w = load8(a + i);
    for (int r = 0; r < count; ++r) acc[r] += w * load8(x + rows[r] * k + i);
  }
  for (int r = 0; r < count; ++r) {
    float sum = hsum(acc[r]);
    for (int64_t i = full; i < k; ++i) sum += static_cast<float>(a[i]) * static_cast<float>(x[rows[r] * k + i]);
    *h[r] = sum;
  }
}

#ifdef TIDAL_AVX512_BF16
#define TIDAL_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
// The same on bf16 rows with AVX512-BF16: 32 products per instruction, exact, summed in float32.
TIDAL_TARGET void dots_bf16(const c10::BFloat16* x, const int64_t* rows, int count, const c10::BFloat16* a,
                            int64_t k, float* const* h) {
  __m512 acc[kRowTile];
  for (int r = 0; r < count; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 32) {
    const __mmask32 mask = k - i >= 32 ? ~__mmask32(0) : (__mmask32(1) << (k - i)) - 1;
    const __m512bh w = (__m512bh)_mm512_maskz_loadu_epi16(mask, a + i);
    for (int r = 0; r < count; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], w, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + rows[r] * k + i));
  }
  for (int r = 0; r < count; ++r) *h[r] = _mm512_reduce_add_ps(acc[r]);
}
#undef TIDAL_TARGET
#endif

template <typename T>
void dots(const T* x, const int64_t* rows, int count, const T* a, int64_t k, float* const* h) {
#ifdef TIDAL_AVX512_BF16
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (isa().avx512_bf16) return dots_bf16(x, rows, count, a, k, h);
  }
#endif
  dots_vec8(x, rows, count, a, k, h);
}

// Columns [c, c + 8 * V) of up to kRowTile rows: per rank, V vectors of B widened once serve every row, each
// row's h broadcast once for the V vectors (one B vector per row and rank ran at half the rate).
template <int V, typename T>
void expand_block(const float* h, int64_t width, const T* b, int64_t n, int64_t first, int64_t rank,
                  const int64_t* rows, int tile, int64_t c, T* out) {
  vec8 acc[kRowTile][V];
  for (int r = 0; r < tile; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = splat(0.0f);
  for (int64_t j = 0; j < rank; ++j) {
    vec8 w[V];
    for (int v = 0; v < V; ++v) w[v] = load8(b + (first + j) * n + c + v * kWidth);
    for (int r = 0; r < tile; ++r) {
      const vec8 hj = splat(h[rows[r] * width + j]);
      for (int v = 0; v < V; ++v) acc[r][v] += w[v] * hj;
    }
  }
  for (int r = 0; r < tile; ++r)
    for (int v = 0; v < V; ++v) {
      T* y = out + rows[r] * n + c + v * kWidth;
      store8(y, load8(y) + acc[r][v]);
    }
}

// out[rows][c0, c1) += h[rows][0, rank) @ B rows [first, first + rank), columns [c0, c1), for one slot's part.
template <typename T>
void expand(const float* h, int64_t width, const T* b, int64_t n, int64_t first, int64_t rank, const int64_t* rows,
            int64_t count, int64_t c0, int64_t c1, T* out) {
  for (int64_t r0 = 0; r0 < count; r0 += kRowTile) {
    const int tile = static_cast<int>(std::min<int64_t>(kRowTile, count - r0));
    int64_t c = c0;
    for (; c + 4 * kWidth <= c1; c += 4 * kWidth) expand_block<4>(h, width, b, n, first, rank, rows + r0, tile, c, out);
    for (; c + kWidth <= c1; c += kWidth) expand_block<1>(h, width, b, n, first, rank, rows + r0, tile, c, out);
    for (; c < c1; ++c)
      for (int r = 0; r < tile; ++r) {
        float sum = 0.0f;
        for (int64_t j = 0; j < rank; ++j)
          sum += h[rows[r0 + r] * width + j] * static_cast<float>(b[(first + j) * n + c]);
        T* y = out + rows[r0 + r] * n + c;
        *y = static_cast<T>(static_cast<float>(*y) + sum);
      }
  }
}

}  // namespace

LoraLinear lora_linear(const at::Tensor& a, const at::Tensor& b, const at::Tensor& ranks,
                       std::vector<int64_t> part_sizes, int64_t max_rank) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.is_contiguous() && b.is_contiguous() &&
                  a.scalar_type() == b.scalar_type() && a.size(0) == b.size(0),
              "A and B must be contiguous [slots * width, K] and [slots * width, N] of one dtype");
  TORCH_CHECK(a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16, "LoRA weights are float32 or bf16");
  TORCH_CHECK(!part_sizes.empty() && max_rank > 0, "part_sizes must name at least one part, max_rank be positive");
  int64_t n = 0;
  for (int64_t size : part_sizes) n += size;
  const int64_t parts = static_cast<int64_t>(part_sizes.size()), width = parts * max_rank;
  TORCH_CHECK(n == b.size(1), "the parts' sizes sum to ", n, ", B has ", b.size(1), " columns");
  TORCH_CHECK(a.size(0) % width == 0, "A's ", a.size(0), " rows are not whole slots of ", width);
  const int64_t num_slots = a.size(0) / width;
  TORCH_CHECK(ranks.dim() == 1 && ranks.size(0) == num_slots && ranks.scalar_type() == at::kInt && ranks.is_contiguous(),
              "ranks must be [", num_slots, "] int32");
  return LoraLinear{a, b, ranks, std::move(part_sizes), max_rank, a.size(1), n, num_slots};
}

void check_lora_slots(const int32_t* slots, int64_t m, int64_t num_slots) {
  for (int64_t t = 0; t < m; ++t)
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, "row ", t, "'s LoRA slot ", slots[t], " is not -1 or below ",
                num_slots);
}

template <typename T>
void lora_add_rows(const T* x, int64_t m, const int32_t* slots, const LoraLinear& w, T* out) {
  const RowsBySlot by = rows_by_slot(slots, m, w.num_slots);
  if (by.rows.empty()) return;
  const int64_t parts = static_cast<int64_t>(w.part_sizes.size()), width = parts * w.max_rank;
  const int32_t* ranks = w.ranks.data_ptr<int32_t>();
  const T* a = w.a.data_ptr<T>();
  const T* b = w.b.data_ptr<T>();
  std::vector<float> h(m * width);  // each row's A x, at its slot's column layout
  // every used slot's ranks, each an A row read once for all of the slot's rows
  std::vector<std::pair<int64_t, int64_t>> units;  // (slot, A row within the slot)
  int64_t multiply_adds = 0;
  for (int64_t s = 0; s < w.num_slots; ++s) {
    const int64_t count = by.starts[s + 1] - by.starts[s], rank = std::min<int64_t>(ranks[s], w.max_rank);
    if (count == 0) continue;
    for (int64_t p = 0; p < parts; ++p)
      for (int64_t j = 0; j < rank; ++j) units.emplace_back(s, p * w.max_rank + j);
    multiply_adds += count * rank * (parts * w.k + w.n);
  }
  const int64_t threads = linear_threads(multiply_adds);
  parallel_claims(static_cast<int64_t>(units.size()), 4, threads, [&](int64_t begin, int64_t end, int64_t) {
    for (int64_t u = begin; u < end; ++u) {
      const auto [s, j] = units[u];
      const int64_t* rows = by.rows.data() + by.starts[s];
      const int64_t count = by.starts[s + 1] - by.starts[s];
      for (int64_t r0 = 0; r0 < count; r0 += kRowTile) {
        const int tile = static_cast<int>(std::min<int64_t>(kRowTile, count - r0));
        float* sums[kRowTile];
        for (int r = 0; r < tile; ++r) sums[r] = h.data() + rows[r0 + r] * width + j;
        dots<T>(x, rows + r0, tile, a + (s * width + j) * w.k, w.k, sums);
      }
    }
  });
  // the expand by column chunks: each column belongs to one part, whose B rows are the only non-zero ones there
  const int64_t chunks = (w.n + kColumnChunk - 1) / kColumnChunk;
  parallel_claims(chunks, 1, threads, [&](int64_t begin, int64_t end, int64_t) {
    int64_t part_start = 0;
    for (int64_t p = 0; p < parts; part_start += w.part_sizes[p++]) {
      const int64_t c0 = std::max(begin * kColumnChunk, part_start);
      const int64_t c1 = std::min({end * kColumnChunk, part_start + w.part_sizes[p], w.n});
      if (c0 >= c1) continue;
      for (int64_t s = 0; s < w.num_slots; ++s) {
        const int64_t count = by.starts[s + 1] - by.starts[s], rank = std::min<int64_t>(ranks[s], w.max_rank);
        if (count == 0 || rank <= 0) continue;
        expand<T>(h.data() + p * w.max_rank, width, b, w.n, s * width + p * w.max_rank, rank,
                  by.rows.data() + by.starts[s], count, c0, c1, out);
      }
    }
  });
}

template void lora_add_rows<float>(const float*, int64_t, const int32_t*, const LoraLinear&, float*);
template void lora_add_rows<c10::BFloat16>(const c10::BFloat16*, int64_t, const int32_t*, const LoraLinear&,
                                           c10::BFloat16*);

// out [M, N] += each row's slot's B (A x) (x [M, K]; slots [M] int32, -1 for a base-model row), in place.
at::Tensor& lora_add_(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                      const at::Tensor& slots, const at::Tensor& ranks, std::vector<int64_t> part_sizes,
                      int64_t max_rank) {
  const LoraLinear w = lora_linear(a, b, ranks, std::move(part_sizes), max_rank);
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
  m.def("lora_add_(Tensor(a!) out, Tensor x, Tensor a, Tensor b, Tensor slots, Tensor ranks, int[] part_sizes, "
        "int max_rank) -> Tensor(a!)",
        &tidal_cpu::lora_add_);
}
