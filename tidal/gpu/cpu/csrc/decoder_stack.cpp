// A Llama-family model's decoder layers as one call, for a CPU forward whose every row attends on
// the paged kernel (all decodes, or prefill rows on the AVX512-BF16 path).
//
// The Python layers (tidal/gpu/model/llama.py) dispatch about twelve ops a layer, and at batch 1 each
// costs a few microseconds of Python and dispatcher work around kernels that themselves take
// microseconds: on the 12-layer "small" model that was ~0.7 ms of a ~6.5 ms step, on top of
// the weight reads the step is bound by. Here the same kernels run in the same order with the same
// arguments, called directly: the result is bitwise the Python layers' (tests/gpu/cpu/test_decoder_stack.py).
// The embedding and the final norm run here too: each Python call costs ~50-100 us at decode, where the
// weight stream has just evicted the interpreter's and dispatcher's state from the caches.
//
// The arguments are checked once per forward; the layers then call the kernels on raw rows (ops.h's
// *_rows functions) with their outputs in buffers kept across forwards. A tensor op per kernel cost its
// checks, an output tensor and a dispatch: at one row of the 4-layer "tiny" model, ~100 of a ~230 us
// forward. The rotary angles are rotary_angles' (layer_ops.cpp), as RotaryEmbedding.cos_sin's on the CPU.
// Rows through LoRA adapters stay here too: each linear adds its rows' adapter products (lora.cpp) after the base
// product, as the Python layers' add_lora does, so a step with adapters costs the base step and those products.
// Other devices and batches stay in Python.

#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "ops.h"

