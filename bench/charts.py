"""Draw the documentation's figures from the committed benchmark results (matplotlib, SVG).

    python bench/charts.py                   # (re)writes docs/figures/*.svg
    python bench/charts.py --out /tmp/figs   # the same files elsewhere

Run it again whenever a result below changes; it reads only files under ``bench/results/``:

* ``save_restore.svg``: the transformer-like state, from the newest *full* ``bench/run.py``
  report: its ``<date>.json`` where committed, else its ``<date>.md`` table, parsed by the
  row labels ``bench/run.py`` writes (``ROWS``);
* ``small_leaves.svg``: the newest ``*-small-scaling.json`` (``bench/small_scaling.py``);
* ``plan_scale.svg``: the newest date's ``*-plan-scale-p<P>.json`` (``bench/plan_scale.py``,
  one file per process count);
* ``cost_per_call.svg``: the newest ``*-call-cost.json`` (``bench/call_cost.py --before``);
* ``save_phases.svg`` and ``layout.svg``: diagrams of a save and of a checkpoint directory
  (docs/concepts/async.md, docs/concepts/commit.md, docs/format.md).

The output is deterministic (fixed ``svg.hashsalt``, no date in the metadata, text kept as
text): rerunning on unchanged results rewrites identical files (``tests/test_charts.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import statistics
import sys
import textwrap
from typing import Any, Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from bench.run import ROWS  # noqa: E402  (the row labels of run.py's markdown report)

RESULTS = os.path.join(REPO, "bench", "results")
STYLE = {"svg.hashsalt": "fnckpt-charts", "svg.fonttype": "none",   # text stays text
         "font.family": "sans-serif", "font.sans-serif": ["DejaVu Sans", "Helvetica", "Arial"],
         "font.monospace": ["DejaVu Sans Mono", "Menlo", "Consolas"], "font.size": 9,
         "axes.spines.top": False, "axes.spines.right": False, "axes.titlesize": 10,
         "figure.titlesize": 11, "legend.fontsize": 8}
COLORS = {"fnckpt": "#1f6fb4", "orbax": "#e8822a", "limit": "#8c8c8c", "raw": "#4f9a5b"}
NAMES = {"fnckpt": "fnckpt", "orbax": "Orbax"}
NOTE = "Drawn by bench/charts.py from {src}"

# ------------------------------------------------------------------ the bench/run.py report

# The rows drawn, as (metric key, limit key) of bench/run.py (its report has two limits for
# "to committed" and for "restore, same mesh": the machine's and raw TensorStore's).
DRAWN = (("save_block_s", "d2h_s"), ("save_commit_s", "write_s"),
         ("save_commit_s", "ts_write_s"), ("restore_a_s", "read_a_s"),
         ("restore_a_s", "ts_read_s"), ("restore_b_s", "read_b_s"))
LABELS = {label: (key, lkey) for key, label, _, lkey, _ in ROWS if (key, lkey) in DRAWN}
STAMP = re.compile(r"\d{4}-\d\d-\d\d-\d{6}")


@dataclasses.dataclass(frozen=True)
class Report:
  """One state of a ``bench/run.py`` report: medians per library and the run's limits."""
  source: str                  # the file, relative to the repository
  date: str                    # YYYY-MM-DD-HHMMSS
  mode: str                    # "full" or "quick"
  runs: int
  machine: str
  leaves: int
  state_mib: float
  values: dict[tuple[str, str], dict[str, float | None]]   # DRAWN row -> fnckpt, orbax, limit


def report_from_json(path: str, state: str) -> Report | None:
  """``state`` of a ``bench/run.py`` JSON report (``None`` when the report lacks it)."""
  with open(path) as f:
    d = json.load(f)
  s = d["states"].get(state)
  if s is None:
    return None
  agg, lim, m = s["aggregate"], s["limits"], d["machine"]
  values = {(k, lk): {**{lib: agg.get(lib, {}).get("median", {}).get(k) for lib in NAMES},
                      "limit": lim.get(lk)} for k, lk in DRAWN}
  return Report(os.path.relpath(path, REPO), d["date"], d["mode"], d["runs"],
                f"{m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, disk {m['disk']}",
                int(lim["leaves"]), lim["state_bytes"] / 2**20, values)


