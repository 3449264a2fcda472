"""An open .kvz file: header-level facts, lazy per-layer decoding, and ``inspect``.

What differs between tiers is the tier's decoder (:meth:`kvcodec.tiers.base.Tier.decoder`); this module only
opens the bytes, checks the model against the header and assembles caches.
"""

from __future__ import annotations

import hashlib
import math
import os

import numpy as np
import torch

from . import registry
from .cache import KVCache
from .container import layout as L
from .container.reader import KvzReader
from .dtypes import DTYPES, bit_patterns
from .errors import ChecksumMismatch, ConfigError
from .identity import check_model
from .state import decode_bytes_payload

__all__ = ["KvzFile", "open_path"]


def open_path(path, mode: str):
    """A binary file object for a local path or an fsspec URL (``s3://``, ``memory://`` ...)."""
    import fsspec

    return fsspec.open(os.fspath(path) if isinstance(path, os.PathLike) else path, mode).open()


def _is_url(source) -> bool:
    return isinstance(source, (str, os.PathLike)) and "://" in str(source)


#: ``numerics=`` of the decoders (token tiers): "strict" refuses before any work where this machine cannot
#: reproduce the file's recorded numerics profile; "try" attempts anyway (the checksums decide); "recompute"
#: decodes the tokens (only where they decode: token model ``static``) and returns this machine's regeneration
#: without the residuals (tier ``tokens`` semantics), with a warning.
NUMERICS_MODES = ("strict", "try", "recompute")


