"""LMCache's own storage path, on the CPU, on a shared-prefix session workload (peer run, not part of kvcodec).

Runs in LMCache's own virtual environment (lmcache 0.5.6, torch 2.13.0+cpu; see docs/lmcache_backend.md):

    OMP_NUM_THREADS=1 PYTHONHASHSEED=0 LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_LOG_LEVEL=WARNING \
        ~/.cache/kvcodec/peers/lmcache/bin/python scripts/peers/lmcache_store.py --out /tmp/lmcache_store.json

Workload: the first ``--prefix-tokens`` (1,000) SmolLM2 tokens of the Python control-flow tutorial as a shared
prefix, then ``--sessions`` (10) sessions, each the prefix plus a run of 32-256 tokens from another corpus
file (seeded).  The KV cache is SmolLM2-135M's own (bfloat16, computed here with transformers: the prefix
once, each session's tail on top of a copy), laid out the way vLLM pages it (per layer
``[2, num_blocks, 16, 3, 64]``, blocks in shuffled order, a slot mapping per session).

Each mode builds an ``LMCacheEngine`` with ``LMCacheEngineBuilder.get_or_create`` and serves every session as
vLLM's LMCache connector does: ``lookup(tokens)`` (prefix tokens already stored), then ``store(tokens,
mask=...)`` with the hit prefix masked off, then waits until the chunks are on disk; afterwards every
session is fetched back with ``retrieve(tokens)`` into a fresh paged cache and compared with the original.

LMCache 0.5.6 ships no CPU connector for vLLM-paged caches (``CreateGPUConnector`` raises "No supported
cpu connector found"; ``VLLMPagedMemGPUConnectorV2.__init__`` calls ``torch.cuda.Stream()``).  ``CPUPagedConnector``
below is the only code of ours in LMCache's data path: it calls LMCache's own non-CUDA transfer kernel
(``lmcache.device_ops.multi_layer_kv_transfer``, the torch fallback) exactly where the CUDA connector calls
the CUDA one.  Everything else (chunking, chained chunk hashes, keys, allocation, storage manager, backends,
serde, files) is LMCache's.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # CacheGen reads the model's config by model_name: no hub here

import torch  # noqa: E402

torch.set_num_threads(1)

import lmcache  # noqa: E402
import lmcache.lmcache_native as lmcache_native  # noqa: E402
from lmcache import device_ops  # noqa: E402
from lmcache.utils import EngineType, mock_up_broadcast_fn, mock_up_broadcast_object_fn  # noqa: E402
from lmcache.v1.cache_engine import LMCacheEngineBuilder  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.gpu_connector import GPUConnectorInterface  # noqa: E402
from lmcache.v1.gpu_connector.utils import normalize_kv_and_discover_format  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402

CORPUS = Path("/work/shared/corpus")
MODEL_DIR = Path.home() / ".cache/kvcodec/models/smollm2-v1"
PREFIX_FILE = "techdoc_en_python_tutorial_controlflow.rst"
L, H, D = 30, 3, 64
BLOCK = 16  # vLLM page size
PER_TOKEN = 2 * L * H * D * 2  # bf16 bytes per position: 23,040


class CPUPagedConnector(GPUConnectorInterface):
    """vLLM-paged KV on the CPU <-> LMCache memory objects (KV_2LTD), via LMCache's torch transfer kernel."""

    def __init__(self, num_layers: int, hidden: int):
        self.num_layers, self.hidden = num_layers, hidden
        self.kvcaches = None

    def initialize_kvcaches_ptr(self, **kwargs):
        if "kvcaches" in kwargs:
            self.kvcaches = kwargs["kvcaches"]

    def _transfer(self, memory_obj, start, end, direction, **kwargs):
        self.initialize_kvcaches_ptr(**kwargs)
        # NHD hint: with no hint LMCache assumes vLLM's CPU attention layout (HND), which its
        # non-CUDA kernel rejects ("HND layouts are not supported in the non-CUDA fallback").
        fmt, kv = normalize_kv_and_discover_format(self.kvcaches, EngineType.VLLM, layout_hints={"kv_layout": "NHD"})
        nb, bs = kv[0].shape[1], kv[0].shape[2]
        views = [t.view(2, nb * bs, self.hidden) for t in kv]
        device_ops.multi_layer_kv_transfer(
            memory_obj.tensor, views, kwargs["slot_mapping"][start:end], torch.device("cpu"), nb * bs,
            direction, fmt, block_size=bs, head_size=kv[0].shape[-1])

    def from_gpu(self, memory_obj, start, end, **kwargs):
        self._transfer(memory_obj, start, end, lmcache_native.TransferDirection.D2H, **kwargs)
        memory_obj.metadata.fmt = MemoryFormat.KV_2LTD

    def to_gpu(self, memory_obj, start, end, **kwargs):
        self._transfer(memory_obj, start, end, lmcache_native.TransferDirection.H2D, **kwargs)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
        for m, s, e in zip(memory_objs, starts, ends):
            self.from_gpu(m, s, e, **kwargs)

    def batched_to_gpu(self, memory_objs, starts, ends, **kwargs):
        for m, s, e in zip(memory_objs, starts, ends):
            self.to_gpu(m, s, e, **kwargs)

    def get_shape(self, num_tokens):
        return torch.Size([2, self.num_layers, num_tokens, self.hidden])


