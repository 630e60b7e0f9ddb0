"""The memory-speed item checksum (sum64b512) and the mapped host-tier write path: what it detects, that torch
and numpy compute the same sums, that files written through a kept mapping read back bit-exactly and verify,
and that CRC32-recorded items and manifests keep verifying."""

import os
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchmoe_ckpt.dcp import CorruptItemError, RawReader, RawWriter
from torchmoe_ckpt.storage_format import checksums
from torchmoe_ckpt.storage_format.checksums import (
    BLOCK,
    SUM64,
    FileEntry,
    block_sums,
    digest,
    file_entry,
    tensor_block_sums,
)
from torchmoe_ckpt.storage_format.manifest import WindowManifest
from torchmoe_ckpt.storage_format.mapped_files import MappedFiles

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _data(n: int, seed: int = 0) -> bytearray:
    g = torch.Generator().manual_seed(seed)
    return bytearray(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes())


def test_torch_and_numpy_sums_agree_bitwise():
    buf = _data(64 * 512)
    t = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
    assert np.array_equal(tensor_block_sums(t).numpy(), block_sums(buf))  # wrapping int64, any order


@pytest.mark.parametrize("n", [8, 100, 4096, 4096 * 3 + 5])
def test_detects_bit_flips_anywhere(n):
    buf = _data(n, seed=n)
    want = digest(buf, SUM64)
    for pos in sorted({0, n // 3, n // 2, n - 1}):
        for bit in (0, 7):
            bad = bytearray(buf)
            bad[pos] ^= 1 << bit
            assert digest(bad, SUM64) != want, (pos, bit)


def test_detects_zeroed_page_swapped_words_and_length():
    buf = _data(16 * 4096, seed=1)
    want = digest(buf, SUM64)
    zeroed = bytearray(buf)
    zeroed[4096:8192] = bytes(4096)  # a page that was never written (torn write)
    assert digest(zeroed, SUM64) != want
    swapped = bytearray(buf)  # two 8-byte words in different blocks trade places
    a, b = 8 * 3, 512 * 5 + 8 * 11
    swapped[a : a + 8], swapped[b : b + 8] = buf[b : b + 8], buf[a : a + 8]
    assert buf[a : a + 8] != buf[b : b + 8] and digest(swapped, SUM64) != want
    assert digest(buf + bytes(8), SUM64) != want  # trailing zeros: the length is part of the digest
    assert digest(buf[:-8], SUM64) != want


def test_unknown_algorithm_is_refused_and_crc32_still_checks():
    buf = _data(1000)
    assert checksums.matches(buf, checksums.checksum(buf, "crc32"))
    with pytest.raises(checksums.UnknownChecksum):
        checksums.matches(buf, "md4:00000000")


def test_manifest_entries_name_their_algorithm():
    man = WindowManifest(
        3, 9, 1, 1, {"window": 1, "slots": []}, {"a": FileEntry(10, 0x1234), "b": FileEntry(512, 0xABCD, SUM64)}
    )
    d = man.to_dict()
    assert d["files"]["a"] == {"bytes": 10, "crc32": 0x1234}  # CRC32 entries unchanged from earlier versions
    assert d["files"]["b"]["algo"] == SUM64
    assert WindowManifest.from_json(man.to_json()).files == man.files


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300, 7, generator=g),
        "b": torch.randn(13, generator=g).to(torch.bfloat16),
        "i": torch.randint(0, 9, (5,), generator=g),
        "e": torch.empty(0),
        "s": torch.tensor(3.0),
    }


def test_mapped_writer_reads_back_bit_exact_and_reuses_the_mapping(tmp_path):
    maps = MappedFiles()
    for seed in (1, 2):  # the second save goes through the mapping the first one made
        sd = _state(seed)
        w = RawWriter(tmp_path, checksum_algo=SUM64, mapped=maps)
        dcp.save(sd, storage_writer=w, no_dist=True)
        assert len(maps) == 1
        ((rel, (algo, value)),) = w.file_checksum.items()
        assert file_entry(tmp_path / rel, algo) == FileEntry(w.written[rel], value, SUM64)
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(out, storage_reader=RawReader(tmp_path), no_dist=True)
        for k in sd:
            assert torch.equal(out[k], sd[k]), k
    path = tmp_path / rel
    with open(path, "r+b") as f:  # one bit of the stored "w" flipped: the item no longer verifies
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 4]))
    with pytest.raises(BaseException) as err:  # DCP wraps it in a CheckpointException (a BaseException)
        dcp.load({k: torch.zeros_like(v) for k, v in sd.items()}, storage_reader=RawReader(tmp_path), no_dist=True)
    assert any(isinstance(f[0], CorruptItemError) for f in err.value.failures.values())  # (exception, traceback)
    maps.forget(path)
    assert len(maps) == 0
    os.unlink(path)


def test_crc32_items_of_earlier_writers_still_verify(tmp_path):
    sd = _state(5)
    dcp.save(sd, storage_writer=RawWriter(tmp_path, checksum_algo="crc32"), no_dist=True)  # CRC32 per item
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=RawReader(tmp_path), no_dist=True)
    assert all(torch.equal(out[k], sd[k]) for k in sd)


def test_mapping_of_a_file_deleted_elsewhere_is_dropped(tmp_path):
    maps = MappedFiles()
    items = [(0, 40, torch.arange(10, dtype=torch.int32))]
    maps.write(str(tmp_path / "a"), BLOCK, items)
    os.unlink(tmp_path / "a")  # deleted by someone else: its mapping must not pin the pages
    sums = maps.write(str(tmp_path / "b"), BLOCK, items)
    assert len(maps) == 1
    assert np.array_equal(sums, block_sums((tmp_path / "b").read_bytes()))
