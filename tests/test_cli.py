"""The kvz command line on golden vectors and bad files."""

import json
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

import kvcodec
from kvcodec.cli import main

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
