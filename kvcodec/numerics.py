"""The numerics profile: what decides the bits of a model's forward pass on this machine.

Regenerating a cache from its tokens (tiers ``exact`` and ``tokens``) and the
``lm``/``draft`` token models' probabilities are float arithmetic; their bits
depend on the engine.  Measured (``scripts/studies/numerics.py``; SmolLM2-135M,
tiny Llama, torch 2.13 CPU on an AVX-512 Xeon): ATen's CPU kernel level
(``ATEN_CPU_CAPABILITY``: silu, softmax, SDPA), MKL's GEMM code path
(``MKL_CBWR``, ``MKL_ENABLE_INSTRUCTIONS``, and so the CPU's instruction set),
the attention implementation (SDPA vs eager), the dtype, and the thread count
for forward calls of more than one token each change the logits at most
positions (1e-5 .. 1e-4 for SmolLM2) and the 24-bit token frequencies at
84-97 % of positions, so an LM-coded stream stops decoding within the first
tokens.  oneDNN's ISA limit and ``torch.backends.mkldnn`` changed nothing;
neither did the thread count for float32 one-token calls (in bfloat16 it
does: the token tiers run one-token calls on a fixed count, recorded as
``step_threads``).

:func:`profile` records these determinants (``tokens.procedure.numerics``) and a
``canary``: the hash of the logits of a fixed 10-token probe, which catches what
the list cannot name (another CPU vendor, another BLAS build);
:func:`differences` says which of them differ on this machine, so a decoder
refuses *before* any work (:class:`~kvcodec.errors.NumericsMismatch`) instead
of failing at a checksum minutes later.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import weakref

#: environment variables that change MKL's or ATen's code paths (recorded when set)
ENV_KNOBS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS")


def cpu_isa() -> str:
    """The widest x86 vector extension this CPU has (MKL dispatches its GEMM kernels on it): ``avx512``,
    ``avx2``, ``sse4_2`` or ``other`` (also on non-x86 machines, whose kernels are another matter)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    for name, flag in (("avx512", "avx512f"), ("avx2", "avx2"), ("sse4_2", "sse4_2")):
                        if flag in flags:
                            return name
                    break
    except OSError:
        pass
    import platform

    return f"other:{platform.machine() or 'unknown'}"


def profile(model) -> dict:
    """The numerics profile of running ``model`` here (JSON-able, every value a string or an integer)."""
    import torch

    p = next(model.parameters())
    dev = p.device
    out = {
        "engine": "torch",
        "torch": torch.__version__,
        "transformers": md.version("transformers"),
        "device": dev.type,
        "dtype": str(p.dtype).replace("torch.", ""),
        "attention": str(getattr(getattr(model, "config", None), "_attn_implementation", None) or "default"),
        "threads": torch.get_num_threads(),
    }
    if dev.type == "cpu":
        out["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        out["cpu_isa"] = cpu_isa()
        out["blas"] = "mkl" if torch.backends.mkl.is_available() else "other"
    elif dev.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(dev)
        out["cuda"] = str(torch.version.cuda)
    env = {k: os.environ[k] for k in ENV_KNOBS if os.environ.get(k)}
    if env:
        out["env"] = env
    probe = _canary_memo(model, out)
    if probe is not None:
        out["canary"] = probe
    return out


_CANARIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _canary_memo(model, determinants: dict) -> str | None:
    """:func:`canary`, computed once per model and state: the probe's few forward calls were ~10 % of an
    exact-tier restore.  Keyed by every determinant of the profile and the parameters' in-place version
    counters, so a change of threads, dtype, device, attention or weights computes it again."""
    try:
        version = sum(p._version for p in model.parameters())
        key = (tuple(sorted((k, str(v)) for k, v in determinants.items())), version)
        memo = _CANARIES.setdefault(model, {})
    except TypeError:  # not weak-referenceable: no memo
        return canary(model)
    if key not in memo:
        memo[key] = canary(model)
    return memo[key]


def canary(model) -> str | None:
    """SHA-256 (16 hex digits) of the float logits of a fixed probe: one call over 8 fixed tokens, then 2 calls
    of one token.  Catches what the listed determinants cannot name (CPU vendor, BLAS minor version) before
    any real work: a few forward calls.  None if the model cannot run the probe."""
    import hashlib

    import torch
    from transformers.cache_utils import DynamicCache

    from .identity import vocab_size
    from .tokens.plan import forward

    try:
        dev = next(model.parameters()).device
        v = vocab_size(model)
        ids = (torch.arange(1, 11, device=dev) * 7919 % max(v - 1, 1) + 1)[None, :]
        cache = DynamicCache(config=model.config)
        h = hashlib.sha256()
        with torch.no_grad():
            for a, b in ((0, 8), (8, 9), (9, 10)):
                h.update(forward(model, ids[:, a:b], cache, {}).float().contiguous().cpu().numpy().tobytes())
        return h.hexdigest()[:16]
    except Exception:  # an exotic model: the other determinants and the checksums still guard
        return None


def differences(recorded: dict, current: dict, *, multi_token_calls: bool = True) -> list[str]:
    """The determinants that differ (``'cpu_capability AVX2 (file) vs AVX512 (here)'``); [] if the recorded
    profile is reproducible here.  The thread count matters only for calls of more than one token."""
    keys = [k for k in sorted(set(recorded) | set(current)) if k != "threads" or multi_token_calls]
    if not multi_token_calls and recorded.get("threads") != current.get("threads"):
        keys = [k for k in keys if k != "canary"]  # the probe's 8-token call depends on the thread count
    return [f"{k} {recorded.get(k)} (file) vs {current.get(k)} (here)" for k in keys
            if recorded.get(k) != current.get(k)]


def differences_here(recorded: dict, model, *, step_threads=None, multi_token_calls: bool = True) -> list[str]:
    """:func:`differences` between a recorded profile and this machine's for ``model``.  ``step_threads`` is
    a parameter of the procedure, which the decoder reproduces (the file's value), not a property of the
    machine: it is set in this machine's profile as given."""
    here = {**profile(model), "step_threads": step_threads}
    return differences(recorded, here, multi_token_calls=multi_token_calls)


def advice(diffs: list[str], *, tried: bool = False) -> str:
    """What would reproduce the recorded numerics (for the error message); ``tried``: the decoder already
    attempted (numerics="try"), so do not suggest it."""
    tips = []
    if any(d.startswith("threads") for d in diffs):
        tips.append("torch.set_num_threads(<the file's threads>) before decoding")
    if any(d.startswith(("cpu_capability", "env")) for d in diffs):
        tips.append("set ATEN_CPU_CAPABILITY / MKL_CBWR as the file records, before Python starts (only on a CPU "
                    "with the same instruction set)")
    tips.append("decode on a machine with the recorded profile")
    if not tried:
        tips.append("numerics='try' to attempt anyway (the file's checksums still guard the result)")
    return "; ".join(tips)
