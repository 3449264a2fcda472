"""The public surface: encode / decode / save / load / inspect / open_kvz, and a reusable :class:`Encoder`.

Everything tier-specific lives in the tiers (:mod:`kvcodec.tiers`), found by id
through :mod:`kvcodec.registry`; this module picks the tier, runs its option
checks, hands it the cache and handles the fallback to the lossless tier.
"""

from __future__ import annotations

import dataclasses
import io
import os

import torch

from . import registry
from .atomic import atomic_output
from .cache import to_canonical
from .container import layout as L
from .errors import ConfigError, FallbackWarning, warn
from .file import KvzFile, open_path
from .tiers.base import DEFAULT_CHUNK_TOKENS, UNSET, EncodeJob, Fallback, Options

__all__ = ["Encoder", "encode", "decode", "save", "load", "inspect", "open_kvz", "KvzFile"]

_PER_CACHE = ("tokens", "schedule", "attention_mask", "info", "progress", "engine")


class Encoder:
    """Encoder settings, reusable across caches (like python-zstandard's ``ZstdCompressor``).

    Parameters
    ----------
    tier : str, optional
        ``"exact"`` (default with a model: tokens + residual, bit-identical),
        ``"tokens"`` (tokens only - restore is recompute - or, with
        ``tolerance=eps``, a residual bounding the error by eps), ``"lossless"``
        (default without a model: the tensors themselves, bit-exact, no model
        needed to decode) or ``"lossy"`` (quantized to ``bits=`` per component
        or to ``max_kl=``, no model needed to decode).  When a token tier cannot
        store a cache (tokens not recoverable, a cache not starting at position
        0 ...) it is stored losslessly with a :class:`~kvcodec.errors.FallbackWarning`.
    chunk_tokens : int
        Tokens per kv / residual section: the granularity of random access.
    threads : int, optional
        Sections coded in parallel; default: ``$KVCODEC_THREADS`` or every core.
    token_model : ``"auto"`` (default), ``"lm"``, ``"blocks"``, ``"static"`` or ``"draft"``
        Token tiers: the token channel's probability model - the model itself
        (``lm``: fewest bits, decoding runs it token by token), in parallel
        blocks of ``block_tokens=`` (that many batched calls), an adaptive
        context model (``static``: no network), or ``draft=``; ``auto`` picks
        blocks or static so a restore takes about two prefills (recorded).
    tolerance : float or None
        Token tiers: 0 = lossless residual, eps = max abs error eps, None = no residual.
    **codec_options
        The tier's codec options: lossless ``scale_bits``, ``ways``,
        ``max_tables``, ``context``, ``coded_bits``; lossy ``bits``,
        ``max_kl``, ``quantizer``, ``window``, ``sink`` ... (``spec/kvz.md``).

    Examples
    --------
    >>> import torch, kvcodec
    >>> enc = kvcodec.Encoder(tier="lossy", bits=4.0, sink=0)
    >>> cache = [(torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4))]
    >>> kvcodec.decode(enc.encode(cache), output="kvcache").keys[0].shape
    torch.Size([1, 2, 8, 4])
    """

    def __init__(self, *, tier: str | None = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 threads: int | None = None, token_model: str | None = None, draft=None, tolerance=UNSET,
                 **codec_options):
        if tier is not None:
            registry.tier(tier)  # ConfigError naming the tiers there are
        if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or not (
                1 <= chunk_tokens <= L.MAX_CHUNK_TOKENS):
            raise ConfigError(f"chunk_tokens must be an int in [1, {L.MAX_CHUNK_TOKENS}]")
        self.options = Options(tier, chunk_tokens, threads, token_model, draft, tolerance, codec_options)
        #: what the tier reported about the last cache it encoded (token tiers: ``cross_entropy_bits``,
        #: ``schedule_source``; after a fallback: ``fallback``)
        self.last_report: dict = {}

    def tier_for(self, model) -> str:
        """The tier this encoder uses with (or without) a model."""
        o = self.options
        if o.tier is not None:
            return o.tier
        if model is None:
            return "lossless"
        return "tokens" if o.tolerance is not UNSET and o.tolerance != 0 else "exact"

    def write(self, sink, cache, model=None, *, tokens=None, schedule=None, attention_mask=None,
              info: dict | None = None, progress=None, engine: tuple | None = None) -> int:
        """Encode ``cache`` into the binary file-like ``sink`` (written sequentially); returns bytes written.
        ``engine``: an engine file's ``(engine_file object, verbatim bytes)`` (spec 15; :mod:`kvcodec.llama_cpp`)."""
        opts = self.options
        kv = to_canonical(cache)
        tier_id = self.tier_for(model)
        if kv.reduce is not None and registry.tier(tier_id).header_key is not None:  # a token tier
            if opts.tier is not None:
                raise ConfigError(f"tier {tier_id!r} recomputes the cache from its tokens, which a reduced cache's "
                                  "atoms are not: store it with tier 'lossless' or 'lossy'")
            tier_id = "lossless"
        tier = registry.tier(tier_id)
        tier.check(opts, model)
        if tokens is not None:
            tokens = torch.as_tensor(tokens)
            tokens = tokens.unsqueeze(0) if tokens.dim() == 1 else tokens
        job = EncodeJob(sink, cache, kv, model, opts, tokens, schedule, attention_mask, info, progress, engine=engine)
        self.last_report = job.report
        try:
            return tier.write(job)
        except Fallback as e:
            job.report["fallback"] = str(e)
            dropped = ""
            if job.tokens is not None and job.tokens.shape[-1] != job.kv.seq_len:
                job.tokens = None
                dropped = " without the token ids (they cover positions the sliding windows dropped)"
            warn(f"tier {tier.tier_id!r} cannot store this cache ({e}); stored losslessly instead{dropped}",
                 FallbackWarning)
            job.info = {**job.base_info(), "fallback": str(e)}
            job.options = dataclasses.replace(opts, tier="lossless", token_model=None, draft=None, tolerance=UNSET,
                                              codec={})
            return registry.tier("lossless").write(job)

    def encode(self, cache, model=None, **per_cache) -> bytes:
        """Encode ``cache`` to .kvz bytes; ``per_cache``: ``tokens``, ``schedule``, ``attention_mask``, ``info``."""
        # a BytesIO, whose buffer takes each section as it comes (its getvalue shares the buffer): the encode's
        # peak memory is about the file's size; keeping the sections to join them once was ~5 % faster and
        # held the file twice (bf16 SmolLM2 cache: 57.1 against 37.3 MiB; BENCHMARKS "Encode speed")
        buf = io.BytesIO()
        self.write(buf, cache, model, **per_cache)
        return buf.getvalue()

    def save(self, path, cache, model=None, *, overwrite: bool = True, **per_cache) -> int:
        """Encode ``cache`` to ``path`` (local path or fsspec URL), streaming; returns bytes written.

        A local file appears complete or not at all (:func:`kvcodec.atomic.atomic_output`: a temporary file
        unique to this writer, fsynced, renamed over the target), so a crash or a concurrent writer never
        leaves a half-written file; the last writer wins.
        """
        if isinstance(path, os.PathLike) or "://" not in str(path):
            with atomic_output(path, overwrite=overwrite) as f:
                return self.write(f, cache, model, **per_cache)
        with open_path(path, "wb") as f:
            return self.write(f, cache, model, **per_cache)


