#!/usr/bin/env python
"""Time-bounded fuzzing of the .kvz decoder (pure Python, no extra tools).

    python fuzz/fuzz.py --seconds 60            # all targets, split evenly
    python fuzz/fuzz.py --target resealed --seconds 300 --seed 7

Targets
  bytes     arbitrary bytes (random, and random bytes behind a valid magic)
  mutate    valid files (spec/vectors, fuzz/corpus) with bit flips, byte sets,
            truncation, extension, splices and length fields overwritten
  resealed  like ``mutate`` but every checksum is recomputed afterwards, so the
            mutation reaches the header parser and the payload decoders
            instead of stopping at a checksum
  payload   bit flips inside section payloads or digits of the header of valid
            files, resealed: reaches the token decoders, the residual codec and
            the model-replay path of the token tiers (with the vectors' model)
  header    structure-aware: one value of a valid file's JSON header (any
            depth, ``info`` and ``tokens.schedule`` included) replaced by a
            hostile one (huge or negative integers, 4,000-digit numbers, 1e400,
            deep nesting, lone surrogates, huge schedule runs), the file
            rebuilt with every offset shifted and every checksum resealed
  roundtrip random caches (dtype, shape, options) -> encode -> decode == input

Every input is decoded and inspected.  Any exception other than ``KvzError``
is a finding, as is an input that takes more than ``--hang`` seconds or whose
peak allocation (tracemalloc, which sees NumPy's buffers) exceeds the bound
of spec section 9 for the declared output limit: ``--max-ratio`` x
``max_output_bytes`` + 64 MiB.  The summary reports executions, the
exceptions by type and the largest peak against that bound.  Findings are written to
``fuzz/crashes/`` and the run exits 1; copy each into ``tests/data/malformed/``
as a regression file once fixed.  Run with ``NUMBA_BOUNDSCHECK=1`` to make
out-of-bounds reads in the Numba kernels raise instead of reading garbage.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import struct
import sys
import time
import traceback
import tracemalloc
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import kvcodec  # noqa: E402
from kvcodec.container import layout as L  # noqa: E402
from kvcodec.errors import ConfigError, KvzError, NumericsMismatch, PredictorsRequired  # noqa: E402

LIMITS = {"max_output_bytes": 1 << 24}
INTERESTING32 = [0, 1, 2, 0x7F, 0x80, 0xFF, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF]


def seeds() -> list[bytes]:
    out = [p.read_bytes() for p in sorted((ROOT / "spec" / "vectors").glob("*.kvz"))]
    out += [p.read_bytes() for p in sorted((ROOT / "fuzz" / "corpus").glob("*")) if p.is_file()]
    return out


def reseal(data: bytes) -> bytes:
    """Recompute every checksum of a (possibly mutated) file, where its structure still parses."""
    b = bytearray(data)
    if len(b) < L.PREAMBLE.size:
        return data
    hlen = struct.unpack_from("<I", b, 12)[0]
    hend = L.PREAMBLE.size + hlen
    if hend + 8 > len(b):
        return data
    hsum = L.xxh3(bytes(b[:hend]))
    struct.pack_into("<Q", b, hend, hsum)
    pos = hend + 8
    index_offset = None
    while pos + 40 <= len(b) - 32:
        n = struct.unpack_from("<Q", b, pos + 16)[0]
        if pos + 40 + n > len(b):
            break
        typ = struct.unpack_from("<H", b, pos)[0]
        struct.pack_into("<Q", b, pos + 24, L.xxh3(bytes(b[pos + 40:pos + 40 + n])))
        struct.pack_into("<Q", b, pos + 32, L.xxh3(bytes(b[pos:pos + 32])))
        if typ == L.SECTION_INDEX:
            index_offset = pos
        pos += 40 + n
    if index_offset is not None and len(b) >= 32:
        fo = len(b) - 32
        io_, fl = struct.unpack_from("<QQ", b, fo)
        struct.pack_into("<Q", b, fo + 16, L.footer_checksum(io_, fl, hsum))
    return bytes(b)


def header_of(data: bytes):
    """The JSON header of a file (None if it does not parse as JSON)."""
    import json

    hlen = struct.unpack_from("<I", data, 12)[0]
    try:
        return json.loads(data[16:16 + hlen])
    except ValueError:
        return None


def with_header(data: bytes, header, *, raw: bytes | None = None) -> bytes:
    """``data`` with its header replaced by ``header`` (canonical JSON) or by the bytes ``raw``: every offset
    after it (index entries, Index_Offset, File_Length) shifted and every checksum resealed."""
    import json

    new = raw if raw is not None else json.dumps(header, sort_keys=True, separators=(",", ":"),
                                                 ensure_ascii=False).encode()
    hlen = struct.unpack_from("<I", data, 12)[0]
    delta = len(new) - hlen
    b = bytearray(data[:12] + struct.pack("<I", len(new)) + new + data[16 + hlen:])
    fo = len(b) - 32
    io_, fl = struct.unpack_from("<QQ", b, fo)
    io_ += delta
    struct.pack_into("<QQ", b, fo, io_, fl + delta)
    count = struct.unpack_from("<I", b, io_ + 40)[0]
    for i in range(count):
        at = io_ + 48 + 32 * i
        struct.pack_into("<Q", b, at, struct.unpack_from("<Q", b, at)[0] + delta)
    return reseal(bytes(b))


HOSTILE_VALUES = [0, -1, 1, 2**31, 2**31 - 1, 2**32, 2**63, 10**8, 10**40, -(10**40), 1e400, -1e400, 0.5, None,
                  True, "", "x" * 1000, [], {}, [[1, 10**8]], [[1, 2**31]], "\ud800", "@DEEP@", "@DIGITS@"]


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:8]):
            yield from _paths(v, prefix + (i,))


def mutate_header(rng: random.Random, data: bytes) -> bytes:
    """One header value replaced by a hostile one (structure-aware); the file rebuilt and resealed."""
    import json

    h = header_of(data)
    if not isinstance(h, dict):
        return data
    paths = [p for p in _paths(h) if p]
    path = rng.choice(paths)
    parent = h
    for k in path[:-1]:
        parent = parent[k]
    value = rng.choice(HOSTILE_VALUES)
    if isinstance(value, float) and abs(value) == 1e400 or value in ("\ud800", "@DEEP@", "@DIGITS@"):
        parent[path[-1]] = "@@"
        text = json.dumps(h, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        raw = {"\ud800": '"\\ud800"', "@DEEP@": "[" * 2000 + "]" * 2000, "@DIGITS@": "9" * 5000}.get(
            value, "1e400" if value == 1e400 else "-1e400")
        return with_header(data, None, raw=text.replace('"@@"', raw, 1).encode())
    parent[path[-1]] = value
    return with_header(data, h)


def mutate(rng: random.Random, data: bytes, pool: list[bytes]) -> bytes:
    b = bytearray(data)
    for _ in range(rng.choice([1, 1, 1, 2, 3, 8])):
        op = rng.randrange(7)
        if not b:
            b = bytearray(rng.choice(pool))
        if op == 0:  # bit flip
            i = rng.randrange(len(b) * 8)
            b[i // 8] ^= 1 << (i % 8)
        elif op == 1:  # byte set
            b[rng.randrange(len(b))] = rng.choice([0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)])
        elif op == 2:  # truncate
            del b[rng.randrange(len(b)):]
        elif op == 3:  # extend
            b += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        elif op == 4 and len(b) >= 4:  # 32-bit field overwrite
            i = rng.randrange(len(b) - 3)
            struct.pack_into("<I", b, i, rng.choice(INTERESTING32))
        elif op == 5 and len(b) >= 8:  # 64-bit length field overwrite (section lengths, footer)
            i = rng.randrange(len(b) - 7)
            struct.pack_into("<Q", b, i, rng.choice([0, 1, len(b), 2**32, 2**63, 2**64 - 1]))
        elif op == 6:  # splice from another seed
            other = rng.choice(pool)
            i, j = rng.randrange(len(b) + 1), rng.randrange(len(other) + 1)
            b = b[:i] + other[j:j + rng.randrange(1, 200)] + b[i + rng.randrange(0, 200):]
    return bytes(b)


def random_cache(rng: random.Random):
    dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
    layers = rng.randint(1, 3)
    b, h, d = rng.randint(1, 2), rng.randint(1, 3), rng.randint(1, 9)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    kv = []
    for _ in range(layers):
        s = rng.randint(0, 40)
        k = torch.randn(b, h, s, d, generator=g) * rng.choice([1e-3, 1, 1e3])
        v = torch.randn(b, h, s, d, generator=g)
        if rng.random() < 0.3 and k.numel():  # raw bit patterns, NaNs included
            iv = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[dtype]
            info = torch.iinfo(iv)
            k = torch.randint(info.min, info.max, k.shape, generator=g, dtype=iv).view(dtype)
            kv.append((k, v.to(dtype)))
        else:
            kv.append((k.to(dtype), v.to(dtype)))
    opts = {"chunk_tokens": rng.choice([1, 3, 7, 4096])}
    if rng.random() < 0.5:
        opts.update(context=rng.choice(["prev", "none"]), ways=rng.randint(1, 8), scale_bits=rng.randint(13, 15),
                    max_tables=rng.randint(1, 64))
    if rng.random() < 0.3:  # layer states (format 1.3): hybrid layers with random slots, shapes and dtypes
        from kvcodec.state import LayerState

        def tensor(shape):
            t = torch.randn(shape, generator=g) * rng.choice([0, 1e-3, 1, 1e3])
            return t.to(rng.choice([torch.float32, torch.float16, torch.bfloat16]))

        states = []
        for _ in range(layers):
            slots = rng.randint(1, 3)
            if rng.random() < 0.5:
                states.append(None)
                continue
            conv = [tensor((b, rng.randint(0, 9), rng.randint(1, 4))) if rng.random() < 0.6 else None
                    for _ in range(slots)]
            rec = [tensor((b, *[rng.randint(1, 5) for _ in range(rng.randint(0, 3))])) if rng.random() < 0.6
                   else None for _ in range(slots)]
            states.append(LayerState("hybrid", slots, conv, rec))
        kv = kvcodec.KVCache([k for k, _ in kv], [v for _, v in kv], states=states)
    return kv, opts


_MODEL = []


def vector_model(data: bytes | None = None):
    """The tiny model of the token-tier vectors, so mutated token-tier files reach the token decoders: the one
    whose fingerprint the header names (the Mamba of ``exact_state``, the V = 49152 Llama of
    ``exact_blocks_v49152``), else the tiny Llama of the others."""
    if not _MODEL:
        from transformers import AutoModelForCausalLM

        from kvcodec.models import model_fingerprint

        vec = ROOT / "spec" / "vectors" / "models"
        for name in ("tiny-llama", "tiny-mamba", "tiny-llama-v49152"):
            m = AutoModelForCausalLM.from_pretrained(vec / name).eval()
            _MODEL.append((model_fingerprint(m), m))
    try:  # a mutated header may be anything: bad JSON, deep nesting, bad UTF-8
        h = header_of(data) if data is not None and len(data) >= 16 else None
    except (ValueError, RecursionError, UnicodeDecodeError, struct.error):
        h = None
    m = h.get("model") if isinstance(h, dict) else None
    fp = m.get("fingerprint") if isinstance(m, dict) else None
    return next((mdl for f, mdl in _MODEL if f == fp), _MODEL[0][1])


def mutate_payload(rng: random.Random, data: bytes) -> bytes:
    from kvcodec.container.reader import KvzReader

    try:
        with KvzReader(data) as r:
            spans = [(e.payload_offset, e.length) for e in r.sections if e.length]
    except KvzError:
        return data
    b = bytearray(data)
    hlen = struct.unpack_from("<I", b, 12)[0]
    if rng.random() < 0.3 or not spans:
        pos = rng.randrange(16, 16 + hlen)
        if chr(b[pos]).isdigit():
            b[pos] = ord(str(rng.randrange(10)))
    else:
        off, n = rng.choice(spans)
        for _ in range(rng.randint(1, 3)):
            b[off + rng.randrange(n)] ^= 1 << rng.randrange(8)
    return reseal(bytes(b))


_PREDICTORS: list = []


def vector_predictors():
    """The predictors of the golden vector ``lossy_predicted`` (spec section 13.1), so mutated predicted files
    reach the predicted decoder (other files ignore them)."""
    if not _PREDICTORS:
        from kvcodec import predict

        _PREDICTORS.append(predict.from_bytes(
            (ROOT / "spec" / "vectors" / "lossy_predicted.predictors.safetensors").read_bytes()))
    return _PREDICTORS[0]


LLAMA_STATE = (ROOT / "spec" / "vectors" / "engine_llama_seq.engine.bin").read_bytes()


def llama_one(data: bytes):
    """A damaged llama.cpp state: a KvzError, or a state that packs and unpacks to the same bytes."""
    from kvcodec import llama_cpp

    try:
        llama_cpp.parse(data)
    except KvzError:
        return None
    except Exception:
        return "exception:\n" + traceback.format_exc()
    try:
        back = llama_cpp.unpack_bytes(llama_cpp.pack_bytes(data, threads=1), check_model=False)
    except Exception:
        return "exception:\n" + traceback.format_exc()
    return None if back == data else "pack / unpack changed the state"


def run_one(data: bytes, hang: float, bound: int, stats: dict):
    """Decode and inspect; return None, or a description of the finding.  ``stats`` collects the outcome
    (``ok`` or the KvzError subclass) and the largest peak allocation."""
    model = vector_model(data)
    tracemalloc.start()
    t = time.perf_counter()
    outcome = "ok"
    try:
        try:
            kvcodec.inspect(data)
        except KvzError:
            pass
        kvcodec.decode(data, model, output="kvcache", limits=LIMITS, threads=1, numerics="try",
                       predictors=vector_predictors())
        with kvcodec.open_kvz(data, limits=LIMITS, threads=1) as f:  # (1.10) an engine file: rebuild it
            if f.header.engine is not None:
                f.engine_file()
    except KvzError as e:
        outcome = type(e).__name__
    except Exception:
        return "exception:\n" + traceback.format_exc()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    stats["outcomes"][outcome] = stats["outcomes"].get(outcome, 0) + 1
    stats["peak"] = max(stats["peak"], peak)
    dt = time.perf_counter() - t
    if dt > hang:
        return f"hang: {dt:.1f} s"
    if peak > bound:
        return f"allocation: peak {peak / 2**20:.1f} MiB over the bound of {bound / 2**20:.0f} MiB"
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", choices=["all", "bytes", "mutate", "resealed", "payload", "header", "roundtrip",
                                         "llama"],
                    default="all")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--hang", type=float, default=10.0)
    ap.add_argument("--max-ratio", type=float, default=6.0,
                    help="peak allocation bound: this x max_output_bytes + 64 MiB (spec section 9)")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    rng = random.Random(seed)
    pool = seeds()
    targets = (["bytes", "mutate", "resealed", "payload", "header", "roundtrip", "llama"] if args.target == "all"
               else [args.target])
    bound = int(args.max_ratio * LIMITS["max_output_bytes"]) + (64 << 20)
    stats = {"outcomes": {}, "peak": 0}
    crashes = ROOT / "fuzz" / "crashes"
    findings = 0
    counts = {}
    per = args.seconds / len(targets)
    for data in pool:  # JIT warm-up outside the clock: every kernel variant the seeds use compiles here
        try:
            kvcodec.decode(data, vector_model(data), output="kvcache", threads=1, predictors=vector_predictors())
        except NumericsMismatch:  # a model-coded token vector written on a CPU with other float results: this
            pass  # machine refuses it by design (spec section 11.4); its mutants are still fuzzed
        except (ConfigError, PredictorsRequired):  # exact_draft_padded needs its draft model, lossy_predicted_far
            pass  # its own predictors: the fuzzer passes neither (their mutants still reach the header checks)
    for target in targets:
        end = time.perf_counter() + per
        n = 0
        while time.perf_counter() < end:
            n += 1
            if target == "llama":  # a llama.cpp state file, damaged: parsed, packed and unpacked byte for byte
                data = mutate(rng, LLAMA_STATE, [LLAMA_STATE])
                problem = llama_one(data)
            elif target == "roundtrip":
                kv, opts = random_cache(rng)
                try:
                    data = kvcodec.encode(kv, threads=1, **opts)
                    back = kvcodec.decode(data, output="kvcache")
                    ok = back.equal(kvcodec.to_canonical(kv))
                    problem = None if ok else "round trip changed the tensors"
                except kvcodec.ConfigError:
                    problem = None  # refused options (too many symbols for scale_bits): not a bug
                except Exception:
                    problem = "exception:\n" + traceback.format_exc()
                    data = b""
            else:
                if target == "bytes":
                    size = rng.randrange(0, 400)
                    data = bytes(rng.randrange(256) for _ in range(size))
                    if rng.random() < 0.5:
                        data = L.MAGIC + data
                elif target == "payload":
                    data = mutate_payload(rng, rng.choice(pool))
                elif target == "header":
                    data = mutate_header(rng, rng.choice(pool))
                else:
                    data = mutate(rng, rng.choice(pool), pool)
                    if target == "resealed":
                        data = reseal(data)
                problem = run_one(data, args.hang, bound, stats)
            if problem:
                findings += 1
                crashes.mkdir(exist_ok=True)
                name = hashlib.sha256(data).hexdigest()[:16]
                (crashes / f"{target}-{name}.bin").write_bytes(data)
                print(f"FINDING ({target}, seed {seed}, input {n}): {problem}", file=sys.stderr)
        counts[target] = n
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(stats["outcomes"].items(), key=lambda kv: -kv[1]))
    print(f"fuzz: seed {seed}, {sum(counts.values())} inputs {counts}, {findings} findings")
    print(f"fuzz: outcomes by type: {outcomes}")
    print(f"fuzz: peak allocation {stats['peak'] / 2**20:.1f} MiB, bound {bound / 2**20:.0f} MiB "
          f"({args.max_ratio:g} x max_output_bytes {LIMITS['max_output_bytes'] >> 20} MiB + 64 MiB)")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
