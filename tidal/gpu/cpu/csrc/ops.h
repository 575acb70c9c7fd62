// The C++ entry points of the CPU kernels, for callers in this library (decoder_stack.cpp) as well as
// for torch.ops.tidal_cpu, which registers the same functions (see each file for its contract).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace tidal_cpu {

// layer_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps);
void rotary_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& x);

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
// The same weight checked once, for a caller that runs it at every step (decoder_stack.cpp): x [m, k] float32
// rows in, out [m, n] float32 written, no tensor made per call. offsets and bias: undefined when absent.
struct A8Linear {
  at::Tensor packed, scales, offsets, bias;
  int64_t n, k, padded_k, bits, group_size, groups;
};
A8Linear a8_linear(const at::Tensor& packed, const at::Tensor& scales, const std::optional<at::Tensor>& offsets,
                   int64_t n, int64_t k, int64_t bits, int64_t group_size, const std::optional<at::Tensor>& bias);
void linear_int_a8_into(const float* x, int64_t m, const A8Linear& w, float* out);

// paged_decode.cpp
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale);
void write_kv_cache_(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                     const at::Tensor& slot_mapping);

}  // namespace tidal_cpu