# ---------------------------------------------------------------- workload

def sessions(tok, n_sessions: int, prefix_tokens: int, seed: int):
    prefix = tok((CORPUS / PREFIX_FILE).read_text(encoding="utf-8"), return_tensors="pt").input_ids[0, :prefix_tokens]
    files = sorted(p for p in CORPUS.iterdir() if p.suffix != ".md" and p.name != PREFIX_FILE)
    pools = [(p.name, tok(p.read_text(encoding="utf-8", errors="replace"), return_tensors="pt").input_ids[0])
             for p in files]
    rng = random.Random(seed)
    out = []
    for _ in range(n_sessions):
        name, pool = rng.choice(pools)
        n = rng.randint(32, 256)
        a = rng.randrange(0, max(1, pool.numel() - n))
        out.append((name, torch.cat([prefix, pool[a:a + n]])))
    return prefix, out


@torch.no_grad()
def real_caches(model, prefix, sess):
    """[L, 2, T, H, D] bf16 per session: the prefix once, each tail on top of a copy (as a server would)."""
    base = model(prefix[None], use_cache=True).past_key_values
    out = []
    for _, ids in sess:
        c = copy.deepcopy(base)
        model(ids[None, prefix.numel():], past_key_values=c, use_cache=True)
        kv = torch.stack([torch.stack([lay.keys[0], lay.values[0]]) for lay in c.layers])  # [L,2,H,T,D]
        out.append(kv.permute(0, 1, 3, 2, 4).contiguous().to(torch.bfloat16))
    return out


