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
    assert main(["inspect", "/nonexistent/file.kvz"]) == 1
    assert "No such file" in capsys.readouterr().err


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
