"""The shape of the code base: the tier and codec contracts hold, imports form no cycle, no private name
crosses modules, and the generated lane decoders are what their generator writes."""

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvcodec
from kvcodec import registry
from kvcodec.container import layout as L

from .common import check_rejects, check_roundtrip, random_cache

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvcodec"


def test_a_new_tier_is_one_class_and_a_registry_entry():
    """A tier and its codec registered in a few lines: encode, inspect, decode and the container's checks work
    without touching anything else; once unregistered, its files are refused by name."""
    from kvcodec.codecs.base import Codec
    from kvcodec.dtypes import DTYPES, bit_patterns
    from kvcodec.tiers.base import DirectTier

    @registry.register_codec
    class RawCodec(Codec):
        codec_id = "x-test-raw"

        def encode(self, t, where, prediction=None):
            return bit_patterns(t).astype(f"<u{DTYPES[where.dtype].itemsize}").tobytes()

        def decode(self, payload, where, prediction=None, out=None):
            dt = DTYPES[where.dtype]
            return np.frombuffer(payload, f"<u{dt.itemsize}").astype(dt.uint).reshape(where.shape)

    @registry.register_tier
    class RawTier(DirectTier):
        tier_id, codec_ids, summary = "x-test-raw", ("x-test-raw",), "raw little-endian tensors"

        def codec(self, job):
            return RawCodec()

    try:
        data = check_roundtrip(random_cache(layers=3, seq=9), tier="x-test-raw", chunk_tokens=4)
        assert kvcodec.inspect(data)["codec"]["id"] == "x-test-raw"
        check_rejects(kvcodec.ConfigError, random_cache(), tier="x-test-raw", bits=2)  # options it does not take
    finally:
        registry.unregister_tier("x-test-raw")
        registry.unregister_codec("x-test-raw")
    check_rejects(kvcodec.UnknownId, data, match="x-test-raw")


def test_every_tier_declares_the_contract():
    for tid in registry.tier_ids():
        t = registry.tier(tid)
        assert t.tier_id == tid and t.summary and t.codec_ids and 0 <= t.min_minor <= L.FORMAT_VERSION_MINOR
        assert t.read_minor is None or 0 <= t.read_minor <= t.min_minor
        assert all(c in registry.codec_ids() for c in t.codec_ids)
        assert isinstance(t.needs_model, bool) and isinstance(t.option_names, frozenset)


def test_the_builtin_tiers_are_listed_as_they_are():
    """registry.BUILTIN_TIERS (the command line's --tier choices and help, read without importing the tiers) names
    every built-in tier with its own summary."""
    assert {t: registry.tier(t).summary for t in registry.tier_ids()} == registry.BUILTIN_TIERS


def test_the_public_names_load_on_first_use():
    """``import kvcodec`` imports no tier, codec or torch; every name of ``__all__`` is there all the same (not a
    submodule of the same name, whichever was imported first), and the first look-up in the registry finds the
    built-in tiers and codecs."""
    code = """if True:
        import importlib, sys, types
        import kvcodec
        light = not any(m in sys.modules for m in ("torch", "transformers", "numba", "kvcodec.tiers"))
        from kvcodec import registry
        tiers = registry.tier_ids()
        for m in ("api", "cache", "calibrate", "models", "predict", "reduction", "store"):
            importlib.import_module("kvcodec." + m)
        missing = [n for n in kvcodec.__all__ if isinstance(getattr(kvcodec, n, None), (type(None), types.ModuleType))]
        from kvcodec import *  # noqa: F403
        print(light, tiers == sorted(registry.BUILTIN_TIERS), bool(registry.codec_ids()), missing, callable(Store),
              kvcodec.tokens.__name__)
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True", "True", "[]", "True", "kvcodec.tokens"], r.stdout


def _modules():
    """kvcodec module name -> (path, is package)."""
    out = {}
    for p in PACKAGE.rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        pkg = parts[-1] == "__init__"
        if pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (p, pkg)
    return out


def _imports(mods):
    """(importer, imported module, imported name or None, line) for every import statement, lazy ones too."""
    for name, (path, is_pkg) in mods.items():
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("kvcodec"):
                        yield name, a.name, None, node.lineno
            elif isinstance(node, ast.ImportFrom):
                target = (".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
                          if node.level else node.module or "")
                if not target.startswith("kvcodec"):
                    continue
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    yield (name, sub, None, node.lineno) if sub in mods else (name, target, a.name, node.lineno)


def test_no_import_cycles():
    mods = _modules()
    graph = {m: set() for m in mods}
    for src, dst, _, _ in _imports(mods):
        if dst in mods and dst != src and not src.startswith(dst + "."):  # a package's own submodules: not a cycle
            graph[src].add(dst)
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_no_private_name_crosses_modules():
    mods = _modules()
    bad = [f"{src}:{line} imports {dst}.{name}" for src, dst, name, line in _imports(mods)
           if name and name.startswith("_") and not name.startswith("__") and dst != src]
    assert not bad, bad


def test_api_is_a_thin_surface():
    assert len((PACKAGE / "api.py").read_text().splitlines()) <= 250


def test_generated_lane_decoders_match_their_generator(tmp_path):
    """kvcodec/entropy/_lanes_unrolled.py is generated by scripts/gen_lanes.py: it must be exactly its output."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_lanes.py"), "--stdout"], capture_output=True,
                         text=True, check=True).stdout
    assert out == (PACKAGE / "entropy" / "_lanes_unrolled.py").read_text()


