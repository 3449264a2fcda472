"""Model identity: what a file records about the model it needs, and the check that refuses another one.

A file made by a token tier is decoded by recomputing the cache with the model
that made it, so the header records that model's fingerprint (config and
weights, :func:`kvcodec.models.model_fingerprint`) and, when a tokenizer was
given, its vocabulary's (:func:`kvcodec.models.tokenizer_fingerprint`).
Fingerprints hash every weight, so they are memoised per model object and
weights version.  ``model`` arguments are a transformers model or a
``(model, tokenizer)`` pair, as :func:`kvcodec.load_model` returns.
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
from pathlib import Path

from .container import layout as L
from .errors import ModelMismatch
from .models import model_fingerprint, tokenizer_fingerprint, weights_fingerprint

__all__ = ["split_model", "vocab_size", "fingerprint", "model_record", "check_model", "file_digest"]

_MODEL_FP: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_WEIGHTS_FP: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_TOKENIZER_FP: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def split_model(model):
    """``(model, tokenizer or None)`` of a model argument."""
    if isinstance(model, tuple):
        return model[0], model[1]
    return model, None


def vocab_size(model) -> int:
    """Rows of the model's output embedding: the alphabet of the token channel."""
    return int(model.get_output_embeddings().weight.shape[0])


def _memo(table, obj, stamp, compute):
    try:
        hit = table.get(obj)
    except TypeError:  # not weak-referenceable
        return compute(obj)
    if hit and hit[0] == stamp:
        return hit[1]
    value = compute(obj)
    table[obj] = (stamp, value)
    return value


def fingerprint(model) -> str:
    """:func:`kvcodec.models.model_fingerprint`, memoised per model object and weights version."""
    model, _ = split_model(model)
    return _memo(_MODEL_FP, model, sum(p._version for p in model.parameters()), model_fingerprint)


def weights(model) -> str:
    """:func:`kvcodec.models.weights_fingerprint`, memoised per model object and weights version."""
    model, _ = split_model(model)
    return _memo(_WEIGHTS_FP, model, sum(p._version for p in model.parameters()), weights_fingerprint)


def _tokenizer(tok) -> str:
    return _memo(_TOKENIZER_FP, tok, len(tok), tokenizer_fingerprint)


def model_record(model, *, with_weights: bool = False) -> dict | None:
    """The header's ``model`` object for ``model`` (None for None); ``with_weights``: also ``weights`` (format
    1.12: what the token tiers' files carry; hashing them is a second pass over every weight)."""
    if model is None:
        return None
    model, tok = split_model(model)
    rec = {"fingerprint": fingerprint(model)}
    if with_weights:
        rec["weights"] = weights(model)
    if tok is not None:
        rec["tokenizer"] = _tokenizer(tok)
    arch = getattr(getattr(model, "config", None), "model_type", None)
    if isinstance(arch, str):
        rec["architecture"] = arch
    name = getattr(model, "kvcodec_name", None)  # set by kvcodec.load_model: what --model / load_model accept
    if isinstance(name, str):
        rec["name"] = name
    return rec


def check_model(recorded: dict | None, model, what: str = "model") -> None:
    """Raise :class:`ModelMismatch` if ``model`` is not the one ``recorded`` (a header's ``model`` object)."""
    if recorded is None:
        return
    mdl, tok = split_model(model)
    if "weights" in recorded:  # (1.12) what any implementation computes; the configuration's serialisation that
        # `fingerprint` hashes depends on the library that loaded the model, so it is not compared (or computed)
        have = weights(mdl)
        if have != recorded["weights"]:
            raise ModelMismatch(f"file was made with {what} weights {recorded['weights'][:16]}…, the {what} given "
                                f"has {have[:16]}… (another model, another dtype or modified weights)",
                                field=f"Header.{what}.weights", offset=L.PREAMBLE.size)
    elif (have := fingerprint(mdl)) != recorded["fingerprint"]:
        raise ModelMismatch(f"file was made with {what} {recorded['fingerprint'][:16]}…, "
                            f"the {what} given is {have[:16]}… (another model, another dtype or "
                            "modified weights)", field=f"Header.{what}.fingerprint", offset=L.PREAMBLE.size)
    if tok is not None and "tokenizer" in recorded and _tokenizer(tok) != recorded["tokenizer"]:
        raise ModelMismatch(f"file was made with a {what} whose tokenizer differs from the one given",
                            field=f"Header.{what}.tokenizer", offset=L.PREAMBLE.size)


def file_digest(path) -> str:
    """SHA-256 of a file, remembered beside kvcodec's model cache by path, size and modification time (weights
    are hashed once per machine, not per engine start)."""
    from .models import cache_dir

    path = Path(path)
    st = path.stat()
    memo_path = cache_dir() / "file-digests.json"
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if isinstance(memo, dict) and isinstance(memo.get(key), str):
        return memo[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    digest = h.hexdigest()
    memo = memo if isinstance(memo, dict) else {}
    memo[key] = digest
    try:
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_name(f"{memo_path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo))
        os.replace(tmp, memo_path)
    except OSError:
        pass
    return digest
