// One categorical draw per row, by the inverse CDF: one uniform per row instead of one per vocabulary
// entry. torch's exponential race (uniform_, log_, div_, argmin over [N, V]) cost ~60 us of CPU per row
// of 8192 here, most of it generating V random numbers and their logs; this walks the row three times
// (max, exp-and-sum, search) at ~1-2 ns per entry.
//
// categorical_sample(x [N, V] float32, inv_temperature [N] float32 or None, uniforms [N] float64):
// * with inv_temperature, x holds logits and each row's weights are exp((x - max) * inv_temperature),
//   written over x (a softmax left unnormalised: the draw only compares ratios);
// * without, x already holds nonnegative weights (probabilities after top-k / top-p / min-p).
// Row r picks the first index whose running sum of weights exceeds uniforms[r] * (the row's total).
// A weight of 0 (a masked token, a logit of -inf) is never picked. The sums run over 8-entry blocks in
// a fixed order, so a row's token depends only on its weights and its uniform, not on the batch or the
// thread count.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "vec8.h"

namespace {

using namespace tidal_cpu;

// ~1 ms of work: below this a second thread costs more than it saves on a busy host (measured 2.4x
// slower at 64 rows of 8192 with the other core loaded)
constexpr int64_t kElementsPerTask = 1 << 20;

// Turns one row of logits into its weights in place: exp((x - max) * inv_t), exactly 0 for -inf.
void logits_to_weights(float* x, int64_t v, float inv_t) {
  const int64_t full = v / kWidth * kWidth;
  const float top = row_max(x, v);
  // below exp(-87) a weight is under float's normal range: call it 0, which also keeps -inf at 0
  const vec8 shift = splat(top), scale = splat(inv_t), floor = splat(-87.0f), zero = splat(0.0f);
  for (int64_t i = 0; i < full; i += kWidth) {
    const vec8 scaled = (load8(x + i) - shift) * scale;
    const vec8 e = exp_nonpositive(scaled);
    store8(x + i, scaled >= floor ? e : zero);
  }
  for (int64_t i = full; i < v; ++i) {
    const float scaled = (x[i] - top) * inv_t;
    x[i] = scaled >= -87.0f ? std::exp(scaled) : 0.0f;
  }
}

// The index the uniform u lands on in the row's weights (see the file comment); `sums` is scratch.
int64_t draw(const float* w, int64_t v, double u, std::vector<float>& sums) {
  const int64_t blocks = (v + kWidth - 1) / kWidth, full = v / kWidth;
  sums.resize(static_cast<size_t>(blocks));
  double total = 0.0;
  for (int64_t b = 0; b < full; ++b) {
    sums[b] = hsum(load8(w + b * kWidth));
    total += sums[b];
  }
  if (full < blocks) {
    float tail = 0.0f;
    for (int64_t i = full * kWidth; i < v; ++i) tail += w[i];
    sums[full] = tail;
    total += tail;
  }
  int64_t last_positive = -1;
  if (!(total > 0.0) || !std::isfinite(total)) {  // no weight (or NaN): the most likely entry, as argmax would
    int64_t best = 0;
    for (int64_t i = 1; i < v; ++i)
      if (w[i] > w[best]) best = i;
    return best;
  }
  const double target = u * total;
  double running = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (running + sums[b] <= target) {
      running += sums[b];
      continue;
    }
    for (int64_t i = b * kWidth; i < std::min(v, (b + 1) * kWidth); ++i) {
      if (w[i] > 0.0f) last_positive = i;
      running += w[i];
      if (running > target && w[i] > 0.0f) return i;
    }
  }
  // rounding left the target past the last sum: the last entry that has weight
  for (int64_t i = v - 1; last_positive < 0 && i >= 0; --i)
    if (w[i] > 0.0f) last_positive = i;
  return last_positive;
}

at::Tensor categorical_sample(at::Tensor& x, const std::optional<at::Tensor>& inv_temperature,
                              const at::Tensor& uniforms) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous [N, V] float32 CPU tensor");
  const int64_t n = x.size(0), v = x.size(1);
  TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.is_contiguous() && uniforms.numel() == n,
              "uniforms must be [N] float64");
  const float* inv_t = nullptr;
  if (inv_temperature.has_value()) {
    TORCH_CHECK(inv_temperature->scalar_type() == at::kFloat && inv_temperature->is_contiguous() &&
                    inv_temperature->numel() == n,
                "inv_temperature must be [N] float32");
    inv_t = inv_temperature->data_ptr<float>();
  }
  at::Tensor out = at::empty({n}, x.options().dtype(at::kLong));
  if (n == 0) return out;
  TORCH_CHECK(v > 0, "no vocabulary to draw from");
  float* rows = x.data_ptr<float>();
  const double* u = uniforms.data_ptr<double>();
  int64_t* tokens = out.data_ptr<int64_t>();
  at::parallel_for(0, n, std::max<int64_t>(1, kElementsPerTask / v), [&](int64_t begin, int64_t end) {
    std::vector<float> sums;
    for (int64_t r = begin; r < end; ++r) {
      if (inv_t != nullptr) logits_to_weights(rows + r * v, v, inv_t[r]);
      tokens[r] = draw(rows + r * v, v, u[r], sums);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tidal_cpu, m) {
  m.def("categorical_sample(Tensor(a!) x, Tensor? inv_temperature, Tensor uniforms) -> Tensor", &categorical_sample);
}
