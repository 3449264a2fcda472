"""Issue-10 regressions: hostile headers are bounded, decoders' memory is bounded by the declared limits, and
saving is safe under crashes and concurrent writers."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import pytest
import torch

import kvcodec
from kvcodec.container import layout as L

from .common import check_rejects, fuzz_tools, random_cache

ROOT = Path(__file__).resolve().parent.parent
VECTORS = ROOT / "spec" / "vectors"
header_of, with_header = fuzz_tools().header_of, fuzz_tools().with_header


def vector(case):
    return (VECTORS / f"{case}.kvz").read_bytes()


def edited(case, edit):
    data = vector(case)
    h = header_of(data)
    edit(h)
    return with_header(data, h)


# --- the JSON header ------------------------------------------------------------------------------
@pytest.mark.parametrize("raw", [
    '{"x":%s}' % ("9" * 5000),  # Python's int() refuses > 4300 digits with a plain ValueError
    '{"x":1e400}',  # infinity
    '{"x":"\\ud800"}',  # lone surrogate escape
    '{"x":%s1%s}' % ("[" * 40, "]" * 40),  # deeper than the spec's 32 levels
    '{"x":%s1%s}' % ("[" * 5000, "]" * 5000),  # deep enough to exhaust the parser's stack
])
def test_hostile_json_in_info_is_a_format_error(raw):
    def edit(h):
        h["info"] = "@@"
    data = edited("bf16_basic", edit)
    h = header_of(data)
    text = json.dumps(h, sort_keys=True, separators=(",", ":")).replace('"@@"', raw)
    bad = with_header(data, None, raw=text.encode())
    for fn in (kvcodec.decode, kvcodec.inspect, kvcodec.open_kvz):
        check_rejects(kvcodec.FormatError, bad, fn=fn, match="Header")


def test_json_nesting_limit_is_the_same_everywhere():
    """32 levels pass (header object = level 1), 33 fail, in inspect and decode alike."""
    data = vector("bf16_basic")
    h = header_of(data)
    for depth, ok in ((32, True), (33, False)):
        nest = 1
        for _ in range(depth - 2):  # the header object and the info object are two levels
            nest = [nest]
        h["info"] = {"x": nest}
        bad = with_header(data, h)
        for fn in (kvcodec.decode, kvcodec.inspect):
            if ok:
                fn(bad)
            else:
                check_rejects(kvcodec.FormatError, bad, fn=fn, match="deeper than 32")


def test_codec_params_infinity_rejected():
    data = vector("bf16_basic")
    text = header_of(data)
    text["codec"]["params"]["x-big"] = "@@"
    raw = json.dumps(text, sort_keys=True, separators=(",", ":")).replace('"@@"', "-1e400").encode()
    check_rejects(kvcodec.FormatError, with_header(data, None, raw=raw), match="finite")


# --- counts are checked before anything is expanded -----------------------------------------------
@pytest.mark.parametrize("n", [10**8, 2**31])
def test_huge_schedule_is_refused_without_expanding(n):
    def edit(h):
        h["cache"]["num_tokens"] = n
        for lay in h["cache"]["layers"]:
            lay.update(seq_len=4, sliding_window=4, cumulative_length=n)
        h["tokens"]["schedule"] = [[1, n]]
    bad = edited("exact_lm_steps", edit)
    tracemalloc.start()
    t = time.perf_counter()
    try:
        check_rejects(kvcodec.LimitExceeded, bad, limits={"max_output_bytes": 1 << 20}, match="token ids")
        info = kvcodec.inspect(bad)  # within the default limit (or refused): header only, no expansion
        assert info["tier"] == "exact"
    except kvcodec.LimitExceeded:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert time.perf_counter() - t < 5 and peak < 16 << 20


def test_token_ids_count_against_the_output_limit():
    data = vector("fp32_chunked_tokens")
    h = kvcodec.inspect(data)
    need = h["raw_tensor_bytes"] + 4 * h["batch"] * h["tokens"]
    kvcodec.decode(data, limits={"max_output_bytes": need})
    check_rejects(kvcodec.LimitExceeded, data, limits={"max_output_bytes": need - 1})


# --- memory is bounded by the declared output ---------------------------------------------------
def test_side_information_memory_is_bounded_by_the_output():
    """Many rows, one token per chunk: the per-row side information is the largest part of the payload.
    The spec bounds it by 4x the slice's decoded bytes; the decoder must not widen it (it once used
    64 bytes per row for 2 decoded bytes: 33x the output limit)."""
    k = torch.zeros(1, 64, 1, 4096, dtype=torch.float16)
    k[..., ::7] = 1.0
    data = kvcodec.encode([(k, -k)], chunk_tokens=1, threads=1)
    out_bytes = 2 * k.numel() * 2
    kvcodec.decode(data, threads=1)  # compile the kernels outside the measurement
    tracemalloc.start()
    try:
        kvcodec.decode(data, output="kvcache", limits={"max_output_bytes": out_bytes}, threads=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 6 * out_bytes + (8 << 20), peak / out_bytes


# --- saving -----------------------------------------------------------------------------------------
_WRITER = textwrap.dedent("""
    import sys, torch, kvcodec
    path, seed, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    g = torch.Generator().manual_seed(seed)
    kv = [(torch.randn(1, 2, 200, 64, generator=g), torch.randn(1, 2, 200, 64, generator=g)) for _ in range(2)]
    print("ready", flush=True)
    for _ in range(n):
        kvcodec.save(path, kv, threads=1)
