// A Llama-family model's decoder layers as one call, for a CPU forward whose every row attends on
// the paged kernel (all decodes, or prefill rows on the AVX512-BF16 path).
//
// The Python layers (tidal/gpu/model/llama.py) dispatch about twelve ops a layer, and at batch 1 each
// costs a few microseconds of Python and dispatcher work around kernels that themselves take
// microseconds: on the 12-layer "small" model that was ~0.7 ms of a ~6.5 ms step, on top of
// the weight reads the step is bound by. Here the same kernels run in the same order with the same
// arguments, called directly: the result is bitwise the Python layers' (tests/gpu/cpu/test_decoder_stack.py).
// The embedding and the final norm run here too, as the same ATen and tidal ops the Python forward calls:
// each Python call costs ~50-100 us at decode, where the weight stream has just evicted the interpreter's
// and dispatcher's state from the caches. The rotary angles come from RotaryEmbedding.cos_sin, their one
// owner. Other devices and batches stay in Python.

#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "ops.h"

namespace tidal_cpu {
namespace {

struct StackLinear {
  at::Tensor packed;
  int64_t n;
  std::optional<at::Tensor> bias;
  // int8/int4 weights (linear_int), set by use_int_linears: bits 0 means packed is a bf16 layout
  int64_t bits = 0, group_size = 0, activation_bits = 16;
  at::Tensor scales;
  std::optional<at::Tensor> offsets;
  std::optional<A8Linear> a8;  // int8 activations: the weight checked once, run without a tensor per call
};

struct StackLayer {
  at::Tensor input_norm, post_attention_norm;
  std::optional<at::Tensor> q_norm, k_norm;
  StackLinear qkv, o, gate_up, down;
};

// The model-level tensors, after the layers' (LlamaForCausalLM._build_decoder_stack).
enum ModelSlot { kEmbed, kFinalNorm, kModelSlots };

// The per-layer tensors, as DecoderStack's constructor takes them (an absent bias or q/k norm is an
// empty tensor), in the order LlamaForCausalLM._build_decoder_stack lists them.
enum Slot {
  kInputNorm, kQkv, kQkvBias, kO, kOBias, kPostNorm, kGateUp, kGateUpBias, kDown, kDownBias, kQNorm, kKNorm,
  kSlotsPerLayer
};

std::optional<at::Tensor> present(const at::Tensor& t) {
  return t.numel() == 0 ? std::nullopt : std::optional<at::Tensor>(t);
}

class DecoderStack : public torch::CustomClassHolder {
 public:
  // tensors: kSlotsPerLayer per layer, then kModelSlots; shape: [num_heads, num_kv_heads, head_dim, qkv_n, o_n,
  // gate_up_n, down_n];
  // avx2: float32 activations on bf16-stored weights (linear_avx2) instead of bf16 throughout (linear_bf16)
  DecoderStack(std::vector<at::Tensor> tensors, std::vector<int64_t> shape, bool avx2, double eps, double scale)
      : avx2_(avx2), eps_(eps), scale_(scale) {
    TORCH_CHECK(shape.size() == 7, "shape must be [num_heads, num_kv_heads, head_dim, qkv_n, o_n, gate_up_n, down_n]");
    TORCH_CHECK(tensors.size() > kModelSlots && (tensors.size() - kModelSlots) % kSlotsPerLayer == 0, "expected ",
                int(kSlotsPerLayer), " tensors per layer and ", int(kModelSlots), " for the model, got ", tensors.size());
    const at::Tensor* model = tensors.data() + tensors.size() - kModelSlots;
    embed_ = model[kEmbed];
    final_norm_ = model[kFinalNorm];
    TORCH_CHECK(avx2 ? linear_avx2_supported() : linear_bf16_supported(), "this CPU cannot run the stack's linears");
    num_heads_ = shape[0];
    num_kv_heads_ = shape[1];
    head_dim_ = shape[2];
    for (size_t first = 0; first + kModelSlots < tensors.size(); first += kSlotsPerLayer) {
      const at::Tensor* t = tensors.data() + first;
      layers_.push_back(StackLayer{t[kInputNorm], t[kPostNorm], present(t[kQNorm]), present(t[kKNorm]),
                                   {t[kQkv], shape[3], present(t[kQkvBias])},
                                   {t[kO], shape[4], present(t[kOBias])},
                                   {t[kGateUp], shape[5], present(t[kGateUpBias])},
                                   {t[kDown], shape[6], present(t[kDownBias])}});
    }
  }

  // Run every linear on int8/int4 weights (linear_int): per layer, for qkv, o, gate_up and down in that order,
  // tensors (packed, scales, offsets or an empty tensor) and params (bits, group_size, activation_bits); the packed
  // tensors given to the constructor were these same ones.
  void use_int_linears(std::vector<at::Tensor> tensors, std::vector<int64_t> params) {
    TORCH_CHECK(tensors.size() == layers_.size() * 12 && params.size() == layers_.size() * 12,
                "expected 12 tensors and 12 params per layer");
    for (size_t i = 0; i < layers_.size(); ++i) {
      StackLinear* linears[] = {&layers_[i].qkv, &layers_[i].o, &layers_[i].gate_up, &layers_[i].down};
      for (int j = 0; j < 4; ++j) {
        const at::Tensor* t = tensors.data() + i * 12 + j * 3;
        linears[j]->packed = t[0];
        linears[j]->scales = t[1];
        linears[j]->offsets = present(t[2]);
        linears[j]->bits = params[i * 12 + j * 3];
        linears[j]->group_size = params[i * 12 + j * 3 + 1];
        linears[j]->activation_bits = params[i * 12 + j * 3 + 2];
        if (linears[j]->activation_bits == 8)
          linears[j]->a8 = a8_linear(t[0], t[1], linears[j]->offsets, linears[j]->n, input_features(i, j),
                                     linears[j]->bits, linears[j]->group_size, linears[j]->bias);
      }
    }
  }