def paged(kv: torch.Tensor, rng: random.Random, spare_blocks: int = 8):
    """vLLM-style paged copy: per layer [2, nb, BLOCK, H, D], blocks in shuffled order, + slot mapping."""
    T = kv.shape[2]
    need = -(-T // BLOCK)
    nb = need + spare_blocks
    blocks = list(range(nb))
    rng.shuffle(blocks)
    slots = torch.tensor([blocks[t // BLOCK] * BLOCK + t % BLOCK for t in range(T)], dtype=torch.long)
    caches = []
    for layer in range(kv.shape[0]):
        c = torch.zeros(2, nb * BLOCK, H, D, dtype=kv.dtype)
        c[:, slots] = kv[layer]
        caches.append(c.view(2, nb, BLOCK, H, D))
    return caches, slots


def unpaged(caches, slots):
    return torch.stack([c.view(2, -1, H, D)[:, slots] for c in caches])


def lmcache_raw_bytes(sess, chunk=256, per_token=PER_TOKEN, partial=True):
    """kvcodec's bench_store._lmcache_raw_bytes arithmetic (partial=True), and its full-chunks-only variant."""
    seen, total = set(), 0
    for _, ids in sess:
        parent, t = b"", ids.numpy().astype("<u4")
        for a in range(0, t.size, chunk):
            if not partial and a + chunk > t.size:
                break
            parent = hashlib.sha256(parent + t[a:a + chunk].tobytes()).digest()
            if parent not in seen:
                seen.add(parent)
                total += (min(t.size, a + chunk) - a) * per_token
    return total


# ---------------------------------------------------------------- engine

def make_engine(name, root: Path, serde: str | None, unfull: bool, local_cpu: bool):
    kw = dict(chunk_size=256, local_cpu=local_cpu, max_local_cpu_size=1.0, save_unfull_chunk=unfull,
              lmcache_instance_id=name)
    if serde is None:
        kw.update(local_disk=str(root), max_local_disk_size=4.0)
    else:  # LMCache's file-system remote connector: one file per chunk, serialized by remote_serde
        kw.update(remote_url=f"fs://localhost:0{root}", remote_serde=serde)
    cfg = LMCacheEngineConfig.from_defaults(**kw)
    # model_name = the local model directory, as vLLM names a model served from a path; CacheGenConfig
    # knows 4 model names and otherwise calls AutoConfig.from_pretrained(model_name)
    md = LMCacheMetadata(model_name=str(MODEL_DIR), world_size=1, local_world_size=1, worker_id=0,
                         local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(L, 2, 256, H, D))
    eng = LMCacheEngineBuilder.get_or_create(name, cfg, md, CPUPagedConnector(L, H * D),
                                             mock_up_broadcast_fn, mock_up_broadcast_object_fn)
    eng.post_init()
    return eng


def wait_stored(eng, tokens, expect, timeout=120.0):
    """Block until lookup sees `expect` prefix tokens (disk writes are asynchronous in LMCache)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if eng.lookup(tokens) >= expect:
            return True
        time.sleep(0.002)
    return False


def dir_stats(root: Path):
    files = [p for p in root.rglob("*") if p.is_file()]
    du = subprocess.run(["du", "-sb", str(root)], capture_output=True, text=True).stdout.split()[0]
    du_k = subprocess.run(["du", "-sk", str(root)], capture_output=True, text=True).stdout.split()[0]
    return {"files": len(files), "file_bytes": sum(p.stat().st_size for p in files), "du_apparent_bytes": int(du),
            "du_disk_kib": int(du_k), "sizes": sorted({p.stat().st_size for p in files})}


def run_mode(mode, serde, unfull, sess, kvs, work: Path, seed: int):
    root = work / mode
    root.mkdir(parents=True)
    rng = random.Random(seed)
    eng = make_engine(f"kvz-{mode}", root, serde, unfull, local_cpu=False)
    chunk = 256
    put_call, put_durable, hits, expected_stored = [], [], [], []
    for (_, ids), kv in zip(sess, kvs):
        caches, slots = paged(kv, rng)
        T = ids.numel()
        want = T if unfull else T - T % chunk
        t0 = time.perf_counter()
        hit = eng.lookup(ids)
        mask = torch.ones(T, dtype=torch.bool)
        mask[:hit] = False
        eng.store(ids, mask=mask, kvcaches=caches, slot_mapping=slots)
        t1 = time.perf_counter()
        ok = wait_stored(eng, ids, want)
        t2 = time.perf_counter()
        assert ok, f"{mode}: chunks never reached the backend"
        put_call.append(t1 - t0)
        put_durable.append(t2 - t0)
        hits.append(hit)
        expected_stored.append(want)
    after_put = dir_stats(root)

    # dedup check: store every session again with no mask (no lookup first); count files added / rewritten
    mtimes = {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}
    restore_call = []
    for (_, ids), kv in zip(sess, kvs):
        caches, slots = paged(kv, rng)
        t0 = time.perf_counter()
        eng.store(ids, kvcaches=caches, slot_mapping=slots)
        restore_call.append(time.perf_counter() - t0)
    time.sleep(2.0)
    after_restore = dir_stats(root)
    after_restore["rewritten_files"] = sum(1 for p, m in mtimes.items() if p.exists() and p.stat().st_mtime_ns != m)
    after_restore["store_call_s_median"] = statistics.median(restore_call)

    def fetch_all(engine):
        times, got, errs = [], [], []
        for (_, ids), kv in zip(sess, kvs):
            caches, slots = paged(torch.zeros_like(kv), rng)
            t0 = time.perf_counter()
            n = engine.lookup(ids)
            ret = (engine.retrieve(ids, kvcaches=caches, slot_mapping=slots) if n
                   else torch.zeros(ids.numel(), dtype=torch.bool))
            times.append(time.perf_counter() - t0)
            k = int(ret.sum())
            got.append(k)
            if k:
                back = unpaged(caches, slots)[:, :, :k].float()
                ref = kv[:, :, :k].float()
                errs.append({
                    "exact": bool(torch.equal(back, ref)),
                    "relmse_k": float(((back[:, 0] - ref[:, 0]) ** 2).mean() / (ref[:, 0] ** 2).mean()),
                    "relmse_v": float(((back[:, 1] - ref[:, 1]) ** 2).mean() / (ref[:, 1] ** 2).mean()),
                })
        return times, got, errs

    get_same, got_same, err_same = fetch_all(eng)
    LMCacheEngineBuilder.destroy(f"kvz-{mode}")
    # a fresh engine over the same directory (what a restarted server would see)
    eng2 = make_engine(f"kvz-{mode}-restart", root, serde, unfull, local_cpu=False)
    get_fresh, got_fresh, err_fresh = fetch_all(eng2)
    LMCacheEngineBuilder.destroy(f"kvz-{mode}-restart")

    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {
        "mode": mode, "serde": serde or "none (local_disk writes raw memory objects)", "save_unfull_chunk": unfull,
        "disk_after_puts": after_put, "disk_after_restoring_all_unmasked": after_restore,
        "prefix_hits_at_put": hits, "tokens_expected_stored": expected_stored,
        "put_call_s_median": med(put_call), "put_durable_s_median": med(put_durable),
        "put_call_s": put_call, "put_durable_s": put_durable,
        "get_s_median_same_engine": med(get_same), "get_tokens_same_engine": got_same,
        "get_s_same_engine": get_same,
        "get_exact_same_engine": all(e["exact"] for e in err_same) if err_same else None,
        "get_relmse_k_same_engine": max((e["relmse_k"] for e in err_same), default=None),
        "get_relmse_v_same_engine": max((e["relmse_v"] for e in err_same), default=None),
        "get_s_median_fresh_engine": med(get_fresh), "get_tokens_fresh_engine": got_fresh,
        "get_exact_fresh_engine": all(e["exact"] for e in err_fresh) if err_fresh else None,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=10)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="disk,disk_unfull,fs_naive,fs_naive_unfull,fs_cachegen,fs_cachegen_unfull")
    ap.add_argument("--workdir", default=None, help="kept after the run when given")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dump-tokens", default=None, help="write the sessions' token ids (JSON) here")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    prefix, sess = sessions(tok, args.sessions, args.prefix_tokens, args.seed)
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, torch_dtype=torch.bfloat16).eval()
    kvs = real_caches(model, prefix, sess)
    cache_s = time.perf_counter() - t
    del model

    lens = [ids.numel() for _, ids in sess]
    info = {
        "versions": {"lmcache": lmcache.__version__, "torch": torch.__version__, "python": sys.version.split()[0],
                     "transformers": __import__("transformers").__version__},
        "workload": {"prefix_tokens": prefix.numel(), "sessions": len(sess), "session_tokens": lens,
                     "tail_files": [n for n, _ in sess], "seed": args.seed, "bytes_per_token_bf16": PER_TOKEN,
                     "all_positions_bytes": sum(lens) * PER_TOKEN,
                     "ideal_prefix_once_bytes": (prefix.numel() + sum(x - prefix.numel() for x in lens)) * PER_TOKEN,
                     "kvcodec_lmcache_raw_bytes_arith_partial": lmcache_raw_bytes(sess, partial=True),
                     "kvcodec_lmcache_raw_bytes_arith_full_chunks_only": lmcache_raw_bytes(sess, partial=False),
                     "real_cache_compute_s": round(cache_s, 2)},
        "results": [],
    }
    modes = {"disk": (None, False), "disk_unfull": (None, True), "fs_naive": ("naive", False),
             "fs_naive_unfull": ("naive", True), "fs_cachegen": ("cachegen", False),
             "fs_cachegen_unfull": ("cachegen", True)}
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="lmcache_store_"))
    work.mkdir(parents=True, exist_ok=True)
    for m in args.modes.split(","):
        serde, unfull = modes[m]
        try:
            r = run_mode(m, serde, unfull, sess, kvs, work, args.seed)
        except Exception as e:  # record, go on with the other modes
            import traceback
            r = {"mode": m, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        info["results"].append(r)
        print(json.dumps({k: v for k, v in r.items() if not k.endswith("_s")}, default=str), flush=True)
    if args.dump_tokens:
        Path(args.dump_tokens).write_text(json.dumps({"prefix": prefix.tolist(),
                                                      "sessions": [[n, ids.tolist()] for n, ids in sess]}))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(info, indent=1, default=str))
    print(json.dumps(info["workload"], default=str))


if __name__ == "__main__":
    main()
