// Fused per-layer elementwise ops for the CPU: each replaces three to eight torch ops (and as many
// passes over memory and dispatcher calls) with one. In bfloat16 each op rounds wherever the torch
// sequence it replaces rounds (every torch op on bf16 tensors computes in float and rounds its
// result), so the results match transformers' bf16 modules; in float32 they match up to summation
// order. Rows are split over threads only when there are enough of them to pay for a thread.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

#include "ops.h"
#include "vec8.h"

namespace tidal_cpu {
namespace {

constexpr int64_t kElementsPerTask = 65536;  // below this a thread costs more than it saves

// Scalar twins of vec8.h's loads and stores, for the tails of rows whose length is not a multiple of 8.
inline float load1(const float* p) { return *p; }
inline float load1(const c10::BFloat16* p) { return static_cast<float>(*p); }
inline void store1(float* p, float v) { *p = v; }
inline void store1(c10::BFloat16* p, float v) { *p = c10::BFloat16(v); }
inline float round1(float v, const float*) { return v; }
inline float round1(float v, const c10::BFloat16*) { return static_cast<float>(c10::BFloat16(v)); }

// Rows of a [..., D] tensor whose last dim is contiguous: row r starts at offset(r).
struct Rows {
  int64_t count, dim, inner, stride_outer, stride_inner;  // 2-D: inner = 1; 3-D [A, B, D]: inner = B
  explicit Rows(const at::Tensor& t) {
    TORCH_CHECK((t.dim() == 2 || t.dim() == 3) && t.stride(-1) == 1, "expected a [T, D] or [T, H, D] tensor with a "
                "contiguous last dim");
    dim = t.size(-1);
    inner = t.dim() == 3 ? t.size(1) : 1;
    count = t.size(0) * inner;
    stride_outer = t.stride(0);
    stride_inner = t.dim() == 3 ? t.stride(1) : 0;
  }
  // rows of `heads` heads each, `heads * dim` apart or `row_stride` apart: [T, heads, dim] with contiguous heads
  Rows(int64_t rows, int64_t heads, int64_t dim_, int64_t row_stride)
      : count(rows * heads), dim(dim_), inner(heads), stride_outer(row_stride), stride_inner(dim_) {}
  int64_t offset(int64_t r) const { return (r / inner) * stride_outer + (r % inner) * stride_inner; }
};

int64_t grain_rows(int64_t dim) { return std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(1, dim)); }

template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, const Rows& xr, scalar_t* residual, const Rows& rr, const scalar_t* weight,
                   float eps, scalar_t* out, const Rows& outr) {
  const int64_t dim = xr.dim, vec_end = dim / kWidth * kWidth;
  at::parallel_for(0, xr.count, grain_rows(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* src = x + xr.offset(r);
      scalar_t* o = out + outr.offset(r);
      if (residual != nullptr) {  // residual += x, rounded as torch's add rounds; then normalise the sum
        scalar_t* res = residual + rr.offset(r);
        for (int64_t d = 0; d < vec_end; d += kWidth) store8(res + d, load8(res + d) + load8(src + d));
        for (int64_t d = vec_end; d < dim; ++d) store1(res + d, load1(res + d) + load1(src + d));
        src = res;
      }
      vec8 squares = splat(0.f);
      for (int64_t d = 0; d < vec_end; d += kWidth) {
        const vec8 v = load8(src + d);
        squares += v * v;
      }
      float sum = hsum(squares);
      for (int64_t d = vec_end; d < dim; ++d) sum += load1(src + d) * load1(src + d);
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(dim) + eps);
      // weight * (x * inv rounded to the dtype): transformers casts back before the weight
      for (int64_t d = 0; d < vec_end; d += kWidth)
        store8(o + d, load8(weight + d) * round_as(load8(src + d) * inv, src));
      for (int64_t d = vec_end; d < dim; ++d) store1(o + d, load1(weight + d) * round1(load1(src + d) * inv, src));
    }
  });
}

template <typename F>
void dispatch(const at::Tensor& t, const char* op, F&& f) {
  if (t.scalar_type() == at::kFloat) {
    f(static_cast<float*>(nullptr));
  } else if (t.scalar_type() == at::kBFloat16) {
    f(static_cast<c10::BFloat16*>(nullptr));
  } else {
    TORCH_CHECK(false, op, " supports float32 and bfloat16, got ", t.scalar_type());
  }
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(-1),
              "weight must be a contiguous [D] tensor");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "x and weight must share a dtype");
}

