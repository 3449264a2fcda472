"""Human-readable text of what the command line prints (``kvz inspect``, sizes)."""

from __future__ import annotations

import json

__all__ = ["human", "inspection_text"]


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def inspection_text(info: dict, name: str, sections: bool = True) -> str:
    """What ``kvz inspect`` prints for ``kvcodec.inspect()``'s result ``info`` of the file ``name``."""
    lines = []
    out = lines.append
    out(f"{name}: .kvz {info['format_version']}, {human(info['file_bytes'])}")
    m = info["model"]
    if m:
        what = ", ".join(x for x in (m.get("architecture"), f"fingerprint {m['fingerprint'][:16]}…") if x)
        out(f"  model        : {m.get('name') or 'unnamed'} ({what})")
    else:
        out("  model        : none recorded")
    params = json.dumps(info["codec"]["params"], sort_keys=True)
    out(f"  tier / codec : {info['tier']} / {info['codec']['id']} {params}")
    out(f"  cache        : {info['dtype']}, batch {info['batch']}, {info['num_layers']} layers, "
          f"kv heads {info['kv_heads']}, head dims {info['head_dims']}, {info['tokens']} tokens, "
          f"start position {info['start_position']}, token ids {'stored' if info['has_token_ids'] else 'not stored'}")
    out(f"  size         : {human(info['raw_tensor_bytes'])} raw -> {human(info['file_bytes'])}: "
          f"{info['ratio']}x, {info['bits_per_component']} bits/component")
    tc = info.get("token_channel")
    if tc:
        blocks = tc["procedure"].get("block_tokens") if tc["token_model"] == "blocks" else None
        out(f"  token channel: {tc['token_model']}{f' (blocks of {blocks})' if blocks else ''}, "
            f"{tc['coded_tokens']} tokens in {human(tc['token_stream_bytes'])}"
              f" = {tc['bits_per_token']} bits/token; schedule {tc['schedule']}, padding {tc['padding']}")
        out(f"  residual     : {human(tc['residual_bytes'])}, tolerance {tc['tolerance']}, max abs deviation of "
              f"a bare recompute at encode time {tc['max_abs_deviation']}")
    st = info.get("state")
    if st:
        kinds = ", ".join(f"{i} {k}" for i, k in st["layers"].items())
        out(f"  state        : {st['tensors']} state tensors (layers {kinds}): {human(st['raw_bytes'])} "
            f"raw, {human(st['stored_bytes'])} stored exactly"
            + (" (the others are regenerated)" if info.get("token_channel") else ""))
    rd = info.get("reduce")
    if rd:
        levels = [x for x in rd["parts"]["levels"] if x is not None]
        keep = "-" if rd["keep"] is None else format(rd["keep"], ".3g")
        lo, hi = rd.get("entries_range") or (rd["entries"], rd["entries"])
        spread = "" if lo == hi else f" (per layer {lo} to {hi}, mean {rd['entries']})"
        if rd.get("held") is not None:
            spread += (f", heads of a layer holding different numbers (the decoded tensors hold {rd['held']} per "
                       "head, the absent ones masked)")
        out(f"  reduce       : {rd['method']} ({rd['form']} masses), {rd['entries']} entries{spread} for "
            f"{rd['tokens']} tokens = keep {keep} in {rd['layers']} reduced layers; K {rd['k']}, B {rd['block']}, "
            f"{rd['sinks']} sinks, window {rd['window']}, seed {rd['seed']}; parts: {rd['parts']['fixed']} fixed, "
            f"{rd['parts']['sinks']} sinks, {len(levels)} summaries ({sum(levels)} atoms), "
            f"{rd['parts']['buffer']} raw recent; appended tokens "
            + (f"keep being reduced ({rd['reducer']})" if rd["reducer"] else "are kept raw"))
    ef = info.get("engine_file")
    if ef:
        m = ef.get("model") or {}
        desc = (info.get("info") or {}).get("llama_cpp") or {}
        what = ", ".join(f"{k} {desc[k]}" for k in ("tokens", "cells", "layers", "row_types", "v_trans") if k in desc)
        out(f"  engine file  : {ef['engine']} {ef['kind']} of {human(ef['length'])}"
            + (f" ({what})" if what else "")
            + f"; {ef['tensor_pieces']} key/value pieces coded, {human(ef['verbatim'])} verbatim; rebuilt "
            + ("byte for byte (SHA-256 checked)" if ef["sha256"] else "from the lossy tensors (other bytes)"))
        out("  engine model : " + (f"{m.get('name') or 'unnamed'} ({m.get('architecture') or '?'}, GGUF SHA-256 "
                                   f"{m['file_sha256'][:16]}…)" if m else "none recorded"))
    pr = info.get("predict")
    if pr:
        out(f"  predict      : residuals of a cross-layer prediction; decoding needs the predictors of SHA-256 "
            f"{pr['predictors']} ({pr['layout']} RoPE; {pr['exact_head']} head and {pr['exact_tail']} tail tokens "
            "stored exactly)")
    out(f"  checksums    : {info['checksums']}")
    out(f"  sections     : {len(info['sections'])} (chunk of {info['chunk_tokens']} tokens)")
    if not sections:
        return "\n".join(lines)
    lossy = info["tier"] == "lossy"
    out("    #  type    layer part    chunk tokens         bytes  bits/comp"
          + ("  coding (quantizer, index bits, step, exact head/tail tokens, fixed-width bits/comp)" if lossy else ""))
    for i, s in enumerate(info["sections"]):
        if s["type"] in ("kv", "residual"):
            c = s.get("coding")
            extra = ""
            if c:
                extra = (f"  {c['quantizer']} k={c['symbol_bits']}" + (f" step={c['step']:.4g}" if c["step"] else "")
                         + f" head={c['head_tokens']} tail={c['exact_tokens']}"
                         + (f" fixed-width={c['fixed_width_bits_per_component']}"
                            if "fixed_width_bits_per_component" in c else ""))
            where = str(s["tokens"]) if "row" not in s else f"b{s['row'][0]}h{s['row'][1]} {s['tokens']}"
            out(f"  {i:4d} {s['type']:6.6s} {s['layer']:5d} {s['part']:7s} {s['chunk']:5d} {where:14s}"
                  f"{s['bytes']:9d}  {s['bits_per_component']:<9}" + extra)
        elif s["type"] == "state":
            out(f"  {i:4d} {'state':6s} {s['layer']:5d} {s['state'][:7]:7s} {s['slot']:5d} {str(s['shape']):14s}"
                f"{s['bytes']:9d}  {s['dtype']}, {s['coding']}")
        else:
            out(f"  {i:4d} {s['type']:6s} {'':5s} {'':7s} {'':5s} {'':14s}{s['bytes']:9d}")
    return "\n".join(lines)


def progress_bar(total: int, desc: str, unit: str = "section"):
    """A progress bar on stderr, shown once the job takes more than a second (refreshed at least every
    half second while work advances); token-by-token work counts tokens, so its rate and ETA are the
    model's.  Use ``bar.update`` as the ``progress=`` callback."""
    import sys

    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, mininterval=0.5, delay=1.0, leave=False, file=sys.stderr)
