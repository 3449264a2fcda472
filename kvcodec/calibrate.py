"""``kvcodec.calibrate``: a per-model profile for the lossy tier's ``weighted`` quantizer (spec/kvz.md §13).

A key error δk changes the logit of a query q by s·⟨q, δk⟩ (s: the layer's scaling), so the cost of an
error in key channel d is s²·E[q_d²]: channels the queries do not look at can be coarse, the ones they do
must be fine.  A profile holds, per layer and KV head, each key channel's **weight**
w_d = sqrt(s²·E[q_d²]) (the RMS logit change per unit of the channel), the queries taken over the query heads
of the KV head's group on a calibration text.  With RoPE (the rotate-half layout of Llama, Qwen2 and most
models) the two channels of a rotary pair (d, d + D/2) get the mean of their two second moments: a rotation
by position mixes them, so a profile does not depend on where the calibration queries sat.  Weights are
floored at 1e-3 of their head's mean.

The encoder quantizes keys with per-channel steps ``step * key_ratio / w_d`` (Method 5) and stores those
steps in the file: decoding needs neither the model nor the profile.  Measured on SmolLM2 (BENCHMARKS.md):
128 calibration tokens of one genre serve the others as well as each text's own queries.

    >>> # profile = kvcodec.calibrate(model, tokenizer=tok)            # the embedded text, 128 tokens
    >>> # data = kvcodec.encode(cache, tier="lossy", bits=2, quantizer="weighted", profile=profile)
    >>> # profile.save("smollm2.kvp.json"); kvcodec.Profile.load("smollm2.kvp.json")
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ConfigError, FormatError

if TYPE_CHECKING:
    import torch

# numpy and torch are imported where they are used: ``import kvcodec`` binds this module's names without them

__all__ = ["Profile", "calibrate"]

PROFILE_FORMAT = "kvz-profile"
PROFILE_VERSION = 1
FLOOR = 1e-3
MAX_PROFILE_BYTES = 64 << 20


@dataclass
class Profile:
    """Key channel weights per layer (``[kv_heads, head_dim]`` float32, or None for a layer without attention),
    the model's fingerprint and the number of calibration tokens."""

    key_weights: list
    model: str | None = None
    tokens: int = 0

    def check(self, keys: list) -> None:
        """Refuse (:class:`ConfigError`) a cache whose layers do not match the profile's."""
        if len(keys) != len(self.key_weights):
            raise ConfigError(f"the profile has {len(self.key_weights)} layers, the cache {len(keys)}: calibrate "
                              "with the model that made the cache")
        for i, (k, w) in enumerate(zip(keys, self.key_weights)):
            want = (int(k.shape[1]), int(k.shape[-1]))
            if k.shape[2] and (w is None or tuple(w.shape) != want):
                got = None if w is None else tuple(w.shape)
                raise ConfigError(f"layer {i}: the profile's key weights are {got}, the cache's keys need {want}")

    def to_json(self) -> str:
        return json.dumps({"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "model": self.model,
                           "tokens": self.tokens,
                           "key_weights": [None if w is None else [[float(x) for x in row] for row in w]
                                           for w in self.key_weights]})

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        if len(text) > MAX_PROFILE_BYTES:
            raise FormatError(f"a profile of {len(text)} bytes (limit {MAX_PROFILE_BYTES})", field="Profile")
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise FormatError(f"not JSON: {e}", field="Profile") from None
        if not isinstance(obj, dict) or obj.get("format") != PROFILE_FORMAT:
            raise FormatError(f"not a {PROFILE_FORMAT} object", field="Profile.format")
        if obj.get("version") != PROFILE_VERSION:
            raise FormatError(f"profile version {obj.get('version')!r}; this reader takes {PROFILE_VERSION}",
                              field="Profile.version")
        import numpy as np

        layers = obj.get("key_weights")
        if not isinstance(layers, list):
            raise FormatError("key_weights must be a list", field="Profile.key_weights")
        out = []
        for i, w in enumerate(layers):
            if w is None:
                out.append(None)
                continue
            try:
                a = np.asarray(w, dtype=np.float64)
            except (TypeError, ValueError):
                raise FormatError(f"layer {i}: not a matrix of numbers", field=f"Profile.key_weights[{i}]") from None
            if a.ndim != 2 or not a.size or not (np.isfinite(a).all() and (a > 0).all()):
                raise FormatError(f"layer {i}: weights must be a non-empty [heads, dim] matrix of positive finite "
                                  "numbers", field=f"Profile.key_weights[{i}]")
            out.append(a.astype(np.float32))
        model, tokens = obj.get("model"), obj.get("tokens", 0)
        if model is not None and not isinstance(model, str) or not isinstance(tokens, int):
            raise FormatError("model must be a string or null and tokens an int", field="Profile")
        return cls(out, model, tokens)

    def save(self, path) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def load(cls, path) -> "Profile":
        return cls.from_json(Path(path).read_text(encoding="utf-8"))


def rotate_half_pairs(config) -> bool:
    """Does the model rotate key/query pairs (d, d + D/2) over the whole head (RoPE, rotate-half layout)?"""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    rope = getattr(cfg, "rope_theta", None) is not None or getattr(cfg, "rope_parameters", None) is not None
    partial = getattr(cfg, "partial_rotary_factor", 1.0) or 1.0
    return rope and partial == 1.0 and getattr(cfg, "model_type", "") != "gpt2"


def default_ids(tokenizer, tokens: int) -> torch.Tensor:
    """The first ``tokens`` tokens of the text kvcodec embeds (kvcodec/data)."""
    from .models import tokenize

    text = (Path(__file__).parent / "data" / "austen_pride_and_prejudice_ch1-3.txt").read_text(encoding="utf-8")
    return tokenize(tokenizer, text, tokens)


def calibrate(model, ids=None, *, tokenizer=None, tokens: int = 128) -> Profile:
    """A :class:`Profile` of ``model`` from the queries of one forward pass over ``ids`` (``[1, n]`` or 1-D;
    default: the first ``tokens`` tokens of the embedded text, which needs ``tokenizer``)."""
    import torch

    from .identity import fingerprint
    from .reduction.attention import observe

    if ids is None:
        if tokenizer is None:
            raise ConfigError("calibrate() needs ids= or tokenizer= (to tokenize the embedded text)")
        ids = default_ids(tokenizer, tokens)
    ids = torch.as_tensor(ids).long()
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.shape[0] != 1 or ids.shape[1] < 1:
        raise ConfigError(f"calibrate() takes one sequence of ids, got shape {tuple(ids.shape)}")
    n = int(ids.shape[1])
    with observe(model, window=n, received=False) as obs, torch.no_grad():
        model(ids, use_cache=False)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    pairs = rotate_half_pairs(model.config)
    layers = getattr(cfg, "num_hidden_layers", None) or (max(obs.queries) + 1 if obs.queries else 0)
    weights = []
    for li in range(layers):
        q = obs.queries.get(li)
        if q is None:
            weights.append(None)
            continue
        _, hq, _, d = q.shape
        second = (q.double() ** 2).mean(2)[0]  # [hq, d]
        m = second.view(kv_heads, hq // kv_heads, d).mean(1) * obs.scaling[li] ** 2  # [kv, d]
        if pairs and d % 2 == 0:
            half = (m[:, : d // 2] + m[:, d // 2:]) / 2
            m = torch.cat([half, half], 1)
        w = m.sqrt()
        w = torch.maximum(w, FLOOR * w.mean(1, keepdim=True).clamp_min(1e-30))
        weights.append(w.float().numpy())
    return Profile(weights, fingerprint(model), n)
