"""The benchmark plots, as hand-written SVG: no plotting library, the standard library and the result JSONs only.

``python -m kvcodec.lab.plots [OUT_DIR]`` (or :func:`main`) reads the result files kept in ``docs/`` and writes
one SVG per plot into ``OUT_DIR`` (default: ``docs/``), the plots BENCHMARKS.md shows:

- ``plot_lossy_rd.svg``: the lossy tier's rate against distortion, every kvz quantizer and every peer of
  ``docs/bench_lossy.json`` (medians over the texts of bits per component and of mean KL);
- ``plot_store.svg``: store bytes against the number of sessions (``docs/bench_store_sessions.json``);
- ``plot_restore.svg``: restore time per tier against recomputing the cache (``docs/bench_restore.json``);
- ``plot_reduce.svg``: the reduce tier's answer NLL ratio against the budget kept, per method
  (``docs/bench_reduce_chunk.json``).

The bench commands draw their own run with the same functions: ``kvz bench --reduce`` writes
``bench_reduce.svg``, ``--lossy`` ``bench_lossy.svg``, ``--restore`` ``bench_restore.svg``.  Every curve or bar
group is one element with ``class="series"`` and ``data-series`` naming it as the JSON does, so a reader (or a
test) can tell which result drew what.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

#: the repository's docs/, where the result files are kept
DOCS = Path(__file__).resolve().parents[2] / "docs"

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
           "#bcbd22", "#7f7f7f", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d"]


# -- axes ------------------------------------------------------------------------------------------------------
def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e5 or abs(v) < 1e-3:
        return f"{v:.0e}".replace("e-0", "e-").replace("e+0", "e")
    return f"{v:g}"


def _ticks(lo: float, hi: float, log: bool) -> list[float]:
    """Tick values covering [lo, hi]: decades (with 2 and 5 when there are few) on a log axis, steps of 1, 2 or 5
    times a power of ten on a linear one."""
    if log:
        a, b = math.floor(math.log10(lo) + 1e-9), math.ceil(math.log10(hi) - 1e-9)
        mult = (1, 2, 5) if b - a <= 2 else (1,)
        out = [m * 10.0 ** e for e in range(a, b + 1) for m in mult]
        return [t for t in out if lo * (1 - 1e-9) <= t <= hi * (1 + 1e-9)] or [lo, hi]
    span = (hi - lo) or abs(hi) or 1.0
    raw = span / 5
    step = min((m * 10 ** math.floor(math.log10(raw)) for m in (1, 2, 5, 10)),
               key=lambda s: abs(span / s - 5))
    first = math.ceil(lo / step - 1e-9) * step
    return [round(first + i * step, 12) for i in range(int((hi - first) / step + 1e-9) + 1)]


def _range(values: list[float], log: bool, pad: float = 0.05) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if log:  # whole decades when the data span two or more, else a margin in log space
        a, b = math.log10(lo), math.log10(hi)
        if b - a >= 2:
            return 10 ** math.floor(a), 10 ** math.ceil(b)
        d = max(b - a, 0.1) * pad
        return 10 ** (a - d), 10 ** (b + d)
    if hi == lo:
        hi, lo = hi + 1, lo - 1
    d = (hi - lo) * pad
    return lo - d, hi + d


class _Axes:
    """A plot area with its scales: data coordinates to SVG pixels."""

    def __init__(self, box, xr, yr, xlog, ylog):
        self.x0, self.y0, self.x1, self.y1 = box
        self.xr, self.yr, self.xlog, self.ylog = xr, yr, xlog, ylog

    @staticmethod
    def _u(v, r, log):
        lo, hi = r
        if log:
            return (math.log10(v) - math.log10(lo)) / ((math.log10(hi) - math.log10(lo)) or 1)
        return (v - lo) / ((hi - lo) or 1)

    def X(self, x):
        return self.x0 + self._u(x, self.xr, self.xlog) * (self.x1 - self.x0)

    def Y(self, y):
        return self.y1 - self._u(y, self.yr, self.ylog) * (self.y1 - self.y0)


def _frame(w, h, title, subtitle):
    out = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
            'font-family="sans-serif" font-size="12">'), f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2:.1f}" y="22" text-anchor="middle" font-size="15" font-weight="bold">{escape(title)}</text>']
    if subtitle:
        out.append(f'<text x="{w / 2:.1f}" y="40" text-anchor="middle" fill="#444">{escape(subtitle)}</text>')
    return out


def _axis_lines(ax, out, xlabel, ylabel, xticks, yticks, xnames=None):
    out.append(f'<rect x="{ax.x0}" y="{ax.y0}" width="{ax.x1 - ax.x0}" height="{ax.y1 - ax.y0}" fill="none" '
               'stroke="black"/>')
    for t in xticks:
        x = ax.X(t)
        out.append(f'<line x1="{x:.1f}" y1="{ax.y0}" x2="{x:.1f}" y2="{ax.y1}" stroke="#e4e4e4"/>')
        out.append(f'<line x1="{x:.1f}" y1="{ax.y1}" x2="{x:.1f}" y2="{ax.y1 + 5}" stroke="black"/>')
        out.append(f'<text x="{x:.1f}" y="{ax.y1 + 18}" text-anchor="middle">{_fmt(t)}</text>')
    for t in yticks:
        y = ax.Y(t)
        out.append(f'<line x1="{ax.x0}" y1="{y:.1f}" x2="{ax.x1}" y2="{y:.1f}" stroke="#e4e4e4"/>')
        out.append(f'<line x1="{ax.x0 - 5}" y1="{y:.1f}" x2="{ax.x0}" y2="{y:.1f}" stroke="black"/>')
        out.append(f'<text x="{ax.x0 - 8}" y="{y + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    out.append(f'<text x="{(ax.x0 + ax.x1) / 2:.1f}" y="{ax.y1 + 40}" text-anchor="middle">{escape(xlabel)}</text>')
    if ylabel:
        cy = (ax.y0 + ax.y1) / 2
        out.append(f'<text x="16" y="{cy:.1f}" transform="rotate(-90 16 {cy:.1f})" text-anchor="middle">'
                   f'{escape(ylabel)}</text>')


def _vlines(ax, out, vlines):
    """Dashed vertical reference lines at the (value, label) pairs, each labelled at its top."""
    for v, label in vlines:
        out.append(f'<line x1="{ax.X(v):.1f}" y1="{ax.y0}" x2="{ax.X(v):.1f}" y2="{ax.y1}" stroke="#555" '
                   'stroke-dasharray="2,3"/>')
        out.append(f'<text x="{ax.X(v) + 4:.1f}" y="{ax.y0 + 14}" fill="#555">{escape(label)}</text>')


def _legend(out, x, y, entries):
    """entries: (label, colour, dashed, marker)."""
    for i, (label, colour, dashed, kind) in enumerate(entries):
        yy = y + 16 * i
        if kind == "box":
            out.append(f'<rect x="{x}" y="{yy - 9}" width="22" height="10" fill="{colour}"/>')
        else:
            dash = ' stroke-dasharray="5,3"' if dashed else ""
            out.append(f'<line x1="{x}" y1="{yy - 4}" x2="{x + 22}" y2="{yy - 4}" stroke="{colour}" '
                       f'stroke-width="2"{dash}/>')
            out.append(f'<circle cx="{x + 11}" cy="{yy - 4}" r="3" fill="{colour}"/>')
        out.append(f'<text x="{x + 28}" y="{yy}">{escape(label)}</text>')


def line_plot(path, series, *, title, subtitle="", xlabel, ylabel, xlog=False, ylog=False, hlines=(), vlines=(),
              xticks=None, plot_width=640):
    """A line plot written to ``path``: ``series`` is a list of dicts with ``name`` (the JSON's), ``points``
    [(x, y), ...] and optionally ``label`` (the legend's text; default the name) and ``dashed``; ``hlines`` /
    ``vlines`` are (value, label) reference lines.  One ``<polyline class="series">`` per series."""
    series = [s for s in series if s["points"]]
    if not series:
        return None
    n = len(series)
    h = max(440, 90 + 16 * n)
    legend_width = 50 + 7 * max(len(s.get("label", s["name"])) for s in series)
    width = 70 + plot_width + 20 + legend_width
    xs = [x for s in series for x, _ in s["points"]] + [v for v, _ in vlines]
    ys = [y for s in series for _, y in s["points"]] + [v for v, _ in hlines]
    ax = _Axes((70, 55, width - legend_width - 20, h - 60), _range(xs, xlog), _range(ys, ylog), xlog, ylog)
    out = _frame(width, h, title, subtitle)
    _axis_lines(ax, out, xlabel, ylabel, xticks or _ticks(*ax.xr, xlog), _ticks(*ax.yr, ylog))
    for v, label in hlines:
        out.append(f'<line x1="{ax.x0}" y1="{ax.Y(v):.1f}" x2="{ax.x1}" y2="{ax.Y(v):.1f}" stroke="#555" '
                   'stroke-dasharray="2,3"/>')
        out.append(f'<text x="{ax.x0 + 4}" y="{ax.Y(v) - 4:.1f}" fill="#555">{escape(label)}</text>')
    _vlines(ax, out, vlines)
    legend = []
    for i, s in enumerate(series):
        c = s.get("colour") or COLOURS[i % len(COLOURS)]
        pts = sorted(s["points"])
        dash = ' stroke-dasharray="5,3"' if s.get("dashed") else ""
        out.append(f'<polyline class="series" data-series={quoteattr(s["name"])} fill="none" stroke="{c}" '
                   f'stroke-width="{s.get("width", 1.8)}"{dash} points="'
                   + " ".join(f"{ax.X(x):.1f},{ax.Y(y):.1f}" for x, y in pts) + '"/>')
        out.append("<g>" + "".join(f'<circle cx="{ax.X(x):.1f}" cy="{ax.Y(y):.1f}" r="3" fill="{c}"/>'
                                   for x, y in pts) + "</g>")
        legend.append((s.get("label", s["name"]), c, s.get("dashed"), "line"))
    _legend(out, width - legend_width, 70, legend)
    out.append("</svg>")
    Path(path).write_text("\n".join(out) + "\n")
    return Path(path)


def bar_plot(path, categories, series, *, title, subtitle="", xlabel, xlog=True, vlines=(), plot_width=520):
    """Horizontal grouped bars written to ``path``: one row per category, one bar per series in each row;
    ``series`` is a list of dicts with ``name`` and ``values`` {category: value}.  One ``<path class="series">``
    per series (its bars as sub-paths)."""
    vals = [v for s in series for v in s["values"].values() if v]
    if not vals:
        return None
    bar, gap = 7, 10
    left = 30 + 7 * max(len(c) for c in categories)
    right = 50 + 7 * max(len(s.get("label", s["name"])) for s in series)
    width = left + plot_width + right
    row = bar * len(series) + gap
    h = 70 + row * len(categories) + 55
    ax = _Axes((left, 55, width - right, h - 60), _range(vals + [v for v, _ in vlines], xlog), (0, 1), xlog, False)
    out = _frame(width, h, title, subtitle)
    _axis_lines(ax, out, xlabel, "", _ticks(*ax.xr, xlog), [])
    for i, cat in enumerate(categories):
        y = ax.y0 + 8 + row * i + bar * len(series) / 2
        out.append(f'<text x="{ax.x0 - 8}" y="{y + 4:.1f}" text-anchor="end">{escape(cat)}</text>')
    _vlines(ax, out, vlines)
    legend = []
    for j, s in enumerate(series):
        c = s.get("colour") or COLOURS[j % len(COLOURS)]
        d = []
        for i, cat in enumerate(categories):
            v = s["values"].get(cat)
            if v:
                y = ax.y0 + 8 + row * i + bar * j
                d.append(f"M{ax.x0},{y:.1f}H{ax.X(v):.1f}V{y + bar - 1:.1f}H{ax.x0}Z")
        out.append(f'<path class="series" data-series={quoteattr(s["name"])} fill="{c}" d="{" ".join(d)}"/>')
        legend.append((s.get("label", s["name"]), c, False, "box"))
    _legend(out, width - right + 15, 70, legend)
    out.append("</svg>")
    Path(path).write_text("\n".join(out) + "\n")
    return Path(path)


# -- the plots ---------------------------------------------------------------------------------------------------
def lossy_series_name(row: dict) -> str:
    """The curve a row of ``bench_lossy.json`` belongs to: its method, turboquant's IP variant apart from its MSE
    one."""
    cfg = row["config"].get("config", "") if isinstance(row.get("config"), dict) else ""
    return row["method"] + (" (IP + QJL)" if "TurboQuantIP" in str(cfg) else "")


def lossy_plot(res: dict, path) -> Path | None:
    """Rate (median bits per component over the texts, all side information) against distortion (median mean
    KL, bits/token), one curve per kvz quantizer, peer and reference of a ``kvz bench --lossy`` result."""
    groups: dict = {}
    for r in res["rows"]:
        if "mean_kl_bits" in r:  # a peer that could not run has none
            key = (lossy_series_name(r), json.dumps(r["config"], sort_keys=True))
            groups.setdefault(key, []).append(r)
    curves: dict = {}
    for (name, _), rs in groups.items():
        curves.setdefault(name, []).append((statistics.median(r["bits_per_component"] for r in rs),
                                            statistics.median(r["mean_kl_bits"] for r in rs)))
    order = sorted(curves, key=lambda n: (not n.startswith("kvz"), n))
    series = [{"name": n, "points": curves[n], "dashed": not n.startswith("kvz"),
               "width": 3 if "predictors" in n else 1.8} for n in order]
    texts = len({r["text"] for r in res["rows"]})
    return line_plot(path, series, xlabel="bits per component (all side information)",
                     ylabel="mean KL(P_exact ‖ P_compressed), bits/token", ylog=True,
                     hlines=[(0.01, "KL 0.01")], vlines=[(2.0, "2 bits")],
                     title=f"Lossy tier, rate vs distortion: {res.get('model', '?')}",
                     subtitle=f"{res.get('command', '')}; medians over {texts} texts; machine "
                              f"{res.get('machine', 'not recorded')}")


def store_series(res: dict) -> list[dict]:
    """The curves of ``bench_store_sessions.json``: each measured quantity of each tier, and the raw chunks."""
    out: dict = {}
    for row in res["rows"]:
        n = row["sessions"]
        for tier, t in row["tiers"].items():
            for key, label in STORE_QUANTITIES:
                if t.get(key) is not None:
                    out.setdefault(f"{label}, {tier}", []).append((n, t[key]))
        if row.get("lmcache_raw_mib") is not None:
            out.setdefault(STORE_RAW, []).append((n, row["lmcache_raw_mib"]))
    return [{"name": k, "points": v, "dashed": not k.startswith("kvz store")} for k, v in out.items()]


STORE_QUANTITIES = [("store_mib", "kvz store"), ("ideal_mib", "ideal (prefix once + own positions)"),
                    ("one_kvz_per_session_mib", "one .kvz per session")]
STORE_RAW = "LMCache-style raw chunks (256 tokens, bf16)"


def store_plot(res: dict, path) -> Path | None:
    series = store_series(res)
    ticks = sorted({row["sessions"] for row in res["rows"]})
    return line_plot(path, series, xlog=True, ylog=True, xticks=ticks, xlabel="sessions sharing a 1,000-token prefix",
                     ylabel="bytes stored, MiB", title=f"Store bytes vs sessions: {res.get('model', '?')}",
                     subtitle=f"{res.get('date', '')}; machine {res.get('machine', 'not recorded')}"
                              + ("; numbers transcribed from BENCHMARKS.md's tables (the JSON's source)"
                                 if str(res.get("source", "")).startswith("Transcribed") else ""))


def restore_series(res: dict) -> tuple[list[str], list[dict]]:
    """Rows (methods, in the JSON's order) and one bar series per (dtype, threads) of a ``kvz bench --restore``
    result; values in milliseconds."""
    cats: list[str] = []
    series: dict = {}
    for case in res["cases"]:
        for r in case["rows"]:
            if r["method"] not in cats:
                cats.append(r["method"])
            name = f"{case['dtype']}, {r['threads']} thread{'s' if r['threads'] != 1 else ''}"
            series.setdefault(name, {})[r["method"]] = 1e3 * r["restore_s"]
    return cats, [{"name": k, "values": v} for k, v in series.items()]


def restore_plot(res: dict, path) -> Path | None:
    """Restore time per tier and method, the recompute (one prefill) among them, log scale."""
    cats, series = restore_series(res)
    case = res["cases"][0] if res.get("cases") else {}
    return bar_plot(path, cats, series, xlabel="restore time, ms (log scale; file in the page cache)",
                    title=f"Restore vs recompute: {case.get('text', '?')}, {case.get('tokens', '?')} tokens",
                    subtitle=f"{res.get('command', '')}; machine {res.get('machine', 'not recorded')}, "
                             f"{res.get('cpus', '?')} CPUs")


#: legend text of the reduce bench's method names (the JSON's names stay in data-series)
REDUCE_LABELS = {"kvzip,chunk=512": "kvzip: the default (heads, fit, replay in passes of 512)",
                 "kvzip,chunk=4096": "kvzip, fit, replay in one pass",
                 "kvzip,fit=policy": "kvzip, on-policy fit, one pass",
                 "kvzip,nofit": "kvzip, no fit (selection alone)",
                 "kvzip,allocation=ranks": "kvzip, no fit, allocation ranks",
                 "kvzip,allocation=layers": "kvzip, no fit, allocation layers",
                 "kvzip,allocation=uniform": "kvzip, no fit, allocation uniform"}


def reduce_plot(res: dict, path) -> Path | None:
    """Answer NLL ratio (reduced / full cache) against the fraction kept, one line per method of a
    ``kvz bench --reduce`` result."""
    methods = [m for m in res["methods"] if m != "full"]
    series = [{"name": m, "label": REDUCE_LABELS.get(m, m), "dashed": not m.startswith("kvzip"),
               "width": 3 if m == methods[0] else 1.8,
               "points": [(s["keep"], s["nll_ratio"]) for s in res["summary"]
                          if s["method"] == m and s["nll_ratio"] == s["nll_ratio"]]} for m in methods]
    return line_plot(path, series, xlog=True, xticks=sorted(res["keeps"]), hlines=[(1.0, "full cache")],
                     xlabel="fraction of entries kept per KV head (log scale)",
                     ylabel="answer NLL, reduced / full cache",
                     title=f"Reduce tier: answer NLL vs budget, {res.get('model', '?')}",
                     subtitle=f"{res.get('documents', '?')} documents × {res.get('context', '?')} tokens, "
                              f"{res.get('questions', '?')} questions; machine "
                              f"{res.get('machine', 'not recorded in the JSON')}")


#: plot file -> (result file in docs/, function)
PLOTS = {"plot_lossy_rd.svg": ("bench_lossy.json", lossy_plot),
         "plot_store.svg": ("bench_store_sessions.json", store_plot),
         "plot_restore.svg": ("bench_restore.json", restore_plot),
         "plot_reduce.svg": ("bench_reduce_chunk.json", reduce_plot)}


def main(out_dir: str | Path = DOCS, src_dir: str | Path = DOCS) -> list[Path]:
    """Write every plot of :data:`PLOTS` from the result files in ``src_dir`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (source, fn) in PLOTS.items():
        res = json.loads((Path(src_dir) / source).read_text())
        p = fn(res, out / name)
        if p is not None:
            written.append(p)
            print(f"wrote {p} (from {source})")
    return written


if __name__ == "__main__":
    main(*sys.argv[1:2])
