"""``fnckpt ls DIR``: the steps of a run directory (or one checkpoint), with their status,
sizes, leaves, files, commit time and metrics; with ``--local``, both tiers."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .._errors import CheckpointError
from .._format import manifest as _manifest
from .._io import paths as _paths
from .._manager import fork as _fork
from .._manager import steps as _steps
from .._sources import read as _read
from .._sources import source as _source
from .text import compact, human, table, when
from .text import lineage as lineage_text

__all__ = ["run"]

HEADER = ["STEP", "STATUS", "DATA", "WRITTEN", "LEAVES", "FILES", "COMMITTED", "METRICS"]


def run(args: argparse.Namespace) -> int:
  root, options = args.dir, args.storage_options
  keys = _paths.list_keys(_paths.Location.of(root, options))
  if args.local is None and (_manifest.COMMIT in keys or _manifest.MANIFEST in keys):
    print(f"{_paths.display(root)} is a single checkpoint (not a run directory):")
    rows, lineage = _step_rows([(".", root)], keys, options)
    print(table([HEADER] + rows))
    if lineage:
      print(f"this checkpoint is a {lineage}")
    return 0
  if args.local is not None and (
    not keys or _manifest.COMMIT in keys or _manifest.MANIFEST in keys
  ):
    what = "holds nothing" if not keys else "is a single checkpoint"
    print(
      f"{_paths.display(root)!r} {what}, not a run directory: with --local, DIR must be "
      "the manager's durable directory (check the path).",
      file=sys.stderr,
    )
    return 1
  local_options = None  # the durable tier's --storage-option settings are not the local tier's
  tiers = [("durable", root, keys, options)] + (
    [
      (
        "local",
        args.local,
        _paths.list_keys(_paths.Location.of(args.local, local_options)),
        local_options,
      )
    ]
    if args.local is not None
    else []
  )
  rows, notes, restorable, lineage = [], [], set(), ""
  for tier, location, tier_keys, options in tiers:
    run = _paths.Location.of(location, options)
    listing = _steps.StepIndex(run).list()
    restorable |= set(listing.steps)
    tier_rows, found = _step_rows(
      [(str(s), _paths.join(location, str(s))) for s in listing.steps], tier_keys, options
    )
    lineage = lineage or _fork.lineage(run) or found
    rows += [
      ([tier] if len(tiers) > 1 else []) + r for r in tier_rows + _other_rows(listing, tier_keys)
    ]
    notes.append(
      f"{len(listing.steps)} committed, {len(listing.uncommitted)} uncommitted"
      + (f", {len(listing.damaged)} marked damaged" if listing.damaged else "")
      + (f", {len(listing.held)} referenced" if listing.held else "")
      + (f" in {tier} {_paths.display(location)}" if len(tiers) > 1 else "")
    )
  if not rows:
    print(f"No checkpoints under {_paths.display(root)!r}.", file=sys.stderr)
    return 1
  rows.sort(key=lambda r: int(r[1] if len(tiers) > 1 else r[0]))
  print(table([(["TIER"] if len(tiers) > 1 else []) + HEADER] + rows))
  if lineage:
    print(f"this run is a {lineage}")
  forks = [k for k in keys if k.startswith(_fork.FORKS + "/")]
  if forks:
    print(f"{len(forks)} fork(s) of this run refer to its data (records in {_fork.FORKS}/)")
  latest = f"; latest: {max(restorable)}" if restorable else ""
  print("; ".join(notes) + latest)
  return 0


def _files_of(keys: list[str], name: str) -> str:
  return str(sum(1 for k in keys if k.partition("/")[0] == name) if name != "." else len(keys))


def _other_rows(listing: _steps.Listing, keys: list[str]) -> list[list[str]]:
  """``ls`` rows of a tier's steps marked damaged, leftovers and referenced (deleted) steps."""
  return (
    [
      [
        str(s),
        "DAMAGED",
        "-",
        "-",
        "-",
        "-",
        "-",
        f"marked damaged ({compact(d, 60)})"
        f"; skipped by the manager; manager.delete({s}) removes it",
      ]
      for s, d in sorted(listing.damaged.items())
    ]
    + [
      [
        str(s),
        "UNCOMMITTED",
        "-",
        "-",
        "-",
        _files_of(keys, str(s)),
        "-",
        "interrupted save: ignored; CheckpointManager.cleanup() removes it",
      ]
      for s in listing.uncommitted
    ]
    + [
      [
        str(s),
        "referenced",
        "-",
        "-",
        "-",
        _files_of(keys, str(s)),
        "-",
        "deleted step: data kept while later steps or forks refer to it",
      ]
      for s in listing.held
    ]
  )


def _step_rows(
  steps: list[tuple[str, str]], keys: list[str], options: dict[str, Any] | None
) -> tuple[list[list[str]], str]:
  """One ``ls`` row per committed checkpoint (``DAMAGED`` where it cannot be opened), and
  the lineage of the first forked one ('' if none)."""
  rows, lineage = [], ""
  for name, path in steps:
    try:
      src = _source.open_source(path, options)
    except CheckpointError as e:
      rows.append([name, "DAMAGED", "-", "-", "-", _files_of(keys, name), "-", str(e)])
      continue
    manifest, commit = src.manifest, _manifest.decode_commit(src.commit, src.location)
    meta = manifest.metadata
    metrics = meta.get("metrics") if isinstance(meta, dict) else None
    metric_text = (
      ", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
      if isinstance(metrics, dict)
      else "-"
    )
    leaves = manifest.leaves
    lineage = lineage or lineage_text(src)
    own = sum(r.nbytes for r in leaves if _read.base_of(manifest, r) is None)
    rows.append(
      [
        name,
        "committed",
        human(sum(r.nbytes for r in leaves)),
        human(own),
        str(len(leaves)),
        _files_of(keys, name),
        when(commit.get("committed")),
        metric_text,
      ]
    )
  return rows, lineage
