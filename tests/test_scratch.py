"""Memory and machine code the decoders keep between calls: the scratch buffers (kvcodec.scratch) and the vector
kernels' machine code on disk (kvcodec.entropy._lanes_simd.jit)."""

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import kvcodec
from kvcodec import scratch
from kvcodec.entropy import rans

from .common import random_cache

ROOT = Path(__file__).resolve().parents[1]


def test_take_give_reuses_buffers_within_the_cap(monkeypatch):
    scratch.clear()
    n0 = scratch.outstanding()
    a = scratch.take(1000, np.uint32)  # 4,000 bytes: one 64 KiB size class
    assert a.shape == (250,) and a.dtype == np.uint32 and a.ctypes.data % 64 == 0 and a.flags.writeable
    b = scratch.take(4000)
    assert a.ctypes.data != b.ctypes.data and scratch.outstanding() == n0 + 2
    scratch.give(a)
    assert scratch.held_bytes() == 64 << 10
    with pytest.raises(ValueError, match="given back already"):
        scratch.give(a)
    c = scratch.take(40, np.uint16)  # the same size class: the buffer given back, not new memory
    assert c.ctypes.data == a.ctypes.data and scratch.held_bytes() == 0
    with pytest.raises(ValueError, match="not an array take"):
        scratch.give(np.empty(10))
    with pytest.raises(ValueError, match="whole number"):
        scratch.take(6, np.uint32)
    scratch.give(b)
    scratch.give(c)
    assert scratch.outstanding() == n0
    assert scratch.held_bytes() == 2 * (64 << 10)
    scratch.clear()
    monkeypatch.setattr(scratch, "CAP", 200 << 10)  # kept while the free buffers stay within the cap
    big = [scratch.take(100 << 10) for _ in range(3)]  # 128 KiB each
    for x in big:
        scratch.give(x)
    assert scratch.held_bytes() == 128 << 10  # one of the three
    scratch.clear()
    assert scratch.held_bytes() == 0


