"""The benchmark plots (kvcodec.lab.plots): every plot is drawn from the result files in docs/, parses as SVG,
and has one curve or bar group per series its JSON names (issue 50: BENCHMARKS.md opens with these plots)."""

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvcodec.lab import plots

DOCS = Path(__file__).resolve().parent.parent / "docs"
SVG = "{http://www.w3.org/2000/svg}"


def _load(name):
    return json.loads((DOCS / name).read_text())


def _expected_lossy():
    out = set()
    for r in _load("bench_lossy.json")["rows"]:
        if "mean_kl_bits" in r:  # peers that could not run have no point
            ip = "TurboQuantIP" in str(r["config"].get("config", "")) if isinstance(r["config"], dict) else False
            out.add(r["method"] + (" (IP + QJL)" if ip else ""))
    return out


def _expected_store():
    res, out = _load("bench_store_sessions.json"), set()
    for row in res["rows"]:
        for tier, t in row["tiers"].items():
            out |= {f"{label}, {tier}" for key, label in plots.STORE_QUANTITIES if t.get(key) is not None}
        if row.get("lmcache_raw_mib") is not None:
            out.add(plots.STORE_RAW)
    return out


def _expected_restore():
    res = _load("bench_restore.json")
    return {f"{c['dtype']}, {r['threads']} thread{'s' if r['threads'] != 1 else ''}"
            for c in res["cases"] for r in c["rows"]}


def _expected_reduce():
    res = _load("bench_reduce_chunk.json")
    return {s["method"] for s in res["summary"]} - {"full"}


EXPECTED = {"plot_lossy_rd.svg": _expected_lossy, "plot_store.svg": _expected_store,
            "plot_restore.svg": _expected_restore, "plot_reduce.svg": _expected_reduce}


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    out = tmp_path_factory.mktemp("plots")
    written = plots.main(out)
    return out, written


def test_main_writes_every_plot(drawn):
    _, written = drawn
    assert sorted(p.name for p in written) == sorted(plots.PLOTS) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_plot_has_one_series_per_json_series(drawn, name):
    out, _ = drawn
    root = ET.parse(out / name).getroot()  # well-formed XML, an <svg> root
    assert root.tag == SVG + "svg"
    elements = [e for e in root.iter() if e.get("class") == "series"]
    assert all(e.tag in (SVG + "polyline", SVG + "path") for e in elements)
    names = [e.get("data-series") for e in elements]
    assert len(names) == len(set(names)), "a series drawn twice"
    expected = EXPECTED[name]()
    assert expected and set(names) == expected
    for e in elements:  # every series has drawn something
        assert (e.get("points") or e.get("d") or "").strip()
    assert len(list(root.iter(SVG + "text"))) > len(expected)  # ticks, labels and a legend entry each


def test_titles_name_model_and_machine(drawn):
    out, _ = drawn
    title = {n: " ".join(t.text or "" for t in ET.parse(out / n).getroot().iter(SVG + "text")) for n in EXPECTED}
    assert "SmolLM2-135M-Instruct (float32)" in title["plot_lossy_rd.svg"]
    assert _load("bench_restore.json")["machine"] in title["plot_restore.svg"]
    assert _load("bench_store_sessions.json")["machine"] in title["plot_store.svg"]
    assert "smollm2 fp32" in title["plot_reduce.svg"]


def test_the_committed_plots_are_the_ones_the_jsons_draw(drawn):
    """docs/plot_*.svg are regenerated (python -m kvcodec.lab.plots) whenever a result file they read changes."""
    out, _ = drawn
    for name in EXPECTED:
        assert (DOCS / name).read_text() == (out / name).read_text(), f"{name}: run python -m kvcodec.lab.plots"
