"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over tidal's paged KV cache.

One module covers the four architectures; they differ only in switches of ``ModelConfig``:
q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3), o_proj/MLP bias (Llama options) and tied
embeddings. q/k/v and gate/up are stored fused so each is one matmul (fewer, larger GEMMs
are markedly faster on CPU); ``load_weights`` splits Hugging Face's separate tensors into them.

With ``tp`` (a ``parallel.TensorParallel`` of more than one rank) the model is this rank's shard:
the layers of ``tidal/gpu/parallel/layers.py`` replace the plain ones, ``load_weights`` takes each tensor's slice,
and ``compute_logits`` returns the full logits on rank 0 only. Without it nothing changes.

The caller runs ``forward``/``compute_logits`` under ``torch.inference_mode()``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tidal.gpu.forward_batch import ForwardBatch
from tidal.gpu.model.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, place_kernel_weights
from tidal.gpu.model.config import ModelConfig
from tidal.gpu.model.lora import add_lora
from tidal.gpu.model.quantization import PackedInt, QuantizedWeight, Scheme
from tidal.gpu.parallel.layers import ParallelGatedMLP, VocabParallelLMHead, VocabShard, attention_projections, head_shard, vocab_parallel_embedding


class LlamaAttention(nn.Module):
    """Self-attention of one layer: fused qkv projection, rotary, paged attention, o_proj."""

    def __init__(self, config: ModelConfig, attention, rotary: RotaryEmbedding, dtype: torch.dtype, device,
                 tp=None) -> None:
        super().__init__()
        self.rotary = rotary
        heads = head_shard(config, tp.rank, tp.size) if tp is not None else None
        self.num_heads = config.num_heads if heads is None else heads.num_heads
        self.num_kv_heads = config.num_kv_heads if heads is None else heads.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.attention = attention
        if heads is None:
            self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.attention_bias, dtype,
                                   device)
            self.o_proj = Linear(self.q_size, config.hidden_size, config.attention_output_bias, dtype, device)
        else:
            self.qkv_proj, self.o_proj = attention_projections(config, heads, dtype, device, tp)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if batch.lora is not None:
            qkv = add_lora(qkv, hidden, self.qkv_proj, batch.lora)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.rotary.rotate(q, k, cos, sin)
        k_cache, v_cache = kv_cache
        out = self.attention.forward(q, k, v, k_cache, v_cache, batch, self.scale).reshape(num_tokens, self.q_size)
        if batch.lora is not None:
            return add_lora(self.o_proj(out), out, self.o_proj, batch.lora)
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)).

    The residual stream is carried separately and each "+" is fused into the next norm: a layer
    takes (the previous sublayer's output, the residual before it) and returns the same pair.
    """

    def __init__(self, config: ModelConfig, attention, rotary: RotaryEmbedding, dtype: torch.dtype, device,
                 tp=None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(config, attention, rotary, dtype, device, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        if tp is None:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, dtype, device)
        else:
            self.mlp = ParallelGatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, dtype, device,
                                        tp)

    def forward(self, out, residual, cos, sin, kv_cache, batch):
        normed = self.input_layernorm.add_norm(residual, out)
        out = self.self_attn(normed, cos, sin, kv_cache, batch)
        return self.mlp(self.post_attention_layernorm.add_norm(residual, out), batch.lora), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm (named like Hugging Face's ``model.*``)."""

    def __init__(self, config: ModelConfig, attention, rotary: RotaryEmbedding, dtype: torch.dtype, device,
                 tp=None, vocab: VocabShard | None = None) -> None:
        super().__init__()
        rows = config.vocab_size if vocab is None else vocab.size
        self.embed_tokens = nn.Parameter(
            torch.empty(rows, config.hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attention, rotary, dtype, device, tp) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


# Hugging Face tensors that tidal stores as a slice of a fused tensor: name -> (fused name, slice index)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_FUSED_NAME = re.compile(
    r"^(model\.layers\.\d+\.(?:self_attn|mlp)\.)(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$"
)


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM whose attention reads and writes tidal's paged KV cache."""

    def __init__(
        self,
        config: ModelConfig,
        attention,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tp=None,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.tp = tp
        self.vocab = VocabShard.of(config.vocab_size, tp.rank, tp.size) if tp is not None else None
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, dtype, device)
        self.model = LlamaModel(config, attention, self.rotary, dtype, device, tp, self.vocab)
        if not config.tie_word_embeddings:
            self.lm_head = (Linear(config.hidden_size, config.vocab_size, False, dtype, device) if tp is None
                            else VocabParallelLMHead(config.hidden_size, self.vocab, dtype, device))
        self._packed_lm_head: Linear | None = None
        self._decoder_stack = None  # the layers as one C++ call, once packed where it can run (_build_decoder_stack)
        self._stack_max_rows: int | None = None  # rows up to which its linears run (None: any)
        # what each decode asks of the stack, looked up once (at one row, module attribute lookups cost ~10 us a step):
        # the attention backend that plans its rows, the activations' dtype, and (kv_caches, its k and v lists)
        self._stack_attention = None
        self._stack_dtype: torch.dtype | None = None
        self._stack_caches: tuple = (None, [], [])
        self._stack_has_head = False  # the stack also runs the LM head (an int8/int4 one): decode_logits
        self._stack_lora = False  # the stack adds LoRA products (use_lora): adapter rows stay on it
        self._no_lora_rows = torch.empty(0, dtype=torch.int32)  # the stack's lora_slots when no row has an adapter
        attn = self.model.layers[0].self_attn
        self._fused_sizes = {  # this rank's sizes of the parts of the fused tensors
            "qkv_proj": (attn.q_size, attn.kv_size, attn.kv_size),
            "gate_up_proj": (self.model.layers[0].mlp.intermediate_size,) * 2,
        }
        # parameter name -> this rank's slice of its checkpoint tensor(s) (tensor-parallel only)
        self._shards = {} if tp is None else self._shard_rules()

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens
        return self.lm_head.weight

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Run every layer over the batch's rows; returns final-normed hidden states [T, hidden].

        ``kv_caches[i]`` is layer i's ``(k_cache, v_cache)``, each
        ``[num_blocks, block_size, num_kv_heads, head_dim]``; the batch's new K/V are written into them.
        """
        stack_arguments = self._stack_arguments(batch, kv_caches)
        if stack_arguments is not None:  # the same ops, in one call (csrc/decoder_stack.cpp)
            return self._decoder_stack.forward(*stack_arguments)
        if self.tp is None:
            residual = F.embedding(batch.input_ids, self.model.embed_tokens)
        else:
            residual = vocab_parallel_embedding(batch.input_ids, self.model.embed_tokens, self.vocab, self.tp)
        cos, sin = self.rotary.cos_sin(batch.positions, residual.dtype)
        out = torch.zeros_like(residual)  # the first layer's "+ out" adds nothing
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            out, residual = layer(out, residual, cos, sin, kv_cache, batch)
        return self.model.norm.add_norm(residual, out)

    def decode_logits(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """``compute_logits(forward(batch, kv_caches))`` for a batch whose every row samples (all decodes), in the
        decoder stack's one call when it carries the LM head (an int8/int4 head on a CPU); else None: the caller
        runs the two."""
        stack_arguments = self._stack_arguments(batch, kv_caches) if self._stack_has_head else None
        return None if stack_arguments is None else self._decoder_stack.logits(*stack_arguments)

    def _stack_arguments(self, batch: ForwardBatch, kv_caches) -> tuple | None:
        """The one-call decoder stack's arguments for this batch, or None when it does not run it: there is a
        stack, its linears take this many rows, and every row attends on the C++ kernel."""
        lora = batch.lora
        if self._decoder_stack is None or (lora is not None and not (self._stack_lora and lora.kernel == "cpu")) or (
                self._stack_max_rows is not None and batch.input_ids.shape[0] > self._stack_max_rows):
            return None
        rows = self._stack_attention.kernel_rows(batch, self._stack_dtype, kv_caches[0][0])
        if rows is None:
            return None
        if self._stack_caches[0] is not kv_caches:
            self._stack_caches = (kv_caches, [k for k, _ in kv_caches], [v for _, v in kv_caches])
        return (batch.input_ids, batch.positions, batch.slot_mapping, *rows, *self._stack_caches[1:],
                self._no_lora_rows if lora is None else lora.slots)

    def use_lora(self, ranks: torch.Tensor, max_rank: int) -> None:
        """Let the decoder stack run rows through LoRA adapters: every decoder Linear's ``lora`` (lora.LoraSlots,
        which calls this once its weights exist: A and the packed B) is handed to it, held, not copied."""
        if self._decoder_stack is None:
            return
        tensors = []
        for layer in self.model.layers:
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                tensors += [linear.lora.a, linear.lora.b_packed]
        self._decoder_stack.use_lora(tensors, ranks, max_rank)
        self._stack_lora = True

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] of the rows of ``forward``'s output that sample (tensor-parallel:
        on rank 0; the other ranks return None after sending their vocabulary slice)."""
        head = self._packed_lm_head
        if head is not None and isinstance(head.int_packed, PackedInt):
            # the int kernel sums in float32 whatever x's dtype: its float result as it is, not rounded to
            # bf16 and widened again (two ops, and a bf16 model's logits keep their float precision)
            logits = head.int_packed.linear(hidden_rows.float(), head.bias)
        elif head is not None:
            logits = head(hidden_rows).float()
        else:
            logits = F.linear(hidden_rows, self.lm_head_weight).float()
        if self.tp is None:
            return logits
        return self.tp.gather_vocab(logits, self.config.vocab_size)

    def pack_weights(self, weight_dtype: torch.dtype | None = None, lm_head_scheme: Scheme | None = None,
                     tied_head: QuantizedWeight | None = None) -> None:
        """Pack every matmul weight once, after loading (``Linear.pack``: the AVX512-BF16 kernel's layout
        where the CPU has it, else oneDNN's; a float32 model with ``weight_dtype=torch.bfloat16``: the
        AVX2 kernel's bf16 layout). ``lm_head_scheme``: the scheme the LM head is rounded to
        (w8a8/w4a8), or None to keep it dense. ``tied_head``: the tied embedding's own integers (a GGUF's
        Q8_0 table), which the head multiplies on the int kernel instead of a dense copy."""
        if lm_head_scheme is not None and not self.config.tie_word_embeddings:
            self.lm_head.quantized = self.lm_head.quantize(lm_head_scheme)
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(weight_dtype)
        if self.config.tie_word_embeddings and self.model.embed_tokens.device.type != "cpu":
            self._packed_lm_head = None  # a GPU multiplies the plain table: no copy
        elif self.config.tie_word_embeddings:
            # the embedding lookup still needs the plain table: the head gets its own packed copy
            self._packed_lm_head = Linear.packed_from(self.model.embed_tokens, weight_dtype, lm_head_scheme,
                                                      tied_head)
        else:
            self._packed_lm_head = self.lm_head
        place_kernel_weights([m for m in self.modules() if isinstance(m, Linear)])
        self._decoder_stack = self._build_decoder_stack()

    def _build_decoder_stack(self):
        """``torch.classes.tidal_cpu.DecoderStack`` over the packed layers (csrc/decoder_stack.cpp), or None.

        It runs the same C++ ops as the layers' Python, in the same order, in one call: at decode that
        Python cost ~0.7 ms of CPU per step of a 12-layer model whose step takes ~6.5 ms. It needs every op on its C++ kernel
        (a CPU model with every linear packed for linear_bf16, linear_avx2 or linear_int, the fused norm, rotary and
        SiLU-and-mul, the paged attention kernel) and no tensor parallelism; ``TIDAL_CPU_STACK=0`` turns
        it off (benchmarks compare the two).
        """
        if self.tp is not None or os.environ.get("TIDAL_CPU_STACK", "1") == "0":
            return None
        layers = self.model.layers
        first = layers[0]
        linears = [m for layer in layers for m in layer.modules() if isinstance(m, Linear)]
        avx2 = all(linear.avx2_packed is not None for linear in linears)
        ints = all(isinstance(linear.int_packed, PackedInt) for linear in linears)  # int8/int4 (csrc/linear_int.cpp)
        if not (avx2 or ints or all(linear.gemv_packed is not None for linear in linears)):
            return None
        norms = [m for layer in layers for m in layer.modules() if isinstance(m, RMSNorm)]
        if (any(norm._ops is None for norm in norms) or first.mlp._ops is None or self.rotary._ops is None
                or not hasattr(first.self_attn.attention, "kernel_rows")):
            return None
        empty = torch.empty(0)
        tensors = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            for part in (layer.input_layernorm.weight, attn.qkv_proj, attn.o_proj, layer.post_attention_layernorm.weight,
                         mlp.gate_up_proj, mlp.down_proj):
                if isinstance(part, Linear):
                    packed = part.int_packed.packed if ints else part.avx2_packed if avx2 else part.gemv_packed
                    tensors += [packed, empty if part.bias is None else part.bias]
                else:
                    tensors.append(part)
            tensors += [empty, empty] if attn.q_norm is None else [attn.q_norm.weight, attn.k_norm.weight]
        tensors += [self.model.embed_tokens, self.model.norm.weight, self.rotary.inv_freq(torch.device("cpu"))]
        attn = first.self_attn
        shape = [attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.qkv_proj.out_features,
                 attn.o_proj.out_features, first.mlp.gate_up_proj.out_features, first.mlp.down_proj.out_features]
        self._stack_max_rows = None if avx2 or ints else attn.qkv_proj._gemv_rows
        self._stack_attention, self._stack_dtype = attn.attention, self.model.embed_tokens.dtype
        stack = torch.classes.tidal_cpu.DecoderStack(tensors, shape, avx2 or ints, first.input_layernorm.eps, attn.scale)
        if ints:
            int_tensors, params = [], []
            for layer in layers:
                for part in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                             layer.mlp.down_proj):
                    weight = part.int_packed
                    int_tensors += [weight.packed, weight.scales, empty if weight.offsets is None else weight.offsets]
                    params += [weight.bits, weight.group_size, weight.activation_bits]
            stack.use_int_linears(int_tensors, params)
        head = self._packed_lm_head
        self._stack_has_head = head is not None and isinstance(head.int_packed, PackedInt)
        if self._stack_has_head:
            weight = head.int_packed
            stack.use_int_lm_head(weight.packed, weight.scales, empty if weight.offsets is None else weight.offsets,
                                  [weight.n, weight.bits, weight.group_size, weight.activation_bits],
                                  empty if head.bias is None else head.bias)
        return stack

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the parameters (casting to the model dtype).

        Raises ``ValueError`` for an unknown name, a shape mismatch, or (after the last tensor)
        any parameter that was not fully loaded.
        """
        params = dict(self.named_parameters())
        loaded: set[tuple[str, int | None]] = set()
        for name, tensor in named_tensors:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # derived from the config, not a weight
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some checkpoints store the tied copy too
            target, part = _target(name)
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {self.config.architecture}")
            destination = param if part is None else self._fused_slice(param, target, part)
            shard = self._shards.get(target)
            if shard is not None:
                tensor = shard(tensor, part)
            elif not isinstance(tensor, torch.Tensor):
                tensor = tensor[:]  # a lazy safetensors slice of a replicated tensor: all of it
            if tuple(destination.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(destination.shape)}"
                )
            with torch.no_grad():
                destination.copy_(tensor)
            loaded.add((target, part))
        missing = sorted(f"{n}[{p}]" if p is not None else n for n, p in self._expected_parts() - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {', '.join(missing[:5])}")

    def _fused_slice(self, param: torch.Tensor, target: str, part: int) -> torch.Tensor:
        fused = "qkv_proj" if ".qkv_proj." in target else "gate_up_proj"
        return param.split(self._fused_sizes[fused], dim=0)[part]

    def _shard_rules(self) -> dict:
        rules = {"model.embed_tokens": lambda tensor, part: self.vocab.shard("weight", tensor)}
        for name, module in self.named_modules():
            shard = getattr(module, "shard", None)
            if shard is None or not isinstance(module, Linear):
                continue
            for kind in ("weight", "bias"):
                if getattr(module, kind) is not None:
                    rules[f"{name}.{kind}"] = lambda tensor, part, shard=shard, kind=kind: shard(kind, tensor, part)
        return rules

    def _expected_parts(self) -> set[tuple[str, int | None]]:
        expected: set[tuple[str, int | None]] = set()
        for name, _ in self.named_parameters():
            if ".qkv_proj." in name:
                expected.update((name, i) for i in range(3))
            elif ".gate_up_proj." in name:
                expected.update((name, i) for i in range(2))
            else:
                expected.add((name, None))
        return expected


def _target(hf_name: str) -> tuple[str, int | None]:
    """Map a Hugging Face parameter name to (tidal parameter name, slice of a fused tensor or None)."""
    match = _FUSED_NAME.match(hf_name)
    if match:
        prefix, proj, kind = match.groups()
        fused, part = _FUSED[proj]
        return f"{prefix}{fused}.{kind}", part
    if hf_name == "model.embed_tokens.weight":
        return "model.embed_tokens", None
    return hf_name, None
