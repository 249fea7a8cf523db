"""array_files: one pass to write (hashing on the way) and to read (hashing each slice as it is copied)."""

from __future__ import annotations

import functools
import hashlib
import io

import numpy as np
import pytest
import torch

from gpusparse import Index, IndexFormatError
from gpusparse import array_files as af

from .test_formats import make_collection

DTYPES = [np.int32, np.float32, np.int64]


def random_array(rng: np.random.Generator, dtype, n: int) -> np.ndarray:
    return rng.integers(-(2**30), 2**30, n).astype(dtype) if dtype != np.float32 else rng.random(n, dtype=np.float32)


@pytest.mark.parametrize("n", [0, 1, 7, 1000, 40_001])
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_npy_is_np_save_byte_for_byte_with_its_digest(tmp_path, dtype, n):
    a = random_array(np.random.default_rng(n), dtype, n)
    meta = af.write_npy(tmp_path / "a.npy", a)
    ref = io.BytesIO()
    np.save(ref, a)
    data = (tmp_path / "a.npy").read_bytes()
    assert data == ref.getvalue()
    assert meta == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize("chunk", [8, 64, 1 << 26])
@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("n", [0, 1, 33, 5000])
def test_read_npy_equals_the_array_and_checks_every_slice(tmp_path, monkeypatch, chunk, mmap, n):
    monkeypatch.setattr(af, "CHUNK", chunk)  # several slices, a last partial one
    rng = np.random.default_rng(1000 + n)
    a = random_array(rng, np.int32, n)
    meta = af.write_npy(tmp_path / "a.npy", a)
    t = af.read_npy(tmp_path / "a.npy", np.int32, device=torch.device("cpu"), mmap=mmap, sha256=meta["sha256"])
    assert t.dtype == torch.int32 and np.array_equal(t.numpy(), a)
    if n == 0:
        return
    data = bytearray((tmp_path / "a.npy").read_bytes())
    header = len(data) - a.nbytes
    for pos in (0, header, header + int(rng.integers(a.nbytes)), len(data) - 1):  # header, first, any, last byte
        bad = bytearray(data)
        bad[pos] ^= 0x10
        (tmp_path / "b.npy").write_bytes(bytes(bad))
        with pytest.raises(IndexFormatError, match=r"b\.npy (does not match its checksum|is not a readable|has dtype)"):
            af.read_npy(tmp_path / "b.npy", np.int32, device=torch.device("cpu"), mmap=mmap, sha256=meta["sha256"])


def test_read_npy_refuses_another_dtype_or_shape(tmp_path):
    af.write_npy(tmp_path / "a.npy", np.zeros(4, np.int64))
    np.save(tmp_path / "m.npy", np.zeros((2, 2), np.int32))
    for name, want in (("a.npy", "int64 and 1 dims, expected 1-D int32"), ("m.npy", "int32 and 2 dims")):
        with pytest.raises(IndexFormatError, match=want):
            af.read_npy(tmp_path / name, np.int32, device=torch.device("cpu"), mmap=True, sha256=None)


def test_write_all_names_the_first_file_that_failed(tmp_path):
    def fails(msg):
        def job():
            raise OSError(msg)

        return job

    jobs = {"a.npy": lambda: af.write_npy(tmp_path / "a.npy", np.zeros(3)), "b.npy": fails("b"), "c.npy": fails("c")}
    with pytest.raises(af.FileJobError) as info:
        af.write_all(jobs)
    assert info.value.name == "b.npy" and str(info.value.error) == "b"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("chunk", [64, 1 << 26])
def test_index_loads_to_the_gpu_through_staging_and_checks_it(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(af, "CHUNK", chunk)
    index = Index.build(make_collection(4242, n=300))
    index.save(tmp_path / "idx")
    loaded = Index.load(tmp_path / "idx", device="cuda")
    for name, t in index.arrays().items():
        u = loaded.arrays()[name]
        assert u.device.type == "cuda" and u.dtype == t.dtype and torch.equal(u.cpu(), t), name
    f = tmp_path / "idx" / "scores.npy"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(IndexFormatError, match=r"scores\.npy does not match its checksum"):
        Index.load(tmp_path / "idx", device="cuda")


def test_many_files_read_at_once_parse_their_headers_safely(tmp_path):
    """Threads reading .npy files side by side (np.load parses headers with ast.literal_eval,
    which CPython 3.11 cannot run in two threads at once)."""
    arrays = {f"a{i}.npy": np.arange(i * 7, dtype=np.float32) for i in range(64)}
    metas = {name: af.write_npy(tmp_path / name, a) for name, a in arrays.items()}
    for _ in range(5):
        cpu = torch.device("cpu")
        jobs = {
            n: functools.partial(af.read_npy, tmp_path / n, np.float32, device=cpu, mmap=True, sha256=m["sha256"])
            for n, m in metas.items()
        }
        got = af.read_all(jobs)
        assert all(np.array_equal(got[n].numpy(), a) for n, a in arrays.items())
