"""Large GGUF block tensors read into huge-page-backed memory (tidal/loader/resident.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.loader.test_weight_cache import write_tiny_quantized_gemma
from tidal.loader import resident
from tidal.loader.model_loader import load_model
from tidal.loader.resident import HUGE_PAGE_BYTES, huge_pages_available, read_resident
from tidal.quant.gguf_blocks import GGUFLinear


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
def test_reads_the_files_bytes(tmp_path: Path, offset: int, nbytes: int) -> None:
    data = torch.randint(0, 256, (offset + nbytes + 11,), dtype=torch.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.numpy().tobytes())
    t = read_resident(path, offset, nbytes)
    assert t.dtype == torch.uint8 and t.shape == (nbytes,)
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0  # where a huge page can start
    assert torch.equal(t, data[offset : offset + nbytes])
    t[0] = t[0] ^ 1  # its own memory: writable, the file untouched
    assert path.read_bytes()[offset] == int(data[offset])


@pytest.mark.skipif(not huge_pages_available(), reason="transparent huge pages are off here")
def test_the_mapping_is_eligible_for_huge_pages(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(bytes(range(256)) * (3 * HUGE_PAGE_BYTES // 256))
    t = read_resident(path, 0, 3 * HUGE_PAGE_BYTES)
    vma = _vma_of(t.data_ptr())
    assert "hg" in vma.get("VmFlags", "").split(), vma  # MADV_HUGEPAGE took
    if "THPeligible" in vma:
        assert vma["THPeligible"] == "1", vma


def test_a_short_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(b"x" * 100)
    with pytest.raises(OSError, match="bytes short"):
        read_resident(path, 50, 100)
    with pytest.raises(ValueError, match="must be positive"):
        read_resident(path, 0, 0)


def test_resident_blocks_give_the_same_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the size threshold at zero every block tensor is read into its own memory: the same
    bytes, so the same logits, as the mapped load."""
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
    whole = read_resident(path, 0, rows * row_bytes).view(rows, row_bytes)
    assert resident.is_resident(whole) and not resident.is_resident(mapped)
    part = TensorSlice(0, 16, 48)
    for blocks, copied in ((whole, True), (mapped, False)):
        got = slice_blocks(BlockWeight(blocks, 8, rows, 64), part, "w").blocks
        assert torch.equal(got, data.view(rows, row_bytes)[16:48])
        shares = got.untyped_storage().data_ptr() == blocks.untyped_storage().data_ptr()
        assert shares != copied
        assert resident.is_resident(got) == copied
