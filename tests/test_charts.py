"""``bench/charts.py`` draws the documentation's figures from the committed results: every
figure is written, is an SVG with its title, and a second run writes the same bytes."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

import matplotlib  # noqa: F401  (the docs extra, which the README's test command installs)

REPO = pathlib.Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
TITLES = {
    "save_restore.svg": "Transformer-like state: save and restore, fnckpt vs Orbax",
    "small_leaves.svg": "Many small leaves: time against the number of leaves",
    "plan_scale.svg": "Planning cost per process against the process count",
    "save_phases.svg": "A save's phases",
    "layout.svg": "A checkpoint directory, format 3",
    "cost_per_call.svg": "Cost per call: what a save in a training loop blocks for",
}


def _draw(out: pathlib.Path) -> dict[str, bytes]:
  env = {**os.environ, "MPLBACKEND": "Agg"}
  subprocess.run([sys.executable, str(REPO / "bench" / "charts.py"), "--out", str(out)],
                 check=True, cwd=REPO, env=env, capture_output=True, timeout=120)
  return {p.name: p.read_bytes() for p in out.iterdir()}


def test_charts_written_parseable_and_deterministic(tmp_path):
  first = _draw(tmp_path / "a")
  assert sorted(first) == sorted(TITLES)
  for name, data in first.items():
    root = ET.fromstring(data)
    assert root.tag.endswith("svg"), name
    assert TITLES[name] in " ".join("".join(root.itertext()).split()), name
  second = _draw(tmp_path / "b")
  assert [n for n in first if first[n] != second[n]] == []


def test_markdown_and_json_reports_agree():
  """The report's two forms (run.py writes both) give the same figures: the JSON medians
  rounded as the markdown prints them (3 significant digits)."""
  sys.path.insert(0, str(REPO))
  from bench import charts
  stem = RESULTS / "2026-11-26-smallleaves-after"
  md = charts.report_from_markdown(f"{stem}.md", "small")
  js = charts.report_from_json(f"{stem}.json", "small")
  assert md is not None and js is not None
  assert (md.date, md.mode, md.runs, md.leaves) == (js.date, js.mode, js.runs, js.leaves)
  assert set(md.values) == set(js.values) == set(charts.DRAWN)
  for row in charts.DRAWN:
    for col, v in js.values[row].items():
      assert v is not None and md.values[row][col] == pytest.approx(v, rel=0.01), (row, col)


def test_newest_full_report_is_the_cited_one():
  sys.path.insert(0, str(REPO))
  from bench import charts
  r = charts.newest_full_report(str(RESULTS))
  assert (r.mode, r.leaves) == ("full", 260)
  assert r.date >= "2026-11-23-180635"