// x * cos + rotate_half(x) * sin in place on every head of q [T, Hq, D] and k [T, Hk, D], with
// cos/sin [T, D] (the "rotate half" layout of Hugging Face checkpoints).
template <typename scalar_t>
void rotary_heads(scalar_t* x, const Rows& xr, const scalar_t* cos, const scalar_t* sin, int64_t cs_stride) {
  const int64_t half = xr.dim / 2, vec_end = half / kWidth * kWidth;
  at::parallel_for(0, xr.count, grain_rows(4 * xr.dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* lo = x + xr.offset(r);
      scalar_t* hi = lo + half;
      const int64_t t = r / xr.inner;
      const scalar_t* c = cos + t * cs_stride;
      const scalar_t* s = sin + t * cs_stride;
      // rounded where torch rounds: x * cos, rotate_half(x) * sin, then their sum
      for (int64_t d = 0; d < vec_end; d += kWidth) {
        const vec8 x1 = load8(lo + d), x2 = load8(hi + d);
        store8(lo + d, round_as(x1 * load8(c + d), lo) + round_as(-x2 * load8(s + d), lo));
        store8(hi + d, round_as(x2 * load8(c + half + d), lo) + round_as(x1 * load8(s + half + d), lo));
      }
      for (int64_t d = vec_end; d < half; ++d) {
        const float x1 = load1(lo + d), x2 = load1(hi + d);
        store1(lo + d, round1(x1 * load1(c + d), lo) + round1(-x2 * load1(s + d), lo));
        store1(hi + d, round1(x2 * load1(c + half + d), lo) + round1(x1 * load1(s + half + d), lo));
      }
    }
  });
}

inline vec8 silu(vec8 g) {
  const vec8 e = exp_nonpositive(g > splat(0.f) ? -g : g);  // exp(-|g|): never overflows
  const vec8 one = splat(1.0f);
  return g * ((g > splat(0.f) ? one : e) / (one + e));  // sigmoid(g) = 1 / (1 + e^-g) = e^g / (1 + e^g)
}

}  // namespace

// weight * rms_normalised(x) as a new contiguous tensor, the shape of x.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  const Rows xr(x);
  at::Tensor out = at::empty(x.sizes(), x.options());
  dispatch(x, "rms_norm", [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), xr, nullptr, xr, weight.data_ptr<scalar_t>(),
                            static_cast<float>(eps), out.data_ptr<scalar_t>(), Rows(out));
  });
  return out;
}

// residual += x (in place), then weight * rms_normalised(residual) as a new tensor.
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual and x must have the same shape and dtype");
  const Rows xr(x), rr(residual);
  at::Tensor out = at::empty(x.sizes(), x.options());
  dispatch(x, "add_rms_norm_", [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), xr, residual.data_ptr<scalar_t>(), rr,
                            weight.data_ptr<scalar_t>(), static_cast<float>(eps), out.data_ptr<scalar_t>(), Rows(out));
  });
  return out;
}

void rotary_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "q and k must be [T, H, D] with the same T and D");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == q.size(0) && cos.size(1) == q.size(2) &&
                  cos.stride(1) == 1 && sin.stride(1) == 1 && cos.stride(0) == sin.stride(0),
              "cos and sin must be [T, D] with contiguous rows");
  TORCH_CHECK(q.size(2) % 2 == 0, "head_dim must be even");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == cos.scalar_type() &&
                  cos.scalar_type() == sin.scalar_type(),
              "q, k, cos and sin must share a dtype");
  const Rows qr(q), kr(k);
  dispatch(q, "rotary_", [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin.data_ptr<scalar_t>();
    rotary_heads<scalar_t>(q.data_ptr<scalar_t>(), qr, c, s, cos.stride(0));
    rotary_heads<scalar_t>(k.data_ptr<scalar_t>(), kr, c, s, cos.stride(0));
  });
}

// silu(x[:, :I]) * x[:, I:] for x [T, 2I]: the gated MLP's activation, as a new [T, I] tensor.
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 && x.size(1) % (2 * kWidth) == 0,
              "x must be a [T, 2I] CPU tensor with contiguous rows and I a multiple of 8");
  const int64_t rows = x.size(0), width = x.size(1) / 2, row_stride = x.stride(0);
  at::Tensor out = at::empty({rows, width}, x.options());
  dispatch(x, "silu_and_mul", [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    silu_and_mul_rows<scalar_t>(x.data_ptr<scalar_t>(), rows, width, row_stride, out.data_ptr<scalar_t>());
  });
  return out;
}