  // The model's forward over the rows: embedding, every layer, final norm; returns the final-normed hidden
  // states [T, hidden], as LlamaForCausalLM.forward does. cos/sin: the rows' rotary angles [T, head_dim];
  // tables/lens: each row's block table and attended length (TorchPagedAttention.kernel_rows).
  at::Tensor forward(at::Tensor input_ids, at::Tensor cos, at::Tensor sin, at::Tensor slot_mapping, at::Tensor tables,
                     at::Tensor lens, std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches) {
    at::Tensor residual = at::embedding(embed_, input_ids);
    at::Tensor out = layers(residual, at::zeros_like(residual), cos, sin, slot_mapping, tables, lens, k_caches, v_caches);
    return add_rms_norm_(residual, out, final_norm_, eps_);
  }

 private:
  // Every layer over the rows. residual [T, hidden] is updated in place as the Python layers update it;
  // out is the last sublayer's output before the final norm's residual add (zeros for the first layer),
  // and the new one is returned.
  at::Tensor layers(at::Tensor& residual, at::Tensor out, const at::Tensor& cos, const at::Tensor& sin,
                    const at::Tensor& slot_mapping, const at::Tensor& tables, const at::Tensor& lens,
                    std::vector<at::Tensor>& k_caches, std::vector<at::Tensor>& v_caches) {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(), "expected ", layers_.size(),
                " k and v caches");
    const int64_t rows = residual.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    at::Tensor qkv_out, o_out, gate_up_out, down_out;  // each linear's output, made once and reused by every layer
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& layer = layers_[i];
      // attention: norm(residual + out), qkv, (q/k norms), rotary, cache write, paged attention, o_proj
      at::Tensor x = add_rms_norm_(residual, out, layer.input_norm, eps_);
      const at::Tensor qkv = linear(x, layer.qkv, qkv_out);
      at::Tensor q = qkv.narrow(1, 0, q_size).view({rows, num_heads_, head_dim_});
      at::Tensor k = qkv.narrow(1, q_size, kv_size).view({rows, num_kv_heads_, head_dim_});
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, num_kv_heads_, head_dim_});
      if (layer.q_norm.has_value()) {
        q = rms_norm(q, *layer.q_norm, eps_);
        k = rms_norm(k, *layer.k_norm, eps_);
      }
      rotary_(q, k, cos, sin);
      write_kv_cache_(k, v, k_caches[i], v_caches[i], slot_mapping);
      const at::Tensor attended = paged_decode_attention(q, k_caches[i], v_caches[i], tables, lens, scale_);
      out = linear(attended.view({rows, q_size}), layer.o, o_out);
      // MLP: norm(residual + out), gate_up, SiLU-and-mul, down
      x = add_rms_norm_(residual, out, layer.post_attention_norm, eps_);
      out = linear(silu_and_mul(linear(x, layer.gate_up, gate_up_out)), layer.down, down_out);
    }
    return out;
  }

  // K of layer i's j-th linear (qkv, o, gate_up, down)
  int64_t input_features(size_t i, int j) const {
    const int64_t hidden = embed_.size(1);
    switch (j) {
      case 0: return hidden;
      case 1: return num_heads_ * head_dim_;
      case 2: return hidden;
      default: return layers_[i].gate_up.n / 2;
    }
  }

  // x @ w into `buffer` (made at the first call of a forward) where the int8-activation kernel can write it
  // there; otherwise a new tensor from the op.
  at::Tensor linear(const at::Tensor& x, const StackLinear& w, at::Tensor& buffer) const {
    if (!w.a8.has_value() || x.scalar_type() != at::kFloat || x.dim() != 2 || !x.is_contiguous() || x.size(1) != w.a8->k)
      return linear(x, w);
    if (!buffer.defined()) buffer = at::empty({x.size(0), w.n}, x.options());
    linear_int_a8_into(x.data_ptr<float>(), x.size(0), *w.a8, buffer.data_ptr<float>());
    return buffer;
  }

  at::Tensor linear(const at::Tensor& x, const StackLinear& w) const {
    if (w.bits != 0) return linear_int(x, w.packed, w.scales, w.offsets, w.n, w.bits, w.group_size, w.activation_bits, w.bias);
    return avx2_ ? linear_avx2(x, w.packed, w.n, w.bias) : linear_bf16(x, w.packed, w.n, w.bias);
  }

  std::vector<StackLayer> layers_;
  at::Tensor embed_, final_norm_;
  bool avx2_;
  double eps_, scale_;
  int64_t num_heads_ = 0, num_kv_heads_ = 0, head_dim_ = 0;
};

}  // namespace
}  // namespace tidal_cpu

TORCH_LIBRARY_FRAGMENT(tidal_cpu, m) {
  m.class_<tidal_cpu::DecoderStack>("DecoderStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, bool, double, double>())
      .def("use_int_linears", &tidal_cpu::DecoderStack::use_int_linears)
      .def("forward", &tidal_cpu::DecoderStack::forward);
}
