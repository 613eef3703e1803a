"""Large GGUF block tensors mapped, then moved into huge-page-backed memory in place
(tidal/loader/resident.py)."""

from __future__ import annotations

import gc
import mmap
import sys
import threading
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from tests.loader.test_weight_cache import write_tiny_quantized_gemma
from tidal.loader import resident
from tidal.loader.model_loader import load_model
from tidal.loader.resident import (
    HUGE_PAGE_BYTES,
    huge_pages_available,
    map_resident,
    promote_resident,
)
from tidal.quant.gguf_blocks import GGUFLinear

# mmap(MAP_FIXED), mremap and /proc/self/smaps: Linux only, as tidal's use of them
# (wants_resident is false elsewhere)
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def _vma_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address` ("path": its file, or
    "" for anonymous memory)."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        parts = line.split()
        head = parts[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
            if inside:
                fields["path"] = " ".join(parts[5:])
            continue
        if inside and ":" in head:
            fields[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return fields


@pytest.mark.parametrize("offset, nbytes", [(0, 1), (7, 5000), (4096, HUGE_PAGE_BYTES + 123)])
def test_maps_then_moves_the_files_bytes_in_place(tmp_path: Path, offset: int, nbytes: int) -> None:
    data = torch.randint(0, 256, (offset + nbytes + 11,), dtype=torch.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.numpy().tobytes())
    t = map_resident(path, offset, nbytes)
    assert t.dtype == torch.uint8 and t.shape == (nbytes,)
    # its file page starts where a huge page can
    assert (t.data_ptr() - offset % mmap.PAGESIZE) % HUGE_PAGE_BYTES == 0
    assert _vma_of(t.data_ptr())["path"] == str(path)  # mapped, not read
    assert torch.equal(t, data[offset : offset + nbytes])
    t[0] = t[0] ^ 1  # private: writable, the file untouched
    assert path.read_bytes()[offset] == int(data[offset])
    address = t.data_ptr()
    assert promote_resident() >= nbytes
    assert t.data_ptr() == address  # same pointer: the kernels' cached arguments stay valid
    assert _vma_of(address)["path"] == ""  # anonymous memory now
    want = data[offset : offset + nbytes].clone()
    want[0] ^= 1  # the write went along
    assert torch.equal(t, want)
    assert promote_resident() == 0  # nothing left to move


@pytest.mark.skipif(not huge_pages_available(), reason="transparent huge pages are off here")
def test_the_moved_memory_is_eligible_for_huge_pages(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(bytes(range(256)) * (3 * HUGE_PAGE_BYTES // 256))
    t = map_resident(path, 0, 3 * HUGE_PAGE_BYTES)
    promote_resident()
    vma = _vma_of(t.data_ptr())
    assert "hg" in vma.get("VmFlags", "").split(), vma  # MADV_HUGEPAGE took
    if "THPeligible" in vma:
        assert vma["THPeligible"] == "1", vma
    assert torch.equal(t[:256], torch.arange(256, dtype=torch.uint8))


def test_readers_see_the_same_bytes_while_it_moves(tmp_path: Path) -> None:
    """The move replaces the mapping under a thread that keeps reading it: every read, before,
    during and after, sees the file's bytes."""
    nbytes = 4 * HUGE_PAGE_BYTES + 999
    data = torch.randint(0, 256, (nbytes + 5,), dtype=torch.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.numpy().tobytes())
    t = map_resident(path, 5, nbytes)
    want = int(data[5:].sum())
    sums: list[int] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set() or len(sums) < 3:
            sums.append(int(t.sum()))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert promote_resident() >= nbytes
    finally:
        stop.set()
        reader.join(timeout=60)
    assert sums and all(s == want for s in sums)
    assert _vma_of(t.data_ptr())["path"] == ""


def _rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def test_the_move_never_holds_the_matrix_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunk by chunk: each chunk's move unmaps the file pages it replaces, so the process's
    RSS after any copy is the matrix's plus about one chunk, never twice the matrix."""
    nbytes = 24 * HUGE_PAGE_BYTES
    path = tmp_path / "blob"
    path.write_bytes(bytes(range(256)) * (nbytes // 256))
    t = map_resident(path, 0, nbytes)
    assert int(t[:: mmap.PAGESIZE].sum()) == 0  # every page touched: all of it in the RSS
    chunk = 4 * HUGE_PAGE_BYTES
    monkeypatch.setattr(resident, "_CHUNK", chunk)
    after_copies: list[int] = []
    memmove = resident.ctypes.memmove

    def copy(dst: int, src: int, n: int) -> int:
        out = memmove(dst, src, n)
        after_copies.append(_rss_bytes())
        return out

    monkeypatch.setattr(resident.ctypes, "memmove", copy)
    before = _rss_bytes()
    assert promote_resident() == nbytes
    assert len(after_copies) == nbytes // chunk
    assert max(after_copies) - before < 2 * chunk, (before, after_copies)
    assert torch.equal(t[:256], torch.arange(256, dtype=torch.uint8))


def test_a_region_whose_tensors_are_gone_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(b"y" * 10_000)
    t = map_resident(path, 100, 5000)
    del t
    gc.collect()
    assert promote_resident() == 0


def test_a_short_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(b"x" * 100)
    with pytest.raises(OSError, match="bytes short"):
        map_resident(path, 50, 100)
    with pytest.raises(ValueError, match="must be positive"):
        map_resident(path, 0, 0)


def test_resident_blocks_give_the_same_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the size threshold at zero every block tensor is mapped on its own, then moved into
    its own memory: the same bytes, so the same logits, as the plain mapped load."""
    path = tmp_path / "tiny-q.gguf"
    write_tiny_quantized_gemma(path)
    mapped = load_model(path, gguf_blocks=True)
    monkeypatch.setattr(resident, "RESIDENT_MIN_BYTES", 0)
    monkeypatch.setattr(resident, "huge_pages_available", lambda: True)
    ours = load_model(path, gguf_blocks=True)
    pairs = [
        (a, b)
        for a, b in zip(mapped.model.modules(), ours.model.modules(), strict=True)
        if isinstance(a, GGUFLinear)
    ]
    assert pairs
    promote_resident()
    for a, b in pairs:
        for pa, pb in zip(a.parts, b.parts, strict=True):
            assert torch.equal(pa.blocks, pb.blocks)
            assert _vma_of(pa.blocks.data_ptr())["path"] == str(path)  # a view of the file
            assert _vma_of(pb.blocks.data_ptr())["path"] == ""  # its own memory
    torch.manual_seed(0)
    x = torch.randn(4, mapped.arch.hidden_size)
    assert torch.equal(mapped.model.lm_head(x), ours.model.lm_head(x))


def test_tensor_parallel_rows_of_a_resident_matrix_are_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank's rows of a resident matrix are its own copy (huge pages again where large), so
    the whole matrix is freed after loading; rows of a mapped one stay views of the file."""
    from tidal.kernels.gguf_gemm import BlockWeight
    from tidal.loader.shard import TensorSlice, slice_blocks

    rows, row_bytes = 64, 34 * 2  # Q8_0, 64 columns
    data = torch.randint(0, 256, (rows * row_bytes,), dtype=torch.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.numpy().tobytes())
    mapped = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c")).view(rows, row_bytes)
    monkeypatch.setattr(resident, "RESIDENT_MIN_BYTES", 0)
    monkeypatch.setattr(resident, "huge_pages_available", lambda: True)
    whole = map_resident(path, 0, rows * row_bytes).view(rows, row_bytes)
    assert resident.is_resident(whole) and not resident.is_resident(mapped)
    part = TensorSlice(0, 16, 48)
    for blocks, copied in ((whole, True), (mapped, False)):
        got = slice_blocks(BlockWeight(blocks, 8, rows, 64), part, "w").blocks
        assert torch.equal(got, data.view(rows, row_bytes)[16:48])
        shares = got.untyped_storage().data_ptr() == blocks.untyped_storage().data_ptr()
        assert shares != copied
        assert resident.is_resident(got) == copied


def test_an_engine_serves_the_same_tokens_before_and_after_the_move(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """build_engine starts the move on a background thread; greedy tokens are the same as a
    plainly mapped engine's, and stay the same once every block tensor has moved."""
    from tidal import LLM, SamplingParams

    path = tmp_path / "tiny-q.gguf"
    write_tiny_quantized_gemma(path)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[1, 5, 9, 22, 7], [1, 40, 3]]
    kwargs = dict(kv_cache_bytes=4 << 20, block_size=8, threads=1)

    def tokens(llm: LLM) -> list[list[int]]:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        return [o.outputs[0].token_ids for o in outs]

    mapped = tokens(LLM(str(path), **kwargs))
    monkeypatch.setattr(resident, "RESIDENT_MIN_BYTES", 0)
    monkeypatch.setattr(resident, "huge_pages_available", lambda: True)
    llm = LLM(str(path), **kwargs)
    during = tokens(llm)  # the background move may be under way
    promote_resident()  # waits for it (one move at a time), then moves anything left
    head = llm.engine.loaded.model.lm_head.parts[0].blocks
    assert resident.is_resident(head) and _vma_of(head.data_ptr())["path"] == ""
    assert during == mapped
    assert tokens(llm) == mapped


def test_huge_pages_off_keeps_every_matrix_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """model.huge_pages false: nothing is set aside to move, so every block tensor stays a view
    of the file's mapping (shared with other processes), and the tokens are the same."""
    from tidal import LLM, SamplingParams

    path = tmp_path / "tiny-q.gguf"
    write_tiny_quantized_gemma(path)
    monkeypatch.setattr(resident, "RESIDENT_MIN_BYTES", 0)
    monkeypatch.setattr(resident, "huge_pages_available", lambda: True)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kwargs = dict(kv_cache_bytes=4 << 20, block_size=8, threads=1)
    off = LLM(str(path), huge_pages=False, **kwargs)
    on = LLM(str(path), **kwargs)
    promote_resident()
    head_off = off.engine.loaded.model.lm_head.parts[0].blocks
    head_on = on.engine.loaded.model.lm_head.parts[0].blocks
    assert _vma_of(head_off.data_ptr())["path"] == str(path)
    assert not resident.is_resident(head_off)
    assert _vma_of(head_on.data_ptr())["path"] == ""
    out = [
        llm.generate(prompt_token_ids=[[1, 5, 9, 22]], sampling_params=params)[0]
        for llm in (off, on)
    ]
    assert out[0].outputs[0].token_ids == out[1].outputs[0].token_ids


def test_wait_promoted_returns_once_the_background_copy_is_done(tmp_path: Path) -> None:
    """A benchmark waits for the background move before it times anything: wait_promoted returns
    True only once the thread promote_in_background started has moved what was pending."""
    path = tmp_path / "blob"
    data = torch.randint(0, 256, (HUGE_PAGE_BYTES + 99,), dtype=torch.uint8)
    path.write_bytes(data.numpy().tobytes())
    t = map_resident(path, 0, data.numel())
    thread = resident.promote_in_background()
    assert resident.wait_promoted(timeout_s=60.0)
    if thread is not None:
        assert not thread.is_alive()
    assert torch.equal(t, data)  # the same bytes, wherever they live now
    assert resident.wait_promoted(timeout_s=0.0)  # nothing in flight: returns at once
