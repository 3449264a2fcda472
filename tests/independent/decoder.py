"""Independent .kvz decoder written from spec/kvz.md and spec/registry.md only."""
import hashlib
import json
import math
import re
import struct

import numpy as np
import xxhash
import zstandard


class KvzError(Exception):
    pass


def _mk(name):
    return type(name, (KvzError,), {})


BadMagic = _mk("BadMagic")
UnsupportedVersion = _mk("UnsupportedVersion")
FormatError = _mk("FormatError")
LimitExceeded = _mk("LimitExceeded")
TruncatedFile = _mk("TruncatedFile")
TrailingData = _mk("TrailingData")
ChecksumMismatch = _mk("ChecksumMismatch")
OffsetError = _mk("OffsetError")
UnknownId = _mk("UnknownId")
# (§1, §5, §6; revision 1.11.1) a reserved field or flag bit of a section header or of the index is not zero
ReservedBitSet = _mk("ReservedBitSet")
# (1.6, §13.1) the file names predictors that were not given (or not the named ones)
PredictorsRequired = _mk("PredictorsRequired")
# (§4.1, 1.10 §15) the model named is not the one the file records
ModelMismatch = _mk("ModelMismatch")


def xxh(b):
    return xxhash.xxh3_64_intdigest(bytes(b))


MAGIC = b"\x89KVZ\r\n\x1a\n"
END_MAGIC = b"\x89KVZEND\n"
IMPL_MINOR = 12  # (1.10) engine files (§15); (1.11) reduce.bound and the scores state tensor (§14.1, §14.2);
# (1.12) model.weights (§4.1)
HEADER_LIMIT = 16 << 20
OUTPUT_LIMIT = 64 << 30
MAX_SECTIONS = 1 << 22
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
SEC_KV, SEC_TOKENS, SEC_STREAM, SEC_RESID, SEC_CKS, SEC_STATE, SEC_INDEX = 1, 2, 3, 4, 5, 6, 0xFFFF
SEC_ENGINE = 7  # (1.10) engine_bytes (§15, registry.md)
KNOWN_SEC = {1, 2, 3, 4, 5, 6, 7, 0xFFFF}
STATE_KINDS = ("linear", "hybrid", "indexed", "reduced")
# also their order inside a slot (state order, §4.2; log_weights, anchor, (1.11) scores, §14.2)
STATE_NAMES = ("conv", "recurrent", "indexer_keys", "log_weights", "anchor", "scores")
# which tensor names each kind may hold (§4.2): indexer_keys in `indexed` only, conv / recurrent never there;
# (1.4) log_weights / anchor (and (1.11) scores) in `reduced` only (§4.2, registry.md)
STATE_KIND_NAMES = {"linear": ("conv", "recurrent"), "hybrid": ("conv", "recurrent"),
                    "indexed": ("indexer_keys",), "reduced": ("log_weights", "anchor", "scores")}
# (1.4) reduced caches (§14.1, registry.md); (1.7) methods tova and kvzip
REDUCE_METHODS = ("cluster", "sample", "streaming", "snapkv", "h2o", "tova", "kvzip")
REDUCERS = ("cluster", "sample")  # the merge-reduce methods
REDUCE_FORMS = ("query", "dot", "kernel")
ZSTD_MAGIC = 0xFD2FB528


class ConfigError(KvzError):
    pass


# ----------------------------------------------------------------- JSON (§4)
def _prescan_depth(text):
    depth = 0
    in_str = False
    esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        else:
            if ch == '"':
                in_str = True
            elif ch in "[{":
                depth += 1
                if depth > 32:
                    raise FormatError("header JSON nests deeper than 32 levels")
            elif ch in "]}":
                depth -= 1


def _check_str(s):
    for ch in s:
        if 0xD800 <= ord(ch) <= 0xDFFF:
            raise FormatError("lone surrogate in header string")
    return s


def _walk_strings(v):
    if isinstance(v, str):
        _check_str(v)
    elif isinstance(v, dict):
        for k, x in v.items():
            _check_str(k)
            _walk_strings(x)
    elif isinstance(v, list):
        for x in v:
            _walk_strings(x)



def _no_duplicate_keys(prefix):
    """A json object_pairs_hook refusing a key given twice (FormatError)."""
    def pairs(ps):
        d = {}
        for k, v in ps:
            if k in d:
                raise FormatError(f"{prefix}duplicate key {k!r}")
            d[k] = v
        return d
    return pairs

def parse_header_json(raw):
    try:
        text = raw.decode("utf-8", errors="strict")
    except UnicodeDecodeError as e:
        raise FormatError(f"header is not UTF-8: {e}")
    _prescan_depth(text)

    pairs = _no_duplicate_keys("")

    def pint(s):
        if len(s) > 40:
            raise FormatError("number literal longer than 40 characters")
        return int(s)

    def pfloat(s):
        if len(s) > 40:
            raise FormatError("number literal longer than 40 characters")
        f = float(s)
        if not math.isfinite(f):
            raise FormatError(f"non-finite number {s}")
        return f

    def pconst(s):
        raise FormatError(f"literal {s} not allowed")

    try:
        v = json.loads(text, object_pairs_hook=pairs, parse_int=pint,
                       parse_float=pfloat, parse_constant=pconst)
    except KvzError:
        raise
    except (ValueError, RecursionError) as e:
        raise FormatError(f"header is not JSON: {e}")
    _walk_strings(v)
    return v


# ------------------------------------------------------- header validation
def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v):
    return (isinstance(v, (int, float)) and not isinstance(v, bool))


def _keys(obj, required, optional=(), where=""):
    if not isinstance(obj, dict):
        raise FormatError(f"{where} is not an object")
    for k in required:
        if k not in obj:
            raise FormatError(f"missing key {where}.{k}")
    for k in obj:
        if k in required or k in optional or k.startswith("x-"):
            continue
        raise FormatError(f"unknown key {where}.{k}")


def _int(obj, k, lo, hi=None, where="", limit=None):
    v = obj[k]
    if not _is_int(v):
        raise FormatError(f"{where}.{k} is not an integer")
    if v < lo:
        raise FormatError(f"{where}.{k}={v} below {lo}")
    if hi is not None and v > hi:
        raise FormatError(f"{where}.{k}={v} above {hi}")
    if limit is not None and v > limit:
        raise LimitExceeded(f"{where}.{k}={v} above limit {limit}")
    return v


HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _model_obj(m, where, minor=IMPL_MINOR):
    _keys(m, ["fingerprint"], ["tokenizer", "name", "architecture", "weights"], where)
    if not isinstance(m["fingerprint"], str) or not HEX64.match(m["fingerprint"]):
        raise FormatError(f"{where}.fingerprint")
    for k in ("tokenizer", "weights"):
        if k in m and (not isinstance(m[k], str) or not HEX64.match(m[k])):
            raise FormatError(f"{where}.{k}")
    if "weights" in m and minor < 12:  # §3: a model object with weights is stamped 1.12 or later
        raise FormatError(f"{where}.weights in a file stamped 1.{minor} (needs 1.12)")
    for k in ("name", "architecture"):
        if k in m and not isinstance(m[k], str):
            raise FormatError(f"{where}.{k}")


def validate_header(h, minor):
    _keys(h, ["format", "tier", "codec", "cache", "model"], ["tokens", "info", "reduce", "predict", "engine_file"],
          "header")
    if h["format"] != "kvz":
        raise FormatError("format")
    tier = h["tier"]
    if not isinstance(tier, str):
        raise FormatError("tier")
    if tier not in ("lossless", "exact", "tokens", "lossy"):
        raise UnknownId(f"tier {tier}")
    need = {"lossless": 0, "exact": 1, "tokens": 1, "lossy": 1}[tier]
    if minor < need:
        raise FormatError(f"tier {tier} needs Version_Minor >= {need}")
    codec = h["codec"]
    _keys(codec, ["id", "params"], (), "codec")
    if not isinstance(codec["id"], str) or not isinstance(codec["params"], dict):
        raise FormatError("codec")
    want = {"lossless": "float_ctx_rans", "lossy": "vq_rans",
            "exact": "int_residual_rans", "tokens": "int_residual_rans"}[tier]
    if codec["id"] not in ("float_ctx_rans", "vq_rans", "int_residual_rans"):
        raise UnknownId(f"codec {codec['id']}")
    if codec["id"] != want:
        raise FormatError(f"codec {codec['id']} for tier {tier}")
    if "info" in h and not isinstance(h["info"], dict):
        raise FormatError("info")
    reduce = None
    if "reduce" in h:
        # (1.4, §3, §4, §14) stamped 1.4 or later, tiers lossless and lossy only
        if minor < 4:
            raise FormatError(f"header.reduce in a file stamped 1.{minor} (needs 1.4)")
        if tier not in ("lossless", "lossy"):
            raise FormatError(f"header.reduce in tier {tier} (lossless and lossy only)")
        # `reduce` is an object when present: null (or any non-object) is invalid (§14.1)
        if not isinstance(h["reduce"], dict):
            raise FormatError("header.reduce is not an object (null is invalid, §14.1)")
        reduce = validate_reduce(h["reduce"], minor)
        if reduce["method"] in ("tova", "kvzip") and minor < 7:  # (1.7, §3) methods tova and kvzip
            raise FormatError(f"header.reduce.method {reduce['method']} in a file stamped 1.{minor} (needs 1.7)")
    cache = h["cache"]
    _keys(cache, ["dtype", "batch", "chunk_tokens", "start_position", "num_tokens", "layers"], (), "cache")
    if not isinstance(cache["dtype"], str):
        raise FormatError("dtype")
    if cache["dtype"] not in ITEMSIZE:
        raise UnknownId(f"dtype {cache['dtype']}")
    B = _int(cache, "batch", 1, where="cache", limit=65536)
    C = _int(cache, "chunk_tokens", 1, None, "cache", limit=1 << 24)  # §4: above 2^24 LimitExceeded
    sp = _int(cache, "start_position", 0, where="cache", limit=1 << 31)
    nt = _int(cache, "num_tokens", 0, where="cache", limit=1 << 31)
    if not isinstance(cache["layers"], list) or len(cache["layers"]) < 1:
        raise FormatError("cache.layers")
    runs = []
    total = 0
    for i, L in enumerate(cache["layers"]):
        w = f"cache.layers[{i}]"
        _keys(L, ["kv_heads", "k_dim", "v_dim", "seq_len", "sliding_window", "cumulative_length"],
              ["repeat", "state"], w)
        H = _int(L, "kv_heads", 1, where=w, limit=65536)
        Dk = _int(L, "k_dim", 1, where=w, limit=65536)
        Dv = _int(L, "v_dim", 1, where=w, limit=65536)
        S = _int(L, "seq_len", 0, where=w, limit=1 << 31)
        sw = L["sliding_window"]
        if sw is not None:
            sw = _int(L, "sliding_window", 1, where=w, limit=1 << 31)
        cl = _int(L, "cumulative_length", S, where=w, limit=(1 << 31) + (1 << 32))
        rep = 1
        if "repeat" in L:
            if minor < 1:
                raise FormatError(f"{w}.repeat in a 1.0 file")
            rep = _int(L, "repeat", 2, where=w, limit=65536)
        total += rep
        if total > 65536:
            raise LimitExceeded("more than 65536 layers")
        state = None
        if "state" in L:
            if minor < 3:
                raise FormatError(f"{w}.state in a file stamped 1.{minor} (needs 1.3)")
            state = validate_state(L["state"], B, S, sw, f"{w}.state", H=H, Dk=Dk, reduce=reduce, cl=cl,
                                   minor=minor)
            if state["kind"] == "linear" and not (H == 1 and Dk == 1 and Dv == 1 and S == 0 and cl == 0
                                                  and sw is None):
                raise FormatError(f"{w}: a linear layer needs kv_heads/k_dim/v_dim 1, seq_len 0, "
                                  "cumulative_length 0, sliding_window null")
        # a full layer has seen exactly what it holds, except a reduced layer (§4, §14.2)
        if sw is None and cl != S and not (state is not None and state["kind"] == "reduced"):
            raise FormatError(f"{w}.cumulative_length != seq_len for a full layer")
        runs.append((rep, dict(H=H, Dk=Dk, Dv=Dv, S=S, sw=sw, cl=cl, state=state)))
    if reduce is not None and not any(L["state"] is not None and L["state"]["kind"] == "reduced"
                                      for _, L in runs):
        raise FormatError("header.reduce without a layer of state kind reduced (§14.1)")
    if reduce is not None and nt != 0:
        raise FormatError(f"cache.num_tokens={nt}: a reduced file stores no token ids, num_tokens is 0 (§14.1)")
    # output limit and section count, on counts
    isz = ITEMSIZE[cache["dtype"]]
    out = 4 * B * nt
    nsec = 0
    maxS = 0
    for rep, L in runs:
        out += rep * B * L["H"] * L["S"] * (L["Dk"] + L["Dv"]) * isz  # (1.8) heads: still [B, H, S, D]
        nsec += rep * 2 * layer_chunk_count(L, B, C)
        if L["state"] is not None:
            for t in L["state"]["tensors"]:
                out += rep * t["nbytes"]
            nsec += rep * len(L["state"]["tensors"])
        maxS = max(maxS, L["S"])
    if out > OUTPUT_LIMIT:
        raise LimitExceeded("decoded size above output limit")
    nsec += 1 + B + 1
    if "engine_file" in h:
        nsec += 1  # (1.10) the engine_bytes section
    if nsec > MAX_SECTIONS:
        raise LimitExceeded("too many sections")
    model = h["model"]
    if model is not None:
        _model_obj(model, "model", minor)
    token_tier = tier in ("exact", "tokens")
    if token_tier:
        if model is None:
            raise FormatError("token tiers require model")
        if "tokens" not in h:
            raise FormatError("missing tokens")
        if sp != 0:
            raise FormatError("token tiers need start_position 0")
        if nt < 1:
            raise FormatError("token tiers need num_tokens >= 1")
        for rep, L in runs:
            linear = L["state"] is not None and L["state"]["kind"] == "linear"
            if L["cl"] != (0 if linear else nt):
                raise FormatError("cumulative_length != N")
        validate_tokens(h["tokens"], tier, B, nt, minor)
    else:
        if "tokens" in h:
            raise FormatError("tokens object forbidden in this tier")
        if nt != 0 and nt != maxS:
            raise FormatError("num_tokens must equal the largest seq_len")
    layers = []
    for rep, L in runs:
        layers.extend([L] * rep)
    predict = None
    if "predict" in h:
        predict = validate_predict(h["predict"], minor, tier, reduce, layers, sp)
    engine = None
    if "engine_file" in h:
        engine = validate_engine_file(h["engine_file"], minor, tier, reduce, predict, B, layers, isz)
    return dict(tier=tier, B=B, C=C, nt=nt, dtype=cache["dtype"], W=isz, layers=layers, sp=sp, reduce=reduce,
                predict=predict, engine=engine)


