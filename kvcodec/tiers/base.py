"""The tier contract: everything that differs between ways of storing a cache lives in one tier class.

A tier declares

* ``tier_id`` - the header's ``tier`` - and ``codec_ids``, the codecs its files
  may name; ``min_minor``, the lowest format revision (1.x) that can express
  it; ``needs_model``, whether decoding needs the model; ``header_key``, the
  top-level header object it owns (or None); ``option_names``, the encoder
  options it takes beyond the common ones;

and implements the hooks

* encoder: :meth:`Tier.check` (option checks, before any work) and
  :meth:`Tier.write` (header and sections, through a
  :class:`~kvcodec.container.writer.KvzWriter`);
* container: :meth:`Tier.parse_header` (validate its header object and rules),
  :meth:`Tier.sections` (the sections a file must hold, in order);
* decoder: :meth:`Tier.decoder` (an object with ``layers()`` and ``tokens()``),
  :meth:`Tier.describe` / :meth:`Tier.describe_section` (``kvz inspect``).

A tier registers with :func:`kvcodec.registry.register_tier`; the container,
the API and the command line find it there.  Adding a tier is one module, its
registry entry, its spec section and its golden vectors.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from .. import registry, scratch
from ..cache import KVCache
from ..codecs.base import Slice
from ..container import layout as L
from ..container.writer import KvzWriter
from ..dtypes import DTYPES, from_bit_patterns
from ..errors import ConfigError, FormatError
from ..identity import model_record
from ..parallel import run_ordered
from ..state import LayerState, absent_entries, bytes_payload, decode_payload, encode_payload
from ..version import __version__

__all__ = ["UNSET", "Options", "EncodeJob", "Fallback", "Tier", "DirectTier", "build_header", "slice_jobs"]

DEFAULT_CHUNK_TOKENS = 4096
UNSET = object()  #: an option the caller did not give (``tolerance=None`` means something)


class Fallback(Exception):
    """Raised by a tier's writer when it cannot store this cache; the API then stores it losslessly with a
    :class:`~kvcodec.errors.FallbackWarning` (the message says why)."""


@dataclass
class Options:
    """Encoder options (:class:`kvcodec.Encoder` holds one, reusable across caches)."""

    tier: str | None = None
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    threads: int | None = None
    token_model: str | None = None
    draft: object = None
    tolerance: object = UNSET
    codec: dict = field(default_factory=dict)  #: the tier's codec options (``bits=``, ``ways=`` ...)

    def given(self) -> set[str]:
        """Names of the tier-specific options that were set."""
        out = {k for k in ("token_model", "draft") if getattr(self, k) is not None}
        lossless = self.tolerance is UNSET or (self.tolerance in (0, None) and not isinstance(self.tolerance, bool))
        return out | (set() if lossless else {"tolerance"}) | set(self.codec)


@dataclass
class EncodeJob:
    """What :meth:`Tier.write` works on: one cache, and where its file goes."""

    sink: object  #: binary file-like, written sequentially
    cache: object  #: the caller's cache object (a RecordingCache carries its schedule)
    kv: KVCache
    model: object  #: a model, a (model, tokenizer) pair, or None
    options: Options
    tokens: torch.Tensor | None = None  #: [batch, tokens] ids given by the caller
    schedule: object = None
    attention_mask: object = None
    info: dict | None = None
    progress: object = None
    report: dict = field(default_factory=dict)  #: what the tier tells the caller (not stored in the file)
    #: (1.10) ``(engine_file object, verbatim bytes)``: the file rebuilds an engine's state file (spec section 15;
    #: :mod:`kvcodec.llama_cpp`); direct tiers only
    engine: tuple | None = None

    def base_info(self) -> dict:
        """The header's ``info``: the caller's, else this version's."""
        return {"kvcodec_version": __version__} if self.info is None else dict(self.info)

    def header(self, tier_id: str, codec: dict, **kw) -> dict:
        h = build_header(self.kv, tier_id, codec, self.options.chunk_tokens, self.model, self.info, **kw)
        if self.engine is not None:
            if tier_id not in ("lossless", "lossy"):
                raise ConfigError(f"engine files are stored by tier 'lossless' or 'lossy', not {tier_id!r}")
            h["engine_file"] = self.engine[0]
        return h

    def slice_jobs(self):
        return slice_jobs(self.kv, self.options.chunk_tokens)


