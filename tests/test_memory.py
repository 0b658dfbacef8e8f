"""attnlab.memory: the blocks a cache is written into come back when its last tensor is freed and
serve the next call without new pages; the pool keeps no more than one call took; outside a
recorded call, large outputs are advised into 2 MB pages. The effect is counted in page faults
(getrusage), never in time."""

from __future__ import annotations

import gc
import io
import resource

import pytest
import torch

from attnlab import Transformer, memory
from attnlab.generate.fast_layers import inference_kernels_unusable
from attnlab.lens import hooks
from attnlab.model.config import ModelConfig

BLOCK = 1 << 20  # floats: a 4 MiB block, above memory.SMALLEST


@pytest.fixture(autouse=True)
def fresh_pool(monkeypatch):
    """Each test on a pool of its own."""
    monkeypatch.setattr(memory, "POOL", memory.BlockPool())
    yield
    gc.collect()


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_a_freed_block_serves_the_next_tensor_of_its_size_without_new_pages():
    with memory.recycled():
        first = memory.new_tensor(4, BLOCK // 4)
        first.fill_(1.0)
    where = first.data_ptr()
    del first
    assert memory.POOL.kept == BLOCK * 4
    with memory.recycled():
        before = faults()
        again = memory.new_tensor(4, BLOCK // 4)
        again.fill_(2.0)
        written = faults() - before
    assert again.data_ptr() == where and again.shape == (4, BLOCK // 4)
    assert memory.POOL.kept == 0
    assert written < BLOCK * 4 // 4096 // 10, written  # the pages were there
    assert torch.equal(again, torch.full((4, BLOCK // 4), 2.0))


def test_a_block_stays_out_of_the_pool_while_a_view_of_it_lives():
    with memory.recycled():
        first = memory.new_tensor(BLOCK)
    view, where = first[10:20], first.data_ptr()
    del first
    assert memory.POOL.kept == 0
    with memory.recycled():
        other = memory.new_tensor(BLOCK)
    assert other.data_ptr() != where
    view.fill_(3.0)  # still its own memory
    del view
    assert memory.POOL.kept == BLOCK * 4


def test_the_pool_keeps_no_more_than_one_call_took_and_release_hands_it_back():
    with memory.recycled():
        a = [memory.new_tensor(BLOCK) for _ in range(2)]
    with memory.recycled():  # the first call's tensors still held: two more blocks
        b = [memory.new_tensor(BLOCK) for _ in range(2)]
    assert memory.POOL.most == 2 * BLOCK * 4
    del a, b
    assert memory.POOL.kept == 2 * BLOCK * 4  # two of the four
    assert memory.release() == 2 * BLOCK * 4
    assert memory.POOL.kept == 0


def test_small_tensors_and_tensors_outside_a_recorded_call_are_torch_empty(monkeypatch):
    advised = []
    monkeypatch.setattr(memory, "_madvise", lambda: lambda *a: advised.append(a))
    with memory.recycled():
        small = memory.new_tensor(memory.SMALLEST // 4 - 1)
    assert memory.POOL.taken == 0
    outside = memory.new_tensor(BLOCK)
    del small, outside
    assert memory.POOL.kept == 0 and advised == []
    big = memory.new_tensor(5, memory.FRESH_HUGE_FROM // 4 // 5 + 7)
    ((start, length, advice),) = advised
    end, big_end = start + length, big.data_ptr() + big.numel() * 4
    assert advice == memory.MADV_HUGEPAGE and big.dtype == torch.float32
    assert start % memory.HUGE_PAGE == 0 and end % memory.HUGE_PAGE == 0
    assert big.data_ptr() <= start < big.data_ptr() + memory.HUGE_PAGE
    assert big_end - memory.HUGE_PAGE < end <= big_end


def test_a_pooled_tensor_saves_only_its_own_values():
    with memory.recycled():
        t = memory.new_tensor(3, memory.SMALLEST // 4)
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape))
    buffer = io.BytesIO()
    torch.save(t[1], buffer)
    assert buffer.tell() < 2 * t.numel() * 4
    buffer.seek(0)
    assert torch.equal(torch.load(buffer), t[1])


def test_a_refused_mapping_is_torch_empty(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(memory.mmap, "mmap", refuse)
    with memory.recycled():
        t = memory.new_tensor(BLOCK)
    t.fill_(1.0)
    assert t.shape == (BLOCK,)


def test_run_with_cache_records_its_forward_pass(monkeypatch):
    entered = []

    @memory.contextlib.contextmanager
    def recording():
        entered.append(1)
        yield

    monkeypatch.setattr(hooks, "recycled", recording)
    config = ModelConfig(d_vocab=11, n_ctx=8, d_model=16, n_layers=1, n_heads=2, d_mlp=24)
    Transformer(config).eval().run_with_cache(torch.randint(0, 11, (1, 5)))
    assert entered == [1]


@pytest.mark.kernel_builds("avx512")  # the C forward pass that writes a cache: AVX-512's tiles
def test_a_second_cache_is_written_on_the_first_ones_pages(kernel_build):
    config = ModelConfig(
        d_vocab=50, n_ctx=256, d_model=64, n_layers=2, n_heads=4, d_mlp=128,
        positional="rope", norm="rmsnorm", mlp="swiglu",
    )  # fmt: skip
    assert inference_kernels_unusable() is None  # the C forward pass, whose outputs the pool holds
    torch.manual_seed(0)
    model = Transformer(config).eval()
    ids = torch.randint(0, 50, (2, 256))
    with torch.no_grad():
        logits, cache = model.run_with_cache(ids)
        pattern = cache["blocks.0.attn.hook_pattern"]  # 2 x 4 x 256 x 256 floats: 2 MiB
        first = {t.untyped_storage().data_ptr() for t in cache.values()}
        expected = (logits.clone(), pattern.clone())
        del logits, cache, pattern
        kept = memory.POOL.kept
        assert kept >= 2 << 20
        logits, cache = model.run_with_cache(ids)
    assert memory.POOL.kept < kept // 4  # taken again
    again = {t.untyped_storage().data_ptr() for t in cache.values()}
    assert cache["blocks.0.attn.hook_pattern"].untyped_storage().data_ptr() in first
    assert len(first & again) >= len(again) // 4
    assert torch.equal(logits, expected[0])
    assert torch.equal(cache["blocks.0.attn.hook_pattern"], expected[1])


def test_new_tensors_are_float32_whatever_the_default_dtype():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with memory.recycled():
            pooled = memory.new_tensor(BLOCK)
        assert memory.new_tensor(3, 5).dtype == pooled.dtype == torch.float32
    finally:
        torch.set_default_dtype(previous)