""")


def _writer(path, seed, n):
    return subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(seed), str(n)], stdout=subprocess.PIPE,
                            cwd=ROOT, text=True)


def test_concurrent_writers_leave_one_valid_file(tmp_path):
    p = tmp_path / "shared.kvz"
    procs = [_writer(p, seed, 8) for seed in (1, 2)]
    for pr in procs:
        assert pr.wait(timeout=300) == 0
    assert [q.name for q in tmp_path.iterdir()] == ["shared.kvz"]
    kv = kvcodec.load(p, output="kvcache")  # complete and valid: one writer's cache
    assert kv.keys[0].shape == (1, 2, 200, 64)


def test_killed_writer_leaves_the_old_file_and_its_temp_is_swept(tmp_path):
    p = tmp_path / "c.kvz"
    old = random_cache(layers=1, seq=8)
    kvcodec.save(p, old)
    before = p.read_bytes()
    pr = _writer(p, 3, 1000)
    assert pr.stdout.readline().strip() == "ready"
    time.sleep(1.5)
    pr.send_signal(signal.SIGKILL)
    pr.wait()
    names = sorted(q.name for q in tmp_path.iterdir())
    assert "c.kvz" in names
    kvcodec.load(p)  # the old file or a complete new one, never a prefix
    stale = [n for n in names if n.endswith(".kvz-tmp")]
    kvcodec.save(p, old)  # the next writer removes what the dead one left
    assert [q.name for q in tmp_path.iterdir()] == ["c.kvz"] and p.read_bytes() == before, stale


def test_another_hosts_temporary_file_is_never_swept_by_a_process_id(tmp_path):
    """On a shared file system a process id says nothing about another machine's writer: its temporary file
    (another host tag, a pid that is dead here) stays; this host's dead writer's goes."""
    from kvcodec import atomic

    p = tmp_path / "c.kvz"
    dead = 2 ** 22 + 12345  # above Linux's pid_max: no such process here
    other = tmp_path / f".c.kvz.{'0' * 8 if atomic.HOST != '0' * 8 else '1' * 8}-{dead}-abcd1234.kvz-tmp"
    mine = tmp_path / f".c.kvz.{atomic.HOST}-{dead}-abcd1234.kvz-tmp"
    other.write_bytes(b"x")
    mine.write_bytes(b"x")
    kvcodec.save(p, random_cache(layers=1, seq=4))
    assert other.exists() and not mine.exists()


def test_save_onto_a_missing_directory_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError):
        kvcodec.save(tmp_path / "no" / "c.kvz", random_cache(layers=1, seq=4))
    assert list(tmp_path.iterdir()) == []


# --- trailing data --------------------------------------------------------------------------------
def test_appended_bytes_are_trailing_data():
    data = vector("fp16_tiny")
    check_rejects(kvcodec.TrailingData, data + b"\0" * 100, match="File_Length")
    check_rejects(kvcodec.TrailingData, data + data)
    check_rejects(kvcodec.TruncatedFile, data[:-1])
    assert L.END_MAGIC in data


def test_crafted_regression_files_exist():
    names = {p.name for p in (ROOT / "tests" / "data" / "malformed").glob("*.bin")}
    assert {"header-bigint.bin", "header-deep.bin", "header-inf.bin", "header-surrogate.bin",
            "schedule-huge.bin", "trailing-data.bin"} <= names


def test_a_live_writers_temporary_file_is_not_swept_before_it_is_locked(tmp_path):
    """A writer's temporary file exists for a moment before the writer locks it, and (before this was fixed) for
    a moment after it unlocked it and before the rename: a second writer's sweep took it for a dead writer's and
    the first writer's rename failed (FileNotFoundError, seen in CI).  A file whose process is alive on this host
    is never swept; the rename happens while the file is still locked."""
    from kvcodec import atomic

    p = tmp_path / "c.kvz"
    live = tmp_path / f".c.kvz.{atomic.HOST}-{os.getpid()}-abcd1234.kvz-tmp"
    live.write_bytes(b"x")  # not locked: a writer between creating and locking it
    assert atomic.sweep_stale(str(p)) == [] and live.exists()
    with atomic.atomic_output(p) as f:
        f.write(b"data")
    assert p.read_bytes() == b"data" and live.exists()
