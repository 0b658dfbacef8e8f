"""Loading a GGUF file within the memory the machine reports (issue 43): the check is made before
anything is allocated, from attnlab.memory.available (faked here: the promise, not a machine's
figure); a file whose float32 copy does not fit keeps its blocks and says so in one line, and a way
that cannot fit is refused in one line with its figures and the fix. The bytes are read into the
memory that keeps them, never through the reader's mapping."""

from __future__ import annotations

import warnings

import pytest
import torch
from gguf_files import Q, write_model

import attnlab
from attnlab import memory
from attnlab.errors import UserError
from attnlab.formats import gguf
from attnlab.quant.blocks import BlockLinear
from attnlab.slower import SlowerPath


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    """A tiny llama file, Q8_0 matrices and embedding: its float32 copy is about 3.8 times its
    blocks."""
    path = tmp_path_factory.mktemp("memory") / "tiny-q8.gguf"
    return write_model(path, "llama", matrix=Q.Q8_0, embedding=Q.Q8_0, d_model=128, d_mlp=256)


@pytest.fixture(scope="module")
def plan(q8_file):
    file = gguf.read_gguf(q8_file)
    return gguf.plan_memory(list(file.tensors.values()))


def budget(monkeypatch, n: int | None) -> None:
    """This process may allocate n more bytes, as MemAvailable says (None: nothing reported)."""
    monkeypatch.setattr(memory, "available", lambda: None if n is None else (n, "MemAvailable"))


def quiet_said(monkeypatch) -> None:
    """attnlab.slower says a line once per process: forget what it said."""
    from attnlab import slower

    monkeypatch.setattr(slower, "_said", set())


def test_the_plan_counts_the_float_copy_and_the_blocks(plan):
    assert plan.kinds == ("Q8_0",)
    # Q8_0: 34 bytes per 32 weights, float32 128
    assert plan.float32 - plan.blocks > 2.5 * plan.blocks_bytes
    assert plan.blocks > plan.blocks_bytes


def test_a_file_that_fits_loads_as_float32_as_before(q8_file, plan, monkeypatch):
    budget(monkeypatch, plan.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = attnlab.load(q8_file)
    assert not any(isinstance(m, BlockLinear) for m in model.modules())


def test_a_file_whose_float_copy_does_not_fit_keeps_its_blocks_and_says_so(
    q8_file, plan, monkeypatch
):
    quiet_said(monkeypatch)
    budget(monkeypatch, plan.float32 - 1)
    with pytest.warns(SlowerPath) as said:
        model = attnlab.load(q8_file)
    assert len(said) == 1
    line = str(said[0].message)
    assert "\n" not in line and "Q8_0 blocks kept" in line and "MemAvailable" in line
    assert memory.gigabytes(plan.float32) in line
    assert any(isinstance(m, BlockLinear) for m in model.modules())
    # the same model as keep_blocks=True makes
    kept = attnlab.load(q8_file, keep_blocks=True)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), kept(ids), rtol=0, atol=0)


def test_keep_blocks_false_that_cannot_fit_is_refused_with_the_fix(q8_file, plan, monkeypatch):
    budget(monkeypatch, plan.float32 - 1)
    with pytest.raises(UserError) as refused:
        attnlab.load(q8_file, keep_blocks=False)
    line = str(refused.value)
    assert "\n" not in line
    assert memory.gigabytes(plan.float32) in line and "keep_blocks=True" in line


def test_blocks_that_cannot_fit_are_refused(q8_file, plan, monkeypatch):
    budget(monkeypatch, plan.blocks - 1)
    for keep_blocks in (None, True):
        with pytest.raises(UserError, match="even with the file's blocks kept.*free memory"):
            attnlab.load(q8_file, keep_blocks=keep_blocks)


def test_a_float_file_that_cannot_fit_is_refused_without_suggesting_blocks(tmp_path, monkeypatch):
    path = write_model(tmp_path / "f32.gguf", "llama")
    file = gguf.read_gguf(path)
    plan = gguf.plan_memory(list(file.tensors.values()))
    assert plan.blocks_bytes == 0
    budget(monkeypatch, plan.float32 - 1)
    with pytest.raises(UserError) as refused:
        attnlab.load(path)
    assert "keep_blocks" not in str(refused.value) and "free memory" in str(refused.value)


def test_nothing_reported_nothing_refused(q8_file, monkeypatch):
    budget(monkeypatch, None)
    model = attnlab.load(q8_file)
    assert not any(isinstance(m, BlockLinear) for m in model.modules())


def test_the_blocks_are_read_without_the_files_mapping(q8_file, monkeypatch):
    """Every byte kept comes through read_bytes (os.preadv into the blocks' own memory): a read
    through gguf-py's mapping would leave the file's pages in the resident set."""
    reads = []
    real = gguf.read_bytes

    def counted(path, tensor):
        reads.append(tensor.name)
        return real(path, tensor)

    monkeypatch.setattr(gguf, "read_bytes", counted)
    file = gguf.read_gguf(q8_file)
    attnlab.load(q8_file, keep_blocks=True)
    assert sorted(reads) == sorted(file.tensors)
    for tensor in file.tensors.values():
        assert real(q8_file, tensor).tobytes() == bytes(tensor.data.reshape(-1).view("uint8"))


def test_available_takes_the_smaller_of_meminfo_and_the_cgroup(monkeypatch):
    monkeypatch.setattr(memory, "_meminfo_available", lambda: 8 << 30)
    monkeypatch.setattr(memory, "_cgroup_room", lambda: (2 << 30, "the cgroup limit of /x"))
    assert memory.available() == (2 << 30, "the cgroup limit of /x")
    monkeypatch.setattr(memory, "_cgroup_room", lambda: None)
    assert memory.available() == (8 << 30, "MemAvailable")


def test_the_cgroup_v2_room_is_its_limit_less_its_usage(tmp_path, monkeypatch):
    group = tmp_path / "user.slice"
    group.mkdir()
    (group / "memory.max").write_text("1000000\n")
    (group / "memory.current").write_text("400000\n")
    (tmp_path / "memory.max").write_text("max\n")
    monkeypatch.setattr(memory, "CGROUP_ROOT", tmp_path)
    real_read = memory.Path.read_text

    def read_text(self, *args, **kwargs):
        if str(self) == "/proc/self/cgroup":
            return "0::/user.slice\n"
        return real_read(self, *args, **kwargs)

    monkeypatch.setattr(memory.Path, "read_text", read_text)
    assert memory._cgroup_room() == (600000, f"the cgroup limit of {group}")


def test_kept_blocks_are_tensors_of_their_own_so_moving_them_frees_the_old_memory(q8_file):
    """Generation moves the weights into 2 MB pages by replacing each tensor's data: a view would
    keep its base, the file's bytes as read, alive beside the moved copy (every matrix twice)."""
    model = attnlab.load(q8_file, keep_blocks=True)
    kept = [m.blocks for m in model.modules() if isinstance(m, BlockLinear)]
    assert kept and all(blocks._base is None for blocks in kept)