def seconds(cell: str) -> float | None:
  """``'0.055 s'``, ``'5.7 ms'`` or ``'0.162 s (device→host, best way)'`` -> seconds."""
  m = re.match(r"([0-9][0-9,]*(?:\.[0-9]+)?(?:e[-+]?[0-9]+)?) (ms|s)\b", cell.strip())
  if m is None:
    return None
  v = float(m[1].replace(",", ""))
  return v / 1e3 if m[2] == "ms" else v


def _section(text: str, state: str) -> str | None:
  """The text of ``## State `state` ...`` up to the next ``## ``."""
  m = re.search(rf"^## State `{re.escape(state)}`.*?(?=^## |\Z)", text, re.M | re.S)
  return m[0] if m else None


def _table(section: str) -> dict[tuple[str, str], dict[str, float | None]]:
  """The DRAWN rows of a state's markdown table, by its header's column names."""
  rows = [[c.strip() for c in line.strip().strip("|").split("|")]
          for line in section.splitlines() if line.startswith("| ")]
  header = rows[0]
  cols = {name: header.index(name) for name in (*NAMES, "limit") if name in header}
  return {LABELS[r[0]]: {name: seconds(r[cols[name]]) if name in cols else None
                         for name in (*NAMES, "limit")}
          for r in rows[1:] if r[0] in LABELS}


def report_from_markdown(path: str, state: str) -> Report | None:
  """``state`` of a ``bench/run.py`` markdown report (``None`` when the report lacks it)."""
  with open(path) as f:
    text = f.read()
  section = _section(text, state)
  if section is None:
    return None
  date = re.search(r"^# fnckpt benchmark — (\S+)", text, re.M)
  mode = re.search(r"^Mode: (\w+), (\d+) runs", text, re.M)
  machine = re.search(r"^Machine: (.*?) \(data dir", text, re.M)
  size = re.search(r"`: ([0-9,]+) leaves, ([0-9,.]+) MiB", section)
  if not (date and mode and machine and size):
    raise SystemExit(f"{path}: not a bench/run.py report (header or state line missing)")
  return Report(os.path.relpath(path, REPO), date[1], mode[1], int(mode[2]), machine[1],
                int(size[1].replace(",", "")), float(size[2].replace(",", "")), _table(section))


def newest_full_report(results: str, state: str = "transformer") -> Report:
  """The newest full-mode ``bench/run.py`` report holding ``state`` (JSON preferred)."""
  stems = sorted({f.split(".")[0] for f in os.listdir(results)
                  if STAMP.fullmatch(f.split(".")[0])}, reverse=True)
  for stem in stems:
    base = os.path.join(results, stem)
    r = (report_from_json(base + ".json", state) if os.path.exists(base + ".json")
         else report_from_markdown(base + ".md", state))
    if r is not None and r.mode == "full":
      return r
  raise SystemExit(f"no full bench/run.py report with state {state!r} in {results}")


# ------------------------------------------------------------------ figure helpers

def _note(fig: Figure, text: str) -> None:
  """The source line(s) at the bottom left, wrapped to the figure's width."""
  fig.text(0.01, 0.01, textwrap.fill(text, int(fig.get_figwidth() * 17)), fontsize=7,
           color="#555555", ha="left", va="bottom")


def _save(fig: Figure, path: str) -> None:
  fig.savefig(path, format="svg", metadata={"Date": None})
  plt.close(fig)


def _when(stamp: str) -> str:
  """``2026-11-23-180635`` -> ``2026-11-23 18:06``."""
  return f"{stamp[:10]} {stamp[11:13]}:{stamp[13:15]}" if STAMP.fullmatch(stamp) else stamp


def _fmt_s(v: float) -> str:
  return f"{v:.3g} s" if v >= 0.01 else f"{v * 1e3:.2g} ms"


# ------------------------------------------------------------------ save_restore.svg

# (label, fnckpt/Orbax row, raw TensorStore row or None, what the machine limit is)
GROUPS = (("caller blocked\nby save (steady)", ("save_block_s", "d2h_s"), None,
           "device→host copy"),
          ("save to committed\n(steady)", ("save_commit_s", "write_s"),
           ("save_commit_s", "ts_write_s"), "max(device→host, disk write + fsync)"),
          ("restore, same mesh\n(cold cache)", ("restore_a_s", "read_a_s"),
           ("restore_a_s", "ts_read_s"), "max(cold disk read, host→device)"),
          ("restore onto another\nmesh and specs (cold)", ("restore_b_s", "read_b_s"), None,
           "max(cold disk read, host→device)"))