class KvzFile:
    """An open .kvz file (bytes, path, fsspec URL or binary file object).

    ``model`` (and ``draft``) are checked against the header at once
    (:class:`~kvcodec.errors.ModelMismatch`); files of the token tiers need
    the model to decode.

    ::

        with kvcodec.open_kvz("cache.kvz") as f:
            k, v = f.layer(3)
    """

    def __init__(self, source, model=None, *, draft=None, limits: dict | None = None, threads: int | None = None,
                 numerics: str = "strict", predictors=None):
        if numerics not in NUMERICS_MODES:
            raise ConfigError(f"numerics must be one of {NUMERICS_MODES}, not {numerics!r}")
        self._owned = None
        self.model, self.draft, self.threads, self.numerics = model, draft, threads, numerics
        self.predictors = predictors  # lossy files whose slices are predicted (format 1.6) name them
        if _is_url(source):
            self._owned = source = open_path(source, "rb")
        try:
            self.reader = KvzReader(source, limits=limits)
            self.header = self.reader.header
            self.tier = registry.tier(self.header.tier)
            if model is not None:
                check_model(self.header.model, model)
            self._decoder = self.tier.decoder(self)
        except BaseException:
            self.close()
            raise

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.header.dtype].torch

    def num_sections(self) -> int:
        return len(self.reader.sections)

    def tokens(self) -> torch.Tensor | None:
        """The cache's token ids ``[batch, tokens]`` (token tiers: decoded with the model), or None."""
        return self._decoder.tokens()

    def work(self) -> tuple[int, str]:
        """``(total, unit)`` that a ``progress(n)`` callback of :meth:`to_kvcache` counts: positions
        (``"token"``) for the token tiers, whose time is the model's; sections otherwise."""
        if hasattr(self._decoder, "work"):
            return self._decoder.work()
        return len(self.reader.sections), "section"

    def regenerated(self) -> KVCache:
        """Token tiers: the cache the model regenerates from the decoded tokens, before the residuals."""
        if not hasattr(self._decoder, "regenerated"):
            raise ConfigError(f"tier {self.header.tier!r} stores the tensors themselves: nothing is regenerated")
        return self._decoder.regenerated()[1]

    def state(self, i: int):
        """Layer ``i``'s recurrent / conv state (a :class:`~kvcodec.state.LayerState`), or None when the layer
        has none (attention layers)."""
        if not 0 <= i < len(self.header.layers):
            raise IndexError(f"layer {i} of {len(self.header.layers)}")
        return self._decoder.states([i]).get(i)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode one layer's keys and values, reading only its sections (token tiers regenerate the whole
        cache once, then apply this layer's residual)."""
        if not 0 <= i < len(self.header.layers):
            raise IndexError(f"layer {i} of {len(self.header.layers)}")
        d = self._decoder.layers([i])
        return d[i, L.PART_KEYS], d[i, L.PART_VALUES]

    def engine_verbatim(self) -> bytes:
        """(1.10) The ``engine_bytes`` section's data (spec section 15)."""
        h, r = self.header, self.reader
        if h.engine is None:
            raise ConfigError("this .kvz file holds a cache, not an engine's state file (no engine_file)")
        e = r.entry(L.SECTION_ENGINE_BYTES)
        return decode_bytes_payload(r.read_payload(e), h.engine["verbatim"], e.payload_offset, "Engine")

    def engine_file(self, progress=None, *, regenerated: bytes | None = None) -> bytes:
        """(1.10) The engine state file this file rebuilds (spec section 15): its pieces, the verbatim bytes of
        the ``engine_bytes`` section and the decoded keys and values laid out as rows or columns, joined.  Tier
        ``lossless``: checked against the SHA-256 the file records (:class:`ChecksumMismatch`).  A file whose
        pieces are the engine's own regeneration (``engine_file.recompute``) needs it: ``regenerated=``, the
        bytes the engine's procedure made (:mod:`kvcodec.llama_cpp` runs it, and checks the model first)."""
        h = self.header
        verbatim = self.engine_verbatim()
        rec = h.engine.get("recompute")
        if rec is not None and regenerated is None:
            raise ConfigError(f"this file is rebuilt by running {rec['engine']} ({rec['procedure']}): pass its "
                              f"regeneration ({rec['length']} bytes)")
        if rec is not None and len(regenerated) != rec["length"]:
            raise ChecksumMismatch(f"the regeneration has {len(regenerated)} bytes, engine_file.recompute.length "
                                   f"says {rec['length']}", field="Header.engine_file.recompute.length",
                                   offset=L.PREAMBLE.size)
        used = sorted({li for kind, li, _ in h.engine["pieces"] if kind in ("keys", "values")})
        tensors = self._decoder.layers(used, progress) if used else {}
        out = bytearray()
        for kind, a, b in h.engine["pieces"]:
            if kind == "bytes":
                out += verbatim[a:a + b]
                continue
            if kind == "recomputed":
                out += regenerated[a:a + b]
                continue
            t = tensors[a, L.PART_KEYS if kind == "keys" else L.PART_VALUES][0]  # [H, S, D] of batch row 0
            bits = bit_patterns(t)
            # rows: per position, its H x D elements (head-major); columns: per (head, dim), its S elements
            arr = bits.transpose(1, 0, 2) if b == "rows" else bits.transpose(0, 2, 1)
            out += np.ascontiguousarray(arr).astype(f"<u{bits.dtype.itemsize}", copy=False).tobytes()
        data = bytes(out)
        digest = h.engine["sha256"]
        if digest is not None and hashlib.sha256(data).hexdigest() != digest:
            raise ChecksumMismatch("the engine file rebuilt does not have the SHA-256 engine_file.sha256 records",
                                   field="Header.engine_file.sha256", offset=L.PREAMBLE.size)
        return data

    def to_kvcache(self, progress=None, *, regenerated: KVCache | None = None, into=None) -> KVCache:
        """Decode the whole file.  Token tiers: ``regenerated=`` applies the file's residuals to those tensors
        instead of regenerating the cache with the model (no model needed; no token ids in the result).
        ``into=``: a cache (``DynamicCache``, :class:`KVCache`, legacy pairs) whose key and value tensors are
        written with the decoded ones (:func:`kvcodec.decode`)."""
        h = self.header
        n = len(h.layers)
        if into is not None and regenerated is not None:
            raise ConfigError("into= and regenerated= do not go together")
        if into is not None:
            dest = self._destination(into)
            if hasattr(self._decoder, "decodes_into"):  # the direct tiers write into the tensors themselves
                d = self._decoder.layers(range(n), progress, into={key: bit_patterns(t) for key, t in dest.items()})
            else:  # the others make their tensors (regenerated, predicted), then copy them in
                d = self._decoder.layers(range(n), progress)
                for key, t in dest.items():
                    t.copy_(d[key])
            d, tokens = {**d, **dest}, self.tokens()  # the caller's tensor objects where it gave them
            states = self._decoder.states(range(n))
        elif regenerated is None:
            d, tokens = self._decoder.layers(range(n), progress), self.tokens()
            states = self._decoder.states(range(n))
        elif hasattr(self._decoder, "regenerated"):
            d, tokens = self._decoder.layers(range(n), progress, regen=regenerated), None
            states = self._decoder.states(range(n), regen=regenerated)
        else:
            raise ConfigError(f"regenerated= applies to the token tiers, not to tier {h.tier!r}")
        return KVCache([d[i, L.PART_KEYS] for i in range(n)], [d[i, L.PART_VALUES] for i in range(n)], tokens,
                       h.start_position, [lay.sliding_window for lay in h.layers],
                       [lay.cumulative_length for lay in h.layers], [states.get(i) for i in range(n)],
                       reduce=h.reduce)

    def _destination(self, into) -> dict:
        """``{(layer, part): tensor}`` of ``into``'s tensors that the file's layers fill (those of no entries are
        left out), each checked to be a CPU tensor of the file's dtype and shape, C-contiguous, not one that
        autograd tracks, and sharing no memory with another."""
        from .cache import to_canonical

        h = self.header
        if h.reduce is not None:
            raise ConfigError("into=: a reduced cache decodes to new tensors (its atoms' masses are not a "
                              "cache's tensors)")
        try:
            kv = to_canonical(into)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"into= takes a cache (DynamicCache, KVCache, legacy pairs): {e}") from None
        if kv.num_layers != len(h.layers):
            raise ConfigError(f"into= has {kv.num_layers} layers, the file {len(h.layers)}")
        dest, spans = {}, []
        for i, lay in enumerate(h.layers):
            for part, name, tensors in ((L.PART_KEYS, "keys", kv.keys), (L.PART_VALUES, "values", kv.values)):
                want = (h.batch, lay.kv_heads, lay.seq_len, lay.dim(part))
                t = tensors[i]
                if math.prod(want) == 0:  # nothing to write (a state-space layer's placeholder)
                    continue
                what = f"into= layer {i} {name}"
                if t is None:
                    raise ConfigError(f"{what}: none, the file has {list(want)} there")
                if tuple(t.shape) != want or t.dtype != self.dtype:
                    raise ConfigError(f"{what} is {t.dtype} {list(t.shape)}, the file's is {self.dtype} {list(want)}")
                if t.device.type != "cpu" or not t.is_contiguous() or t.requires_grad:
                    raise ConfigError(f"{what} must be a C-contiguous CPU tensor that autograd does not track "
                                      f"(it is on {t.device}, contiguous: {t.is_contiguous()}, requires_grad: "
                                      f"{t.requires_grad})")
                dest[i, part] = t
                spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), f"layer {i} {name}"))
        spans.sort()
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                raise ConfigError(f"into=: {a} and {b} share memory")
        return dest

    def describe(self, verify_checksums: bool = False) -> dict:
        """``kvz inspect``: the file from its header and index, without decoding payloads (JSON-able)."""
        r, h = self.reader, self.header
        sections = []
        for e in r.sections:
            d = {"type": e.name, "offset": e.offset, "bytes": e.length}
            if e.section_type in (L.SECTION_KV, L.SECTION_RESIDUAL):
                lay = h.layers[e.layer]
                a, b = lay.chunk_range(e.chunk, h.chunk_tokens)
                comps = math.prod(lay.slice_shape(e.chunk, h.chunk_tokens, h.batch, e.part))
                if lay.heads is not None:  # (1.8) one head's entries: [batch row, KV head]; tokens then count the
                    d["row"] = list(lay.runs(h.chunk_tokens)[e.chunk].row)  # head's stored entries
                d.update(layer=e.layer, part="keys" if e.part == L.PART_KEYS else "values", chunk=e.chunk,
                         tokens=[a, b], components=comps,
                         bits_per_component=round(8 * e.length / comps, 4) if comps else None)
            if e.section_type == L.SECTION_STATE:
                t = h.layers[e.layer].state.tensors[e.part]
                head = r.read_payload_prefix(e, 1)
                d.update(layer=e.layer, state=t.name, slot=t.slot, dtype=t.dtype, shape=list(t.shape),
                         coding={0: "raw", 1: "zstd"}.get(head[0], head[0]) if head else None)
            d.update(self.tier.describe_section(r, e))
            sections.append(d)
        status = "header, index and footer checksums ok; payloads not read"
        if verify_checksums:
            r.verify_checksums()
            status = "all checksums ok"
        raw = h.tensor_bytes()
        out = {
            "format_version": f"{r.version[0]}.{r.version[1]}",
            "file_bytes": r.size,
            "tier": h.tier,
            "codec": {"id": h.codec_id, "params": h.codec_params},
            "model": h.model,
            "dtype": h.dtype,
            "batch": h.batch,
            "num_layers": len(h.layers),
            "kv_heads": sorted({lay.kv_heads for lay in h.layers}),
            "head_dims": sorted({lay.k_dim for lay in h.layers} | {lay.v_dim for lay in h.layers}),
            "tokens": max(lay.seq_len for lay in h.layers),
            "start_position": h.start_position,
            "has_token_ids": bool(h.num_tokens),
            "chunk_tokens": h.chunk_tokens,
            "raw_tensor_bytes": raw,
            "ratio": round(raw / r.size, 4) if r.size else None,
            "bits_per_component": round(8 * r.size / (raw / h.itemsize), 4) if raw else None,
            "info": h.raw.get("info"),
            "token_channel": None,
            # (1.3) recurrent / conv state of state-space layers, stored exactly in every tier
            "state": None if not h.has_state else {
                "layers": {i: lay.state.kind for i, lay in enumerate(h.layers) if lay.state is not None},
                "tensors": len(h.state_sections()), "raw_bytes": h.state_bytes(),
                "stored_bytes": sum(e.length for e in r.sections if e.section_type == L.SECTION_STATE)},
            # (1.4) a reduced cache: how it was reduced, and its entries against the tokens they stand for
            "reduce": None if h.reduce is None else self._describe_reduce(),
            # (1.6) the slices are residuals of a cross-layer prediction: decoding needs these predictors
            "predict": None if h.predict is None else dict(h.predict),
            # (1.10) the file rebuilds an engine's state file (llama.cpp's): what it was, without its pieces
            "engine_file": None if h.engine is None else {
                k: x for k, x in h.raw["engine_file"].items() if k != "pieces"} | {
                "pieces": len(h.engine["pieces"]),
                "tensor_pieces": sum(1 for p in h.engine["pieces"] if p[0] in ("keys", "values"))},
            "checksums": status,
            "sections": sections,
        }
        out.update(self.tier.describe(r))
        return out

    def _describe_reduce(self) -> dict:
        h = self.header
        red = [lay for lay in h.layers if lay.state is not None and lay.state.kind == "reduced"]
        first = red[0]
        held = [lay.seq_len for lay in red]
        # (1.8) a layer whose heads hold different numbers: its entries are their mean, not the length it holds
        sizes = [lay.seq_len if lay.heads is None else
                 lay.seq_len - lay.state.parts["fixed"] + sum(map(sum, lay.heads)) / (h.batch * lay.kv_heads)
                 for lay in red]
        stood = sum(lay.cumulative_length for lay in red)
        # entries per KV head: their mean over the reduced layers (they differ where the budget was spread
        # over the layers: "entries_range"); the first reduced layer's parts
        out = {**h.reduce, "layers": len(red), "entries": round(sum(sizes) / len(sizes)),
               "entries_range": [round(min(sizes)), round(max(sizes))], "tokens": first.cumulative_length,
               "keep": round(sum(sizes) / stood, 4) if stood else None, "parts": first.state.parts}
        if held != sizes:  # entries held per KV head, absent places included (what the decoded tensors hold)
            out["held"] = round(sum(held) / len(held))
        return out

    def close(self):
        if getattr(self, "reader", None) is not None:
            self.reader.close()
        if self._owned is not None:
            self._owned.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
