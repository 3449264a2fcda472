"""Reduced objects (spec/store.md §6.1): a reduced cache (:func:`kvcodec.reduce`) kept beside the sessions,
keyed by the full token sequence it stands for, so that an agent keeps both its full memory and a small one.

A reduced cache holds entries (selected tokens, atoms with masses), not token positions: it cannot be
chunked or share a prefix with other sessions.  It is one ``.kvz`` file of the namespace's tier at
``ns/<N>/reduced/<s[0:2]>/<s>/<r>.kvz``: ``<s>`` the session key the token sequence would have (§3), ``<r>``
the hash of the file's ``reduce`` object (how it was reduced), so several reductions of one sequence live
side by side and putting the same reduction again replaces it.  The object names its sequence in its header
(``info``), so a copy under another name is caught.  It is a root: only :meth:`delete` removes it; a
collection neither condemns nor evicts it (its bytes are not in ``max_bytes``).
"""

from __future__ import annotations

import io

from ..cache import KVCache
from ..errors import ConfigError, FormatError, KvzError, UnknownId, UnsupportedCache, UnsupportedVersion
from .keys import (
    VERSION,
    chain_key,
    is_hex64,
    is_reduced_name,
    reduced_path,
    reduction_id,
    split_reduced_key,
    token_ids,
)
from .read import ReadPath

#: the ``info`` keys a reduced object's header carries (spec §6.1)
INFO_KEYS = ("kvcodec_store", "reduced_of", "tokens")


class ReducedObjects(ReadPath):
    def _put_reduced(self, kv: KVCache, model, tokens) -> str:
        """Store a reduced cache as its own object (spec §6.1); its key ``<N>:<s>:<r>``."""
        from ..file import KvzFile

        if kv.batch != 1:
            raise UnsupportedCache(f"a store keeps one cache per put: batch {kv.batch} (put each row)")
        if tokens is None:
            raise ConfigError("a reduced cache holds entries, not token ids: put(reduced, tokens=ids) names the "
                              "full token sequence it stands for (the tokens it was reduced from, then every token "
                              "added since)")
        ids = token_ids(tokens)
        seen = max(kv.cumulative_length)
        if kv.start_position != 0 or ids.size != seen or not ids.size:
            raise ConfigError(f"{ids.size} token ids for a reduced cache that has seen {seen} tokens"
                              + (f" from position {kv.start_position}" if kv.start_position else "")
                              + ": tokens= must be every token it stands for, from position 0")
        ns = self.namespace(model, kv.dtype)
        self._last_dtype = kv.dtype
        self._publish_predictors(ns)
        session = chain_key(bytes.fromhex(ns), bytes(32), ids, self.record(ns)["chunk_tokens"]).hex()
        info = {"kvcodec_store": VERSION, "reduced_of": session, "tokens": int(ids.size)}
        data = self._encoder.encode(kv, info=info)
        with KvzFile(io.BytesIO(data)) as f:  # the name hashes the reduce object as the file records it
            r = reduction_id(f.header.reduce)
        self.backend.write(reduced_path(ns, session, r), data)
        self.put_stats["bytes_written"] += len(data)
        return f"{ns}:{session}:{r}"

    def _get_reduced(self, key: str, model, output: str):
        from ..file import KvzFile

        ns, session, r = split_reduced_key(key)
        path = reduced_path(ns, session, r)

        def decode(fh):
            with KvzFile(fh) as f:
                self._attach_predictors(ns, f)
                h = f.header
                info = h.raw.get("info")
                if h.reduce is None or not isinstance(info, dict) or type(info.get("kvcodec_store")) is not int \
                        or info.get("kvcodec_store") != VERSION \
                        or info.get("reduced_of") != session or reduction_id(h.reduce) != r:
                    raise FormatError(f"reduced object {session[:16]}…/{r} is not the reduced cache its name "
                                      "says (its header's reduce object and info.reduced_of name another)",
                                      field="Header.info")
                if h.batch != 1:
                    raise FormatError(f"reduced object {session[:16]}…/{r} holds batch {h.batch}: a store keeps one "
                                      "cache per object", field="Header.cache.batch")
                kv = f.to_kvcache()
                if type(info.get("tokens")) is not int or max(kv.cumulative_length) != info["tokens"] \
                        or kv.start_position != 0:
                    raise FormatError(f"reduced object {session[:16]}…/{r}: info.tokens "
                                      f"{info.get('tokens')!r} is not the {max(kv.cumulative_length)} tokens its "
                                      "layers have seen", field="Header.info.tokens")
                return kv
        record = self.record(ns)  # the namespace is checked against its id first
        if model is not None and isinstance(record.get("model"), dict) and "fingerprint" in record["model"]:
            from ..identity import check_model

            check_model(record["model"], model)  # as a session's get does: another model is refused
        try:
            kv = self._read_file(path, decode)
        except (UnsupportedVersion, UnknownId):
            raise  # a newer writer's file, perhaps: not proven bad, left in place
        except FormatError as e:
            self._quarantine(path, e)  # its own bytes are bad: never returned
            raise
        if kv is None:
            raise KeyError(key)
        if output == "kvcache":
            return kv
        return kv.to_dynamic_cache(model=model[0] if isinstance(model, tuple) else model)  # a ReducedCache

    def reductions(self, tokens=None) -> list[str]:
        """The keys ``<N>:<s>:<r>`` of the stored reduced caches: every one, or (``tokens``) those of exactly
        that token sequence, in every namespace of the store (any model, dtype or tier: each key names its
        namespace, and :meth:`get` with a model refuses another one)."""
        if tokens is not None:
            ids, out = token_ids(tokens), []
            for ns in self.namespaces():
                try:
                    size = self.record(ns)["chunk_tokens"]
                except (KeyError, KvzError):
                    continue  # an unreadable namespace record: nothing in it is listed
                s = chain_key(bytes.fromhex(ns), bytes(32), ids, size).hex()
                out += [f"{ns}:{s}:{it.name[:-4]}" for it in self.backend.listdir(f"ns/{ns}/reduced/{s[:2]}/{s}")
                        or [] if is_reduced_name(it.name, it.kind)]
            return sorted(out)
        out = []
        for ns in self.namespaces():
            for rel, it in self.backend.walk(f"ns/{ns}/reduced"):
                parts = rel.split("/")
                if len(parts) == 6 and is_hex64(parts[4]) and parts[3] == parts[4][:2] \
                        and is_reduced_name(it.name, it.kind):
                    out.append(f"{ns}:{parts[4]}:{it.name[:-4]}")
        return sorted(out)

    def _delete_reduced(self, key: str) -> None:
        ns, session, r = split_reduced_key(key)
        if self.backend.delete(reduced_path(ns, session, r)) < 0:
            raise KeyError(key)


__all__ = ["INFO_KEYS", "ReducedObjects"]