def _bars(r: Report) -> list[tuple[str, str, float, str]]:
  """(group label, series, seconds, value text) for every bar drawn, top to bottom."""
  out = []
  for label, row, raw, what in GROUPS:
    v = r.values.get(row, {})
    for lib in NAMES:
      if v.get(lib) is not None:
        out.append((label, lib, v[lib], _fmt_s(v[lib])))
    if v.get("fnckpt") and v.get("orbax"):
      out[-1] = (*out[-1][:3], f"{out[-1][3]} ({v['orbax'] / v['fnckpt']:.1f}x fnckpt's)")
    if v.get("limit") is not None:
      out.append((label, "limit", v["limit"], f"{_fmt_s(v['limit'])}: {what}"))
    t = r.values.get(raw, {}).get("limit") if raw else None
    if t is not None:
      out.append((label, "raw", t, f"{_fmt_s(t)}: zarr3 + crc32c, one array per leaf"))
  return out


def save_restore(out: str) -> None:
  r = newest_full_report(RESULTS)
  bars = _bars(r)
  fig, ax = plt.subplots(figsize=(9, 6.2))
  y, ticks, prev = 0.0, [], None
  for label, series, v, text in bars:
    if label != prev:
      y += 0.8 if prev is not None else 0.0
      ticks.append((y + 0.5, label))
      prev = label
    ax.barh(-y, v, height=0.8, color=COLORS[series])
    ax.text(v * 1.06, -y, text, va="center", fontsize=7.5)
    y += 1
  ax.set_yticks([-t for t, _ in ticks], [lab for _, lab in ticks])
  ax.tick_params(axis="y", length=0)
  ax.set_xscale("log")
  ax.set_xlim(min(b[2] for b in bars) / 2, max(b[2] for b in bars) * 12)
  ax.set_xlabel("seconds (log scale; shorter is better)")
  legend = {"fnckpt": "fnckpt", "orbax": "Orbax (async CheckpointManager, defaults)",
            "limit": "machine limit, same run", "raw": "raw TensorStore, same run"}
  # above the bars, under the title: clear of the data whatever the values (issue 35)
  ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in legend],
            labels=list(legend.values()), loc="lower left", bbox_to_anchor=(0, 1.01), ncol=2,
            frameon=False)
  fig.suptitle(f"Transformer-like state: save and restore, fnckpt vs Orbax vs the machine's "
               f"limits\n{r.state_mib:,.0f} MiB in {r.leaves} leaves, 8 virtual CPU devices, "
               f"medians of {r.runs} runs", x=0.01, ha="left")
  _note(fig, NOTE.format(src=f"{r.source} (bench/run.py, {r.mode} run of {_when(r.date)}; "
                         f"{r.machine})"))
  fig.subplots_adjust(left=0.19, right=0.98, top=0.79, bottom=0.14)
  _save(fig, os.path.join(out, "save_restore.svg"))


# ------------------------------------------------------------------ small_leaves.svg

PANELS = (("save_block_s", "caller blocked by save"), ("save_commit_s", "save to committed"),
          ("restore_s", "restore, same mesh (cold cache)"))


def _newest(pattern: str) -> str:
  files = sorted(glob.glob(os.path.join(RESULTS, pattern)))
  if not files:
    raise SystemExit(f"no {pattern} in {RESULTS}")
  return files[-1]


def _scaling_panel(ax: Axes, times: dict, key: str, title: str) -> None:
  counts = sorted(int(n) for n in times["fnckpt"])
  med = {lib: [statistics.median(times[lib][str(n)][key]) for n in counts] for lib in NAMES}
  for lib, ys in med.items():
    runs = [times[lib][str(n)][key] for n in counts]
    ax.fill_between(counts, [min(r) for r in runs], [max(r) for r in runs], color=COLORS[lib],
                    alpha=0.15, lw=0)
    ax.plot(counts, ys, marker="o", color=COLORS[lib], label=NAMES[lib])
    ax.annotate(_fmt_s(ys[-1]), (counts[-1], ys[-1]), xytext=(4, 0),
                textcoords="offset points", va="center", fontsize=7.5)
  ratio = med["orbax"][-1] / med["fnckpt"][-1]
  ax.set_title(f"{title}\nOrbax / fnckpt at {counts[-1]:,} leaves: {ratio:.0f}x")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xticks(counts, [f"{n:,}" for n in counts])
  ax.minorticks_off()
  ax.set_xlim(counts[0] / 1.3, counts[-1] * 2.2)
  ax.set_xlabel("leaves (4 KiB each, log scale)")