namespace tidal_cpu {
namespace {

struct StackLinear {
  at::Tensor packed;
  int64_t n;
  std::optional<at::Tensor> bias;
  // int8/int4 weights, set by use_int_linears and checked once there (neither: packed is a bf16 layout)
  std::optional<A8Linear> a8;            // with int8 activations (linear_int_a8.cpp)
  std::optional<IntLinear> weight_only;  // on float or bf16 activations (linear_int.cpp)
  std::optional<LoraLinear> lora;        // the LoRA slots' A and B (use_lora), or none
};

struct StackLayer {
  at::Tensor input_norm, post_attention_norm;
  std::optional<at::Tensor> q_norm, k_norm;
  StackLinear qkv, o, gate_up, down;
};

// The model-level tensors, after the layers' (LlamaForCausalLM._build_decoder_stack).
enum ModelSlot { kEmbed, kFinalNorm, kInvFreq, kModelSlots };

// The per-layer tensors, as DecoderStack's constructor takes them (an absent bias or q/k norm is an
// empty tensor), in the order LlamaForCausalLM._build_decoder_stack lists them.
enum Slot {
  kInputNorm, kQkv, kQkvBias, kO, kOBias, kPostNorm, kGateUp, kGateUpBias, kDown, kDownBias, kQNorm, kKNorm,
  kSlotsPerLayer
};

std::optional<at::Tensor> present(const at::Tensor& t) {
  return t.numel() == 0 ? std::nullopt : std::optional<at::Tensor>(t);
}

// w on int8/int4 weights (packed [.., K], its scales and offsets or an empty tensor), checked once here: with int8
// activations (activation_bits 8) or on the float/bf16 rows (16).
void use_int_weights(StackLinear& w, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& offsets,
                     int64_t k, int64_t bits, int64_t group_size, int64_t activation_bits) {
  TORCH_CHECK(activation_bits == 8 || activation_bits == 16, "activation_bits must be 8 or 16");
  w.packed = packed;
  if (activation_bits == 8)
    w.a8 = a8_linear(packed, scales, present(offsets), w.n, k, bits, group_size, w.bias);
  else
    w.weight_only = int_linear(packed, scales, present(offsets), w.n, k, bits, group_size, w.bias);
}

// y [rows, w.n] = x [rows, k] @ w on float rows, for a w with int weights.
void run_int_linear(const float* x, int64_t rows, int64_t k, const StackLinear& w, float* y) {
  if (w.a8.has_value()) linear_int_a8_into(x, rows, *w.a8, y);
  else linear_int_into(x, rows, k, *w.weight_only, y);
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
    inv_freq_ = model[kInvFreq];
    TORCH_CHECK(avx2 ? linear_avx2_supported() : linear_bf16_supported(), "this CPU cannot run the stack's linears");
    num_heads_ = shape[0];
    num_kv_heads_ = shape[1];
    head_dim_ = shape[2];
    TORCH_CHECK(inv_freq_.dim() == 1 && inv_freq_.scalar_type() == at::kFloat && inv_freq_.is_contiguous() &&
                    2 * inv_freq_.size(0) == head_dim_,
                "inv_freq must be [head_dim / 2] float32");
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
        const int64_t* param = params.data() + i * 12 + j * 3;  // bits, group_size, activation_bits
        use_int_weights(*linears[j], t[0], t[1], t[2], input_features(i, j), param[0], param[1], param[2]);
      }
    }
  }

  // LoRA slots on every linear (tidal/gpu/model/lora.py's LoraSlots): per layer the A and packed B (pack_lora_b) of
  // qkv, o, gate_up and down in that order, the slots' ranks [slots] int32 (shared by all; written in place as adapters are placed)
  // and max_rank. The tensors are held, not copied: a slot written from Python is what the next forward reads.
  void use_lora(std::vector<at::Tensor> tensors, at::Tensor ranks, int64_t max_rank) {
    TORCH_CHECK(tensors.size() == layers_.size() * 8, "expected A and B of 4 linears per layer");
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    for (size_t i = 0; i < layers_.size(); ++i) {
      StackLayer& layer = layers_[i];
      const at::Tensor* t = tensors.data() + i * 8;
      layer.qkv.lora = lora_linear(t[0], t[1], ranks, {q_size, kv_size, kv_size}, max_rank);
      layer.o.lora = lora_linear(t[2], t[3], ranks, {layer.o.n}, max_rank);
      layer.gate_up.lora = lora_linear(t[4], t[5], ranks, {layer.gate_up.n / 2, layer.gate_up.n / 2}, max_rank);
      layer.down.lora = lora_linear(t[6], t[7], ranks, {layer.down.n}, max_rank);
      StackLinear* linears[] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
      for (int j = 0; j < 4; ++j)
        TORCH_CHECK(linears[j]->lora->k == input_features(i, j) && linears[j]->lora->a.scalar_type() == embed_.scalar_type(),
                    "layer ", i, "'s LoRA A of linear ", j, " must be [.., ", input_features(i, j),
                    "] of the activations' dtype");
    }
    lora_slots_ = layers_.empty() ? 0 : layers_[0].qkv.lora->num_slots;
  }

  // The LM head on int8/int4 weights, as LlamaForCausalLM.compute_logits runs it (linear_int on the hidden rows
  // widened to float32): params are (n, bits, group_size, activation_bits); offsets and bias may be empty tensors.
  // logits() then runs forward and the head in one call: at one row of the tiny model the head's op call from
  // Python, its checks and the float copy cost ~15 us of a ~230 us step.
  void use_int_lm_head(at::Tensor packed, at::Tensor scales, at::Tensor offsets, std::vector<int64_t> params,
                       at::Tensor bias) {
    TORCH_CHECK(params.size() == 4, "params must be [n, bits, group_size, activation_bits]");
    StackLinear head{packed, params[0], present(bias)};
    use_int_weights(head, packed, scales, offsets, embed_.size(1), params[1], params[2], params[3]);
    head_ = std::move(head);
  }

  // forward's rows through the LM head: float32 logits [T, vocab] of every row (use_int_lm_head first), the same
  // values as compute_logits(forward(...)).
  at::Tensor logits(at::Tensor input_ids, at::Tensor positions, at::Tensor slot_mapping, at::Tensor tables,
                    at::Tensor lens, std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                    at::Tensor lora_slots) {
    TORCH_CHECK(head_.has_value(), "the stack has no LM head");
    at::Tensor hidden = forward(input_ids, positions, slot_mapping, tables, lens, k_caches, v_caches, lora_slots);
    if (hidden.scalar_type() != at::kFloat) hidden = hidden.to(at::kFloat);
    at::Tensor out = at::empty({hidden.size(0), head_->n}, hidden.options());
    run_int_linear(hidden.data_ptr<float>(), hidden.size(0), hidden.size(1), *head_, out.data_ptr<float>());
    return out;
  }

  // The model's forward over the rows: embedding, every layer, final norm; returns the final-normed hidden
  // states [T, hidden], as LlamaForCausalLM.forward does. positions: the rows' positions [T] (their rotary
  // angles are rotary_angles', as RotaryEmbedding.cos_sin's); tables/lens: each row's block table and attended
  // length (TorchPagedAttention.kernel_rows); lora_slots: each row's LoRA slot [T] int32 (-1: the base model), or
  // an empty tensor when no row has an adapter.
  at::Tensor forward(at::Tensor input_ids, at::Tensor positions, at::Tensor slot_mapping, at::Tensor tables,
                     at::Tensor lens, std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                     at::Tensor lora_slots) {
    lora_rows_ = nullptr;
    if (lora_slots.numel() > 0) {
      TORCH_CHECK(lora_slots_ > 0, "the stack has no LoRA slots (use_lora)");
      TORCH_CHECK(lora_slots.dim() == 1 && lora_slots.size(0) == input_ids.size(0) &&
                      lora_slots.scalar_type() == at::kInt && lora_slots.is_contiguous(),
                  "lora_slots must be [T] int32");
      check_lora_slots(lora_slots.data_ptr<int32_t>(), lora_slots.size(0), lora_slots_);
      lora_rows_ = lora_slots.data_ptr<int32_t>();
    }
    if (embed_.scalar_type() == at::kFloat)
      return run<float>(input_ids, positions, slot_mapping, tables, lens, k_caches, v_caches);
    TORCH_CHECK(embed_.scalar_type() == at::kBFloat16, "the stack runs float32 or bfloat16 activations");
    return run<c10::BFloat16>(input_ids, positions, slot_mapping, tables, lens, k_caches, v_caches);
  }

 private:
  // Every argument is checked here, once: the layers then run the kernels on raw rows, without a tensor
  // or a dispatcher call per op (at one row those cost as much as the kernels).
  template <typename T>
  at::Tensor run(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& slot_mapping,
                 const at::Tensor& tables, const at::Tensor& lens,
                 const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches) {
    const at::ScalarType dtype = embed_.scalar_type();
    TORCH_CHECK(input_ids.dim() == 1 && input_ids.scalar_type() == at::kLong && input_ids.is_contiguous(),
                "input_ids must be [T] int64");
    const int64_t rows = input_ids.size(0), hidden = embed_.size(1), vocab = embed_.size(0);
    TORCH_CHECK(positions.dim() == 1 && positions.size(0) == rows && positions.scalar_type() == at::kLong &&
                    positions.is_contiguous(),
                "positions must be [T] int64");
    TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == rows && slot_mapping.scalar_type() == at::kLong &&
                    slot_mapping.is_contiguous(),
                "slot_mapping must be [T] int64");
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(), "expected ", layers_.size(),
                " k and v caches");
    const at::Tensor& first = k_caches[0];
    TORCH_CHECK(first.dim() == 4 && first.size(2) == num_kv_heads_ && first.size(3) == head_dim_,
                "caches must be [num_blocks, block_size, num_kv_heads, head_dim]");
    for (size_t i = 0; i < layers_.size(); ++i)
      TORCH_CHECK(k_caches[i].sizes() == first.sizes() && v_caches[i].sizes() == first.sizes() &&
                      k_caches[i].is_contiguous() && v_caches[i].is_contiguous() &&
                      k_caches[i].scalar_type() == dtype && v_caches[i].scalar_type() == dtype,
                  "layer ", i, "'s caches must be contiguous, of the first's shape and the activations' dtype");
    const int64_t block_size = first.size(1), num_slots = first.size(0) * block_size;
    const std::vector<int64_t> lengths = checked_lengths(tables, lens, rows, block_size, first.size(0));
    const int64_t* ids = input_ids.data_ptr<int64_t>();
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    for (int64_t t = 0; t < rows; ++t)  // all checked before any write: a bad row leaves the cache as it was
      TORCH_CHECK(ids[t] >= 0 && ids[t] < vocab, "row ", t, " has token id ", ids[t], " outside the vocabulary");
    check_slots(slots, rows, num_slots);

    T* residual = buffer<T>(residual_, rows * hidden);
    const T* embed = embed_.data_ptr<T>();
    for (int64_t t = 0; t < rows; ++t) std::memcpy(residual + t * hidden, embed + ids[t] * hidden, hidden * sizeof(T));
    T* zeros = buffer<T>(zeros_, rows * hidden);  // the first layer's "+ out" adds nothing
    std::memset(static_cast<void*>(zeros), 0, rows * hidden * sizeof(T));
    T* cos = buffer<T>(cos_, rows * head_dim_);
    T* sin = buffer<T>(sin_, rows * head_dim_);
    rotary_angles_rows<T>(positions.data_ptr<int64_t>(), rows, inv_freq_.data_ptr<float>(), head_dim_ / 2, cos, sin);
    const T* out = layers<T>(residual, zeros, rows, cos, sin, head_dim_, slots,
                             tables.data_ptr<int32_t>(), tables.stride(0), lengths, block_size, k_caches, v_caches);
    at::Tensor normed = at::empty({rows, hidden}, embed_.options());
    add_rms_norm_rows<T>(residual, out, final_norm_.data_ptr<T>(), rows, hidden, static_cast<float>(eps_),
                         normed.data_ptr<T>());
    return normed;
  }

  // Every layer over the rows, as the Python layers run them: residual [T, hidden] is updated in place; out is
  // the last sublayer's output (zeros for the first layer), and the new one is returned.
  template <typename T>
  const T* layers(T* residual, const T* out, int64_t rows, const T* cos, const T* sin, int64_t cs_stride,
                  const int64_t* slots, const int32_t* tables, int64_t table_stride, const std::vector<int64_t>& lengths,
                  int64_t block_size, const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches) {
    const int64_t hidden = embed_.size(1), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    const float eps = static_cast<float>(eps_);
    T* normed = buffer<T>(normed_, rows * hidden);
    T* attended = buffer<T>(attended_, rows * q_size);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& layer = layers_[i];
      // attention: norm(residual + out), qkv, (q/k norms), rotary, cache write, paged attention, o_proj
      add_rms_norm_rows<T>(residual, out, layer.input_norm.data_ptr<T>(), rows, hidden, eps, normed);
      T* q = linear<T>(normed, rows, hidden, layer.qkv, qkv_);
      T* k = q + q_size;
      const T* v = k + kv_size;
      const int64_t qkv_n = layer.qkv.n;
      if (layer.q_norm.has_value()) {
        rms_norm_heads_<T>(q, rows, num_heads_, head_dim_, qkv_n, layer.q_norm->data_ptr<T>(), eps);
        rms_norm_heads_<T>(k, rows, num_kv_heads_, head_dim_, qkv_n, layer.k_norm->data_ptr<T>(), eps);
      }
      rotary_rows_<T>(q, rows, num_heads_, head_dim_, qkv_n, cos, sin, cs_stride);
      rotary_rows_<T>(k, rows, num_kv_heads_, head_dim_, qkv_n, cos, sin, cs_stride);
      T* k_cache = k_caches[i].data_ptr<T>();
      T* v_cache = v_caches[i].data_ptr<T>();
      write_kv_rows(reinterpret_cast<const char*>(k), qkv_n * sizeof(T), reinterpret_cast<const char*>(v),
                    qkv_n * sizeof(T), rows, kv_size * sizeof(T), slots, reinterpret_cast<char*>(k_cache),
                    reinterpret_cast<char*>(v_cache));
      paged_decode_rows<T>(q, qkv_n, head_dim_, num_heads_, k_cache, v_cache, block_size, num_kv_heads_, head_dim_,
                           tables, table_stride, lengths, static_cast<float>(scale_), attended);
      out = linear<T>(attended, rows, q_size, layer.o, o_);
      // MLP: norm(residual + out), gate_up, SiLU-and-mul, down
      add_rms_norm_rows<T>(residual, out, layer.post_attention_norm.data_ptr<T>(), rows, hidden, eps, normed);
      const T* gate_up = linear<T>(normed, rows, hidden, layer.gate_up, gate_up_);
      const int64_t intermediate = layer.gate_up.n / 2;
      T* activated = buffer<T>(activated_, rows * intermediate);
      silu_and_mul_rows<T>(gate_up, rows, intermediate, layer.gate_up.n, activated);
      out = linear<T>(activated, rows, intermediate, layer.down, down_);
    }
    return out;
  }

  // Where a linear kind writes: one buffer reused by every layer and forward (the int kernels write into it), or
  // the op's new tensor, held until that kind's next call.
  struct LinearOut {
    at::Tensor buffer, result;
  };

  // x [rows, k] @ w, plus each row's LoRA product when the forward has adapter rows: the output's rows, contiguous.
  template <typename T>
  T* linear(T* x, int64_t rows, int64_t k, const StackLinear& w, LinearOut& out) {
    T* y = base_linear(x, rows, k, w, out);
    if (lora_rows_ != nullptr) lora_add_rows<T>(x, rows, lora_rows_, *w.lora, y);
    return y;
  }

  template <typename T>
  T* base_linear(T* x, int64_t rows, int64_t k, const StackLinear& w, LinearOut& out) {
    if (w.a8.has_value() || w.weight_only.has_value()) {
      T* y = buffer<T>(out.buffer, rows * w.n);
      if constexpr (std::is_same_v<T, float>) {
        run_int_linear(x, rows, k, w, y);
      } else if (w.a8.has_value()) {
        // bf16 activations (an AVX512-BF16 host's default): the int8-activation kernel reads the bf16 rows and
        // rounds its float32 sums to bf16 as linear_int's tensor path does, with no float copies between (at a
        // 128-token prefill of SmolLM2-135M's Q4_1 file the copies took ~9 of ~66 ms; a decode step 0.2 of 3.0)
        linear_int_a8_into(x, rows, *w.a8, y);
      } else {
        // the weight-only kernel's float32 sums, rounded here, without its tensors and conversion ops (at one
        // row of the tiny model, ~50 of ~190 us)
        float* y32 = buffer<float>(y32_, rows * w.n);
        linear_int_bf16_into(x, rows, k, *w.weight_only, y32);
        for (int64_t i = 0; i < rows * w.n; ++i) y[i] = static_cast<T>(y32[i]);
      }
      return y;
    }
    out.result = linear(at::from_blob(x, {rows, k}, embed_.options()), w);
    return out.result.template data_ptr<T>();
  }

  // At least `numel` elements of type U in `b`, kept for the next forward (the stack runs one forward at a
  // time: the engine's step loop). It grows to the largest batch's rows; prefill chunks bound it.
  template <typename U>
  U* buffer(at::Tensor& b, int64_t numel) {
    if (!b.defined() || b.numel() < numel)
      b = at::empty({numel}, embed_.options().dtype(c10::CppTypeToScalarType<U>::value));
    return b.template data_ptr<U>();
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

  at::Tensor linear(const at::Tensor& x, const StackLinear& w) const {
    return avx2_ ? linear_avx2(x, w.packed, w.n, w.bias) : linear_bf16(x, w.packed, w.n, w.bias);
  }

  std::vector<StackLayer> layers_;
  at::Tensor embed_, final_norm_, inv_freq_;
  at::Tensor residual_, zeros_, cos_, sin_, normed_, attended_, activated_;  // buffer(): reused by every forward
  at::Tensor y32_;  // a bf16 stack's weight-only int linears' float output
  LinearOut qkv_, o_, gate_up_, down_;
  std::optional<StackLinear> head_;  // the LM head on int weights (use_int_lm_head), or none
  int64_t lora_slots_ = 0;               // slots of every linear's LoRA weights (use_lora), 0: none
  const int32_t* lora_rows_ = nullptr;   // this forward's rows' LoRA slots, or null: no adapter rows
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
      .def("use_int_lm_head", &tidal_cpu::DecoderStack::use_int_lm_head)
      .def("use_lora", &tidal_cpu::DecoderStack::use_lora)
      .def("forward", &tidal_cpu::DecoderStack::forward)
      .def("logits", &tidal_cpu::DecoderStack::logits);
}