def build_header(kv: KVCache, tier_id: str, codec: dict, chunk_tokens: int, model, info: dict | None,
                 extra: tuple[str, dict] | None = None, num_tokens: int | None = None,
                 predict: dict | None = None) -> dict:
    """The header object every tier writes; ``extra`` is the tier's own ``(header_key, object)``.  Files with
    such an object (format 1.1) write runs of identical layers once, with ``repeat``."""
    # (1.12) model.weights in the token tiers' files (``extra``); the direct tiers decode without the model: their
    # files keep the record they always had, not a 1.12 key older decoders refuse
    rec = model_record(model, with_weights=extra is not None)
    h = {
        "format": "kvz",
        "tier": tier_id,
        "codec": codec,
        "cache": {
            "dtype": kv.dtype_name,
            "batch": kv.batch,
            "chunk_tokens": chunk_tokens,
            "start_position": int(kv.start_position),
            "num_tokens": (0 if kv.tokens is None else int(kv.tokens.shape[1])) if num_tokens is None else num_tokens,
            "layers": [
                {"kv_heads": int(k.shape[1]), "k_dim": int(k.shape[3]), "v_dim": int(v.shape[3]),
                 "seq_len": int(k.shape[2]), "sliding_window": kv.sliding_window[i],
                 "cumulative_length": int(kv.cumulative_length[i]),
                 **({} if kv.states[i] is None else {"state": kv.states[i].descriptor()})}
                for i, (k, v) in enumerate(zip(kv.keys, kv.values))
            ],
        },
        "model": rec,
        "info": {"kvcodec_version": __version__} if info is None else info,
    }
    if predict is not None:  # (1.6) the slices are residuals of a prediction (spec section 13.1)
        h["predict"] = dict(predict)
    if kv.reduce is not None:  # (1.4) a reduced cache: its plan (spec section 14)
        h["reduce"] = dict(kv.reduce)
        _check_reduced_header(h)
    if extra is not None:
        h[extra[0]] = extra[1]
        runs = []
        for lay in h["cache"]["layers"]:
            if runs and {k: x for k, x in runs[-1].items() if k != "repeat"} == lay:
                runs[-1]["repeat"] = runs[-1].get("repeat", 1) + 1
            else:
                runs.append(dict(lay))
        h["cache"]["layers"] = runs
    return h


def _check_reduced_header(h: dict) -> None:
    """A reduced cache built by hand can break spec section 14's rules (a plan and parts that disagree): refuse
    to write a file the decoder would reject, with the decoder's own reason."""
    from ..container.header import dumps, parse
    from ..errors import KvzError

    try:
        parse(dumps(h), offset=L.PREAMBLE.size)
    except KvzError as e:
        raise ConfigError(f"this reduced cache is not a valid .kvz reduced cache: {e}") from None


def write_states(writer, kv: KVCache, which=None) -> None:
    """One ``state`` section per state tensor of ``kv`` (1.3), in canonical order; ``which(layer, index)``
    selects (token tiers: only the tensors regeneration does not reproduce)."""
    for li, st in enumerate(kv.states):
        if st is not None:
            for j, (name, _s, t) in enumerate(st.tensors()):
                if name == "scores" and bool(torch.isnan(t).any()):  # (1.11) the decoder would refuse the file
                    raise ConfigError(f"layer {li}: a reduced layer's scores hold NaN (spec section 14.2)")
                if which is None or which(li, j):
                    writer.write_section(L.SECTION_STATE, encode_payload(t), layer=li, part=j)