def small_leaves(out: str) -> None:
  path = _newest("*-small-scaling.json")
  with open(path) as f:
    d = json.load(f)
  fig, axes = plt.subplots(1, len(PANELS), figsize=(10, 4), sharey=True)
  for ax, (key, title) in zip(axes, PANELS):
    _scaling_panel(ax, d["times"], key, title)
  axes[0].set_ylabel("seconds (log scale; band: fastest to slowest run)")
  axes[0].legend(frameon=False, loc="upper left")
  fig.suptitle("Many small leaves: time against the number of leaves (float32, 4 KiB each, "
               "half replicated, half sharded 8 ways)", x=0.01, ha="left")
  load = "-".join(f"{x:.1f}" for x in d["load"])
  _note(fig, NOTE.format(src=f"{os.path.relpath(path, REPO)} ({d['command']}; medians of "
                         f"{d['runs']} runs in one process, {_when(d['date'])} UTC, "
                         f"{d['machine']['cores']} cores, load average {load})"))
  fig.subplots_adjust(left=0.07, right=0.98, top=0.8, bottom=0.2, wspace=0.12)
  _save(fig, os.path.join(out, "small_leaves.svg"))


# ------------------------------------------------------------------ plan_scale.svg

# (label, path into a plan_scale.py result, color, line style)
PLAN_LINES = (("save plan, first save", ("save", "plan_s_per_process"), COLORS["fnckpt"], "-"),
              ("save plan, later saves (cached)", ("save", "plan_s_per_process_steady"),
               COLORS["fnckpt"], ":"),
              ("restore plan (onto TP 4)", ("restore", "plan_s_per_process"), COLORS["raw"], "-"),
              ("format-1 planner, save (extrapolated)",
               ("before", "save_plan_s_per_process_extrapolated"), COLORS["limit"], "--"),
              ("format-1 planner, restore (extrapolated)",
               ("before", "restore_plan_s_per_process_extrapolated"), COLORS["limit"], "-."))


def plan_results() -> tuple[list[dict[str, Any]], str]:
  """The newest date's ``plan_scale.py`` results, by process count, and their file pattern."""
  files = glob.glob(os.path.join(RESULTS, "*-plan-scale-p*.json"))
  if not files:
    raise SystemExit(f"no *-plan-scale-p*.json in {RESULTS}")
  date = max(os.path.basename(f)[:10] for f in files)
  runs = []
  for f in files:
    if os.path.basename(f).startswith(date):
      with open(f) as fh:
        runs.append(json.load(fh))
  return sorted(runs, key=lambda r: r["processes"]), f"bench/results/{date}-plan-scale-p*.json"


def plan_scale(out: str) -> None:
  runs, src = plan_results()
  procs = [r["processes"] for r in runs]
  fig, ax = plt.subplots(figsize=(10, 4.6))
  for label, (a, b), color, style in PLAN_LINES:
    ax.plot(procs, [r[a][b] for r in runs], style, marker="o", markersize=3.5, color=color,
            label=label)
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xticks(procs, [f"{p:,}\n({p * runs[0]['devices_per_process']:,})" for p in procs])
  ax.minorticks_off()
  ax.set_xlabel("processes (devices), 8 devices per process")
  ax.set_ylabel("seconds per process (log scale)")
  ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
  ax.grid(axis="y", color="#e5e5e5")
  r = runs[-1]
  fig.suptitle(f"Planning cost per process against the process count\n70B-like AdamW state "
               f"({r['leaves']:,} leaves, {r['state_bytes'] / 1e9:,.0f} GB, FSDP x TP 8), "
               "simulated shardings; the slowest of 5 sampled processes, best of 3",
               x=0.01, ha="left")
  _note(fig, NOTE.format(src=f"{src} (python bench/plan_scale.py --processes P "
                         "--devices-per-process 8 --json FILE)"))
  fig.subplots_adjust(left=0.08, right=0.68, top=0.85, bottom=0.22)
  _save(fig, os.path.join(out, "plan_scale.svg"))