def _split(kwargs: dict) -> tuple[Encoder, dict]:
    per_cache = {k: kwargs.pop(k) for k in _PER_CACHE if k in kwargs}
    return Encoder(**kwargs), per_cache


def encode(cache, model=None, **kwargs) -> bytes:
    """Encode a KV cache to .kvz bytes.

    ``cache`` is a transformers ``DynamicCache`` (or a
    :class:`~kvcodec.tokens.RecordingCache`, which also records how it was
    filled), a tuple of ``(key, value)`` pairs or a :class:`~kvcodec.KVCache`;
    ``model`` the transformers model it was made with, or ``(model,
    tokenizer)``.  Keyword arguments: the :class:`Encoder` settings, and per
    cache ``tokens=`` (its ids ``[batch, seq]``: token tiers recover them from
    the cache when omitted, direct tiers store them alongside),
    ``schedule=`` (how it was filled: ``"prefill"``, call sizes or ``[size,
    count]`` runs; else recorded or inferred), ``attention_mask=`` (left
    padding of a batch; else inferred from pad tokens) and ``info=``
    (free-form metadata).

    Examples
    --------
    >>> import torch, kvcodec
    >>> cache = [(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))]
    >>> data = kvcodec.encode(cache)
    >>> out = kvcodec.decode(data, output="kvcache")
    >>> out.equal(kvcodec.KVCache([cache[0][0]], [cache[0][1]]))
    True
    """
    enc, per_cache = _split(kwargs)
    return enc.encode(cache, model, **per_cache)