def read_states(f, layers) -> dict:
    """``{layer: LayerState}`` of the listed layers of the open file ``f`` that carry state, decoded from
    their ``state`` sections (each checked against the header's dtype and shape)."""
    h, r = f.header, f.reader
    out = {}
    for li in layers:
        info = h.layers[li].state
        if info is None:
            continue
        st = LayerState(info.kind, info.slots, [None] * info.slots, [None] * info.slots, parts=info.parts,
                        scaling=info.scaling)
        for j, t in enumerate(info.tensors):
            e = r.entry(L.SECTION_STATE, li, j, 0)
            st.set(t.name, t.slot, decode_payload(r.read_payload(e), t.dtype, t.shape, e.payload_offset))
            if t.name == "log_weights":
                _raw_weights_zero(st.log_weights, info.parts, e.payload_offset)
                _absent_weights(st.log_weights, info.parts, e.payload_offset)
            elif t.name == "scores" and bool(torch.isnan(st.scores).any()):  # (1.11) spec section 14.2
                raise FormatError("a reduced layer's scores hold NaN", field="State.Data", offset=e.payload_offset)
        out[li] = st
    return out


def _raw_weights_zero(beta, parts, offset: int) -> None:
    """spec section 14.2: the log-weights of a reduced layer's raw tokens (sinks, buffer) are 0."""
    a = parts["fixed"]
    b = a + parts["sinks"]
    c = beta.shape[-1] - parts["buffer"]
    if beta[..., a:b].any() or beta[..., c:].any():
        raise FormatError("a reduced layer's raw tokens (sinks, buffer) have log-weights other than 0",
                          field="State.Data", offset=offset)


def _absent_weights(beta, parts, offset: int) -> None:
    """spec section 14.2 (1.8): with ``heads``, a fixed entry's log-weight is -inf if and only if it is absent."""
    if parts.get("heads") is None:
        return
    if not torch.equal(torch.isneginf(beta[..., :parts["fixed"]]), absent_entries(parts)):
        raise FormatError("a reduced layer's fixed entries have log-weight -inf where its heads hold them, or not "
                          "where they do not (parts.heads)", field="State.Data", offset=offset)


def take_slice(t, where: Slice):
    """The entries of layer tensor ``t`` (``[B, H, S, D]``, torch or NumPy) that ``where`` covers."""
    if where.row is None:
        return t[:, :, where.start:where.start + where.shape[2]]
    b, h = where.row
    got = [t[b:b + 1, h:h + 1, p:p + hi - lo] for lo, hi, p in where.spans]
    if len(got) == 1:
        return got[0]
    return torch.cat(got, 2) if isinstance(t, torch.Tensor) else np.concatenate(got, 2)