# ------------------------------------------------------------------ save_phases.svg

EVERY, PROC0 = "#dbe9f6", "#fde3c8"   # box fills: every process / process 0 only
CALLER_Y, WRITER_Y, LANE_H = 33.0, 17.0, 10.0

# (x0, x1, lane y, fill, text) of each phase, left to right
PHASES = (
    (12, 28, CALLER_Y, EVERY, "plan\nflatten; agree across\nprocesses; each leaf:\n"
                              "inline, pack, pieces\nor zarr array"),
    (29, 45, CALLER_Y, EVERY, "stage shards\ndevice→host copies\n(CPU: views), all started,\n"
                              "then waited for; within\nbudget_bytes"),
    (46, 55, CALLER_Y, EVERY, "return\nSaveHandle"),
    (46, 62, WRITER_Y, EVERY, "write chunks\nTensorStore zarr3 + crc32c,\neach hashed (XXH3-128);\n"
                              "zarr.json, pp/<process>"),
    (63, 73, WRITER_Y, PROC0, "manifest\n(process 0,\nwith every\nprocess's hashes)"),
    (76, 84, WRITER_Y, PROC0, "COMMIT\nmarker\n(process 0)"),
    (87, 99, WRITER_Y, EVERY, "handle.wait()\nreturns SaveStats\n(or raises, with\ne.outcome)"),
)
# (x, name, what every process has done on arriving)
BARRIERS = ((74.5, "written", "every process:\nits chunks durable"),
            (85.5, "committed", "COMMIT\nwritten"))
# (x0, x1, y, label) of the SaveStats spans, under the lanes
SPANS = ((12, 55, 5.7, "blocking_s: the caller waits"), (46, 63, 3.5, "write_s"),
         (63, 87, 3.5, "commit_s"), (12, 87, 0.9, "total_s"))


def _box(ax: Axes, x0: float, x1: float, y: float, fill: str, text: str,
         dashed: bool = False) -> None:
  ax.add_patch(FancyBboxPatch((x0, y - LANE_H / 2), x1 - x0, LANE_H,
                              boxstyle="round,pad=0,rounding_size=0.8", fc=fill,
                              ec="#777777" if dashed else "#333333", lw=0.8,
                              ls="--" if dashed else "-"))
  ax.text((x0 + x1) / 2, y, text, ha="center", va="center", fontsize=7.2, linespacing=1.25)


def _arrow(ax: Axes, a: tuple[float, float], b: tuple[float, float]) -> None:
  ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=9, lw=0.9,
                               color="#333333", shrinkA=0, shrinkB=0))


def _lanes(ax: Axes) -> None:
  for y, name in ((CALLER_Y, "caller thread\n(inside save())"),
                  (WRITER_Y, "background\nwriter thread")):
    ax.axhspan(y - LANE_H / 2 - 1, y + LANE_H / 2 + 1, color="#f6f6f6", zorder=0)
    ax.text(1, y, name, ha="left", va="center", fontsize=8.5, weight="bold")


def _phase_links(ax: Axes) -> None:
  caller = [p for p in PHASES if p[2] == CALLER_Y]
  writer = [p for p in PHASES if p[2] == WRITER_Y]
  for seq in (caller, writer):
    for a, b in zip(seq, seq[1:]):
      _arrow(ax, (a[1], a[2]), (b[0], b[2]))
  _arrow(ax, (44, CALLER_Y - LANE_H / 2), (50, WRITER_Y + LANE_H / 2))
  ax.text(47.6, 24.4, "staged chunks", fontsize=6.8, ha="left", style="italic")
  _box(ax, 29, 45, WRITER_Y, "white", "starts early when the budget\nfills: writes the first "
       "chunks\nand frees their budget", dashed=True)


def _barriers(ax: Axes) -> None:
  for x, name, done in BARRIERS:
    ax.plot([x, x], [WRITER_Y - LANE_H / 2 - 1, WRITER_Y + LANE_H / 2 + 4], color="#b22222",
            lw=1.2, ls="--")
    ax.text(x, WRITER_Y + LANE_H / 2 + 4.4, f"barrier\n'{name}'", ha="center", va="bottom",
            fontsize=7, color="#b22222")
    ax.text(x, WRITER_Y - LANE_H / 2 - 1.5, done, ha="center", va="top", fontsize=6.5,
            color="#b22222")