def test_the_benches_find_the_peer_scripts():
    """kvz bench --lossy / --restore --peers run scripts/peers/* in the peers' venvs: the path they use is the
    checkout's (a wrong one once made every peer row read "not set up"), and every peer they name has a recipe."""
    import importlib.util

    from kvcodec.lab.bench_lossy import PEER_SCRIPTS, PEER_VENV, PEERS
    from kvcodec.lab.bench_restore import DECODE_PEERS

    for name in ("runner.py", "dequant.py", "setup.sh", "recipes.py"):
        assert (PEER_SCRIPTS / name).is_file(), PEER_SCRIPTS / name
    spec = importlib.util.spec_from_file_location("recipes", PEER_SCRIPTS / "recipes.py")
    recipes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipes)
    for peer in PEERS + DECODE_PEERS:
        assert PEER_VENV.get(peer, peer) in recipes.RECIPES, peer


def test_restore_bench_names_a_peer_it_cannot_run(tmp_path, monkeypatch):
    """kvz bench --restore --peers: a peer without a venv gets a row that says so (and the report shows it)."""
    from kvcodec.cache import to_canonical
    from kvcodec.lab import bench_restore

    from .common import random_cache

    monkeypatch.setenv("KVCODEC_PEERS", str(tmp_path / "no-venvs"))
    kv = to_canonical(random_cache())
    rows = bench_restore.peer_rows(["quanto"], kv, tmp_path, 1, 1)
    assert rows == [{"method": "peer quanto", "threads": 1, "bytes": None,
                     "error": "not set up: scripts/peers/setup.sh quanto"}]
    md = bench_restore.to_markdown({"command": "c", "machine": "m", "torch": "t", "numba": "n", "cpus": 1,
                                    "repeats": 1, "cases": [{"text": "x", "dtype": "bf16", "tokens": 16,
                                                             "raw_bytes": 1, "rows": rows}]})
    assert "peer quanto | 1 | - | failed: not set up" in md


def test_restore_bench_models_reading_from_storage():
    """kvz bench --restore: the storage speeds below which a restore beats reading the raw file, and above which
    it beats recomputing, from the measured times plus the file's bytes at that speed (worked by hand here)."""
    from kvcodec.lab.bench_restore import storage_speeds, to_markdown

    raw = {"method": "raw safetensors", "threads": 1, "bytes": 100_000_000, "restore_s": 0.050}
    rec = {"method": "recompute (one prefill)", "threads": 1, "bytes": None, "restore_s": 3.050}
    kvz = {"method": "kvz lossless", "threads": 1, "bytes": 40_000_000, "restore_s": 0.110}
    # 60 MB fewer to read pay for 60 ms more decoding below 1,000 MB/s; 40 MB read in the 2.94 s the prefill
    # takes longer: above 13.6 MB/s
    got = storage_speeds(kvz, raw, rec)
    assert got["beats_raw_below_mb_s"] == pytest.approx(1000.0)
    assert got["beats_recompute_above_mb_s"] == pytest.approx(40 / 2.94)
    assert storage_speeds({**kvz, "restore_s": 0.040}, raw, rec)["beats_raw_below_mb_s"] == "any"
    assert storage_speeds({**kvz, "bytes": 100_000_001}, raw, rec)["beats_raw_below_mb_s"] == "none"
    assert storage_speeds({**kvz, "restore_s": 3.5}, raw, rec)["beats_recompute_above_mb_s"] == "none"
    assert storage_speeds(raw, raw, rec) == {"beats_recompute_above_mb_s": pytest.approx(100 / 3.0)}
    assert storage_speeds(rec, raw, rec) == {} and storage_speeds(kvz, None, None) == {}
    rows = [{**r, "mb_s": 0.0, **storage_speeds(r, raw, rec)} for r in (raw, kvz, rec)]
    md = to_markdown({"command": "c", "machine": "m", "torch": "t", "numba": "n", "cpus": 1, "repeats": 1,
                      "cases": [{"text": "x", "dtype": "bf16", "tokens": 16, "raw_bytes": 1, "rows": rows}]})
    assert "| kvz lossless | 1 | 40000000 | 110.0 | 0 | - | - | - | 1,000 | 14 |" in md
    assert "| raw safetensors | 1 | 100000000 | 50.0 | 0 | - | - | - | - | 33 |" in md
    slow = {**kvz, "restore_s": 3.0, **storage_speeds({**kvz, "restore_s": 3.0}, raw, rec), "mb_s": 0.0}
    assert slow["beats_recompute_above_mb_s"] == pytest.approx(800.0)  # 40 MB in 0.05 s
    tiny = {**kvz, "bytes": 4292, "restore_s": 3.0, "mb_s": 0.0}
    tiny.update(storage_speeds(tiny, raw, rec))  # 4,292 bytes in 0.05 s: 0.086 MB/s, not "0"
    md = to_markdown({"command": "c", "machine": "m", "torch": "t", "numba": "n", "cpus": 1, "repeats": 1,
                      "cases": [{"text": "x", "dtype": "bf16", "tokens": 16, "raw_bytes": 1, "rows": [slow, tiny]}]})
    # 60 MB fewer in 2.95 s more: 20 MB/s; 99.996 MB fewer in 2.95 s: 34
    assert "| 20 | 800 |" in md and "| 4292 | 3000.0 | 0 | - | - | - | 34 | 0.086 |" in md


