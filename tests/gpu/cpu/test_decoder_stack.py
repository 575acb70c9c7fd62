"""The one-call decoder stack (csrc/decoder_stack.cpp) computes what the Python layers compute, bit for bit.

A model with the stack and the same model loaded with ``TIDAL_CPU_STACK=0`` run the same steps (a prefill,
a prefill beside a decode, then decodes) on their own caches: every step's logits and, at the end, every
cache block must be equal, and the decode steps must not run the Python layers at all. Covered for each
architecture switch the stack reads (q/k/v bias and tied embeddings: qwen2; q/k norms: qwen3) and for both
linears it drives (bf16 on AVX512-BF16; float32 on bf16-stored weights, the AVX2 path; float32 on int8 and
int4 weights, with float or int8 activations; bf16 on int8 and int4 weights, with bf16 or int8 activations). On
int8/int4 weights the stack's decode steps also run the LM head in the same call (``decode_logits``).
"""

from __future__ import annotations

import pytest
import torch

from paged_batch import PagedCache, Sequence, build_batch
from tidal.gpu.model.attention import TorchPagedAttention
from tidal.gpu.model.layers import avx2_linear_ops, gemv_ops
from tidal.gpu.model.loader import load_model
from tidal.gpu.model.llama import LlamaDecoderLayer
from tidal.gpu.model.lora import PROJECTIONS, LoraAdapter, LoraSlots, projection_shape
from tidal.gpu.model.quantization import ON_THE_FLY, int_linear_ops

CPU = torch.device("cpu")
# head_dim 32: the bf16 attention kernel's own path, which takes prefill rows too (so mixed steps use the stack)
SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=192)

LINEARS = {
    "bf16": (torch.bfloat16, None, gemv_ops(torch.bfloat16, CPU) is not None),
    "avx2": (torch.float32, torch.bfloat16, avx2_linear_ops(CPU) is not None),
    # --quantization: float32 activations on int8/int4 weights (csrc/linear_int.cpp)
    "int8": (torch.float32, None, int_linear_ops(CPU) is not None),
    "int4": (torch.float32, None, int_linear_ops(CPU) is not None),
    # and with int8 activations (csrc/linear_int_a8.cpp)
    "w8a8": (torch.float32, None, int_linear_ops(CPU) is not None),
    "w4a8": (torch.float32, None, int_linear_ops(CPU) is not None),
    # bf16 activations on int8-activation weights: what --quantization w8a8/w4a8 runs on an AVX512-BF16 host
    "w8a8-bf16": (torch.bfloat16, None, int_linear_ops(CPU) is not None and gemv_ops(torch.bfloat16, CPU) is not None),
    "w4a8-bf16": (torch.bfloat16, None, int_linear_ops(CPU) is not None and gemv_ops(torch.bfloat16, CPU) is not None),
    # and on weight-only int8/int4: what --quantization int8/int4 runs there (int4 on bf16 dot products)
    "int8-bf16": (torch.bfloat16, None, int_linear_ops(CPU) is not None and gemv_ops(torch.bfloat16, CPU) is not None),
    "int4-bf16": (torch.bfloat16, None, int_linear_ops(CPU) is not None and gemv_ops(torch.bfloat16, CPU) is not None),
}


def load(model_dir: str, linears: str, monkeypatch, stack: bool):
    dtype, linear_weights, _ = LINEARS[linears]
    with monkeypatch.context() as env:
        env.setenv("TIDAL_CPU_STACK", "1" if stack else "0")
        model, config = load_model(model_dir, dtype, CPU, TorchPagedAttention(CPU), linear_weights=linear_weights,
                                   quantize=scheme if (scheme := linears.removesuffix("-bf16")) in ON_THE_FLY else None)
    return model, config, dtype


def python_layer_calls(monkeypatch) -> list[int]:
    """A counter of LlamaDecoderLayer.forward calls (the Python layers)."""
    calls = [0]
    forward = LlamaDecoderLayer.forward

    def counted(self, *args):
        calls[0] += 1
        return forward(self, *args)

    monkeypatch.setattr(LlamaDecoderLayer, "forward", counted)
    return calls


