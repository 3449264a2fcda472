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


# -- 1.12: model.weights, from a checkpoint's files alone (no transformers) ------------------------------------------
_ST_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def spec_weights_fingerprint(model_dir) -> str:
    """Spec section 4.1's ``model.weights`` from ``config.json`` and ``model.safetensors`` read as bytes: the
    safetensors header is JSON after an 8-byte length; each tensor's bytes are already little-endian C order."""
    from pathlib import Path

    d = Path(model_dir)
    arch = json.loads((d / "config.json").read_text())["model_type"]
    data = (d / "model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    digests = set()
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        raw = data[8 + n + a:8 + n + b]
        assert len(raw) == _ST_DTYPES[t["dtype"]] * (eval("*".join(map(str, t["shape"])) or "1"))
        digests.add(hashlib.sha256(f"{t['dtype']}|{','.join(map(str, t['shape']))}".encode() + b"\x00" + raw).digest())
    h = hashlib.sha256(b"kvcodec-model-weights-v2\x00" + arch.encode() + b"\x00")
    for dg in sorted(digests):
        h.update(dg)
    return h.hexdigest()


def test_weights_fingerprint_from_the_files_alone(tmp_path):
    """What a decoder without transformers computes from the shipped tiny model's files equals what kvcodec
    records for the loaded model; a tied output embedding (stored once in the checkpoint, named twice in the
    model) counts once; another dtype is another model; the spec's one-tensor example."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from kvcodec.models import weights_fingerprint

    shipped = Path(__file__).parent.parent / "spec" / "vectors" / "models" / "tiny-llama"
    m = AutoModelForCausalLM.from_pretrained(shipped, dtype=torch.float32)
    assert spec_weights_fingerprint(shipped) == weights_fingerprint(m)
    assert weights_fingerprint(m.to(torch.bfloat16)) != spec_weights_fingerprint(shipped)
    import transformers

    torch.manual_seed(0)
    tied = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=True))
    assert len(tied.state_dict()) > len({p.data_ptr() for p in tied.state_dict().values()})  # named twice
    tied.save_pretrained(tmp_path)
    assert spec_weights_fingerprint(tmp_path) == weights_fingerprint(tied)

    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"model_type": "t"})()
            self.w = torch.nn.Parameter(torch.tensor(1.0))

    digest = hashlib.sha256(b"F32|\x00" + bytes.fromhex("0000803f")).digest()
    assert weights_fingerprint(One()) == hashlib.sha256(b"kvcodec-model-weights-v2\x00t\x00" + digest).hexdigest()


def test_weights_decide_where_present():
    """(1.12) A file with model.weights is checked by them: another model is refused by field, and a file whose
    weights match is not refused for a fingerprint (the configuration's serialisation) that differs."""
    import pytest

    import kvcodec
    from kvcodec.identity import check_model, model_record

    m = tiny_model("llama")
    rec = model_record(m, with_weights=True)
    check_model({**rec, "fingerprint": "0" * 64}, m)  # weights match: fingerprint informative
    with pytest.raises(kvcodec.ModelMismatch) as err:
        check_model({**rec, "weights": "0" * 64}, m)
    assert err.value.field == "Header.model.weights"
    old = {k: v for k, v in rec.items() if k != "weights"}
    with pytest.raises(kvcodec.ModelMismatch) as err:
        check_model({**old, "fingerprint": "0" * 64}, m)  # a 1.11 file: the fingerprint decides
    assert err.value.field == "Header.model.fingerprint"