def test_lossless_bench_times_zstd_in_both_forms():
    """kvz bench: zstd's decode timed as ``decompress()`` and into a new NumPy block, the faster compared (zstd -3's
    interleaved with kvz's decodes); the block form gives zstd's bytes (a decode that stopped short would
    raise)."""
    import zstandard

    from kvcodec.cache import to_canonical
    from kvcodec.lab import bench

    from .common import random_cache

    kv = to_canonical(random_cache())
    rows = {r["method"]: r for r in bench.bench_cache(kv, 1, False)}
    for method in ("zstd -3", "zstd -3, byte-grouped"):
        z = rows[method]
        assert z["dec_s"] == min(z["dec_s_bytes"], z["dec_s_block"]) > 0 and z["enc_s"] > 0
    assert list(rows)[:3] == ["raw", "order-0 entropy of the 16-bit words", "zstd -3"]
    assert rows["kvz lossless, 1 thread"]["dec_s"] > 0 and rows["kvz lossless, 1 thread"]["ratio"] > 0
    raw = bench._raw_bytes(kv)
    frame = zstandard.ZstdCompressor(level=3).compress(raw)
    assert bench._zstd_block(zstandard.ZstdDecompressor(), frame, len(raw)).tobytes() == raw
    with pytest.raises(ValueError, match="shorter"):
        bench._zstd_block(zstandard.ZstdDecompressor(), frame, len(raw) + 1)


def test_output_block_views_are_aligned_and_disjoint():
    """A decode's layer tensors are views of one allocation: each C-contiguous, of its shape, the non-empty ones
    64-byte aligned and none overlapping another, and writable through torch as a cache is."""
    import torch

    from kvcodec.dtypes import from_bit_patterns
    from kvcodec.tiers.base import output_block

    shapes = {(0, 0): (1, 3, 7, 64), (0, 1): (1, 3, 7, 48), (1, 0): (2, 1, 0, 64), (1, 1): (1, 5, 3, 1)}
    outs = output_block(shapes, np.uint16)
    spans = []
    for key, shape in shapes.items():
        a = outs[key]
        assert a.shape == shape and a.dtype == np.uint16 and a.flags.c_contiguous and a.flags.writeable
        if a.size:  # (NumPy gives an empty view a pointer of its own)
            assert a.ctypes.data % 64 == 0, key
            spans.append((a.ctypes.data, a.ctypes.data + a.nbytes))
        a[...] = sum(key) + 1
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    for key in shapes:  # nothing written through one view shows in another
        assert (outs[key] == sum(key) + 1).all()
    t = from_bit_patterns(outs[0, 0], torch.bfloat16)
    t.zero_()
    assert not outs[0, 0].any() and (outs[0, 1] == 2).all()


def test_interleaved_medians_runs_the_untimed_step_before_each_call():
    """kvz bench --restore touches fresh memory before each timed call (untimed): the hook runs once before every
    call, rows in order, and its time is not charged to the call."""
    import time

    from kvcodec.lab.common import interleaved_medians, touch_fresh_memory

    log = []

    def before():
        log.append("before")
        time.sleep(0.05)

    times = interleaved_medians({"a": lambda: log.append("a"), "b": lambda: log.append("b")}, 3, before=before)
    assert log == ["before", "a", "before", "b"] * 3
    assert max(times.values()) < 0.04  # the calls append to a list; the 50 ms sleeps are not in their times
    touch_fresh_memory(1 << 20)
    touch_fresh_memory(0)
