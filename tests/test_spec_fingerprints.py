"""Spec section 4.1: the fingerprints computed from the spec's text alone equal kvcodec's."""

import hashlib
import json

import torch

from kvcodec.models import model_fingerprint, tokenizer_fingerprint

from .common import tiny_model

DROPPED = ["_name_or_path", "_model_name_or_path", "transformers_version", "architectures", "torch_dtype", "dtype",
           "quantization_config", "_commit_hash", "name_or_path", "use_cache", "output_attentions",
           "output_hidden_states", "return_dict"]


def spec_model_fingerprint(model) -> str:
    h = hashlib.sha256(b"kvcodec-model-fingerprint-v1\x00")
    cfg = {k: v for k, v in model.config.to_dict().items() if k not in DROPPED}
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode("utf-8"))
    for name in sorted(model.state_dict()):
        t = model.state_dict()[name].detach().contiguous()
        dims = [str(d) for d in t.shape]
        shape = "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"
        h.update(f"{name}|{shape}|{t.dtype}".encode("utf-8") + b"\x00")
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _json_string(s: str) -> str:
    """The spec's escaping rules, written out."""
    named = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
    out = []
    for ch in s:
        if ch in named:
            out.append(named[ch])
        elif ord(ch) < 0x20:
            out.append("\\u%04x" % ord(ch))
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def spec_tokenizer_fingerprint(vocab: dict) -> str:
    pairs = sorted(vocab.items(), key=lambda kv: kv[1])
    text = "[" + ", ".join(f"[{_json_string(tok)}, {i}]" for tok, i in pairs) + "]"
    return hashlib.sha256(b"kvcodec-tokenizer-fingerprint-v1\x00" + text.encode("utf-8")).hexdigest()


class _Tok:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)


def test_model_fingerprint_from_the_spec():
    for kind in ("llama", "gpt2"):
        m = tiny_model(kind)
        assert spec_model_fingerprint(m) == model_fingerprint(m)
        assert spec_model_fingerprint(m.to(torch.bfloat16)) == model_fingerprint(m)


def test_tokenizer_fingerprint_from_the_spec():
    vocab = {"a": 0, "é": 1, 'q"uote': 2, "back\\slash": 3, "\n\t\r\b\f": 4, "\x01\x1f\x7f": 5, "Ġthe": 6,
             "日本": 7, "<|endoftext|>": 8}
    assert spec_tokenizer_fingerprint(vocab) == tokenizer_fingerprint(_Tok(vocab))
    assert spec_tokenizer_fingerprint({"a": 0, "é": 1}) == hashlib.sha256(
        b'kvcodec-tokenizer-fingerprint-v1\x00[["a", 0], ["\xc3\xa9", 1]]').hexdigest()  # the spec's example