def save(path, cache, model=None, *, overwrite: bool = True, **kwargs) -> int:
    """:func:`encode` ``cache`` to ``path`` (local path or fsspec URL), atomically for local paths; returns
    bytes written.  ``overwrite=False`` refuses an existing local file (:class:`ConfigError`)."""
    if isinstance(cache, (str, os.PathLike)) and not isinstance(path, (str, os.PathLike)):
        path, cache = cache, path  # save(cache, path), safetensors' order: a cache is never a path
    enc, per_cache = _split(kwargs)
    return enc.save(path, cache, model, overwrite=overwrite, **per_cache)


def open_kvz(source, model=None, *, draft=None, limits: dict | None = None, threads: int | None = None,
             numerics: str = "strict", predictors=None) -> KvzFile:
    """Open a .kvz file (bytes, path, fsspec URL or file object) for lazy reading."""
    return KvzFile(source, model, draft=draft, limits=limits, threads=threads, numerics=numerics,
                   predictors=predictors)


def _convert(kv, output: str, model=None):
    conversions = {"dynamic": lambda: kv.to_dynamic_cache(model=model), "kvcache": lambda: kv,
                   "legacy": lambda: kv.to_legacy()}
    if output not in conversions:
        raise ConfigError(f"output must be 'dynamic', 'kvcache' or 'legacy', not {output!r}")
    return conversions[output]()


def decode(data, model=None, *, draft=None, output: str = "dynamic", limits: dict | None = None,
           threads: int | None = None, progress=None, numerics: str = "strict", predictors=None, into=None):
    """Decode .kvz bytes (or a path, URL or file object) into a cache, a ``DynamicCache`` by default.

    ``model`` is required for the token tiers (``exact``, ``tokens``): the cache
    is recomputed with it; it must be the model the file was made with
    (:class:`~kvcodec.errors.ModelMismatch` otherwise).  ``draft`` likewise for
    files whose tokens were coded with a draft model.  ``output="kvcache"``
    returns a :class:`~kvcodec.KVCache`, ``"legacy"`` a tuple of pairs.
    ``limits`` caps what the file may ask for (``max_output_bytes`` ...).
    A reduced cache (:func:`kvcodec.reduce`) decodes to a :class:`kvcodec.reduction.ReducedCache`; with
    ``model`` the model is switched to the attention that applies its atoms' masses (else call
    :func:`kvcodec.reduction.enable` before running the model on it).
    ``numerics`` (token tiers): ``"strict"`` refuses before any work where this machine cannot reproduce the
    file's float results (:class:`~kvcodec.errors.NumericsMismatch`), ``"try"`` attempts anyway,
    ``"recompute"`` returns this machine's regeneration without the residuals (statically coded tokens).
    ``into``: a cache whose tensors have the file's shapes and dtype (C-contiguous CPU tensors: e.g. the cache
    an earlier decode of a file of the same shape returned, kept as a buffer): the decoded tensors are written
    into them and the returned cache holds them, instead of new memory.  The direct tiers decode straight
    into them (new memory costs its first touch, and on a virtual machine whose host reclaims free memory
    much more: BENCHMARKS.md, "Decode, ninth pass"); the others copy their result in.  If the decode raises,
    their contents are unspecified.  Use the returned cache: its other fields (positions, sliding windows)
    are the file's.
    """
    with KvzFile(data, model, draft=draft, limits=limits, threads=threads, numerics=numerics,
                 predictors=predictors) as f:
        return _convert(f.to_kvcache(progress, into=into), output, model[0] if isinstance(model, tuple) else model)


def load(path, model=None, **kwargs):
    """Load a .kvz file from a local path or fsspec URL; see :func:`decode`."""
    f = open_path(path, "rb")
    try:
        return decode(f, model, **kwargs)
    finally:
        f.close()


def inspect(source, *, verify_checksums: bool = False) -> dict:
    """Describe a .kvz file from its header and index, without decoding payloads.

    With ``verify_checksums=True`` every payload is also read and its checksum
    checked (still no decoding).  The result is JSON-serialisable.
    """
    with KvzFile(source) as f:
        return f.describe(verify_checksums)
