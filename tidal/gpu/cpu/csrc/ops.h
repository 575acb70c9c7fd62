// The C++ entry points of the CPU kernels, for callers in this library (decoder_stack.cpp) as well as
// for torch.ops.tidal_cpu, which registers the same functions (see each file for its contract).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace tidal_cpu {

// layer_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps);
void rotary_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& x);
std::tuple<at::Tensor, at::Tensor> rotary_angles(const at::Tensor& positions, const at::Tensor& inv_freq,
                                                 at::ScalarType dtype);
// The same ops on raw rows (float or c10::BFloat16), for decoder_stack.cpp, which checks its shapes and dtypes once
// per forward: no checks, no tensors. Rows of [rows, dim] blocks are contiguous; a [rows, heads, dim] block has its
// heads contiguous and its rows `row_stride` apart (q or k inside the qkv projection's output).
template <typename T>
void rotary_angles_rows(const int64_t* positions, int64_t rows, const float* inv_freq, int64_t half, T* cos, T* sin);
template <typename T>
void add_rms_norm_rows(T* residual, const T* x, const T* weight, int64_t rows, int64_t dim, float eps, T* out);
template <typename T>
void rms_norm_heads_(T* x, int64_t rows, int64_t heads, int64_t dim, int64_t row_stride, const T* weight, float eps);
template <typename T>
void rotary_rows_(T* x, int64_t rows, int64_t heads, int64_t dim, int64_t row_stride, const T* cos, const T* sin,
                  int64_t cs_stride);
template <typename T>
void silu_and_mul_rows(const T* x, int64_t rows, int64_t width, int64_t row_stride, T* out);

// linear_bf16.cpp, linear_avx2.cpp
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias);
bool linear_bf16_supported();
at::Tensor linear_avx2(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias);
bool linear_avx2_supported();

// linear_int.cpp, linear_int_a8.cpp
at::Tensor linear_int(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                      const std::optional<at::Tensor>& offsets, int64_t n, int64_t bits, int64_t group_size,
                      int64_t activation_bits, const std::optional<at::Tensor>& bias);
at::Tensor linear_int_a8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                         const std::optional<at::Tensor>& offsets, int64_t n, int64_t bits, int64_t group_size,
                         const std::optional<at::Tensor>& bias);
// The weight-only kernel's weight checked once, for a caller that runs it at every step (decoder_stack.cpp):
// rows x [m, k] (`x_stride` elements apart) in, out [m, n] float32 written, no tensor made per call. offsets and
// bias: undefined when absent. bf16 rows: int4 on bf16 dot products where the CPU has them, else widened here.
struct IntLinear {
  at::Tensor packed, scales, offsets, bias;
  int64_t n, k, bits, group_size, groups;
};
IntLinear int_linear(const at::Tensor& packed, const at::Tensor& scales, const std::optional<at::Tensor>& offsets,
                     int64_t n, int64_t k, int64_t bits, int64_t group_size, const std::optional<at::Tensor>& bias);
void linear_int_into(const float* x, int64_t m, int64_t x_stride, const IntLinear& w, float* out);
void linear_int_bf16_into(const c10::BFloat16* x, int64_t m, int64_t x_stride, const IntLinear& w, float* out);
// The same for int8 activations (linear_int_a8.cpp): x [m, k] float32 rows in, out [m, n] float32 written.
struct A8Linear {
  at::Tensor packed, scales, offsets, bias;
  int64_t n, k, padded_k, bits, group_size, groups;
};
A8Linear a8_linear(const at::Tensor& packed, const at::Tensor& scales, const std::optional<at::Tensor>& offsets,
                   int64_t n, int64_t k, int64_t bits, int64_t group_size, const std::optional<at::Tensor>& bias);
void linear_int_a8_into(const float* x, int64_t m, const A8Linear& w, float* out);
// The same on bf16 rows (an AVX512-BF16 host's stack): x widened and the sums rounded as each tile loads and stores
// them, no float copies of the rows.
void linear_int_a8_into(const c10::BFloat16* x, int64_t m, const A8Linear& w, c10::BFloat16* out);
std::string linear_int_a8_isa();  // the dot products it runs on this CPU: "avx512_vnni", "avx2", or "" (none)

// lora.cpp: each row's own LoRA product added to a linear's output. One fused linear's slots, checked once (A
// [slots * width, K], width = parts * max_rank; B packed [slots, blocks, max_rank, kLoraBlock], lora.cpp's layout;
// ranks [slots] int32, read at every call so a slot's new adapter is seen), then rows x [m, K] contiguous, slots
// [m] (-1: none; check_lora_slots first) and out [m, N] contiguous, updated in place.
constexpr int64_t kLoraBlock = 16;  // output columns per packed block of B
struct LoraLinear {
  at::Tensor a, b, ranks;
  std::vector<int64_t> part_sizes;   // the columns of each part of the fused output
  std::vector<int64_t> part_starts;  // each part's first column, then N
  std::vector<int64_t> part_blocks;  // each part's first packed block, then the blocks of a slot
  int64_t max_rank, k, n, num_slots, blocks;
};
LoraLinear lora_linear(const at::Tensor& a, const at::Tensor& b, const at::Tensor& ranks,
                       std::vector<int64_t> part_sizes, int64_t max_rank);
void check_lora_slots(const int32_t* slots, int64_t m, int64_t num_slots);
template <typename T>
void lora_add_rows(const T* x, int64_t m, const int32_t* slots, const LoraLinear& w, T* out);

// paged_decode.cpp
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale);
// The kernel on raw rows, for decoder_stack.cpp: query [B, Hq, D] (rows `q_stride_b`, heads `q_stride_h` apart),
// caches [num_blocks, block_size, Hkv, D] contiguous, lengths from checked_lengths; writes out [B, Hq, D].
template <typename T>
void paged_decode_rows(const T* query, int64_t q_stride_b, int64_t q_stride_h, int64_t num_heads, const T* k_cache,
                       const T* v_cache, int64_t block_size, int64_t num_kv_heads, int64_t dim,
                       const int32_t* block_tables, int64_t table_stride, const std::vector<int64_t>& seq_lens,
                       float scale, T* out);
// The first `num_seqs` lengths, each checked against its block table and the cache's `num_blocks` (raises on a
// length or block id the kernel must not read).
std::vector<int64_t> checked_lengths(const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_seqs,
                                     int64_t block_size, int64_t num_blocks);
void write_kv_cache_(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                     const at::Tensor& slot_mapping);
// write_kv_cache_'s parts on raw rows, for decoder_stack.cpp: every slot checked against the cache's `num_slots`
// (raises before any write, so a bad slot leaves the cache as it was), then each row's K and V (`row_bytes` each,
// rows `*_stride` bytes apart) copied to its slot.
void check_slots(const int64_t* slots, int64_t rows, int64_t num_slots);
void write_kv_rows(const char* k, size_t k_stride, const char* v, size_t v_stride, int64_t rows, size_t row_bytes,
                   const int64_t* slots, char* k_cache, char* v_cache);

}  // namespace tidal_cpu