def _spans(ax: Axes) -> None:
  for x0, x1, y, label in SPANS:
    ax.annotate("", (x0, y), (x1, y), arrowprops={"arrowstyle": "|-|", "lw": 0.8,
                                                  "mutation_scale": 3, "color": "#555555"})
    ax.text((x0 + x1) / 2, y + 0.4, label, ha="center", va="bottom", fontsize=7,
            color="#333333", family="monospace")


def save_phases(out: str) -> None:
  fig, ax = plt.subplots(figsize=(10, 4.6))
  ax.set_xlim(0, 100)
  ax.set_ylim(-1, 45)
  ax.axis("off")
  _lanes(ax)
  for x0, x1, y, fill, text in PHASES:
    _box(ax, x0, x1, y, fill, text)
  _phase_links(ax)
  _barriers(ax)
  _spans(ax)
  ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, fc=EVERY, ec="#333333"),
                     plt.Rectangle((0, 0), 1, 1, fc=PROC0, ec="#333333"),
                     plt.Line2D([], [], color="#b22222", ls="--")],
            labels=["every process", "process 0 only", "all processes meet"],
            loc="upper right", ncol=3, frameon=False, bbox_to_anchor=(1, 1.02))
  fig.suptitle("A save's phases: fnckpt.save(tree, path) returns after staging; the rest "
               "runs in the background", x=0.01, ha="left")
  _note(fig, "Drawn by bench/charts.py from docs/concepts/async.md and commit.md "
        "(fnckpt/_save/save.py, writer.py). SaveStats fields in monospace. "
        "Time runs left to right, not to scale.")
  fig.subplots_adjust(left=0.01, right=0.99, top=0.9, bottom=0.08)
  _save(fig, os.path.join(out, "save_phases.svg"))


# ------------------------------------------------------------------ layout.svg

# (depth, name, what it is, written by) of each entry, in tree order
LAYOUT = (
    (0, "<path>/", "a checkpoint (in a CheckpointManager run: <run>/<step>/)", ""),
    (1, "manifest.msgpack", "the tree and every leaf's record; leaves up to 16 KiB inline",
     "process 0"),
    (1, "COMMIT", "written last: the manifest's SHA-256; without it, no checkpoint",
     "process 0"),
    (1, "data-<32 hex digits>/", "this save's data: a new random name per save (later saves "
     "with this one as base refer to it)", ""),
    (2, "a/<n>/", "leaf n (> 4 MiB or sharded across processes, shards > 1 MiB): a zarr v3 "
     "array", ""),
    (3, "zarr.json", "chunk = the saved shard; sharding_indexed, bytes (+ zstd/blosc), crc32c",
     "process 0"),
    (3, "c/<i>/<j>", "one object per chunk of the grid, written whole", "its shard's writer"),
    (2, "p/<process>/", "that process's pack: a 1-D uint8 zarr v3 array", ""),
    (3, "zarr.json", "1 MiB inner chunks, each with its crc32c", "that process"),
    (3, "c/<k>", "chunks of ≤ 64 MiB (16 MiB with pieces): leaves of 16 KiB-4 MiB,\n"
     "then pieces (device shards ≤ 1 MiB), as byte ranges", "that process"),
    (2, "q/<process>/<k>/", "saves with a base: a pack segment of changed packed leaves and "
     "piece runs (zarr.json, c/<k>)", "that process"),
    (2, "pp/<process>", "fnckpt.PerProcess values: msgpack with its SHA-256", "that process"),
)
ROW_H, INDENT = 1.0, 2.2


def _tree_lines(ax: Axes) -> None:
  """The connector of each entry to its parent (the nearest earlier entry one level up)."""
  for i, (depth, *_rest) in enumerate(LAYOUT):
    if depth == 0:
      continue
    parent = max(j for j in range(i) if LAYOUT[j][0] == depth - 1)
    x = (depth - 1) * INDENT + 0.6
    ax.plot([x, x, x + INDENT - 0.9], [-parent - 0.45, -i, -i], color="#888888", lw=0.8)


