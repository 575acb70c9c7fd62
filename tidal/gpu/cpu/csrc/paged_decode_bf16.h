// Paged decode attention over a bf16 cache with AVX512-BF16 (paged_decode_bf16.cpp), called by
// paged_decode.cpp's op when the CPU has the instructions and the head dim suits them.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <vector>

namespace tidal_cpu {

// Flops of decode attention worth a thread, for both kernels (paged_decode.cpp, paged_decode_bf16.cpp): enough
// (sequence, kv head) tasks go in one chunk to reach it. At one decode row the cached K/V rows come from memory
// (the step's weight stream evicted them) and one core reads them at about half the host's bandwidth, so even a
// lone sequence splits its kv heads once each is worth it: the small anchor model (4 kv heads of group 3) reads
// them on two threads from 86 cached tokens, its decoder stack ~9% faster at one row (AVX2 host); the tiny one
// (2 kv heads of group 2) from 257.
constexpr int64_t kAttentionChunkFlops = 1 << 18;

// Whether this CPU runs the AVX512-BF16 path and `dim` suits it (a multiple of 32, at most 256).
bool paged_decode_bf16_supported(int64_t dim);

// The same contract as the generic kernel: query [B, Hq, D] (rows `q_stride_b`, heads `q_stride_h`
// apart, dims contiguous), caches [num_blocks, block_size, Hkv, D] contiguous, block tables
// `table_stride` apart, lengths validated by the caller; writes out [B, Hq, D] contiguous.
void paged_decode_bf16(const c10::BFloat16* query, int64_t q_stride_b, int64_t q_stride_h,
                       const c10::BFloat16* k_cache, const c10::BFloat16* v_cache, const int32_t* block_tables,
                       int64_t table_stride, const std::vector<int64_t>& seq_lens, int64_t num_heads,
                       int64_t num_kv_heads, int64_t dim, int64_t block_size, float scale, c10::BFloat16* out);

}  // namespace tidal_cpu
