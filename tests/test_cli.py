"""The kvz command line on golden vectors and bad files."""

import json
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

import kvcodec
from kvcodec.cli import main
from kvcodec.container import layout as L

VECTORS = Path(__file__).resolve().parent.parent / "spec" / "vectors"
VEC = VECTORS / "fp32_chunked_tokens.kvz"


def test_inspect_text_and_json(capsys):
    assert main(["inspect", str(VEC)]) == 0
    out = capsys.readouterr().out
    assert "float_ctx_rans" in out and "float32" in out and "bits/comp" in out
    assert main(["inspect", str(VEC), "--json", "--verify"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["checksums"] == "all checksums ok" and info["batch"] == 2


def test_verify_and_decode(tmp_path, capsys):
    assert main(["verify", str(VEC)]) == 0
    assert "ok" in capsys.readouterr().out
    out = tmp_path / "x.safetensors"
    assert main(["decode", str(VEC), "-o", str(out)]) == 0
    tensors = load_file(str(out))
    kv = kvcodec.load(VEC, output="kvcache")
    assert (tensors["layers.1.values"].view(-1) == kv.values[1].view(-1)).all()
    assert tensors["tokens"].tolist() == kv.tokens.tolist()


def test_bad_file_one_line_error_and_exit_code(tmp_path, capsys):
    bad = tmp_path / "bad.kvz"
    bad.write_bytes(VEC.read_bytes()[:-5])
    for cmd in ("inspect", "verify"):
        assert main([cmd, str(bad)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "TruncatedFile" in err and "End_Magic" in err


def test_console_script_entry_point():
    r = subprocess.run([sys.executable, "-m", "kvcodec.cli", "inspect", str(VEC)], capture_output=True, text=True)
    assert r.returncode == 0 and "tokens" in r.stdout


def test_version_and_help_import_no_model_stack():
    """``kvz --version``, ``kvz --help`` and every verb's ``--help`` answer without importing torch, transformers,
    numba or a tier (they took seconds): the package and the parser load them only where a verb needs them."""
    code = """if True:
        import contextlib, io, sys
        import kvcodec.cli
        from kvcodec.cli import build_parser
        p = build_parser()
        verbs = list(next(a for a in p._actions if a.dest == "cmd").choices)
        for argv in [["--version"], ["--help"]] + [[v, "--help"] for v in verbs]:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
                p.parse_args(argv)
        heavy = sorted(m for m in ("torch", "transformers", "numba", "kvcodec.tiers", "kvcodec.codecs", "kvcodec.api")
                       if m in sys.modules)
        print(len(verbs), heavy)
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    n, heavy = r.stdout.split(" ", 1)
    assert int(n) >= 10 and heavy.strip() == "[]", r.stdout


def test_the_progress_bars_rate_counts_from_the_first_update(monkeypatch):
    """The set-up before the first update (recovering the tokens, the first compilation) is not the work's pace:
    counted in, the demo's first ETA read 2:17:14 (issue 50).  A clock of our own: no timing."""
    from kvcodec.formatting import progress_bar

    now = [1000.0]
    monkeypatch.setattr("tqdm.std.time", lambda: now[0])
    bar = progress_bar(512, "encoding", "token")
    now[0] += 16.0  # sixteen seconds before the first token
    bar.update(1)
    for _ in range(20):  # then ten tokens a second
        now[0] += 0.1
        bar.update(1)
    rate = bar.format_dict["rate"]
    bar.close()
    assert rate is not None and 8 < rate < 12, rate  # an ETA of about 49 s, not 1/16 token/s (2:16:16)


def test_missing_file_exit_code(capsys):
    assert main(["inspect", "/nonexistent/file.kvz"]) == 2  # bad input, like a malformed file
    err = capsys.readouterr().err
    assert "No such file" in err and err.strip().count("\n") == 0


def test_dash_is_stdin_and_stdout(tmp_path):
    """zstd/gzip conventions: '-' reads standard input and writes standard output."""
    cli = [sys.executable, "-m", "kvcodec.cli"]
    data = VEC.read_bytes()
    r = subprocess.run(cli + ["inspect", "-", "--json"], input=data, capture_output=True)
    assert r.returncode == 0 and json.loads(r.stdout)["batch"] == 2
    r = subprocess.run(cli + ["decode", "-", "-o", "-"], input=data, capture_output=True)
    assert r.returncode == 0, r.stderr
    from safetensors.torch import load

    tensors = load(r.stdout)
    assert tensors["layers.0.keys"].equal(kvcodec.decode(data, output="kvcache").keys[0])
    assert not (Path.cwd() / "-").exists()
    r = subprocess.run(cli + ["verify", "-"], input=data, capture_output=True, text=False)
    assert r.returncode == 0 and b"ok" in r.stdout


def test_existing_output_needs_force(tmp_path, capsys):
    out = tmp_path / "x.safetensors"
    out.write_bytes(b"precious")
    assert main(["decode", str(VEC), "-o", str(out)]) == 1
    assert "exists" in capsys.readouterr().err and out.read_bytes() == b"precious"
    assert main(["decode", str(VEC), "-o", str(out), "-f"]) == 0
    assert load_file(str(out))["tokens"].shape == (2, 10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]  # written atomically, no temp left
    # the API: overwrite=False refuses, the old file stays
    kvc = tmp_path / "c.kvz"
    kvc.write_bytes(b"old")
    try:
        kvcodec.save(kvc, kvcodec.decode(VEC, output="kvcache"), overwrite=False)
        raise AssertionError("overwrite=False replaced a file")
    except kvcodec.ConfigError:
        pass
    assert kvc.read_bytes() == b"old"


def test_inspect_reads_a_pipe():
    with open(VEC, "rb") as f:
        r = subprocess.run([sys.executable, "-m", "kvcodec.cli", "inspect", "/dev/stdin", "--json"], stdin=f,
                           capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["num_layers"] == 2


def test_inspect_shows_the_lossy_coding_per_section(tmp_path, capsys):
    lossy = VECTORS / "lossy_uniform_window.kvz"
    assert main(["inspect", str(lossy), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    kv = [s for s in info["sections"] if s["type"] == "kv"]
    first = kv[0]["coding"]
    assert first["quantizer"] == "uniform" and first["head_tokens"] == 1 and first["symbol_bits"] >= 2
    assert kv[-1]["coding"]["exact_tokens"] == 4  # the window lies in the last chunk
    assert main(["inspect", str(lossy)]) == 0
    assert "uniform k=" in capsys.readouterr().out
    assert main(["verify", str(lossy)]) == 0  # no model needed for a lossy file
    assert "ok" in capsys.readouterr().out
    assert main(["inspect", str(VECTORS / "lossy_kivi.kvz"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sections"][0]["coding"]["quantizer"] == "kivi"


def test_describe_refuses_garbage_quietly():
    from kvcodec.codecs import vq_rans as quant

    assert quant.describe(b"\x07" * 40, (1, 1, 4, 8), 16) is None
    assert quant.describe(b"\x01", (1, 1, 4, 8), 16) is None


def test_version_and_json_on_every_reporting_verb(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and f"format 1.{L.FORMAT_VERSION_MINOR}" in capsys.readouterr().out
    assert main(["verify", str(VEC), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    out = tmp_path / "x.safetensors"
    assert main(["decode", str(VEC), "-o", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layers"] == 2


def test_encode_a_cache_saved_as_safetensors(tmp_path, capsys):
    """decode -> safetensors -> encode --cache gives the same file (lossless tier, no model needed)."""
    st = tmp_path / "c.safetensors"
    assert main(["decode", str(VEC), "-o", str(st)]) == 0
    assert oct(st.stat().st_mode & 0o777) != oct(0o600)  # ordinary permissions (umask), not 0600
    out = tmp_path / "c.kvz"
    assert main(["encode", "--cache", str(st), "--tier", "lossless", "-o", str(out), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rep["file"] == str(out) and rep["tokens"] == 10
    a, b = kvcodec.load(VEC, output="kvcache"), kvcodec.load(out, output="kvcache")
    assert a.equal(b) and a.start_position == b.start_position == 7
    bad = tmp_path / "bad.safetensors"
    import torch
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(2)}, str(bad))
    assert main(["encode", "--cache", str(bad), "--tier", "lossless", "-o", str(tmp_path / "b.kvz")]) == 1
    assert "layers.<i>.keys" in capsys.readouterr().err


def test_unwritable_output_and_bad_model_dir_are_one_line(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        code = main(["decode", str(VEC), "-o", str(ro / "x.safetensors")])
        err = capsys.readouterr().err
        import os

        if os.geteuid() != 0:  # root may write anywhere
            assert code == 2 and err.strip().count("\n") == 0 and "Permission" in err
    finally:
        ro.chmod(0o700)
    assert main(["decode", str(VEC), "-o", str(tmp_path / "none" / "x.safetensors")]) == 2
    assert "does not exist" in capsys.readouterr().err
    from kvcodec.models import load_model

    empty = tmp_path / "model"
    empty.mkdir()
    try:
        load_model(str(empty))
        raise AssertionError("an empty directory loaded as a model")
    except kvcodec.ConfigError as e:
        assert "\n" not in str(e) and str(empty) in str(e)


def test_every_option_has_help():
    import argparse

    from kvcodec.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [(verb, a.option_strings or a.dest) for verb, sp in sub.choices.items() for a in sp._actions
               if a.help is None and not isinstance(a, argparse._HelpAction)]
    assert not missing


def test_encode_lossy_weighted_with_a_saved_profile(tmp_path, capsys):
    """kvz encode --tier lossy, quantizer weighted: the profile from --profile; the keys' sections use Method 5."""
    import numpy as np

    st = tmp_path / "c.safetensors"
    src = VECTORS / "lossy_weighted.kvz"
    assert main(["decode", str(src), "-o", str(st)]) == 0
    kv = kvcodec.load(src, output="kvcache")
    prof = tmp_path / "p.json"
    kvcodec.Profile([np.ones((k.shape[1], k.shape[3]), np.float32) for k in kv.keys]).save(prof)
    out = tmp_path / "w.kvz"
    assert main(["encode", "--cache", str(st), "--tier", "lossy", "--bits", "6", "--lossy-options",
                 '{"quantizer": "weighted"}', "--profile", str(prof), "-o", str(out)]) == 0
    coding = [s["coding"]["quantizer"] for s in kvcodec.inspect(out)["sections"] if s["type"] == "kv"]
    assert coding == ["channel", "uniform"]
    prof.write_text("{}")
    assert main(["encode", "--cache", str(st), "--tier", "lossy", "--lossy-options", '{"quantizer": "weighted"}',
                 "--profile", str(prof), "-o", str(tmp_path / "x.kvz")]) == 2  # a bad input file
    assert "Profile.format" in capsys.readouterr().err