@pytest.mark.parametrize("linears", list(LINEARS))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_stack_matches_the_python_layers_bit_for_bit(hf_model_dir, monkeypatch, arch, linears):
    if not LINEARS[linears][2]:
        pytest.skip(f"the {linears} linear cannot run on this CPU")
    model_dir = hf_model_dir(arch, seed=3, **SHAPE)
    with_stack, config, dtype = load(model_dir, linears, monkeypatch, stack=True)
    without, _, _ = load(model_dir, linears, monkeypatch, stack=False)
    assert with_stack._decoder_stack is not None and without._decoder_stack is None
    calls = python_layer_calls(monkeypatch)

    caches = [PagedCache(config), PagedCache(config)]
    for cache in caches:
        cache.kv_caches = [(k.to(dtype), v.to(dtype)) for k, v in cache.kv_caches]
    first = [[Sequence(tokens=[0, 1013, 318, 2047, 57, 4000, 911])] for _ in caches]
    second = [[Sequence(tokens=[0, 77, 8000, 12, 333])] for _ in caches]

    def step(model, cache, decodes, prefills):
        batch = build_batch(cache, decodes, prefills)
        with torch.inference_mode():
            if model is with_stack and not prefills:  # every row samples: the runner asks for decode_logits first
                logits = model.decode_logits(batch, cache.kv_caches)
                # an int8/int4 head runs in the stack's own call; a dense one stays with compute_logits
                assert (logits is None) == (linears in ("bf16", "avx2"))
                if logits is not None:
                    return logits
            return model.compute_logits(model(batch, cache.kv_caches))

    def both(make_step, decode_only: bool) -> None:
        logits, layer_calls = [], []
        for i, (model, cache) in enumerate([(with_stack, caches[0]), (without, caches[1])]):
            before = calls[0]
            logits.append(step(model, cache, *make_step(i)))
            layer_calls.append(calls[0] - before)
        assert layer_calls[1] == config.num_layers  # the model without the stack runs its Python layers
        if decode_only:
            assert layer_calls[0] == 0  # the one with it runs none of them at decode
        assert torch.equal(logits[0], logits[1])

    both(lambda i: ([], [(first[i][0], 7)]), decode_only=False)
    for i in range(2):
        first[i][0].tokens.append(42)
    both(lambda i: ([first[i][0]], [(second[i][0], 5)]), decode_only=False)
    for token in (5, 600, 7000, 31):
        for i in range(2):
            first[i][0].tokens.append(token)
            second[i][0].tokens.append(token + 1)
        both(lambda i: ([first[i][0], second[i][0]], []), decode_only=True)

    for (k0, v0), (k1, v1) in zip(caches[0].kv_caches, caches[1].kv_caches, strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_stack_is_off_where_a_linear_has_no_kernel(hf_model_dir, monkeypatch):
    """float32 weights (an explicit --dtype float32) run MKL's linears: the Python layers, no stack."""
    model, _ = load_model(hf_model_dir("llama", seed=3, **SHAPE), torch.float32, CPU, TorchPagedAttention(CPU))
    assert model._decoder_stack is None


def test_batches_above_the_stacks_row_limit_run_the_python_layers(hf_model_dir, monkeypatch):
    """On an AMX CPU the linears hand calls of more than AMX_GEMV_MAX_ROWS rows to oneDNN, which the stack
    does not drive: such batches must take the Python layers. Simulated here with a limit of one row."""
    if not LINEARS["bf16"][2]:
        pytest.skip("the bf16 linear cannot run on this CPU")
    model, config, dtype = load(hf_model_dir("llama", seed=3, **SHAPE), "bf16", monkeypatch, stack=True)
    model._stack_max_rows = 1
    calls = python_layer_calls(monkeypatch)
    cache = PagedCache(config)
    cache.kv_caches = [(k.to(dtype), v.to(dtype)) for k, v in cache.kv_caches]
    seqs = [Sequence(tokens=[0, 1013, 318]), Sequence(tokens=[0, 77, 8000])]

    def layer_calls(decodes, prefills) -> int:
        before = calls[0]
        with torch.inference_mode():
            model(build_batch(cache, decodes, prefills), cache.kv_caches)
        return calls[0] - before

    layer_calls([], [(seqs[0], 3), (seqs[1], 3)])
    for seq in seqs:
        seq.tokens.append(5)
    assert layer_calls(seqs, []) == config.num_layers  # two rows: above the limit
    seqs[0].tokens.append(6)
    assert layer_calls(seqs[:1], []) == 0  # one row: the stack


def random_adapter(config, rank: int, seed: int) -> LoraAdapter:
    """An adapter on every projection of every layer, random A and B (float32, as read_adapter gives them)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(config.num_layers):
        for projection in PROJECTIONS:
            in_features, out_features = projection_shape(config, projection)
            weights[(layer, projection)] = (0.1 * torch.randn(rank, in_features, generator=generator),
                                            0.1 * torch.randn(out_features, rank, generator=generator))
    return LoraAdapter(f"a{seed}", rank, weights)


@pytest.mark.parametrize("linears", ["bf16", "avx2", "int8", "w4a8", "int4-bf16"])
def test_adapter_rows_stay_on_the_stack_and_match_the_python_layers(hf_model_dir, monkeypatch, linears):
    """Rows through two adapters (one of a rank below the bound) beside base-model rows: the stack adds each row's
    own LoRA product (csrc/lora.cpp) where the Python layers' add_lora does, so its decode steps run none of the
    Python layers and every step's logits are bit for bit theirs; and the adapters change what their rows say."""
    if not LINEARS[linears][2]:
        pytest.skip(f"the {linears} linear cannot run on this CPU")
    model_dir = hf_model_dir("qwen2", seed=3, **SHAPE)
    models = []
    for stack in (True, False):
        model, config, dtype = load(model_dir, linears, monkeypatch, stack=stack)
        slots = LoraSlots(model, num_slots=3, max_rank=8)
        slots.place({1: random_adapter(config, 8, seed=1), 2: random_adapter(config, 4, seed=2)})
        cache = PagedCache(config)
        cache.kv_caches = [(k.to(dtype), v.to(dtype)) for k, v in cache.kv_caches]
        models.append((model, slots, cache))
    assert models[0][0]._stack_lora and models[1][0]._decoder_stack is None
    calls = python_layer_calls(monkeypatch)
    prompt = [0, 1013, 318, 2047, 57]
    # the same prompt through adapter 1, the base model and adapter 2, in that row order
    seqs = [[Sequence(tokens=list(prompt)) for _ in range(3)] for _ in models]
    adapters = [1, None, 2]

    def step(i: int, decode: bool) -> tuple[torch.Tensor, int]:
        model, slots, cache = models[i]
        entries = [(seq, 1 if decode else len(prompt)) for seq in seqs[i]]
        batch = build_batch(cache, seqs[i] if decode else [], [] if decode else entries)
        batch.lora = slots.rows([(slots.slot_of.get(adapter), n) for adapter, (_, n) in zip(adapters, entries)],
                                batch.input_ids.shape[0])
        before = calls[0]
        with torch.inference_mode():
            logits = model.compute_logits(model(batch, cache.kv_caches))
        return logits, calls[0] - before

    for decode in (False, True, True, True):
        (with_stack, stack_calls), (without, _) = step(0, decode), step(1, decode)
        assert torch.equal(with_stack, without)
        if decode:
            assert stack_calls == 0
        last = with_stack.view(3, -1, with_stack.shape[-1])[:, -1] if not decode else with_stack
        assert not torch.equal(last[0], last[1]) and not torch.equal(last[2], last[1])
        for i in range(2):
            for seq, token in zip(seqs[i], (5, 600, 7000), strict=True):
                seq.tokens.append(token)