def validate_predict(p, minor, tier, reduce, layers, sp):
    """The header's predict object (1.6, §4, §13.1). Returns dict(predictors, eh, et, T, H, D)."""
    w = "header.predict"
    # §3: a writer stamps 6 for a header with a predict object; a lower stamp breaks that MUST (§1: FormatError)
    if minor < 6:
        raise FormatError(f"{w} in a file stamped 1.{minor} (needs 1.6)")
    if tier != "lossy":
        raise FormatError(f"{w} in tier {tier} (lossy only)")
    if reduce is not None:
        raise FormatError(f"{w} together with header.reduce")
    _keys(p, ["predictors", "layout", "exact_head", "exact_tail"], (), w)
    if not isinstance(p["predictors"], str) or not HEX64.match(p["predictors"]):
        raise FormatError(f"{w}.predictors: 64 lowercase hex digits")
    if not isinstance(p["layout"], str):
        raise FormatError(f"{w}.layout is not a string")
    if p["layout"] != "rotate_half":
        raise UnknownId(f"{w}.layout {p['layout']!r}")
    eh = _int(p, "exact_head", 0, where=w)
    et = _int(p, "exact_tail", 0, where=w)
    L0 = layers[0]
    T, H, D = L0["S"], L0["H"], L0["Dk"]
    for i, L in enumerate(layers):
        if L["state"] is not None:
            raise FormatError(f"cache.layers[{i}]: a layer state in a predicted file")
        if (L["S"], L["H"], L["Dk"], L["Dv"]) != (T, H, D, D):
            raise FormatError(f"cache.layers[{i}]: every layer of a predicted file has the same seq_len, "
                              "kv_heads and k_dim = v_dim")
    if D % 2:
        # "rotary pairs (i, i + D/2)": an odd D has no such pairing (not stated by the spec, assumed)
        raise FormatError(f"{w}.layout rotate_half needs an even head dimension, not {D}")
    if (sp + T) * (D // 2) > 1 << 30:  # §9: the steps of the RoPE recurrence
        raise LimitExceeded(f"{w}: (start_position + seq_len) * D/2 = {(sp + T) * (D // 2)} above 2^30")
    if eh + et > T:
        raise FormatError(f"{w}: exact_head + exact_tail = {eh + et} > seq_len {T}")
    return dict(predictors=p["predictors"], eh=eh, et=et, T=T, H=H, D=D)


# ------------------------------------------------------- engine files (1.10, §15)
ENGINE_PIECE_TAGS = ("bytes", "recomputed", "keys", "values")
ENGINE_ORDERS = ("rows", "columns")
MAX_ENGINE_PIECES = 1 << 20
# §15.2: the (engine, procedure) pairs this decoder knows (it cannot run llama.cpp itself: a caller passes the
# engine's regeneration to rebuild_engine_file)
ENGINE_PROCEDURES = {("llama.cpp", "llama.cpp-seq-prefill-v1")}
GGML_KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")


def _validate_seq_prefill_params(pp, w):
    """§15.2 procedure llama.cpp-seq-prefill-v1: params n_batch, n_ubatch (integers, 1 <= n_ubatch <= n_batch <=
    2^20), flash_attn (a boolean), type_k, type_v (ggml type names of the list), all required; build optional,
    any value; other keys ignored.  Checked when the procedure runs (§15.2)."""
    for k in ("n_batch", "n_ubatch", "flash_attn", "type_k", "type_v"):
        if k not in pp:
            raise FormatError(f"{w}.{k} is missing")
    nb = _int(pp, "n_batch", 1, 1 << 20, w)
    _int(pp, "n_ubatch", 1, nb, w)
    if not isinstance(pp["flash_attn"], bool):
        raise FormatError(f"{w}.flash_attn is not true or false")
    for k in ("type_k", "type_v"):
        if not isinstance(pp[k], str) or pp[k] not in GGML_KV_TYPES:
            raise FormatError(f"{w}.{k}={pp[k]!r}: not one of {', '.join(GGML_KV_TYPES)}")


def validate_engine_file(e, minor, tier, reduce, predict, B, layers, isz):
    """The header's engine_file object (1.10, §15, §3, §4). Every length is checked from the header alone. Returns
    dict(L, V, sha256, model, pieces=[(tag, a, b, length)], recompute=None or dict(engine, procedure, R, tok_o,
    tok_n, params, known))."""
    w = "header.engine_file"
    if minor < 10:  # §3
        raise FormatError(f"{w} in a file stamped 1.{minor} (needs 1.10)")
    if tier not in ("lossless", "lossy"):  # §4 table
        raise FormatError(f"{w} in tier {tier} (lossless and lossy only)")
    if reduce is not None:
        raise FormatError(f"{w} together with header.reduce")
    if predict is not None:
        raise FormatError(f"{w} together with header.predict")
    # an object when present (null has the wrong type: assumed, §15 does not say it as §14.1 does for reduce)
    if not isinstance(e, dict):
        raise FormatError(f"{w} is not an object")
    _keys(e, ["engine", "kind", "length", "verbatim", "sha256", "pieces", "model"], ["recompute"], w)
    for k in ("engine", "kind"):  # informative, "any" string (the empty string included: assumed)
        if not isinstance(e[k], str):
            raise FormatError(f"{w}.{k} is not a string")
    L = _int(e, "length", 0, where=w, limit=OUTPUT_LIMIT)
    V = _int(e, "verbatim", 0, L, w)  # above L: a relation between fields, FormatError (§1)
    sha = e["sha256"]
    if tier == "lossless":
        if not isinstance(sha, str) or not HEX64.match(sha):
            raise FormatError(f"{w}.sha256: tier lossless needs 64 lowercase hex digits")
    elif sha is not None:
        raise FormatError(f"{w}.sha256: tier lossy needs null")
    m = e["model"]
    if m is not None:
        # unknown keys: §4's general rule (FormatError except x- keys), assumed
        _keys(m, ["file_sha256"], ["name", "architecture"], f"{w}.model")
        if not isinstance(m["file_sha256"], str) or not HEX64.match(m["file_sha256"]):
            raise FormatError(f"{w}.model.file_sha256: 64 lowercase hex digits")
        for k in ("name", "architecture"):
            if k in m and not isinstance(m[k], str):
                raise FormatError(f"{w}.model.{k} is not a string")
    rc = None
    if "recompute" in e:
        wr = f"{w}.recompute"
        r = e["recompute"]
        if not isinstance(r, dict):
            raise FormatError(f"{wr} is not an object")
        if tier != "lossless" or sha is None:
            raise FormatError(f"{wr}: tier lossless only, with sha256")
        _keys(r, ["engine", "procedure", "length", "tokens", "params"], (), wr)
        for k in ("engine", "procedure"):
            if not isinstance(r[k], str):
                raise FormatError(f"{wr}.{k} is not a string")
        R = _int(r, "length", 0, where=wr, limit=OUTPUT_LIMIT)
        tk = r["tokens"]
        if not (isinstance(tk, list) and len(tk) == 2 and all(_is_int(x) and x >= 0 for x in tk)):
            raise FormatError(f"{wr}.tokens: [o, n], two non-negative integers")
        if tk[0] + 4 * tk[1] > V:
            raise FormatError(f"{wr}.tokens: o + 4n = {tk[0] + 4 * tk[1]} above verbatim {V}")
        if not isinstance(r["params"], dict):
            raise FormatError(f"{wr}.params is not an object")
        if r["engine"] != e["engine"]:
            raise FormatError(f"{wr}.engine={r['engine']!r} is not engine_file.engine {e['engine']!r}")
        known = (r["engine"], r["procedure"]) in ENGINE_PROCEDURES  # params: checked when it runs (§15.2)
        rc = dict(engine=r["engine"], procedure=r["procedure"], R=R, tok_o=tk[0], tok_n=tk[1], params=r["params"],
                  known=known)
    if B != 1:
        raise FormatError(f"cache.batch={B}: a file with an engine_file has batch 1")
    pl = e["pieces"]
    if not isinstance(pl, list):
        raise FormatError(f"{w}.pieces is not a list")
    if len(pl) > MAX_ENGINE_PIECES:
        raise LimitExceeded(f"{w}.pieces: {len(pl)} items, above 2^20")
    pieces = []
    seen = set()
    total = 0
    for i, p in enumerate(pl):
        wp = f"{w}.pieces[{i}]"
        if not isinstance(p, list) or len(p) != 3:
            raise FormatError(f"{wp}: a three-item list")
        tag = p[0]
        # an unknown tag: FormatError (assumed; §15 names no class for it, "[FormatError otherwise]")
        if not isinstance(tag, str) or tag not in ENGINE_PIECE_TAGS:
            raise FormatError(f"{wp}[0]={tag!r}: not bytes, recomputed, keys or values")
        if tag in ("bytes", "recomputed"):
            o, n = p[1], p[2]
            if not (_is_int(o) and _is_int(n) and o >= 0 and n >= 0):
                raise FormatError(f"{wp}: o and n are non-negative integers")
            if tag == "bytes":
                if o + n > V:
                    raise FormatError(f"{wp}: o + n = {o + n} above verbatim {V}")
            else:
                if rc is None:
                    raise FormatError(f"{wp}: a recomputed piece without a recompute object")
                if o + n > rc["R"]:
                    raise FormatError(f"{wp}: o + n = {o + n} above recompute.length {rc['R']}")
            pieces.append((tag, o, n, n))
        else:
            l, order = p[1], p[2]
            if not _is_int(l) or not 0 <= l < len(layers):
                raise FormatError(f"{wp}[1]={l!r}: a layer index 0 .. {len(layers) - 1}")
            if not isinstance(order, str):
                raise FormatError(f"{wp}[2] is not a string")
            if order not in ENGINE_ORDERS:
                raise UnknownId(f"{wp}[2]={order!r}: order rows or columns")
            lay = layers[l]
            if lay["state"] is not None or lay["sw"] is not None:
                raise FormatError(f"{wp}: layer {l} named by a piece has a state or a sliding_window")
            if (tag, l) in seen:
                raise FormatError(f"{wp}: ({tag}, {l}) appears twice")
            seen.add((tag, l))
            D = lay["Dk"] if tag == "keys" else lay["Dv"]
            pieces.append((tag, l, order, lay["H"] * lay["S"] * D * isz))
        total += pieces[-1][3]
    if total != L:
        raise FormatError(f"{w}.pieces: lengths add up to {total}, not length {L}")
    if rc is not None and not any(t == "recomputed" for t, *_ in pieces):
        raise FormatError(f"{w}.recompute without a recomputed piece")
    return dict(L=L, V=V, sha256=sha, model=m, pieces=pieces, recompute=rc)


def _finite_json_number(v):
    try:
        return _is_num(v) and math.isfinite(float(v))
    except OverflowError:  # an integer beyond binary64
        return False


def parse_predictors(pb, info):
    """The predictors file (1.6, §13.1): a safetensors file, parsed by hand (8-byte little-endian header length,
    JSON header {name: {dtype, shape, data_offsets}}, then the data). Returns dict(kw, kb, vw, vb: per layer
    binary32 arrays widened exactly from float16; cos, sin: binary64 [D/2]; scale: float)."""
    pr = info["predict"]
    L, HD, D = len(info["layers"]), pr["H"] * pr["D"], pr["D"]
    pb = bytes(pb)
    if len(pb) < 8:
        raise FormatError("predictors: shorter than the safetensors header length")
    n = struct.unpack_from("<Q", pb, 0)[0]
    if n > len(pb) - 8:
        raise FormatError("predictors: header length beyond the file")
    try:
        hdr = json.loads(pb[8:8 + n].decode("utf-8"), object_pairs_hook=_no_duplicate_keys("predictors: "))
    except KvzError:
        raise
    except (ValueError, RecursionError) as e:
        raise FormatError(f"predictors: header is not JSON: {e}")
    if not isinstance(hdr, dict):
        raise FormatError("predictors: header is not an object")
    data = pb[8 + n:]
    want = {"rope.cos_theta": ("F64", [D // 2]), "rope.sin_theta": ("F64", [D // 2])}
    for l in range(L):
        want[f"keys.{l}.weight"] = ("F16", [0 if l == 0 else HD, HD])
        want[f"keys.{l}.bias"] = ("F16", [HD])
        want[f"values.{l}.weight"] = ("F16", [HD if l == 0 else 2 * HD, HD])
        want[f"values.{l}.bias"] = ("F16", [HD])
    isz = {"F16": 2, "F64": 8, "U8": 1}
    spans = []
    arrs = {}
    for name, t in hdr.items():
        if name == "__metadata__":  # safetensors' optional string map: not a tensor (assumed allowed)
            if not isinstance(t, dict) or not all(isinstance(v, str) for v in t.values()):
                raise FormatError("predictors: __metadata__")
            continue
        if not isinstance(t, dict) or set(t) != {"dtype", "shape", "data_offsets"}:
            raise FormatError(f"predictors: tensor {name!r} entry")
        if name == "meta.json":
            wd, wshape = "U8", None
        elif name in want:
            wd, wshape = want[name]
        else:
            raise FormatError(f"predictors: unexpected tensor {name!r}")
        shape, offs = t["shape"], t["data_offsets"]
        if t["dtype"] != wd or not isinstance(shape, list) or not all(_is_int(x) and x >= 0 for x in shape):
            raise FormatError(f"predictors: tensor {name!r} dtype/shape")
        if wshape is None:
            if len(shape) != 1:
                raise FormatError("predictors: meta.json is a 1-D uint8 tensor")
        elif shape != wshape:
            raise FormatError(f"predictors: tensor {name!r} shape {shape}, expected {wshape}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(x) for x in offs)
                and 0 <= offs[0] <= offs[1] <= len(data)):
            raise FormatError(f"predictors: tensor {name!r} data_offsets")
        if offs[1] - offs[0] != int(np.prod(shape, dtype=np.int64)) * isz[wd]:
            raise FormatError(f"predictors: tensor {name!r} byte length")
        spans.append((offs[0], offs[1]))
        arrs[name] = (wd, shape, data[offs[0]:offs[1]])
    missing = [k for k in list(want) + ["meta.json"] if k not in arrs]
    if missing:
        raise FormatError(f"predictors: missing tensors {missing[:4]}")
    # the data buffer is tiled exactly by the tensors (safetensors' own rule: no holes, no overlaps)
    pos = 0
    for a, b in sorted(spans):
        if a != pos:
            raise FormatError("predictors: tensor data do not tile the data buffer")
        pos = b
    if pos != len(data):
        raise FormatError("predictors: bytes after the last tensor")

    def f16(name):
        _, shape, b = arrs[name]
        x = np.frombuffer(b, "<f2").reshape(shape)
        if not np.isfinite(x).all():
            raise FormatError(f"predictors: {name} not finite")
        return x.astype(np.float32)

    def f64(name):
        _, shape, b = arrs[name]
        x = np.frombuffer(b, "<f8").reshape(shape).astype(np.float64)
        if not np.isfinite(x).all():
            raise FormatError(f"predictors: {name} not finite")
        return x

    try:
        meta = json.loads(arrs["meta.json"][2].decode("utf-8"), object_pairs_hook=_no_duplicate_keys("meta.json: "))
    except (ValueError, RecursionError) as e:
        raise FormatError(f"predictors: meta.json is not UTF-8 JSON: {e}")
    if not isinstance(meta, dict) or any(k not in meta for k in ("format", "version", "scale", "meta")):
        raise FormatError("predictors: meta.json lacks format, version, scale or meta")  # other keys: ignored
    if meta["format"] != "kvz-predictors" or meta["version"] != "1":
        raise FormatError("predictors: meta.json format / version")
    if not _finite_json_number(meta["scale"]) or not np.isfinite(np.float32(float(meta["scale"]))) \
            or np.float32(float(meta["scale"])) == 0:
        raise FormatError("predictors: meta.json scale is not a finite, non-zero binary32")
    if not isinstance(meta["meta"], dict):
        raise FormatError("predictors: meta.json meta is not an object")
    return dict(kw=[f16(f"keys.{l}.weight") for l in range(L)], kb=[f16(f"keys.{l}.bias") for l in range(L)],
                vw=[f16(f"values.{l}.weight") for l in range(L)], vb=[f16(f"values.{l}.bias") for l in range(L)],
                cos=f64("rope.cos_theta"), sin=f64("rope.sin_theta"), scale=float(meta["scale"]))


def words_to_f32(words, dtype):
    """dtype words -> binary32, exactly."""
    if dtype == "float32":
        return np.ascontiguousarray(words).astype(np.uint32).view(np.float32)
    if dtype == "float16":
        return np.ascontiguousarray(words).astype(np.uint16).view(np.float16).astype(np.float32)
    return (np.ascontiguousarray(words).astype(np.uint32) << 16).view(np.float32)


def _predict_linear(x, w, bias):
    """P(x) of §13.1 step 2: per token and output j, acc = bias[j], then acc = acc + x[i]*W[i][j] for
    i = 0 .. I-1, every product and sum rounded to binary32 (numpy float32 element-wise, no FMA)."""
    acc = np.repeat(bias[None, :].astype(np.float32), x.shape[0], axis=0)
    for i in range(w.shape[0]):
        acc = acc + x[:, i:i + 1] * w[i][None, :]
    return acc


def rope_tables(pred, positions, scale):
    """§13.1 step 3: (cos, sin) per position (rows) and pair (columns), binary32. c = 1, s = 0 at p = 0, then
    (c, s) <- (c*C - s*S, s*C + c*S) in binary64; at each p the pair's cos / sin are float32(c) * float32(scale)
    and float32(s) * float32(scale), one binary32 product each (the spec's text has a hole here: assumed)."""
    C, S = pred["cos"], pred["sin"]
    sc = np.float32(scale)
    want = {p: i for i, p in enumerate(positions)}
    pmax = max(positions)
    cos = np.zeros((len(positions), C.shape[0]), np.float32)
    sin = np.zeros_like(cos)
    c = np.ones_like(C)
    s = np.zeros_like(S)
    for p in range(pmax + 1):
        if p in want:
            cos[want[p]] = c.astype(np.float32) * sc
            sin[want[p]] = s.astype(np.float32) * sc
        c, s = c * C - s * S, s * C + c * S
    return cos, sin


def apply_predict(info, pred, out_k, out_v):
    """§13.1 steps 1-4 over the decoded residual words (in place)."""
    pr = info["predict"]
    dt, B, H, D, T = info["dtype"], info["B"], pr["H"], pr["D"], pr["T"]
    a, b1 = pr["eh"], T - pr["et"]  # quantized tokens a .. b1 - 1
    Tq = b1 - a
    if Tq <= 0:
        return
    HD, h2 = H * D, D // 2
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is checked on the values (below)
        cos, sin = rope_tables(pred, [info["sp"] + t for t in range(a, b1)], pred["scale"])

    def mat(words):  # [H, Tq, D] words -> [Tq, H*D] binary32 (heads concatenated, token-major)
        return words_to_f32(words, dt).transpose(1, 0, 2).reshape(Tq, HD)

    def unmat(x):  # [Tq, H*D] binary32 -> [H, Tq, D] dtype words
        return to_dtype_words(np.ascontiguousarray(x.reshape(Tq, H, D).transpose(1, 0, 2)), dt)

    for bb in range(B):
        kprev = vprev = None
        for l in range(len(info["layers"])):
            rk = mat(out_k[l][bb, :, a:b1, :])
            rv = mat(out_v[l][bb, :, a:b1, :])
            xk = np.zeros((Tq, 0), np.float32) if l == 0 else kprev
            kt = rk + _predict_linear(xk, pred["kw"][l], pred["kb"][l])
            xv = kt if l == 0 else np.concatenate([kt, vprev], axis=1)
            vt = rv + _predict_linear(xv, pred["vw"][l], pred["vb"][l])
            rot = np.empty_like(kt)
            for h in range(H):
                u1 = kt[:, h * D:h * D + h2]
                u2 = kt[:, h * D + h2:(h + 1) * D]
                rot[:, h * D:h * D + h2] = u1 * cos - u2 * sin
                rot[:, h * D + h2:(h + 1) * D] = u2 * cos + u1 * sin
            # (revision 1.11.1) every k~, v~ and rotated key value of steps 2-3 MUST be finite [FormatError,
            # field predict]: no overflow, so no NaN whose bits would be the CPU's
            for what, x in (("k~", kt), ("v~", vt), ("rotated key", rot)):
                if not np.isfinite(x).all():
                    raise FormatError(f"predict: layer {l} row {bb}: a {what} value is not finite (§13.1)")
            out_k[l][bb, :, a:b1, :] = unmat(rot)
            out_v[l][bb, :, a:b1, :] = unmat(vt)
            kprev, vprev = kt, vt  # the chain carries binary32 (rounding to dtype only at the end, step 4)


def validate_reduce(r, minor=None):
    """The header's reduce object (1.4, §14.1) of a file stamped 1.`minor`. Returns it as a dict (bound: the
    (1.11) bound as dict(recent, step), or None)."""
    w = "header.reduce"
    _keys(r, ["method", "reducer", "form", "k", "block", "sinks", "window", "seed"], ["bound"], w)
    # (1.11, §3) a reduce object with a bound is stamped 11; stamped lower, the key is one a 1.10 decoder
    # refuses [FormatError] (change log 1.11). Checked before the value itself, as for parts.heads (1.8).
    if "bound" in r and minor is not None and minor < 11:
        raise FormatError(f"{w}.bound in a file stamped 1.{minor} (needs 1.11)")
    m = r["method"]
    if not isinstance(m, str):
        raise FormatError(f"{w}.method")
    if m not in REDUCE_METHODS:
        raise UnknownId(f"{w}.method {m!r}")
    red = r["reducer"]
    if red is not None:
        if not isinstance(red, str):
            raise FormatError(f"{w}.reducer")
        # any string other than cluster / sample is UnknownId, the one-shot method names included (§14.1)
        if red not in REDUCERS:
            raise UnknownId(f"{w}.reducer {red!r} (not a reducer)")
    # a known reducer that breaks "equals method for a merge-reduce method, null otherwise": FormatError
    want = m if m in REDUCERS else None
    if red != want:
        raise FormatError(f"{w}.reducer {red!r}: must be {want!r} for method {m!r}")
    f = r["form"]
    if not isinstance(f, str):
        raise FormatError(f"{w}.form")
    if f not in REDUCE_FORMS:
        raise UnknownId(f"{w}.form {f!r}")
    # (1.11, §14.1) bound: an object when present (null or another type: FormatError), keys recent
    # (0 .. 2^31) and step (1 .. 2^31), both required, 2^31 a limit (LimitExceeded above, FormatError below),
    # no other keys but x- ones; present only with reducer null [FormatError]
    bound = None
    if "bound" in r:
        wb = f"{w}.bound"
        if not isinstance(r["bound"], dict):
            raise FormatError(f"{wb} is not an object (null is invalid, §14.1)")
        _keys(r["bound"], ["recent", "step"], (), wb)
        bound = dict(recent=_int(r["bound"], "recent", 0, where=wb, limit=1 << 31),
                     step=_int(r["bound"], "step", 1, where=wb, limit=1 << 31))
        if red is not None:
            raise FormatError(f"{wb}: only with reducer null (a one-shot method), not with reducer {red!r}")
    # k, block, sinks, window: 2^31 is a limit (§9, §14.1): LimitExceeded above it, FormatError below the
    # range; seed's range is fixed: FormatError on either side. All are required and in range even for a
    # one-shot method (reducer null), where only sinks constrains the file (§14.1).
    return dict(method=m, reducer=red, form=f, bound=bound,
                k=_int(r, "k", 1, where=w, limit=1 << 31), block=_int(r, "block", 1, where=w, limit=1 << 31),
                sinks=_int(r, "sinks", 0, where=w, limit=1 << 31),
                window=_int(r, "window", 0, where=w, limit=1 << 31),
                seed=_int(r, "seed", 0, (1 << 63) - 1, w))


def validate_reduced_layer(st, tensors, B, H, S, Dk, sw, cl, reduce, w, minor=None):
    """The kind-specific rules of a layer of state kind `reduced` (1.4, §14.2) [FormatError; LimitExceeded for
    a parts count above 2^31, §9] of a layer with kv_heads H, seq_len S, k_dim Dk, sliding_window sw and
    cumulative_length cl, in a file stamped 1.`minor`; the generic tensor rules of §4.2 have already been
    applied to `tensors`. Returns the parsed parts (heads: the B x H lists of (1.8) parts.heads, or None) and
    scaling (as a float)."""
    if reduce is None:
        raise FormatError(f"{w}: a layer of kind reduced without a header reduce object (§14.1)")
    if sw is not None:
        raise FormatError(f"{w}: a reduced layer has sliding_window null")
    if st["slots"] != 1:
        raise FormatError(f"{w}.slots={st['slots']}: a reduced layer has 1 slot")
    if not 1 <= len(tensors) <= 3:
        raise FormatError(f"{w}.tensors: a reduced layer has 1 to 3 tensors, not {len(tensors)}")
    # tensors[0] log_weights; then anchor, present if and only if form is query; then (1.11) scores, present if
    # and only if the reduce object has a bound (§14.2)
    want = [("log_weights", (B, H, S))]
    if reduce["form"] == "query":
        want.append(("anchor", (B, H, Dk)))
    if reduce["bound"] is not None:
        want.append(("scores", (B, H, S)))
    if len(tensors) != len(want):
        raise FormatError(f"{w}.tensors: {len(tensors)} tensors; form {reduce['form']!r} "
                          f"{'with' if reduce['bound'] is not None else 'without'} a bound needs {len(want)} "
                          "(log_weights, an anchor if and only if form is query, scores if and only if "
                          "reduce has a bound)")
    for j, (t, (name, shape)) in enumerate(zip(tensors, want)):
        if t["name"] != name:
            raise FormatError(f"{w}.tensors[{j}].name {t['name']!r}, expected {name!r}")
        if t["slot"] != 0:
            raise FormatError(f"{w}.tensors[{j}].slot {t['slot']}, expected 0")
        if t["dtype"] != "float32":
            raise FormatError(f"{w}.tensors[{j}].dtype {t['dtype']!r}: a {name} tensor is float32")
        if t["shape"] != shape:
            raise FormatError(f"{w}.tensors[{j}].shape {list(t['shape'])}, expected {list(shape)}")
    # parts
    p = st["parts"]
    wp = f"{w}.parts"
    _keys(p, ["fixed", "sinks", "levels", "buffer"], ["heads"], wp)  # (1.8) heads optional, §14.2
    # (1.8, §3) a reduced layer whose parts has heads is stamped 8; below 8 the file is invalid (FormatError),
    # checked before the value itself (the key did not exist before 1.8)
    if "heads" in p and minor is not None and minor < 8:
        raise FormatError(f"{wp}.heads in a file stamped 1.{minor} (needs 1.8)")
    # the parts counts: 2^31 is a limit (§9): LimitExceeded above, FormatError below; `levels` at most 64
    # items (fixed: FormatError), each null or 1 .. 2^31 (a count too: LimitExceeded above), the last not null
    fixed = _int(p, "fixed", 0, where=wp, limit=1 << 31)
    sinks = _int(p, "sinks", 0, where=wp, limit=1 << 31)
    buf = _int(p, "buffer", 0, where=wp, limit=1 << 31)
    lv = p["levels"]
    if not isinstance(lv, list) or len(lv) > 64:
        raise FormatError(f"{wp}.levels: a list of at most 64 items")
    for i, x in enumerate(lv):
        if x is not None:
            if not _is_int(x) or x < 1:
                raise FormatError(f"{wp}.levels[{i}]: null or an integer 1 .. 2^31")
            if x > 1 << 31:
                raise LimitExceeded(f"{wp}.levels[{i}]={x} above limit 2^31")
    if lv and lv[-1] is None:
        raise FormatError(f"{wp}.levels: the last item is null")
    heads = validate_heads(p["heads"], B, H, fixed, wp) if "heads" in p else None
    if fixed + sinks + sum(x for x in lv if x is not None) + buf != S:
        raise FormatError(f"{wp}: fixed + sinks + levels + buffer != seq_len {S}")
    if sinks > reduce["sinks"]:
        raise FormatError(f"{wp}.sinks={sinks} above reduce.sinks={reduce['sinks']}")
    if reduce["reducer"] is None:
        if any(x is not None for x in lv):
            raise FormatError(f"{wp}.levels: every level null without a reducer")
    else:
        if fixed != 0:
            raise FormatError(f"{wp}.fixed={fixed}: 0 with a reducer")
        for i, x in enumerate(lv):
            if x is not None and x > min(reduce["k"], reduce["block"] << i):
                raise FormatError(f"{wp}.levels[{i}]={x} above min(reduce.k, block * 2^{i})")
        if not buf < reduce["window"] + reduce["block"]:
            raise FormatError(f"{wp}.buffer={buf}: not below reduce.window + reduce.block")
        # the binary counter (§14.2): level l summarises 2^l blocks of `block` tokens
        seen = sinks + reduce["block"] * sum(1 << i for i, x in enumerate(lv) if x is not None) + buf
        if cl != seen:
            raise FormatError(f"{w}: cumulative_length={cl}, but sinks + block*sum(2^l) + buffer = {seen}")
        if sinks < reduce["sinks"] and (any(x is not None for x in lv) or buf != 0):
            raise FormatError(f"{wp}: sinks={sinks} < reduce.sinks={reduce['sinks']}, so every level must be "
                              "null and buffer 0")
    # scaling: any JSON number (integer or not) whose binary64 value is > 0 (§14.2)
    sc = st["scaling"]
    if not _is_num(sc):
        raise FormatError(f"{w}.scaling is not a number")
    sc = float(sc)  # an integer literal (<= 40 characters, §4) is finite as binary64
    if not sc > 0:
        raise FormatError(f"{w}.scaling={sc!r}: its binary64 value must be > 0")
    return dict(fixed=fixed, sinks=sinks, levels=list(lv), buffer=buf, heads=heads), sc


def validate_heads(hd, B, H, fixed, wp):
    """(1.8, §14.2) parts.heads: a list of B lists (one per batch row) of H integers (one per KV head), each n
    in 0 .. fixed (the fixed entries the head holds); the largest equals fixed and at least one is smaller
    [FormatError]. "The largest" / "at least one" are taken over the whole layer (every row and head).
    Returns the lists."""
    w = f"{wp}.heads"
    if not isinstance(hd, list) or len(hd) != B:
        raise FormatError(f"{w}: a list of {B} lists, one per batch row")
    for b, row in enumerate(hd):
        if not isinstance(row, list) or len(row) != H:
            raise FormatError(f"{w}[{b}]: a list of {H} integers, one per KV head (kv_heads)")
        for h, n in enumerate(row):
            if not _is_int(n) or not 0 <= n <= fixed:
                raise FormatError(f"{w}[{b}][{h}]={n!r}: an integer in 0 .. fixed ({fixed})")
    flat = [n for row in hd for n in row]
    if max(flat) != fixed:
        raise FormatError(f"{w}: the longest head holds {max(flat)} entries, not fixed ({fixed})")
    if min(flat) == fixed:
        raise FormatError(f"{w}: every head holds fixed ({fixed}) entries; some head must hold fewer "
                          "(a layer whose heads all hold fixed entries has no heads)")
    return [list(row) for row in hd]


def head_entries(parts, b, h, t0, t1):
    """(1.8, §5 "Slices") the entries that the stored entries t0 .. t1 - 1 of head (b, h) of a layer with
    parts.heads stand for: a head stores its entries 0 .. n - 1, then F .. S - 1 (n = heads[b][h], F = fixed);
    its entries n .. F - 1 are absent. Stored entry t is entry t if t < n, else t - n + F."""
    n, F = parts["heads"][b][h], parts["fixed"]
    t = np.arange(t0, t1, dtype=np.int64)
    return np.where(t < n, t, t - n + F)


def validate_state(st, B, S, sw, w, H=None, Dk=None, reduce=None, cl=None, minor=None):
    """layers[i].state (§4.2) of a layer with seq_len S and sliding_window sw (kind `reduced`, 1.4: also
    kv_heads H, k_dim Dk and the header's validated reduce object or None).
    Returns dict(kind, slots, tensors=[dict(name, slot, dtype, shape, W, nbytes)]) (+ parts, scaling)."""
    if not isinstance(st, dict):
        raise FormatError(f"{w} is not an object")
    if "kind" not in st:
        raise FormatError(f"missing key {w}.kind")
    kind = st["kind"]
    if not isinstance(kind, str):
        raise FormatError(f"{w}.kind")
    if kind not in STATE_KINDS:
        raise UnknownId(f"{w}.kind {kind!r}")
    # kind `reduced` has two more keys (§4.2); for the others they are unknown keys
    _keys(st, ["kind", "slots", "tensors"] + (["parts", "scaling"] if kind == "reduced" else []), (), w)
    slots = _int(st, "slots", 1, 256, w)
    if kind == "indexed":
        if slots != 1:
            raise FormatError(f"{w}.slots={slots}: an indexed layer has 1 slot")
        if sw is not None:
            raise FormatError(f"{w}: an indexed layer has sliding_window null")
    tl = st["tensors"]
    if not isinstance(tl, list):
        raise FormatError(f"{w}.tensors")
    if len(tl) > 3 * slots:
        raise FormatError(f"{w}.tensors: more than 3*slots entries")
    tensors = []
    prev = None
    for j, t in enumerate(tl):
        wj = f"{w}.tensors[{j}]"
        _keys(t, ["name", "slot", "dtype", "shape"], (), wj)
        name, dt = t["name"], t["dtype"]
        if not isinstance(name, str):
            raise FormatError(f"{wj}.name")
        if name not in STATE_NAMES:
            raise UnknownId(f"{wj}.name {name!r}")
        slot = _int(t, "slot", 0, slots - 1, wj)
        if not isinstance(dt, str):
            raise FormatError(f"{wj}.dtype")
        if dt not in ITEMSIZE:
            raise UnknownId(f"{wj}.dtype {dt!r}")
        shape = t["shape"]
        if not isinstance(shape, list) or not (1 <= len(shape) <= 8):
            raise FormatError(f"{wj}.shape: a list of 1 to 8 integers")
        for i, d in enumerate(shape):
            if not _is_int(d) or d < 0:
                raise FormatError(f"{wj}.shape[{i}]")
            if d > 1 << 31:
                raise LimitExceeded(f"{wj}.shape[{i}]={d} above 2^31")
        if shape[0] != B:
            raise FormatError(f"{wj}.shape[0]={shape[0]} is not batch {B}")
        if name in ("conv", "indexer_keys", "log_weights", "anchor", "scores") and len(shape) != 3:
            raise FormatError(f"{wj}.shape: a {name} tensor has exactly 3 dimensions")
        if name == "indexer_keys" and shape[1] != S:
            raise FormatError(f"{wj}.shape[1]={shape[1]} is not the layer's seq_len {S}")
        if name not in STATE_KIND_NAMES[kind]:
            raise FormatError(f"{wj}: a {name} tensor in a layer of kind {kind}")
        key = (slot, STATE_NAMES.index(name))
        if prev is not None and key <= prev:
            raise FormatError(f"{wj}: not in state order (by slot, then conv, recurrent, indexer_keys, "
                              "log_weights, anchor, scores; each once)")
        prev = key
        n = 1
        for d in shape:
            n *= d
        tensors.append(dict(name=name, slot=slot, dtype=dt, shape=tuple(shape), W=ITEMSIZE[dt],
                            nbytes=n * ITEMSIZE[dt]))
    if kind == "indexed" and len(tensors) != 1:
        raise FormatError(f"{w}.tensors: an indexed layer has exactly one tensor (indexer_keys), "
                          f"not {len(tensors)}")
    out = dict(kind=kind, slots=slots, tensors=tensors)
    if kind == "reduced":
        out["parts"], out["scaling"] = validate_reduced_layer(st, tensors, B, H, S, Dk, sw, cl, reduce, w,
                                                              minor)
    return out


def state_tensors(info):
    """The state tensors of a file in canonical (state-tensor) order: (layer, j, tensor description)."""
    return [(l, j, t) for l, L in enumerate(info["layers"]) if L["state"] is not None
            for j, t in enumerate(L["state"]["tensors"])]


def validate_profile(prof, where):
    """§11.4 (revision 1.11.1): a numerics profile is an object; every value a string or an integer (not a
    boolean), except env (an object of strings) and step_threads (an integer 1 .. 1024) [FormatError]."""
    if not isinstance(prof, dict):
        raise FormatError(f"{where} is not an object")
    for k, v in prof.items():
        if k == "env":
            if not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values()):
                raise FormatError(f"{where}.env")
        elif k == "step_threads":
            if not (_is_int(v) and 1 <= v <= 1024):
                raise FormatError(f"{where}.step_threads")
        elif not (isinstance(v, str) or _is_int(v)):
            raise FormatError(f"{where}.{k}")


def validate_tokens(t, tier, B, N, minor=9):
    keys = ["token_model", "draft", "vocab", "chunk_tokens", "procedure", "schedule", "padding",
            "positions", "pad_token", "tolerance", "max_abs_deviation"]
    _keys(t, keys, (), "tokens")
    tm = t["token_model"]
    if not isinstance(tm, str):
        raise FormatError("tokens.token_model")
    if tm not in ("lm", "static", "draft", "blocks"):
        raise UnknownId(f"token_model {tm}")
    if tm == "blocks" and minor < 9:
        raise FormatError(f"token_model blocks in a file stamped 1.{minor} (needs 1.9)")
    if (t["draft"] is not None) != (tm == "draft"):
        raise FormatError("tokens.draft")
    if t["draft"] is not None:
        _model_obj(t["draft"], "tokens.draft", minor)
    V = _int(t, "vocab", 2, (1 << 24) - 2, "tokens")
    _int(t, "chunk_tokens", 1, None, "tokens", limit=1 << 24)
    p = t["procedure"]
    if not isinstance(p, dict) or "id" not in p or not isinstance(p["id"], str):
        raise FormatError("tokens.procedure")
    want = {"lm": "lm-schedule-v1", "draft": "lm-incremental-v1", "static": "static-wb-o2-v1",
            "blocks": "lm-blocks-v1"}[tm]
    if p["id"] != want:
        raise UnknownId("tokens.procedure.id")  # §11.1 (revision 1.12.0)
    if tm == "blocks":
        if "block_tokens" not in p:
            raise FormatError("tokens.procedure.block_tokens")
        _int(p, "block_tokens", 1, None, "tokens.procedure", limit=1 << 16)
    for k in ("numerics", "draft_numerics"):
        if k in p:
            validate_profile(p[k], f"tokens.procedure.{k}")
    sch = t["schedule"]
    if not isinstance(sch, list) or not (1 <= len(sch) <= 1 << 20):
        raise FormatError("tokens.schedule")
    tot = 0
    for r in sch:
        if (not isinstance(r, list) or len(r) != 2 or not all(_is_int(x) and x >= 1 for x in r)):
            raise FormatError("tokens.schedule run")
        tot += r[0] * r[1]
    if tot != N:
        raise FormatError("schedule sizes do not add to N")
    pad = t["padding"]
    if not isinstance(pad, list) or len(pad) != B or not all(_is_int(x) and 0 <= x < N for x in pad):
        raise FormatError("tokens.padding")
    if not isinstance(t["positions"], str):
        raise FormatError("tokens.positions")
    if t["positions"] not in ("mask", "arange"):  # registry.md: an unknown name [UnknownId]
        raise UnknownId(f"tokens.positions {t['positions']!r}")
    _int(t, "pad_token", 0, V - 1, "tokens")
    tol = t["tolerance"]
    if tol is not None and (not _is_num(tol) or tol < 0):
        raise FormatError("tokens.tolerance")
    if tier == "exact" and tol != 0:
        raise FormatError("tolerance must be 0 in tier exact")
    mad = t["max_abs_deviation"]
    if mad is not None and (not _is_num(mad) or mad < 0):
        raise FormatError("tokens.max_abs_deviation")


# --------------------------------------------------------------- container
SEC_HDR = struct.Struct("<HHIHHIQQQ")


def read_section_header(buf, off):
    if off + 40 > len(buf):
        raise TruncatedFile(f"section header at {off}")
    t, fl, layer, part, res, chunk, plen, pck, hck = SEC_HDR.unpack_from(buf, off)
    if xxh(buf[off:off + 32]) != hck:
        raise ChecksumMismatch(f"section header checksum at {off}")
    return dict(type=t, flags=fl, layer=layer, part=part, res=res, chunk=chunk, plen=plen, pck=pck, off=off)


def find_earlier_footer(buf, hck, body0):
    """§7 (revision 1.11.1): the candidates are the 32-byte spans at offsets f with max(body0, n - 65536) <= f
    (body0: the end of Header_Checksum), f + 32 < n, ending in End_Magic, whose File_Length is f + 32 and whose
    Footer_Checksum is valid."""
    n = len(buf)
    lo = max(body0, n - 65536)
    for f in range(n - 33, lo - 1, -1):
        if buf[f + 24:f + 32] != END_MAGIC:
            continue
        io, fl, fck = struct.unpack_from("<QQQ", buf, f)
        if fl == f + 32 and xxh(struct.pack("<QQQ", io, fl, hck)) == fck:
            return True
    return False


def parse_container(buf):
    n = len(buf)
    if n < 8 or buf[:8] != MAGIC:
        raise BadMagic("not a .kvz file")
    if n < 16:
        raise TruncatedFile("preamble")
    major, minor, hl = struct.unpack_from("<HHI", buf, 8)
    if major != 1:
        raise UnsupportedVersion(f"major {major}")
    if minor > IMPL_MINOR:
        raise UnsupportedVersion(f"minor {minor}")
    if hl > HEADER_LIMIT:
        raise LimitExceeded("Header_Length")
    if 16 + hl + 8 + 48 + 32 > n:
        raise TruncatedFile("header, checksum, index and footer do not fit")
    hck = struct.unpack_from("<Q", buf, 16 + hl)[0]
    if xxh(buf[:16 + hl]) != hck:
        raise ChecksumMismatch("Header_Checksum")
    hdr = parse_header_json(buf[16:16 + hl])
    info = validate_header(hdr, minor)
    info["minor"] = minor
    info["header"] = hdr
    # footer
    body0 = 16 + hl + 8
    if buf[n - 8:] != END_MAGIC:
        if find_earlier_footer(buf, hck, body0):
            raise TrailingData("bytes after a complete file")
        raise TruncatedFile("no End_Magic")
    io, fl, fck = struct.unpack_from("<QQQ", buf, n - 32)
    # §7's order: End_Magic, Footer_Checksum, File_Length
    if xxh(struct.pack("<QQQ", io, fl, hck)) != fck:
        raise ChecksumMismatch("Footer_Checksum")
    if fl < n:
        raise TrailingData("File_Length smaller than file")
    if fl > n:
        raise TruncatedFile("File_Length larger than file")
    if io < body0 or io + 40 > n - 32:
        raise OffsetError("Index_Offset")
    ih = read_section_header(buf, io)
    # §6 (revision 1.11.1): reserved bits and Reserved [ReservedBitSet], the type [OffsetError: the footer points
    # at another section], Critical clear or Layer / Part / Chunk not 0 [FormatError]
    if ih["res"] or ih["flags"] & ~1:
        raise ReservedBitSet("index section header: Reserved or a reserved Section_Flags bit")
    if ih["type"] != SEC_INDEX:
        raise OffsetError("Index_Offset: not an index section")
    if ih["flags"] != 1 or ih["layer"] or ih["part"] or ih["chunk"]:
        raise FormatError("index section header: Section_Flags must be 1, Layer, Part, Chunk 0")
    if io + 40 + ih["plen"] != n - 32:
        raise OffsetError("index does not end at footer")
    ipay = buf[io + 40:n - 32]
    if len(ipay) < 8:
        raise FormatError("index payload")
    cnt, ires = struct.unpack_from("<II", ipay, 0)
    if ih["plen"] != 8 + 32 * cnt:
        raise FormatError("index Payload_Length")
    if xxh(ipay) != ih["pck"]:
        raise ChecksumMismatch("index Payload_Checksum")
    if ires != 0:
        raise ReservedBitSet("index Reserved")
    if cnt > MAX_SECTIONS:
        raise LimitExceeded("sections")
    entries = []
    expect = body0
    for i in range(cnt):
        off, t, part, layer, chunk, res, plen = struct.unpack_from("<QHHIIIQ", ipay, 8 + 32 * i)
        if res != 0:
            raise ReservedBitSet("index entry Reserved")
        if off != expect:
            raise OffsetError(f"index entry {i} offset")
        if t == SEC_INDEX:
            raise OffsetError("index entry of type index")
        expect = off + 40 + plen
        if expect > io:
            raise OffsetError("section overruns the index")
        entries.append(dict(off=off, type=t, part=part, layer=layer, chunk=chunk, plen=plen))
    if expect != io:
        raise OffsetError("last section does not end at the index")
    # read & check every section header and payload checksum (tiling)
    secs = []
    for e in entries:
        s = read_section_header(buf, e["off"])
        for k in ("type", "part", "layer", "chunk", "plen"):
            if s[k] != e[k]:
                raise OffsetError(f"section at {e['off']} disagrees with index ({k})")
        if s["res"] != 0 or (s["flags"] & ~1):
            raise ReservedBitSet(f"reserved field of section at {e['off']}")
        payload = buf[e["off"] + 40:e["off"] + 40 + e["plen"]]
        if xxh(payload) != s["pck"]:
            raise ChecksumMismatch(f"Payload_Checksum of section at {e['off']}")
        if s["type"] not in KNOWN_SEC:
            if s["flags"] & 1:
                raise UnknownId(f"unknown critical section type {s['type']}")
            continue
        if not s["flags"] & 1:
            raise FormatError("known section without Critical")
        s["payload"] = payload
        secs.append(s)
    check_order(info, secs)
    return info, secs


def _heads_parts(L):
    """(1.8) the parts of a reduced layer whose parts has heads, else None."""
    st = L["state"]
    if st is not None and st["kind"] == "reduced" and st["parts"]["heads"] is not None:
        return st["parts"]
    return None


def layer_chunk_count(L, B, C):
    """The number of chunks of a layer (§5 "Slices"): ceil(S / C), or (1.8) for a layer cut head by head the
    sum over its heads of ceil(m / C), m = n + S - F the head's stored entries. Counted, never listed."""
    pr = _heads_parts(L)
    if pr is None:
        return -(-L["S"] // C)
    tail = L["S"] - pr["fixed"]
    return sum(-(-(n + tail) // C) for row in pr["heads"] for n in row)


def layer_chunks(L, B, C):
    """The chunks of a layer in Chunk order: (c, head, t0, t1). head None: the chunk covers tokens t0 .. t1 - 1
    of every row and head ([B, H, T, D]). (1.8, §5 "Slices") a layer whose parts has heads is cut head by head:
    head = (b, h), and the chunk is that head's stored entries t0 .. t1 - 1 ([1, 1, T, D]; head_entries maps
    them to entries), heads in order b = 0 .. B - 1, h = 0 .. H - 1, Chunk numbered across the whole layer."""
    pr = _heads_parts(L)
    out = []
    if pr is None:
        for c in range(-(-L["S"] // C)):
            out.append((c, None, c * C, min(c * C + C, L["S"])))
        return out
    tail = L["S"] - pr["fixed"]
    for b in range(B):
        for h in range(L["H"]):
            m = pr["heads"][b][h] + tail
            for j in range(-(-m // C)):
                out.append((len(out), (b, h), j * C, min(j * C + C, m)))
    return out


def slices(info):
    """The slices of a file in canonical order: (layer, part, chunk, t0, t1, head), see layer_chunks."""
    C, B = info["C"], info["B"]
    out = []
    for l, L in enumerate(info["layers"]):
        for c, head, t0, t1 in layer_chunks(L, B, C):
            out.append((l, 0, c, t0, t1, head))
            out.append((l, 1, c, t0, t1, head))
    return out


def check_order(info, secs):
    tier = info["tier"]
    sl = slices(info)
    got = [(s["type"], s["layer"], s["part"], s["chunk"]) for s in secs]
    if tier in ("lossless", "lossy"):
        want = []
        if info["nt"] > 0:
            want.append((SEC_TOKENS, 0, 0, 0))
        want += [(SEC_KV, l, p, c) for (l, p, c, _, _, _) in sl]
        want += [(SEC_STATE, l, j, 0) for (l, j, _) in state_tensors(info)]
        if info["engine"] is not None:  # (1.10) one engine_bytes section iff the header has an engine_file
            want.append((SEC_ENGINE, 0, 0, 0))
        if got != want:
            raise OffsetError("sections not in canonical set/order")
    else:
        B = info["B"]
        want = [(SEC_STREAM, 0, 0, r) for r in range(B)]
        if got[:B] != want:
            raise OffsetError("token_stream sections")
        rest = got[B:]
        tol = info["header"]["tokens"]["tolerance"]
        if tier == "exact" or tol is not None:
            if not rest or rest[0] != (SEC_CKS, 0, 0, 0):
                raise OffsetError("tensor_checksums section")
            rest = rest[1:]
            cand = [(SEC_RESID, l, p, c) for (l, p, c, _, _, _) in sl]
            cand += [(SEC_STATE, l, j, 0) for (l, j, _) in state_tensors(info)]
            i = 0
            for r in rest:
                while i < len(cand) and cand[i] != r:
                    i += 1
                if i == len(cand):
                    raise OffsetError("residual / state sections not a subsequence of slices, states")
                i += 1
        elif rest:
            raise OffsetError("unexpected sections")


# ----------------------------------------------------- float_ctx_rans (§8)
class Reader:
    def __init__(self, b, pos=0):
        self.b = b
        self.pos = pos

    def take(self, n):
        if n < 0 or self.pos + n > len(self.b):
            raise FormatError("payload too short")
        r = self.b[self.pos:self.pos + n]
        self.pos += n
        return r

    def u(self, fmt):
        s = struct.calcsize(fmt)
        return struct.unpack("<" + fmt, self.take(s))[0]


def fcr_coded(rd, shape, W, k_expected=None, wordbits=None):
    """Decode a Mode-1 coded part starting at rd.pos (Mode byte included).
    shape [B,H,T,D]. Returns (symbols array M[R][T] as list of lists, k, L, order-list) and
    leaves rd.pos after Words. wordbits: 8W, or k for the 'k-bit words' views."""
    B, H, T, D = shape
    R = B * H * D
    mode = rd.u("B")
    if mode != 1:
        raise FormatError("Mode")
    k, P, w, Q, res = struct.unpack("<BBBBB", rd.take(5))
    G, side_len, side_raw, nwords = struct.unpack("<HIII", rd.take(14))
    if wordbits is None:
        wordbits = 8 * W
    if k_expected is not None and k != k_expected:
        raise FormatError("Coded_Bits")
    if not (2 <= k <= min(16, wordbits)):
        raise FormatError("Coded_Bits range")
    if not (8 <= P <= 15):
        raise FormatError("Scale_Bits")
    if not (1 <= w <= 32):
        raise FormatError("Ways")
    if Q not in (1, 6):
        raise FormatError("Num_Classes")
    if res != 0:
        raise FormatError("Reserved")
    if not (1 <= G <= 255):
        raise FormatError("Num_Tables")
    if G * (1 << P) > (1 << 22):
        raise LimitExceeded("decode tables")
    if R * T == 0:
        raise FormatError("Mode 1 with R*T = 0")
    if not (2 * w <= nwords <= R * T + 2 * w):
        raise FormatError("Num_Words")
    lo_b = 2 * R + Q * R + 6 * G
    hi_b = 2 * R + Q * R + G * (4 + 2 * (1 << k))
    if not (lo_b <= side_raw <= hi_b):
        raise FormatError("Side_Raw_Length")
    side_c = rd.take(side_len)
    try:
        fp = zstandard.get_frame_parameters(side_c)
    except zstandard.ZstdError as e:
        raise FormatError(f"Side zstd: {e}")
    if fp.content_size != side_raw:
        raise FormatError("Side frame content size")
    try:
        dobj = zstandard.ZstdDecompressor().decompressobj()
        side = dobj.decompress(side_c)
        if not dobj.eof or dobj.unused_data:
            raise FormatError("Side: not exactly one frame")
    except zstandard.ZstdError as e:
        raise FormatError(f"Side zstd: {e}")
    if len(side) != side_raw:
        raise FormatError("Side size")
    ref = np.frombuffer(side, "<u2", R, 0).astype(np.int64)
    if (ref >= (1 << (k - 1))).any():
        raise FormatError("Ref >= 2^(k-1)")
    ctx = np.frombuffer(side, np.uint8, Q * R, 2 * R).reshape(R, Q)
    if (ctx >= G).any():
        raise FormatError("Ctx_Map >= G")
    p = 2 * R + Q * R
    tables = []
    for g in range(G):
        if p + 4 > len(side):
            raise FormatError("frequency tables truncated")
        lo, cm1 = struct.unpack_from("<HH", side, p)
        cnt = cm1 + 1
        p += 4
        if lo + cnt > (1 << k) or p + 2 * cnt > len(side):
            raise FormatError("frequency table")
        F = np.zeros(1 << k, np.int64)
        F[lo:lo + cnt] = np.frombuffer(side, "<u2", cnt, p)
        p += 2 * cnt
        if F.sum() != (1 << P):
            raise FormatError("frequencies do not sum to 2^P")
        Cc = np.concatenate([[0], np.cumsum(F)])
        # slot -> symbol lookup
        lut = np.repeat(np.arange(1 << k), F)
        tables.append((F.tolist(), Cc.tolist(), lut.tolist()))
    if p != len(side):
        raise FormatError("tables do not fill Side")
    words = np.frombuffer(rd.take(2 * nwords), "<u2").tolist()
    half = 1 << (k - 1)
    magm = half - 1
    refl = ref.tolist()
    ctxl = ctx.tolist()

    def cls(prev, r):
        if Q == 1:
            return 0
        mp = prev & magm
        mr = refl[r] & magm
        return 3 * (prev >> (k - 1)) + (0 if mp < mr else 1 if mp == mr else 2)

    M = [[0] * T for _ in range(R)]
    order = []
    x = []
    for j in range(w):
        xs = (words[2 * j] << 16) | words[2 * j + 1]
        if xs < (1 << 16):
            raise FormatError("initial state")
        x.append(xs)
    pos = 2 * w
    mask = (1 << P) - 1
    prev = list(refl)
    for g0 in range(0, R, w):
        lanes = range(g0, min(g0 + w, R))
        for t in range(T):
            for j, r in enumerate(lanes):
                F, Cc, lut = tables[ctxl[r][cls(prev[r], r)]]
                xs = x[j]
                slot = xs & mask
                s = lut[slot]
                xs = F[s] * (xs >> P) + slot - Cc[s]
                if xs < (1 << 16):
                    if pos == nwords:
                        raise FormatError("rANS stream too short")
                    xs = (xs << 16) | words[pos]
                    pos += 1
                x[j] = xs
                M[r][t] = s
                prev[r] = s
                order.append((r, t))
    if any(xs != (1 << 16) for xs in x) or pos != nwords:
        raise FormatError("rANS final state")
    return M, k, order


def read_bits(data, nbits_each, count, pos_bits=0):
    """LSB-first bit reader; returns list of values."""
    out = []
    bitpos = pos_bits
    for _ in range(count):
        v = 0
        for i in range(nbits_each):
            byte = data[bitpos >> 3]
            v |= ((byte >> (bitpos & 7)) & 1) << i
            bitpos += 1
        out.append(v)
    return out


def fcr_payload(rd, shape, W, end=None):
    """A complete float_ctx_rans payload from rd.pos. Returns uint words [B,H,T,D].
    If end is given, the payload must end exactly there."""
    B, H, T, D = shape
    R = B * H * D
    udt = {4: np.uint32, 2: np.uint16}[W]
    if rd.pos >= len(rd.b):
        raise FormatError("missing Mode")
    mode = rd.b[rd.pos]
    if mode == 0:
        rd.pos += 1
        n = B * H * T * D
        raw = rd.take(n * W)
        out = np.frombuffer(raw, "<u%d" % W).astype(udt).reshape(B, H, T, D)
    elif mode == 1:
        M, k, order = fcr_coded(rd, shape, W)
        L = 8 * W - k
        nbytes = (R * T * L + 7) // 8
        raw = rd.take(nbytes)
        out = np.zeros((B, H, T, D), udt)
        if L:
            lows = read_bits(raw, L, R * T)
            pad = nbytes * 8 - R * T * L
            if pad and (raw[-1] >> (8 - pad)):
                raise FormatError("Raw_Bits padding not zero")
        else:
            lows = [0] * (R * T)
        for i, (r, t) in enumerate(order):
            b, rem = divmod(r, H * D)
            h, d = divmod(rem, D)
            out[b, h, t, d] = (M[r][t] << L) | lows[i]
    else:
        raise FormatError(f"float_ctx_rans Mode {mode}")
    if end is not None and rd.pos != end:
        raise FormatError("float_ctx_rans payload does not fill its space")
    return out


# ---------------------------------------------------- int_residual_rans (§12)
def residual_apply(payload, regen_words, W):
    B, H, T, D = regen_words.shape
    bits = 8 * W
    full = (1 << bits) - 1
    top = 1 << (bits - 1)
    rd = Reader(payload)
    mode = rd.u("B")
    if mode == 0:
        if rd.pos != len(payload):
            raise FormatError("residual Mode 0 with data")
        return regen_words.copy()
    if mode == 2:
        return fcr_payload(rd, (B, H, T, D), W, end=len(payload))
    if mode != 1:
        raise FormatError(f"residual Mode {mode}")
    M, k, order = fcr_coded(rd, (B, H, T, D), W, k_expected=6, wordbits=6)
    sym = np.zeros((B, H, T, D), np.int64)
    for r in range(B * H * D):
        b, rem = divmod(r, H * D)
        h, d = divmod(rem, D)
        for t in range(T):
            sym[b, h, t, d] = M[r][t]
    if (sym > 11 + 8 * W).any():
        raise FormatError("bucket symbol too large")
    extra = payload[rd.pos:]
    bitpos = 0
    flat = sym.reshape(-1).tolist()
    z = []
    for s in flat:
        if s < 16:
            z.append(s)
        else:
            n = s - 11
            v = 0
            for i in range(n - 1):
                if (bitpos >> 3) >= len(extra):
                    raise FormatError("Extra_Bits truncated")
                v |= ((extra[bitpos >> 3] >> (bitpos & 7)) & 1) << i
                bitpos += 1
            z.append((1 << (n - 1)) + v)
    if (bitpos + 7) // 8 != len(extra):
        raise FormatError("payload does not end after Extra_Bits")
    if bitpos % 8 and (extra[-1] >> (bitpos % 8)):
        raise FormatError("Extra_Bits padding not zero")

    def key(x):
        return x ^ top if not (x & top) else (~x) & full

    def unkey(kv):
        return kv ^ top if (kv & top) else (~kv) & full

    rg = regen_words.reshape(-1).tolist()
    out = []
    for x, zz in zip(rg, z):
        d = zz >> 1 if not (zz & 1) else -((zz + 1) >> 1)
        out.append(unkey((key(int(x)) + d) & full))
    udt = {4: np.uint32, 2: np.uint16}[W]
    return np.array(out, dtype=udt).reshape(B, H, T, D)


# ------------------------------------------------------------ vq_rans (§13)
def splitmix_signs(seed, D):
    M64 = (1 << 64) - 1
    out = []
    for i in range(D):
        z = (seed + (i + 1) * 0x9E3779B97F4A7C15) & M64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        z = z ^ (z >> 31)
        out.append(-1 if (z >> 63) == 1 else 1)
    return out


def f16_to_f32(words_u16):
    return np.asarray(words_u16, np.uint16).view(np.float16).astype(np.float32)


def to_dtype_words(x32, dtype):
    x32 = np.asarray(x32, np.float32)
    if dtype == "float32":
        return x32.view(np.uint32).copy()
    if dtype == "float16":
        return x32.astype(np.float16).view(np.uint16).copy()
    b = x32.view(np.uint32).astype(np.uint64)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return r.astype(np.uint16)


def indices_payload(rd, shape, k):
    B, H, T, D = shape
    M, kk, order = fcr_coded(rd, shape, None, k_expected=k, wordbits=k)
    sym = np.zeros((B, H, T, D), np.int64)
    for r in range(B * H * D):
        b, rem = divmod(r, H * D)
        h, d = divmod(rem, D)
        sym[b, h, :, d] = M[r]
    return sym


def wht_f32(z):
    # z [..., D] float32, butterfly in binary32
    y = z.astype(np.float32).copy()
    D = y.shape[-1]
    h = 1
    while h < D:
        y2 = y.reshape(y.shape[:-1] + (D // (2 * h), 2, h))
        a = y2[..., 0, :].copy()
        b = y2[..., 1, :].copy()
        y2[..., 0, :] = a + b
        y2[..., 1, :] = a - b
        y = y2.reshape(y.shape)
        h *= 2
    return y


def vq_payload(payload, shape, dtype, W, minor, exact=None):
    """exact: (1.6, §13.1) the (Head_Tokens, Exact_Tokens) a predicted file requires of this payload."""
    B, H, T, D = shape
    rd = Reader(payload)
    mode, method, k, rule = struct.unpack("<BBBB", rd.take(4))
    E = rd.u("I")
    seed = rd.u("Q")
    step = struct.unpack("<f", rd.take(4))[0]
    norms_len = rd.u("I")
    o = rd.u("i")
    if mode not in (1, 2):
        raise FormatError("VQ Mode")
    if method not in (1, 2, 3, 4, 5):
        raise FormatError("VQ Method")
    if method == 5 and minor < 5:
        raise FormatError("VQ Method 5 in a file stamped below 1.5")
    if not (2 <= k <= 12):
        raise FormatError("Symbol_Bits")
    if rule not in (0, 1) or (minor >= 2 and rule != 1) or (minor == 1 and rule != 0):
        raise FormatError("Sign_Rule")
    if rule == 0:
        raise UnsupportedVersion("Sign_Rule 0 not implemented")
    H0 = 0
    head = None
    if mode == 2:
        H0 = rd.u("I")
        hlen = rd.u("I")
        if not (1 <= H0 <= T - E):
            raise FormatError("Head_Tokens")
        hend = rd.pos + hlen
        if hend > len(payload):
            raise FormatError("Head_Length")
        head = fcr_payload(rd, (B, H, H0, D), W, end=hend)
    if E > T - H0:
        raise FormatError("Exact_Tokens")
    if exact is not None and (H0, E) != tuple(exact):
        raise FormatError(f"VQ Head_Tokens/Exact_Tokens ({H0}, {E}) are not the predict object's ({exact[0]}, "
                          f"{exact[1]}) for this chunk")
    Tq = T - E - H0
    if method in (3, 4, 5) and seed != 0:
        raise FormatError("Seed must be 0 for Methods 3, 4, 5")
    if method != 1 or Tq == 0:
        if step != 0.0 or struct.pack("<f", step) != b"\0\0\0\0":
            raise FormatError("Step must be 0")
    else:
        if not (math.isfinite(step) and step > 0):
            raise FormatError("Step")
        if max(abs(o), abs(o + (1 << k) - 1)) * step >= 2.0 ** 127 / max(D, 65536):
            raise FormatError("Step could overflow the reconstruction")
    if (method not in (1, 5) or Tq == 0) and o != 0:
        raise FormatError("Index_Offset must be 0")
    if Tq == 0 and norms_len != 0:
        raise FormatError("Norms_Length")
    q = None
    if Tq > 0:
        if method in (1, 2):
            if D & (D - 1):
                raise FormatError("D not a power of two")
            cb = None
            if method == 2:
                cb = np.frombuffer(rd.take(4 << k), "<f4").astype(np.float32)
                if not np.isfinite(cb).all():
                    raise FormatError("Codebook not finite")
                if float(np.abs(cb).max()) >= 2.0 ** 127 / max(D, 65536):
                    raise FormatError("Codebook could overflow the reconstruction")
            nend = rd.pos + norms_len
            if norms_len == 0 or nend > len(payload):
                raise FormatError("Norms_Length")
            norms = f16_to_f32(fcr_payload(rd, (B, H, Tq, 1), 2, end=nend))
            if not np.isfinite(norms).all():
                raise FormatError("norms not finite")
            s = indices_payload(rd, (B, H, Tq, D), k)
            if method == 1:
                z = (s + o).astype(np.float32) * np.float32(step)
            else:
                if (s >= (1 << k)).any():
                    raise FormatError("symbol >= 2^k")
                z = cb[s]
            y = wht_f32(z.astype(np.float32))
            sign = np.array(splitmix_signs(seed, D), np.float32)
            q = ((y * sign) * np.float32(1.0 / D)) * norms  # norms [B,H,Tq,1]
        elif method == 5:  # (1.5) a float16 step per head and channel
            if norms_len != 0:
                raise FormatError("Norms_Length")
            cs = f16_to_f32(np.frombuffer(rd.take(2 * H * D), "<u2").reshape(H, D))
            if not (np.isfinite(cs).all() and (cs > 0).all()):
                raise FormatError("Channel_Steps")
            s = indices_payload(rd, (B, H, Tq, D), k)
            q = (s + o).astype(np.float32) * cs[None, :, None, :].astype(np.float32)
        elif method == 3:
            if norms_len != 0:
                raise FormatError("Norms_Length")
            axis, bits, G = struct.unpack("<BBH", rd.take(4))
            if axis not in (0, 1) or not (1 <= bits <= 8) or G < 1:
                raise FormatError("KIVI fields")
            if k != max(2, bits):
                raise FormatError("Symbol_Bits != max(2,Bits)")
            slen = rd.u("I")
            send = rd.pos + slen
            if send > len(payload):
                raise FormatError("Side_Length")
            if axis == 0:
                ng_shape = (B, H, D, -(-Tq // G))
            else:
                ng_shape = (B, H, Tq, -(-D // G))
            NG = int(np.prod(ng_shape))
            side = f16_to_f32(fcr_payload(rd, (1, 2, NG, 1), 2, end=send)).reshape(2, NG)
            if not np.isfinite(side).all():  # (revision 1.11.1, §13) every minimum and scale finite
                raise FormatError("VQ.KIVI.Side: a group minimum or scale is not finite")
            mins = side[0].reshape(ng_shape)
            scales = side[1].reshape(ng_shape)
            s = indices_payload(rd, (B, H, Tq, D), k)
            if (s > (1 << bits) - 1).any():
                raise FormatError("KIVI symbol too large")
            tt = np.arange(Tq)
            dd = np.arange(D)
            if axis == 0:
                mn = mins[:, :, dd[None, :], (tt // G)[:, None]]  # -> [B,H,Tq,D]
                sc = scales[:, :, dd[None, :], (tt // G)[:, None]]
            else:
                mn = mins[:, :, tt[:, None], (dd // G)[None, :]]
                sc = scales[:, :, tt[:, None], (dd // G)[None, :]]
            q = mn.astype(np.float32) + (s.astype(np.float32) * sc.astype(np.float32))
        else:
            if norms_len != 0:
                raise FormatError("Norms_Length")
            bins, res = struct.unpack("<HH", rd.take(4))
            if bins < 3 or res != 0:
                raise FormatError("Bins/Reserved")
            half = bins // 2 - 1 if bins % 2 == 0 else (bins - 1) // 2
            if k != max(2, math.ceil(math.log2(2 * half + 1))):
                raise FormatError("Symbol_Bits for CacheGen")
            slen = rd.u("I")
            send = rd.pos + slen
            if send > len(payload):
                raise FormatError("Side_Length")
            sc = f16_to_f32(fcr_payload(rd, (B, 1, Tq, 1), 2, end=send))
            if not np.isfinite(sc).all():  # (revision 1.11.1, §13) every scale finite
                raise FormatError("VQ.CacheGen.Side: a token scale is not finite")
            s = indices_payload(rd, (B, H, Tq, D), k)
            if (s > 2 * half).any():
                raise FormatError("CacheGen symbol too large")
            q = (s - half).astype(np.float32) * sc
    tail_len = rd.u("I")
    if rd.pos + tail_len != len(payload):
        raise FormatError("Tail_Length is not the rest")
    if E == 0 and tail_len != 0:
        raise FormatError("Tail_Length with E = 0")
    tail = None
    if E > 0:
        tail = fcr_payload(rd, (B, H, E, D), W, end=len(payload))
    parts = []
    if head is not None:
        parts.append(head)
    if q is not None:
        parts.append(to_dtype_words(q.astype(np.float32), dtype))
    if tail is not None:
        parts.append(tail)
    udt = {4: np.uint32, 2: np.uint16}[W]
    return np.concatenate([p.astype(udt) for p in parts], axis=2)


# ----------------------------------------------- token streams (§11.2, static)
def freqs_from_p(p):
    V = len(p)
    if not (2 <= V <= (1 << 24) - 2):
        raise FormatError("V")
    S = [0.0] * (V + 1)
    for s in range(V):
        if not (math.isfinite(p[s]) and p[s] >= 0):
            raise FormatError("bad probability")
        S[s + 1] = S[s] + p[s]
    N = S[V]
    if not (math.isfinite(N) and N >= 2.0 ** -1022):
        raise FormatError("bad sum")
    free = float((1 << 24) - V)
    scale = free / N
    if not math.isfinite(scale):
        raise FormatError("scale")
    C = [int(math.trunc(S[s] * scale)) + s for s in range(V)]
    C.append(1 << 24)
    return C


class RangeDecoder:
    M64 = (1 << 64) - 1

    def __init__(self, words):
        self.words = words
        self.pos = 0
        self.low = 0
        self.range = self.M64
        self.point = (self.next() << 32) | self.next()

    def next(self):
        w = self.words[self.pos] if self.pos < len(self.words) else 0
        self.pos += 1
        return w

    def decode(self, C):
        scale = self.range >> 24
        q = ((self.point - self.low) & self.M64) // scale
        if q >= (1 << 24):
            raise FormatError("range decoder: q >= 2^24")
        # binary search
        lo, hi = 0, len(C) - 2
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if C[mid] <= q:
                lo = mid
            else:
                hi = mid - 1
        t = lo
        self.low = (self.low + scale * C[t]) & self.M64
        self.range = scale * (C[t + 1] - C[t])
        if self.range < (1 << 32):
            self.low = (self.low << 32) & self.M64
            self.range <<= 32
            self.point = ((self.point << 32) & self.M64) | self.next()
        return t


STATIC_VARIANT = "c"  # §11.2: the order-0 term as written; exact_static_order2 pins it


def wb_level(lower, counts, n, d, V):
    """p = lower * (d/(n+d)) then += c/(n+d) on seen symbols."""
    if n == 0:
        return list(lower)
    f = d / (n + d)  # correctly rounded quotient of integers (Python int/int)
    out = [x * f for x in lower]
    nd = float(n + d)
    for t, c in counts.items():
        out[t] = out[t] + float(c) / nd
    return out


def static_dist(hist, V):
    n0 = len(hist)
    if n0 == 0:
        return [math.floor((1.0 / V) * 2.0 ** 40) + 1.0] * V
    c0 = {}
    for t in hist:
        c0[t] = c0.get(t, 0) + 1
    d0 = len(c0)
    # order 0: (c0[t] + d0/V) / (n0 + d0)
    nd = float(n0 + d0)
    if STATIC_VARIANT == "a":
        # reading (a): p0 = (1/V) * (d0/(n0+d0)), then += c0/(n0+d0) on seen symbols
        p0 = [(1.0 / V) * (d0 / (n0 + d0))] * V
        for t, c in c0.items():
            p0[t] = p0[t] + float(c) / nd
    elif STATIC_VARIANT == "b":
        # reading (b): p0 = (d0/V) / (n0+d0), then += c0/(n0+d0)
        u = d0 / V
        p0 = [u / nd] * V
        for t, c in c0.items():
            p0[t] = p0[t] + float(c) / nd
    elif STATIC_VARIANT == "c":
        # reading (c): literal (c0 + d0/V) / (n0+d0)
        u = d0 / V
        p0 = [u / nd] * V
        for t, c in c0.items():
            p0[t] = (float(c) + u) / nd
    # order 1
    prev = hist[-1]
    c1 = {}
    for i in range(len(hist) - 1):
        if hist[i] == prev:
            c1[hist[i + 1]] = c1.get(hist[i + 1], 0) + 1
    n1 = sum(c1.values())
    p1 = wb_level(p0, c1, n1, len(c1), V)
    c2 = {}
    if len(hist) >= 2:
        a, b = hist[-2], hist[-1]
        for i in range(len(hist) - 2):
            if hist[i] == a and hist[i + 1] == b:
                c2[hist[i + 2]] = c2.get(hist[i + 2], 0) + 1
    n2 = sum(c2.values())
    p2 = wb_level(p1, c2, n2, len(c2), V)
    return [math.floor(x * 2.0 ** 40) + 1.0 for x in p2]


def decode_static_row(payload, n_expected, V, chunk_tokens):
    rd = Reader(payload)
    n = rd.u("I")
    nch = rd.u("I")
    if n != n_expected:
        raise FormatError("Num_Tokens")
    if nch != -(-n // chunk_tokens):
        raise FormatError("Num_Chunks")
    cks = [rd.u("Q") for _ in range(nch)]
    rest = payload[rd.pos:]
    if len(rest) % 4:
        raise FormatError("Words not a multiple of 4")
    words = list(struct.unpack("<%dI" % (len(rest) // 4), rest))
    toks = []
    if n == 0:
        return toks, cks, words
    dec = RangeDecoder(words)
    for i in range(n):
        C = freqs_from_p(static_dist(toks, V))
        toks.append(dec.decode(C))
        if len(toks) % chunk_tokens == 0 or len(toks) == n:
            ci = (len(toks) - 1) // chunk_tokens
            chunk = toks[ci * chunk_tokens:]
            if xxh(np.array(chunk, "<u4").tobytes()) != cks[ci]:
                raise ChecksumMismatch(f"token chunk {ci}")
    return toks, cks, (dec.pos, len(words))


# ------------------------------------------------------------- state (§5.6)
def zstd_frame_content_size(data, what="state"):
    """Parse an RFC 8878 Zstandard frame header; return (declared Frame_Content_Size or None, header length).
    A frame that needs a dictionary (Dictionary_ID present and not 0) is invalid (§5.6)."""
    if len(data) < 5:
        raise FormatError(f"{what} zstd frame: too short")
    if struct.unpack_from("<I", data, 0)[0] != ZSTD_MAGIC:
        raise FormatError(f"{what} zstd frame: not a Zstandard frame (magic)")
    fhd = data[4]
    fcs_flag = fhd >> 6
    single = (fhd >> 5) & 1
    if fhd & 0x08:
        raise FormatError(f"{what} zstd frame: reserved bit set")
    did_size = (0, 1, 2, 4)[fhd & 3]
    fcs_size = (1 if single else 0, 2, 4, 8)[fcs_flag]
    did_pos = 5 + (0 if single else 1)
    pos = did_pos + did_size
    if len(data) < pos + fcs_size:
        raise FormatError(f"{what} zstd frame: header truncated")
    if did_size and int.from_bytes(data[did_pos:pos], "little") != 0:
        raise FormatError(f"{what} zstd frame needs a dictionary (Dictionary_ID not 0)")
    if fcs_size == 0:
        return None, pos
    v = int.from_bytes(data[pos:pos + fcs_size], "little")
    if fcs_size == 2:
        v += 256
    return v, pos + fcs_size


def decode_coded_bytes(payload, n, what="state"):
    """A payload of the state layout (§5.6; (1.10) engine_bytes, §15): Coding, 7 reserved bytes, Data of n bytes
    once decoded (raw, or one zstd frame declaring Frame_Content_Size = n, nothing after it). Returns the bytes."""
    if len(payload) < 8:
        raise FormatError(f"{what} payload shorter than 8 bytes")
    coding = payload[0]
    if any(payload[1:8]):
        raise FormatError(f"{what} Reserved not zero")
    data = payload[8:]
    if coding == 0:
        if len(data) != n:
            raise FormatError(f"{what} Coding 0: {len(data)} data bytes, expected {n}")
        raw = bytes(data)
    elif coding == 1:
        fcs, _ = zstd_frame_content_size(data, what)
        if fcs is None:
            raise FormatError(f"{what} zstd frame does not declare Frame_Content_Size")
        if fcs != n:
            raise FormatError(f"{what} zstd Frame_Content_Size {fcs}, expected {n}")
        try:
            dobj = zstandard.ZstdDecompressor().decompressobj()
            raw = dobj.decompress(bytes(data))
            if not dobj.eof:
                raise FormatError(f"{what} zstd frame incomplete")
            if dobj.unused_data:
                raise FormatError(f"bytes after the {what} zstd frame")
        except zstandard.ZstdError as e:
            raise FormatError(f"{what} zstd: {e}")
        if len(raw) != n:
            raise FormatError(f"{what} zstd frame decompressed to the wrong size")
    else:
        raise FormatError(f"{what} Coding {coding}")
    return raw


def decode_state_payload(payload, t):
    """One state payload (§5.6) -> little-endian words array of the tensor's shape and dtype."""
    raw = decode_coded_bytes(payload, t["nbytes"], "state")
    return np.frombuffer(raw, "<u%d" % t["W"]).reshape(t["shape"]).copy()


def check_absent_weights(a, parts, layer):
    """(1.8, §14.2) in the decoded log_weights [B, H, S] of a layer whose parts has heads, a fixed entry's beta
    is -inf (binary32 0xFF800000, the exact bit pattern) if and only if it is absent (entries n .. fixed - 1 of
    head (b, h), n = heads[b][h]) [FormatError, field State.Data]."""
    bits = np.asarray(a).view("<u4")
    F = parts["fixed"]
    n = np.asarray(parts["heads"], dtype=np.int64)  # [B, H]
    absent = np.arange(F)[None, None, :] >= n[:, :, None]
    neginf = bits[..., :F] == 0xFF800000
    bad = np.argwhere(neginf != absent)
    if len(bad):
        b, h, j = (int(x) for x in bad[0])
        what = ("absent but its log-weight is not -inf" if absent[b, h, j]
                else "held but its log-weight is -inf")
        raise FormatError(f"State.Data: layer {layer} log_weights[{b}][{h}][{j}]: fixed entry {what} "
                          f"(heads[{b}][{h}]={int(n[b, h])}; -inf if and only if absent, §14.2)")


def check_scores(a, layer):
    """(1.11, §14.2) the decoded scores [B, H, S] of a reduced layer: no score is NaN (any binary32 NaN bit
    pattern, either sign, any payload); every other value, +-inf included, is valid [FormatError, field
    State.Data]. Applied to every entry, the absent places of a layer with parts.heads included."""
    bits = np.asarray(a).view("<u4")
    bad = np.argwhere((bits & 0x7FFFFFFF) > 0x7F800000)
    if len(bad):
        b, h, j = (int(x) for x in bad[0])
        raise FormatError(f"State.Data: layer {layer} scores[{b}][{h}][{j}] is NaN "
                          f"(0x{int(bits[b, h, j]):08X}; no score is NaN, §14.2)")


def _regen_state(rs, l, j):
    if rs is None:
        return None
    if isinstance(rs, dict):
        return rs.get((l, j), rs.get(f"state.{l}.{j}"))
    if l < len(rs) and rs[l] is not None and j < len(rs[l]):
        return rs[l][j]
    return None


# ------------------------------------------------------------------- decode
def decode_file(buf, regen=None, predictors=None):
    """Returns (info, tokens, keys, values, notes); info["states"] holds the state tensors (1.3): per layer
    None (no state) or a list of little-endian word arrays (uint16/uint32 of the tensor's dtype width) in state
    order. regen (token tiers): (keys, values) or (keys, values, states), states per layer a list of word
    arrays in state order (or None), or a dict keyed (layer, j) or "state.<layer>.<j>".
    predictors (1.6): the bytes of the predictors file a header predict object names (§13.1)."""
    info, secs = parse_container(buf)
    pred = None
    if info["predict"] is not None:
        if predictors is None:
            raise PredictorsRequired(f"the file needs the predictors {info['predict']['predictors']}")
        if hashlib.sha256(bytes(predictors)).hexdigest() != info["predict"]["predictors"]:
            raise PredictorsRequired("the predictors given are not the ones the file names (SHA-256)")
        pred = parse_predictors(predictors, info)
    tier = info["tier"]
    B, W, dt = info["B"], info["W"], info["dtype"]
    L = info["layers"]
    out_k = [np.zeros((B, x["H"], x["S"], x["Dk"]), {4: np.uint32, 2: np.uint16}[W]) for x in L]
    out_v = [np.zeros((B, x["H"], x["S"], x["Dv"]), {4: np.uint32, 2: np.uint16}[W]) for x in L]
    tokens = None
    notes = []
    st_list = state_tensors(info)
    info["states"] = None
    if tier in ("lossless", "lossy"):
        states = [None if x["state"] is None else [None] * len(x["state"]["tensors"]) for x in L]
        chunks = {}  # layer -> layer_chunks (built when its first kv section comes)
        i = 0
        if info["nt"] > 0:
            s = secs[0]
            if len(s["payload"]) != 4 * B * info["nt"]:
                raise FormatError("tokens Payload_Length")
            tokens = np.frombuffer(s["payload"], "<u4").reshape(B, info["nt"]).tolist()
            i = 1
        for s in secs[i:]:
            if s["type"] == SEC_ENGINE:
                # (1.10, §15) kept as it is: decoded (Engine.Coding, ...) only when the engine file is rebuilt
                info["engine_payload"] = s["payload"]
                continue
            if s["type"] == SEC_STATE:
                t = L[s["layer"]]["state"]["tensors"][s["part"]]
                a = states[s["layer"]][s["part"]] = decode_state_payload(s["payload"], t)
                if t["name"] == "log_weights":  # §14.2: raw tokens (sinks, buffer) have beta 0
                    pr = L[s["layer"]]["state"]["parts"]
                    f = np.asarray(a).view("<f4")
                    S = f.shape[-1]
                    if (f[..., pr["fixed"]:pr["fixed"] + pr["sinks"]] != 0).any() or \
                            (f[..., S - pr["buffer"]:] != 0).any():
                        raise FormatError("log_weights of sinks/buffer are not 0 (State.Data)")
                    if pr["heads"] is not None:
                        check_absent_weights(a, pr, s["layer"])
                elif t["name"] == "scores":  # (1.11, §14.2) no score is NaN (absent entries' included)
                    check_scores(a, s["layer"])
                continue
            lay = L[s["layer"]]
            D = lay["Dk"] if s["part"] == 0 else lay["Dv"]
            if s["layer"] not in chunks:
                chunks[s["layer"]] = layer_chunks(lay, B, info["C"])
            _, head, t0, t1 = chunks[s["layer"]][s["chunk"]]  # the order check made Chunk a valid index
            if head is not None:
                # (1.8, §5 "Slices") one head's stored entries t0 .. t1 - 1: a [1, 1, T, D] payload, decoded as
                # that of a layer of one batch row and one head; placed at the entries they stand for
                bb, hh = head
                shape = (1, 1, t1 - t0, D)
                if tier == "lossless":
                    arr = fcr_payload(Reader(s["payload"]), shape, W, end=len(s["payload"]))
                else:
                    arr = vq_payload(s["payload"], shape, dt, W, info["minor"], None)
                pos = head_entries(lay["state"]["parts"], bb, hh, t0, t1)
                tgt = out_k if s["part"] == 0 else out_v
                tgt[s["layer"]][bb, hh, pos, :] = np.asarray(arr).reshape(t1 - t0, D)
                continue
            shape = (B, lay["H"], t1 - t0, D)
            if tier == "lossless":
                arr = fcr_payload(Reader(s["payload"]), shape, W, end=len(s["payload"]))
            else:
                exact = None
                if pred is not None:
                    eh, et, T = info["predict"]["eh"], info["predict"]["et"], info["predict"]["T"]
                    exact = (max(0, min(t1, eh) - t0), max(0, t1 - max(t0, T - et)))
                arr = vq_payload(s["payload"], shape, dt, W, info["minor"], exact)
            (out_k if s["part"] == 0 else out_v)[s["layer"]][:, :, t0:t1, :] = arr
        if pred is not None:
            with np.errstate(over="ignore", invalid="ignore"):  # an overflow is an error (§13.1), not a warning
                apply_predict(info, pred, out_k, out_v)
        info["states"] = states
        return info, tokens, out_k, out_v, notes
    # token tiers
    th = info["header"]["tokens"]
    N = info["nt"]
    tokens = []
    for r in range(B):
        s = secs[r]
        if th["token_model"] == "static":
            toks, cks, (pos, nw) = decode_static_row(s["payload"], N - th["padding"][r], th["vocab"], th["chunk_tokens"])
            notes.append(f"row {r}: decoded {len(toks)} tokens, words consumed pos={pos} of {nw}")
            tokens.append([th["pad_token"]] * th["padding"][r] + toks)
        else:
            tokens.append(None)
            notes.append(f"row {r}: {th['token_model']} stream not decoded (needs model)")
    if regen is None:
        return info, tokens, None, None, notes
    rk, rv = regen[0], regen[1]
    rs = regen[2] if len(regen) > 2 else None
    states = [None if x["state"] is None else [None] * len(x["state"]["tensors"]) for x in L]
    for l, j, t in st_list:
        a = _regen_state(rs, l, j)
        if a is not None:
            a = np.ascontiguousarray(a)
            if a.dtype.itemsize != t["W"] or tuple(a.shape) != t["shape"]:
                raise ConfigError(f"regenerated state {l}.{j}: shape/width {a.shape}/{a.dtype} does not match "
                                  f"the header's {t['shape']}/{t['dtype']}")
            a = a.view("<u%d" % t["W"])
        states[l][j] = a
    rest = secs[B:]
    if not rest:
        # tokens.tolerance null: restore = recompute, states are the regeneration (§5), nothing to check
        for l, j, t in st_list:
            if states[l][j] is None:
                raise ConfigError(f"no regeneration of state tensor {l}.{j}")
        info["states"] = states
        return info, tokens, rk, rv, notes
    cks = rest[0]["payload"]
    sl = slices(info)
    nck = len(sl) + len(st_list)
    if len(cks) != 8 * nck:
        raise FormatError("tensor_checksums length")
    ck = struct.unpack("<%dQ" % nck, cks)
    res = {(s["layer"], s["part"], s["chunk"]): s["payload"] for s in rest[1:] if s["type"] == SEC_RESID}
    stsec = {(s["layer"], s["part"]): s["payload"] for s in rest[1:] if s["type"] == SEC_STATE}
    out_k = [x.copy() for x in rk]
    out_v = [x.copy() for x in rv]
    for i, (l, p, c, t0, t1, head) in enumerate(sl):
        if head is not None:  # (1.8) heads only in reduced layers, which the token tiers never have (§14)
            raise FormatError(f"layer {l}: a head-by-head slice in a token tier")
        tgt = out_k if p == 0 else out_v
        sl_words = tgt[l][:, :, t0:t1, :]
        if (l, p, c) in res:
            sl_words = residual_apply(res[(l, p, c)], np.ascontiguousarray(sl_words), W)
            tgt[l][:, :, t0:t1, :] = sl_words
        if xxh(np.ascontiguousarray(sl_words).astype("<u%d" % W).tobytes()) != ck[i]:
            raise ChecksumMismatch(f"tensor checksum slice {i} (layer {l} part {p} chunk {c})")
    for i, (l, j, t) in enumerate(st_list):
        if (l, j) in stsec:
            states[l][j] = decode_state_payload(stsec[(l, j)], t)
            notes.append(f"state {l}.{j}: from its state section")
        elif states[l][j] is None:
            raise ConfigError(f"no regeneration of state tensor {l}.{j} and no state section")
        if xxh(np.ascontiguousarray(states[l][j]).astype("<u%d" % t["W"]).tobytes()) != ck[len(sl) + i]:
            raise ChecksumMismatch(f"tensor checksum of state tensor {l}.{j}")
    info["states"] = states
    return info, tokens, out_k, out_v, notes


# ------------------------------------------------------- engine files (1.10, §15)
def engine_piece_bytes(x, order, W):
    """A keys / values piece (§15): X = x[0] of shape [H, S, D] (batch 1) as little-endian words of W bytes,
    rows: t, h, d (one row of H*D elements per position); columns: h, d, t (one run of S positions per element)."""
    x = np.asarray(x)[0]
    a = x.transpose(1, 0, 2) if order == "rows" else x.transpose(0, 2, 1)
    return np.ascontiguousarray(a).astype("<u%d" % W).tobytes()


def rebuild_engine_file(buf, regenerate=None, model_file_sha256=None, allow_null_model=False):
    """(1.10, §15) The engine's state file a .kvz file with an engine_file object rebuilds: the pieces concatenated
    in order. regenerate (for a recompute object, §15.2): a callable (recompute dict, engine_file model, token
    ids) -> the engine's regeneration; this decoder cannot run llama.cpp itself. model_file_sha256: the SHA-256 of
    the engine's model file the caller names (refused if it is not engine_file.model.file_sha256 [ModelMismatch]);
    a file whose engine_file.model is null is rebuilt only with allow_null_model (SHOULD of §15).
    Tier lossless: the result's SHA-256 MUST equal engine_file.sha256 [ChecksumMismatch]."""
    info, secs = parse_container(buf)
    eng = info["engine"]
    if eng is None:
        raise ConfigError("the file has no engine_file object (§15)")
    # before any work: the model, and whether the procedure can be run
    m = eng["model"]
    if m is None:
        if not allow_null_model:
            raise ConfigError("engine_file.model is null: rebuild only on the user's explicit instruction")
    elif model_file_sha256 is not None and model_file_sha256 != m["file_sha256"]:
        raise ModelMismatch(f"engine model file {model_file_sha256}, the file records {m['file_sha256']}")
    rc = eng["recompute"]
    if rc is not None:
        if not rc["known"]:
            raise UnknownId(f"engine {rc['engine']!r} procedure {rc['procedure']!r} (§15.2)")
        _validate_seq_prefill_params(rc["params"], "engine_file.recompute.params")
        if regenerate is None:
            raise ConfigError(f"the file needs the engine's regeneration ({rc['engine']}, {rc['procedure']})")
    info, _tokens, ks, vs, _notes = decode_file(buf)
    data = decode_coded_bytes(info["engine_payload"], eng["V"], "Engine")
    regen = None
    if rc is not None:
        o, n = rc["tok_o"], rc["tok_n"]
        ids = np.frombuffer(data, "<i4", count=n, offset=o).tolist() if n else []
        regen = bytes(regenerate(dict(info["header"]["engine_file"]["recompute"]), m, ids))
        if len(regen) != rc["R"]:
            # the class is not named by §15.2 (assumed: the engine computed otherwise)
            raise ChecksumMismatch(f"the regeneration has {len(regen)} bytes, not recompute.length {rc['R']}")
    W = info["W"]
    out = []
    for tag, a, b, n in eng["pieces"]:
        if tag == "bytes":
            out.append(data[a:a + b])
        elif tag == "recomputed":
            out.append(regen[a:a + b])
        else:
            piece = engine_piece_bytes((ks if tag == "keys" else vs)[a], b, W)
            assert len(piece) == n
            out.append(piece)
    res = b"".join(out)
    if len(res) != eng["L"]:  # cannot happen: the header's pieces add up to L (checked with the header)
        raise FormatError("rebuilt engine file length")
    if info["tier"] == "lossless" and hashlib.sha256(res).hexdigest() != eng["sha256"]:
        raise ChecksumMismatch("engine_file.sha256: the rebuilt file's SHA-256 differs")
    return res


def weights_fingerprint(model_dir) -> str:
    """§4.1 `model.weights` (1.12) of a model directory: its config.json's `model_type` and the distinct tensors of
    its `*.safetensors` files (each digest once, sorted). A caller compares it with a file's `model.weights`
    [ModelMismatch] before regenerating a cache with that model."""
    import hashlib
    import json as _json
    from pathlib import Path

    d = Path(model_dir)
    arch = _json.loads((d / "config.json").read_text(encoding="utf-8"))["model_type"]
    digests = set()
    for f in sorted(d.glob("*.safetensors")):
        data = f.read_bytes()
        n = int.from_bytes(data[:8], "little")
        for name, t in _json.loads(data[8:8 + n]).items():
            if name == "__metadata__":
                continue
            a, b = t["data_offsets"]
            head = f"{t['dtype']}|{','.join(str(x) for x in t['shape'])}".encode("ascii") + b"\x00"
            digests.add(hashlib.sha256(head + data[8 + n + a:8 + n + b]).digest())
    h = hashlib.sha256(b"kvcodec-model-weights-v2\x00" + arch.encode("utf-8") + b"\x00")
    for dg in sorted(digests):
        h.update(dg)
    return h.hexdigest()