def test_no_buffer_is_handed_out_twice_at_once():
    scratch.clear()
    n0 = scratch.outstanding()
    errors, seen = [], []
    lock = threading.Lock()

    def worker(k):
        rng = np.random.default_rng(k)
        for _ in range(300):
            a = scratch.take(int(rng.integers(1, 300_000)))
            a[:8] = k  # each holder writes its mark; another holder of the same memory would overwrite it
            with lock:
                seen.append(a.ctypes.data)
            if not (a[:8] == k).all():
                errors.append(k)
            scratch.give(a)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(1, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and scratch.outstanding() == n0
    assert len(set(seen)) < len(seen)  # buffers were reused
    assert scratch.held_bytes() <= scratch.CAP


@pytest.fixture
def takes(monkeypatch):
    """The sizes scratch.take was asked for."""
    got = []
    real = scratch.take

    def spy(nbytes, dtype=np.uint8):
        got.append(nbytes)
        return real(nbytes, dtype)

    monkeypatch.setattr(scratch, "take", spy)
    return got


@pytest.mark.parametrize("tier", ["lossless", "lossy"])
def test_decodes_give_every_scratch_buffer_back(tmp_path, takes, tier):
    """A decode's direct tables (lossless), index symbols (lossy) and, from a file on disk, its payloads are
    scratch buffers, all given back after the decode, and after a decode that fails."""
    if not rans.vector_kernels():
        pytest.skip("no vector kernels on this machine (their direct tables are the scratch buffers)")
    kv = random_cache(layers=2, heads=2, seq=64, dim=64, seed=3)
    data = kvcodec.encode(kv, tier=tier, **({"bits": 2.0} if tier == "lossy" else {}))
    path = tmp_path / "c.kvz"
    path.write_bytes(data)
    from kvcodec.container import layout as L
    from kvcodec.container.reader import KvzReader

    r = KvzReader(data)
    want = kvcodec.decode(data, output="kvcache")
    n0 = scratch.outstanding()
    asked = {}
    for src in (data, path):
        takes.clear()
        got = kvcodec.decode(src, output="kvcache")
        assert all(torch.equal(a, b) for a, b in zip(got.keys + got.values, want.keys + want.values))
        assert takes and scratch.outstanding() == n0
        asked[isinstance(src, Path)] = Counter(takes)
        if tier == "lossy":  # the index symbols of each of the 4 slices: 2 heads x tokens x 64 channels, uint16
            assert any(takes.count(n) >= 4 and n % (2 * 2 * 64) == 0 for n in takes)
    # from the file on disk, besides: its payloads, read batch by batch into scratch buffers
    assert sum((asked[True] - asked[False]).elements()) == sum(e.length for e in r.sections
                                                               if e.section_type == L.SECTION_KV)
    # a payload damaged past its checksum's reach is still refused, and nothing stays handed out
    e = r.sections[-1] if r.sections[-1].length > 64 else max(r.sections, key=lambda x: x.length)
    bad = bytearray(data)
    bad[e.payload_offset + e.length // 2] ^= 0xFF
    path.write_bytes(bytes(bad))
    for src in (bytes(bad), path):
        with pytest.raises(kvcodec.KvzError):
            kvcodec.decode(src, output="kvcache")
        assert scratch.outstanding() == n0


_PROBE = r"""
import hashlib, json, sys
import kvcodec
from kvcodec.entropy import _lanes_simd
kv = kvcodec.decode(open(sys.argv[1], "rb").read(), output="kvcache")
h = hashlib.sha256(b"".join(t.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()
                            for t in kv.keys + kv.values)).hexdigest()
print(json.dumps({"objects": _lanes_simd.OBJECTS, "sha": h}))
"""


def _probe(file: Path, cache: Path, **env) -> dict:
    e = {**os.environ, "KVCODEC_CACHE_DIR": str(cache), **env}
    out = subprocess.run([sys.executable, "-c", _PROBE, str(file)], capture_output=True, text=True, env=e,
                         cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_kernels_machine_code_is_kept_on_disk_and_checked(tmp_path):
    """A process loads the vector kernels' machine code an earlier one compiled (same decode); a damaged file
    is compiled again and rewritten; KVCODEC_KERNEL_CACHE=0 keeps nothing; an unwritable cache is no error."""
    if not rans.vector_kernels():
        pytest.skip("no vector kernels on this machine")
    file = tmp_path / "c.kvz"
    file.write_bytes(kvcodec.encode(random_cache(layers=2, heads=2, seq=64, dim=64, seed=4), tier="lossy",
                                    bits=2.0))
    cache = tmp_path / "cache"
    first = _probe(file, cache)
    kernels = sorted((cache / "kernels").glob("*.o"))
    assert first["objects"]["compiled"] >= 2 and first["objects"]["loaded"] == 0
    assert len(kernels) == first["objects"]["compiled"]
    again = _probe(file, cache)
    assert again == {"objects": {"loaded": first["objects"]["compiled"], "compiled": 0}, "sha": first["sha"]}
    # one file's code damaged (its recorded hash no longer matches): compiled again, the file made whole
    blob = bytearray(kernels[0].read_bytes())
    blob[-1] ^= 0xFF
    kernels[0].write_bytes(bytes(blob))
    mended = _probe(file, cache)
    assert mended["objects"] == {"loaded": len(kernels) - 1, "compiled": 1} and mended["sha"] == first["sha"]
    code = kernels[0].read_bytes()[8 + 32:]
    assert kernels[0].read_bytes()[8:40] == hashlib.sha256(code).digest()
    off = _probe(file, tmp_path / "off", KVCODEC_KERNEL_CACHE="0")
    assert off["objects"]["loaded"] == 0 and off["sha"] == first["sha"] and not (tmp_path / "off").exists()
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory would be")
    assert _probe(file, blocked)["sha"] == first["sha"]