// cos and sin [T, D] of positions [T] int64 and inv_freq [D/2] float32 (RotaryEmbedding's frequencies, scaling
// folded in), each half repeated ("rotate half"): the angle is float(position) * inv_freq in float32, as torch
// computes it; its cos and sin come from glibc's sincosf (under 1 ulp), then round to the dtype.
std::tuple<at::Tensor, at::Tensor> rotary_angles(const at::Tensor& positions, const at::Tensor& inv_freq,
                                                 at::ScalarType dtype) {
  TORCH_CHECK(positions.device().is_cpu() && positions.dim() == 1 && positions.scalar_type() == at::kLong,
              "positions must be a [T] int64 CPU tensor");
  TORCH_CHECK(inv_freq.dim() == 1 && inv_freq.scalar_type() == at::kFloat && inv_freq.is_contiguous(),
              "inv_freq must be a contiguous [D/2] float32 tensor");
  const int64_t rows = positions.size(0), half = inv_freq.size(0);
  const at::Tensor pos = positions.contiguous();
  at::Tensor cos = at::empty({rows, 2 * half}, positions.options().dtype(dtype));
  at::Tensor sin = at::empty({rows, 2 * half}, positions.options().dtype(dtype));
  dispatch(cos, "rotary_angles", [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    rotary_angles_rows<scalar_t>(pos.data_ptr<int64_t>(), rows, inv_freq.data_ptr<float>(), half,
                                 cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>());
  });
  return {cos, sin};
}

template <typename scalar_t>
void rotary_angles_rows(const int64_t* positions, int64_t rows, const float* inv_freq, int64_t half, scalar_t* cos,
                        scalar_t* sin) {
  at::parallel_for(0, rows, grain_rows(16 * half), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float position = static_cast<float>(positions[r]);
      scalar_t* c = cos + r * 2 * half;
      scalar_t* s = sin + r * 2 * half;
      for (int64_t i = 0; i < half; ++i) {
        float sin_i, cos_i;
        sincosf(position * inv_freq[i], &sin_i, &cos_i);
        store1(c + i, cos_i);
        store1(c + half + i, cos_i);
        store1(s + i, sin_i);
        store1(s + half + i, sin_i);
      }
    }
  });
}

template <typename scalar_t>
void add_rms_norm_rows(scalar_t* residual, const scalar_t* x, const scalar_t* weight, int64_t rows, int64_t dim,
                       float eps, scalar_t* out) {
  const Rows contiguous(rows, 1, dim, dim);
  rms_norm_rows<scalar_t>(x, contiguous, residual, contiguous, weight, eps, out, contiguous);
}

template <typename scalar_t>
void rms_norm_heads_(scalar_t* x, int64_t rows, int64_t heads, int64_t dim, int64_t row_stride, const scalar_t* weight,
                     float eps) {
  const Rows xr(rows, heads, dim, row_stride);
  rms_norm_rows<scalar_t>(x, xr, nullptr, xr, weight, eps, x, xr);
}

template <typename scalar_t>
void rotary_rows_(scalar_t* x, int64_t rows, int64_t heads, int64_t dim, int64_t row_stride, const scalar_t* cos,
                  const scalar_t* sin, int64_t cs_stride) {
  rotary_heads<scalar_t>(x, Rows(rows, heads, dim, row_stride), cos, sin, cs_stride);
}

template <typename scalar_t>
void silu_and_mul_rows(const scalar_t* x, int64_t rows, int64_t width, int64_t row_stride, scalar_t* out) {
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* gate = x + r * row_stride;
      const scalar_t* up = gate + width;
      scalar_t* dst = out + r * width;
      // rounded where torch rounds: silu(gate), then the product
      for (int64_t d = 0; d < width; d += kWidth)
        store8(dst + d, round_as(silu(load8(gate + d)), gate) * load8(up + d));
    }
  });
}

#define TIDAL_ROW_OPS(T)                                                                                          \
  template void rotary_angles_rows<T>(const int64_t*, int64_t, const float*, int64_t, T*, T*);                   \
  template void add_rms_norm_rows<T>(T*, const T*, const T*, int64_t, int64_t, float, T*);                       \
  template void rms_norm_heads_<T>(T*, int64_t, int64_t, int64_t, int64_t, const T*, float);                     \
  template void rotary_rows_<T>(T*, int64_t, int64_t, int64_t, int64_t, const T*, const T*, int64_t);            \
  template void silu_and_mul_rows<T>(const T*, int64_t, int64_t, int64_t, T*);
TIDAL_ROW_OPS(float)
TIDAL_ROW_OPS(c10::BFloat16)
#undef TIDAL_ROW_OPS

}  // namespace tidal_cpu

using namespace tidal_cpu;

TORCH_LIBRARY_FRAGMENT(tidal_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor", &add_rms_norm_);
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()", &rotary_);
  m.def("silu_and_mul(Tensor x) -> Tensor", &silu_and_mul);
  m.def("rotary_angles(Tensor positions, Tensor inv_freq, ScalarType dtype) -> (Tensor, Tensor)", &rotary_angles);
}
