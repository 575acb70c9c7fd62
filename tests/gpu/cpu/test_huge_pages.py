"""What a CPU decode step streams (the packed weights, the KV cache) lies in 2 MiB pages.

The kernels stream the weights ~13-16% faster from huge pages (tidal/gpu/cpu/huge_pages.py,
docs/performance-history.md): these tests hold the placement itself, that it changes no value, that the
KV cache is resident from the start, and that ``TIDAL_CPU_HUGE_PAGES=0`` keeps torch's own allocation.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tidal.gpu.cpu import huge_pages
from tidal.gpu.model.attention import TorchPagedAttention
from tidal.gpu.engine import Engine
from tidal.gpu.model.layers import Linear, avx2_linear_ops, gemv_ops
from tidal.gpu.model.loader import load_model
from tidal.wire import EngineConfig

CPU = torch.device("cpu")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_on() -> bool:
    """Transparent huge pages can back a mapping advised for them ("always" or "madvise")."""
    return THP.exists() and "[never]" not in THP.read_text()


def mapping_of(ptr: int) -> dict[str, str]:
    """This process's /proc/self/smaps entry for the mapping holding address ``ptr``."""
    entry: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # "start-end perms offset dev inode path"
            start, end = (int(x, 16) for x in head.split("-"))
            if entry is not None:
                return entry
            if start <= ptr < end:
                entry = {"range": head}
        elif entry is not None:
            key, _, value = line.partition(":")
            entry[key] = value.strip()
    assert entry is not None, f"no mapping holds {ptr:#x}"
    return entry


def huge_kib(ptr: int) -> int:
    return int(mapping_of(ptr)["AnonHugePages"].split()[0])


def thp_fallbacks() -> int:
    """Faults where the kernel wanted a huge page and had none to give (memory too fragmented)."""
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("thp_fault_fallback "):
            return int(line.split()[1])
    return 0


def assert_backed_by_huge_pages(ptr: int, fallbacks_before: int) -> None:
    if huge_kib(ptr) == 0 and thp_fallbacks() > fallbacks_before:
        pytest.skip("the kernel had no free huge page (thp_fault_fallback rose)")
    assert huge_kib(ptr) >= 2048


def test_place_moves_every_tensor_into_one_aligned_mapping():
    originals = [torch.randn(1000, 300).bfloat16(), torch.randn(7), torch.arange(5000, dtype=torch.int32)]
    owners = [SimpleNamespace(weight=t.clone()) for t in originals]
    huge_pages.place([(owner, "weight") for owner in owners])
    placed = [owner.weight for owner in owners]
    for before, after in zip(originals, placed, strict=True):
        assert torch.equal(before, after) and after.dtype == before.dtype and after.is_contiguous()
        assert after.data_ptr() % 4096 == 0
    assert placed[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    assert len({mapping_of(t.data_ptr())["range"] for t in placed}) == 1
    placed[1].zero_()  # each copy has its own pages
    assert torch.equal(placed[0], originals[0]) and torch.equal(placed[2], originals[2])


def test_zeros_are_zero_and_separate():
    caches = huge_pages.zeros((3, 16, 2, 32), torch.bfloat16, 4)
    assert [tuple(c.shape) for c in caches] == [(3, 16, 2, 32)] * 4
    assert all(c.dtype == torch.bfloat16 and not c.any() for c in caches)
    caches[1].fill_(1.5)
    assert not caches[0].any() and not caches[2].any() and bool((caches[1] == 1.5).all())


@pytest.mark.skipif(not thp_on(), reason="transparent huge pages are off on this host")
def test_the_mapping_is_backed_by_huge_pages():
    owner = SimpleNamespace(weight=torch.randn(3 << 20))  # 12 MiB: whole huge pages
    fallbacks = thp_fallbacks()
    huge_pages.place([(owner, "weight")])
    assert_backed_by_huge_pages(owner.weight.data_ptr(), fallbacks)


def test_the_kv_cache_is_resident_before_any_step_writes_it():
    """Every page of the cache is faulted in when it is made: a page first written mid-step (a sequence's new
    block) stalled a served stream 10-55 ms while the page was allocated and zeroed."""
    caches = huge_pages.zeros((64, 16, 4, 64), torch.bfloat16, 8)  # 8 x 512 KiB
    resident_kib = int(mapping_of(caches[0].data_ptr())["Rss"].split()[0])
    assert resident_kib >= 8 * 512
    assert all(not c.any() for c in caches)


def test_disabled_keeps_torchs_allocation(monkeypatch):
    monkeypatch.setenv("TIDAL_CPU_HUGE_PAGES", "0")
    weight = torch.randn(10)
    owner = SimpleNamespace(weight=weight)
    huge_pages.place([(owner, "weight")])
    assert owner.weight is weight
    caches = huge_pages.zeros((4,), torch.float32, 2)
    assert all(not c.any() for c in caches) and caches[0].data_ptr() != caches[1].data_ptr()


@pytest.mark.parametrize("linears", ["bf16", "avx2"])
def test_a_loaded_models_kernel_weights_are_placed(hf_model_dir, monkeypatch, linears):
    dtype, weight_dtype, ops = ((torch.bfloat16, None, gemv_ops(torch.bfloat16, CPU)) if linears == "bf16"
                                else (torch.float32, torch.bfloat16, avx2_linear_ops(CPU)))
    if ops is None:
        pytest.skip(f"the {linears} linear cannot run on this CPU")
    model_dir = hf_model_dir("llama", seed=5, hidden_size=128, intermediate_size=256)
    name = "gemv_packed" if linears == "bf16" else "avx2_packed"

    def weights(env: str):
        monkeypatch.setenv("TIDAL_CPU_HUGE_PAGES", env)
        model, _ = load_model(model_dir, dtype, CPU, TorchPagedAttention(CPU), linear_weights=weight_dtype)
        return [getattr(m, name) for m in model.modules() if isinstance(m, Linear)]

    fallbacks = thp_fallbacks()
    placed, plain = weights("1"), weights("0")
    assert placed and all(w is not None for w in placed)
    assert all(torch.equal(a, b) for a, b in zip(placed, plain, strict=True))  # the same packed values
    assert len({mapping_of(w.data_ptr())["range"] for w in placed}) == 1
    assert placed[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    assert all(w.data_ptr() % 4096 == 0 for w in placed)
    if thp_on():
        assert_backed_by_huge_pages(placed[0].data_ptr(), fallbacks)


def test_the_engines_cpu_kv_cache_is_placed(hf_model_dir):
    engine = Engine(EngineConfig(model=hf_model_dir("llama", seed=5), dtype="float32", num_kv_blocks=64,
                                 block_size=16))
    caches = [c for pair in engine.runner.kv_caches for c in pair]
    assert all(not c.any() for c in caches)
    assert len({mapping_of(c.data_ptr())["range"] for c in caches}) == 1
    assert caches[0].data_ptr() % huge_pages.HUGE_PAGE == 0


def test_a_kernel_that_refuses_the_advice_still_gets_the_tensors(monkeypatch):
    class NoTHP(mmap.mmap):  # a kernel built without transparent huge pages: madvise fails with EINVAL
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(huge_pages.mmap, "mmap", NoTHP)
    owner = SimpleNamespace(weight=torch.randn(100, 7))
    original = owner.weight.clone()
    huge_pages.place([(owner, "weight")])
    assert torch.equal(owner.weight, original) and owner.weight.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert all(not c.any() for c in huge_pages.zeros((3, 5), torch.float32, 2))