def output_block(shapes: dict, dtype) -> dict:
    """``{key: array of shape}``: uninitialised C-contiguous arrays of ``dtype``, all views of one allocation (each
    starting on a 64-byte boundary).  A decode's output is new memory (the caller usually still holds the previous
    cache), which the system maps on first touch: one large allocation is mapped in large pages where the system
    allows it (NumPy asks for them from 4 MiB), one allocation per layer tensor page by page (4 KiB each).
    Measured here: filling 60 fresh arrays of 786 KiB 31 ms, one fresh 47 MB block 5.9 ms (BENCHMARKS.md,
    "Decode, fifth pass")."""
    nbytes = {key: math.prod(shape) * np.dtype(dtype).itemsize for key, shape in shapes.items()}
    starts, total = {}, 0
    for key, n in nbytes.items():
        starts[key] = total
        total += -(-n // 64) * 64
    block = scratch.aligned(total)
    return {key: block[starts[key]:starts[key] + nbytes[key]].view(dtype).reshape(shape)
            for key, shape in shapes.items()}


def put_slice(out, arr, where: Slice) -> None:
    """Write a slice's entries ``arr`` into its place in layer tensor ``out`` (the inverse of :func:`take_slice`)."""
    if where.row is None:
        out[:, :, where.start:where.start + where.shape[2]] = arr
        return
    b, h = where.row
    for lo, hi, p in where.spans:
        out[b:b + 1, h:h + 1, p:p + hi - lo] = arr[:, :, lo:hi]


def tensor_slice(kv: KVCache, li: int, part: int, where: Slice) -> torch.Tensor:
    """The tokens of ``kv`` that ``where`` (layer ``li``, keys or values ``part``) covers."""
    return take_slice((kv.keys if part == L.PART_KEYS else kv.values)[li], where)


def slice_of(run, shape, dtype: str, layer: int, part: int, num_layers: int, offset: int = 0,
             minor: int = 99) -> Slice:
    """The :class:`Slice` of one :class:`~kvcodec.container.header.Run` of a layer whose tensors are ``shape``
    ``[B, H, S, D]``."""
    b, h, _, d = shape
    one = run.row is not None  # (1.8) one head's entries
    return Slice((1 if one else b, 1 if one else h, run.stop - run.start, d), dtype, layer, part, run.start,
                 run.total, num_layers, offset, minor, run.row, run.spans() if one else ())


def kv_runs(kv: KVCache, li: int, chunk_tokens: int):
    """The slices of layer ``li`` of ``kv`` (:func:`kvcodec.container.header.layer_runs`)."""
    from ..container.header import layer_runs

    st = kv.states[li] if kv.states else None
    parts = None if st is None else st.parts
    seq = int(kv.keys[li].shape[2])
    if parts is None or parts.get("heads") is None:
        return layer_runs(seq, chunk_tokens)
    return layer_runs(seq, chunk_tokens, parts["heads"], parts["fixed"])


def slice_jobs(kv: KVCache, chunk_tokens: int) -> list[tuple[int, int, int, Slice]]:
    """``(layer, part, chunk, Slice)`` of every kv / residual section, in canonical order."""
    out = []
    for li, (k, v) in enumerate(zip(kv.keys, kv.values)):
        for c, run in enumerate(kv_runs(kv, li, chunk_tokens)):
            for part, t in ((L.PART_KEYS, k), (L.PART_VALUES, v)):
                out.append((li, part, c, slice_of(run, tuple(t.shape), kv.dtype_name, li, part, kv.num_layers)))
    return out


class Tier:
    """Base of the tiers (module docstring); the defaults are those of a tier without a header object."""

    tier_id: ClassVar[str]
    summary: ClassVar[str] = ""  #: one line for help texts
    codec_ids: ClassVar[tuple[str, ...]]
    min_minor: ClassVar[int] = 1
    #: the lowest minor version a file of this tier may state when read (files written before a revision)
    read_minor: ClassVar[int | None] = None
    needs_model: ClassVar[bool] = False
    header_key: ClassVar[str | None] = None
    option_names: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def file_minor(cls, params: dict) -> int:
        """The lowest minor version a file of this tier written with codec ``params`` needs (the writer stamps
        it; layer states and reduced caches may raise it)."""
        return cls.min_minor

    # -- encoder ------------------------------------------------------------------------------------
    def check(self, opts: Options, model) -> None:
        """Refuse options this tier does not take (:class:`ConfigError`), before any work."""
        extra = opts.given() - self.option_names
        if extra:
            raise ConfigError(f"unknown options {sorted(extra)} for tier {self.tier_id!r} (it takes "
                              f"{sorted(self.option_names)})")

    def write(self, job: EncodeJob) -> int:
        """Write the whole file to ``job.sink``; returns its size.  May raise :class:`Fallback`."""
        raise NotImplementedError

    # -- container ----------------------------------------------------------------------------------
    def parse_header(self, v, header, limits: dict):
        """Validate what this tier adds to the header (``v``: a :class:`~kvcodec.container.header.Validator`);
        returns the header's ``tier_info``.  Default: a cache's token ids, if stored, cover its longest layer."""
        if header.num_tokens:
            longest = max(lay.seq_len for lay in header.layers)
            if header.num_tokens != longest:
                v.fail("cache.num_tokens", f"{header.num_tokens} token ids for a cache of {longest} tokens")
        return None

    def sections(self, header) -> list:
        """The sections a file must hold, in order: ``[((type, layer, part, chunk), optional), ...]``.
        Default: the token ids (if any), then one ``kv`` section per slice."""
        out = [((L.SECTION_TOKEN_IDS, 0, 0, 0), False)] if header.num_tokens else []
        out += [((L.SECTION_KV, *s), False) for s in header.slices()]
        out += [((L.SECTION_STATE, li, j, 0), False) for li, j in header.state_sections()]
        return out + ([((L.SECTION_ENGINE_BYTES, 0, 0, 0), False)] if header.engine is not None else [])

    # -- decoder ------------------------------------------------------------------------------------
    def decoder(self, f):
        """An object with ``layers(indices, progress) -> {(layer, part): tensor}`` and ``tokens()`` for the
        open file ``f`` (:class:`~kvcodec.file.KvzFile`)."""
        raise NotImplementedError

    def describe(self, reader) -> dict:
        """Tier-specific entries of ``kvz inspect`` (header and index only; payloads are not read)."""
        return {}

    def describe_section(self, reader, entry) -> dict:
        """Tier-specific entries of one section in ``kvz inspect`` (may read a payload's first bytes)."""
        return {}


class DirectTier(Tier):
    """A tier that codes the tensors themselves with one codec, one ``kv`` section per slice (no model needed
    to decode).  Subclasses choose the codec's options and may pre-compute the payloads (rate control)."""

    def codec(self, job: EncodeJob):
        """The configured codec of this job."""
        raise NotImplementedError

    def payloads(self, job: EncodeJob, codec, jobs) -> list[bytes] | None:
        """Every slice's payload computed ahead of writing, or None to code them while writing."""
        return None

    def encode_threads(self, job: EncodeJob) -> int | None:
        """Threads coding the slices: the job's (None: every core)."""
        return job.options.threads

    def header_objects(self, codec) -> dict:
        """Header objects this tier adds for this codec (``build_header`` keywords); none by default."""
        return {}

    @staticmethod
    def encode_slice(job: EncodeJob, codec):
        """``work(slice job, _) -> payload`` for :func:`~kvcodec.parallel.run_ordered`."""
        def work(j, _):
            li, part, _c, where = j
            return codec.encode(tensor_slice(job.kv, li, part, where), where)

        return work

    def write(self, job: EncodeJob) -> int:
        held = job.kv.seq_len
        if job.tokens is not None and job.kv.reduce is not None:
            raise ConfigError("a reduced cache holds entries, not tokens: it stores no token ids (drop tokens=)")
        if job.tokens is not None and job.tokens.shape[-1] != held:
            raise ConfigError(f"tier {self.tier_id!r} stores token ids only for the {held} positions the cache holds; "
                              f"these {job.tokens.shape[-1]} ids also cover positions its sliding windows dropped "
                              "(tier 'exact' stores them all)")
        if job.tokens is not None:  # stored beside the tensors
            kv = job.kv
            job.kv = dataclasses.replace(kv, tokens=job.tokens)
        kv = job.kv
        codec = self.codec(job)
        ids = None if kv.tokens is None else kv.tokens.to("cpu", torch.int64).numpy()
        if ids is not None and ids.size and (ids.min() < 0 or ids.max() >= 1 << 32):
            raise ValueError("token ids must be in [0, 2**32)")
        jobs = job.slice_jobs()
        # Encoding uses every core by default (threads=None: $KVCODEC_THREADS or the CPU count).  The slices' work
        # no longer calls BLAS (the table clustering was a matrix product that already took both cores; the
        # default was one thread then): bf16 Austen cache, same run, 1 thread 42-44 MB/s, 2 threads 61-72.
        threads = self.encode_threads(job)
        ready = self.payloads(job, codec, jobs)  # before the header: rate control may change the codec's params
        writer = KvzWriter(job.sink, job.header(self.tier_id, codec.get_config(), **self.header_objects(codec)))
        if ids is not None:
            writer.write_section(L.SECTION_TOKEN_IDS, ids.astype("<u4").tobytes())

        def put(j, payload):
            writer.write_section(L.SECTION_KV, payload, layer=j[0], part=j[1], chunk=j[2])

        if ready is None:
            run_ordered(jobs, self.encode_slice(job, codec), threads, put, job.progress)
        else:
            for j, payload in zip(jobs, ready):
                put(j, payload)
                if job.progress:
                    job.progress(1)
        write_states(writer, kv)
        if job.engine is not None:  # (1.10) the engine file's verbatim bytes, last (spec section 15)
            writer.write_section(L.SECTION_ENGINE_BYTES, bytes_payload(job.engine[1]))
        return writer.close()

    def decoder(self, f):
        return _DirectDecoder(f)


class _DirectDecoder:
    def __init__(self, f):
        self.f = f
        self.codec = registry.codec(f.header.codec_id).from_config(f.header.raw["codec"])

    def tokens(self):
        h, r = self.f.header, self.f.reader
        if not h.num_tokens:
            return None
        e = r.entry(L.SECTION_TOKEN_IDS)
        if e.length != 4 * h.batch * h.num_tokens:
            raise FormatError(f"token ids section has {e.length} bytes, expected {4 * h.batch * h.num_tokens}",
                              field="Payload_Length", offset=e.offset + 16)
        ids = np.frombuffer(r.read_payload(e), dtype="<u4").astype(np.int64)
        return torch.from_numpy(ids.reshape(h.batch, h.num_tokens))

    def states(self, layers) -> dict:
        return read_states(self.f, layers)

    decodes_into = True  # layers(into=): the caller's arrays (KvzFile.to_kvcache checked them)

    def layers(self, layers, progress=None, into: dict | None = None) -> dict:
        """``{(layer, part): tensor}`` of ``layers``; ``into``: ``{(layer, part): uint16/uint32 array}`` to write
        them into (C-contiguous, of the layer's shape; those it lacks hold no entries), instead of new memory."""
        f, h = self.f, self.f.header
        dt = DTYPES[h.dtype]
        jobs = []
        shapes = {(li, p): (h.batch, h.layers[li].kv_heads, h.layers[li].seq_len, h.layers[li].dim(p))
                  for li in layers for p in (L.PART_KEYS, L.PART_VALUES)}
        if into is None:
            outs = output_block(shapes, dt.uint)
        else:
            outs = {key: into[key] if key in into else np.empty(shape, dtype=dt.uint) for key, shape in shapes.items()}
        for li in layers:
            lay = h.layers[li]
            if lay.heads is not None:  # (1.8) the absent entries of heads holding fewer: zero
                outs[li, L.PART_KEYS][...] = 0
                outs[li, L.PART_VALUES][...] = 0
            for c in range(lay.chunks(h.chunk_tokens)):
                jobs += [(li, L.PART_KEYS, c), (li, L.PART_VALUES, c)]

        n = self.codec.decode_batch  # sections decoded together (one job)
        batches = [tuple(jobs[i:i + n]) for i in range(0, len(jobs), n)]
        # a file on disk: each batch's payloads are read into one scratch buffer, given back once it is decoded
        # (new memory for each payload would be mapped and zero-filled anew by the system at each decode)
        buffers: dict = {}

        def prepare(batch):
            entries = [f.reader.entry(L.SECTION_KV, *job) for job in batch]
            if f.reader.in_memory():
                return [(f.reader.read_payload_view(e), e.payload_offset) for e in entries]
            buf = buffers[batch] = scratch.take(sum(e.length for e in entries))
            out, at = [], 0
            for e in entries:
                out.append((f.reader.read_payload_view(e, into=buf[at:at + e.length]), e.payload_offset))
                at += e.length
            return out

        def work(batch, prepared):
            items = []
            for (li, p, c), (payload, offset) in zip(batch, prepared):
                lay = h.layers[li]
                where = slice_of(lay.runs(h.chunk_tokens)[c], (h.batch, lay.kv_heads, lay.seq_len, lay.dim(p)),
                                 h.dtype, li, p, len(h.layers), offset, f.reader.version[1])
                whole = where.row is None and lay.chunks(h.chunk_tokens) == 1  # straight into the output
                items.append((payload, where, outs[li, p] if whole else None))
            return [(w, a) for w, a in zip([it[1] for it in items], self.codec.decode_many(items))]

        def put(batch, arrs):
            for (li, p, c), (where, arr) in zip(batch, arrs):
                if arr is not outs[li, p]:
                    put_slice(outs[li, p], arr, where)
            if batch in buffers:  # its payloads are decoded: nothing reads them any more
                scratch.give(buffers.pop(batch))
            if progress:  # counts sections
                progress(len(batch))

        try:
            run_ordered(batches, work, f.threads, put, None, prepare)
        finally:  # a decode that failed: the workers have stopped (run_ordered waits for them)
            while buffers:
                scratch.give(buffers.popitem()[1])
        return {key: from_bit_patterns(arr, dt.torch) for key, arr in outs.items()}