def layout(out: str) -> None:
  fig, ax = plt.subplots(figsize=(10, 4.6))
  ax.set_xlim(0, 40)
  ax.set_ylim(-len(LAYOUT) + 0.3, 1.6)
  ax.axis("off")
  _tree_lines(ax)
  for i, (depth, name, what, who) in enumerate(LAYOUT):
    is_dir = name.endswith("/")
    ax.text(depth * INDENT + 0.1, -i, name, va="center", fontsize=8.5,
            family="monospace", weight="bold" if is_dir else "normal",
            color=COLORS["fnckpt"] if is_dir else "#222222")
    ax.text(10.8, -i, what, va="center", fontsize=7.8)
    ax.text(39.8, -i, who, va="center", ha="right", fontsize=7.5, color="#666666",
            style="italic")
  ax.text(39.8, 1.0, "written by", ha="right", fontsize=7.5, color="#666666", weight="bold")
  fig.suptitle("A checkpoint directory, format 3 (one object per file on gs:// and s3://)",
               x=0.01, ha="left")
  _note(fig, "Drawn by bench/charts.py from docs/format.md (version 3); checked against "
        "`find` of a saved checkpoint (a 64 MiB sharded array, pieces, packed and inline "
        "leaves, a numpy leaf, PerProcess) and of an incremental save on it.")
  fig.subplots_adjust(left=0.01, right=0.99, top=0.9, bottom=0.1)
  _save(fig, os.path.join(out, "layout.svg"))


# ------------------------------------------------------------------ main

# ------------------------------------------------------------------ cost_per_call.svg

CALL_SERIES = (("before", "first_ms", "before: first save", "#b9cde3"),
               ("before", "steady_ms", "before: steady save", "#7fa6cf"),
               ("after", "first_ms", "plans once per structure: first save", "#5b8fc7"),
               ("after", "steady_ms", "plans once per structure: steady save", "#1f6fb4"),
               ("after", "floor_ms", "floor: np.asarray of every shard, same run", "#8c8c8c"))


def cost_per_call(out: str) -> None:
  """Blocked time per save call in a loop, before and after plans made once per structure
  (the newest ``*-call-cost.json`` of ``bench/call_cost.py --before``)."""
  path = _newest("*-call-cost.json")
  with open(path) as f:
    r = json.load(f)
  states = [row["state"] for row in r["after"]]
  fig, ax = plt.subplots(figsize=(9, 5.6))
  y, ticks, top = 0.0, [], 0.0
  for k, state in enumerate(states):
    ticks.append((y + 2, state))
    for arm, key, _, color in CALL_SERIES:
      v = r[arm][k][key]
      top = max(top, v)
      ax.barh(-y, v, height=0.8, color=color)
      ax.text(v * 1.04 + 0.3, -y, f"{v:.1f} ms", va="center", fontsize=7.5)
      y += 1
    y += 1
  ax.set_yticks([-t for t, _ in ticks],
                [f"{s}\n{int(r['after'][k]['arrays']):,} arrays" for k, (_, s) in enumerate(ticks)])
  ax.tick_params(axis="y", length=0)
  ax.set_xlim(0, top * 1.2)
  ax.set_xlabel("milliseconds the caller is blocked by fnckpt.save (shorter is better)")
  ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for *_, c in CALL_SERIES],
            labels=[lab for _, _, lab, _ in CALL_SERIES], loc="lower left",
            bbox_to_anchor=(0, 1.01), ncol=2, frameon=False)
  fig.suptitle("Cost per call: what a save in a training loop blocks for\n8 virtual CPU "
               f"devices, medians of saves 2+ over {r['rounds']} rounds per arm", x=0.01,
               ha="left")
  _note(fig, NOTE.format(src=f"{os.path.relpath(path, REPO)} (bench/call_cost.py --before)"))
  fig.subplots_adjust(left=0.16, right=0.97, top=0.76, bottom=0.13)
  _save(fig, os.path.join(out, "cost_per_call.svg"))


FIGURES: dict[str, Callable[[str], None]] = {
    "save_restore.svg": save_restore, "small_leaves.svg": small_leaves,
    "plan_scale.svg": plan_scale, "save_phases.svg": save_phases, "layout.svg": layout,
    "cost_per_call.svg": cost_per_call}


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default=os.path.join(REPO, "docs", "figures"),
                 help="directory to write the SVG files into (default: docs/figures)")
  a = p.parse_args(argv)
  os.makedirs(a.out, exist_ok=True)
  with plt.rc_context(STYLE):
    for name, draw in FIGURES.items():
      draw(a.out)
      print(os.path.join(a.out, name))


if __name__ == "__main__":
  main()
