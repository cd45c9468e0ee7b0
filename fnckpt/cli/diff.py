"""``fnckpt diff A B``: key paths only in A (-), only in B (+), changed in kind, dtype or shape
(~); with ``--values``, leaves whose values differ (!), arrays compared bitwise through the one
reader, block by block, each checkpoint in half the read window."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any, Iterator, Sequence

import numpy as np

from .._errors import CheckpointError
from .._format import leaves as _leaves
from .._format import records as _records
from .._format import tree as _tree
from .._io import commit as _commit
from .._layout import blocks as _blocks
from .._layout import chunks as _chunks
from .._sources import read as _read
from .._sources import source as _source
from .perprocess_values import read_values, values_under
from .text import cause, compact, desc

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
  src_a = _source.open_source(args.a, args.storage_options)
  src_b = _source.open_source(args.b, args.storage_options)
  recs_a = {_tree.match_key(r.path): r for r in src_a.manifest.leaves}
  recs_b = {_tree.match_key(r.path): r for r in src_b.manifest.leaves}
  lines = []
  for key, rec in recs_a.items():
    if key not in recs_b:
      lines.append(f"- {_tree.keystr(rec.path)}: {desc(rec)}")
  for key, rec in recs_b.items():
    if key not in recs_a:
      lines.append(f"+ {_tree.keystr(rec.path)}: {desc(rec)}")
  same_structure = []
  for key, ra in recs_a.items():
    rb = recs_b.get(key)
    if rb is None:
      continue
    if desc(ra) != desc(rb) or ra.impl != rb.impl:
      lines.append(f"~ {_tree.keystr(ra.path)}: {desc(ra)} -> {desc(rb)}")
    else:
      same_structure.append((ra, rb))
  if args.values:
    lines += _value_lines(src_a, src_b, same_structure)
  if not lines:
    what = "trees and values" if args.values else "trees (key paths, kinds, dtypes, shapes)"
    print(f"{src_a.location} and {src_b.location}: same {what}.")
    return 0
  print(f"--- {src_a.location}\n+++ {src_b.location}")
  print("\n".join(lines))
  return 1


def _value_lines(
  src_a: _source.Source, src_b: _source.Source, pairs: Sequence[tuple[_records.Leaf, _records.Leaf]]
) -> list[str]:
  """``!`` lines for the leaves (of the same structure) whose values differ. A read that
  fails because either checkpoint changed meanwhile is that CheckpointError, as in restore."""
  arrays = [(k, ra, rb) for k, (ra, rb) in enumerate(pairs) if ra.kind in ("array", "key")]
  differ, lines = _array_texts(src_a, src_b, arrays), []
  for k, (ra, rb) in enumerate(pairs):
    if ra.kind in ("array", "key"):
      text = differ.get(k)
    else:
      try:
        text = _values_differ(src_a, ra, src_b, rb)
      except Exception as e:
        text = _cannot_compare(e, src_a, src_b)
    if text:
      lines.append(f"! {_tree.keystr(ra.path)}: values differ ({text})")
  man_a, man_b = src_a.manifest, src_b.manifest
  if man_a.metadata != man_b.metadata:
    lines.append(f"! metadata: {compact(man_a.metadata)} -> {compact(man_b.metadata)}")
  return lines


def _cannot_compare(e: BaseException, *srcs: _source.Source) -> str:
  for src in srcs:
    if not _commit.unchanged(src.kv, src.commit):
      raise _commit.changed_error(src.location) from None
  return f"cannot compare: {str(e) if isinstance(e, CheckpointError) else cause(e)}"


def _array_texts(
  src_a: _source.Source,
  src_b: _source.Source,
  pairs: Sequence[tuple[int, _records.Leaf, _records.Leaf]],
) -> dict[int, str]:
  """Pair number -> how its two arrays (one shape and dtype) differ, bitwise, for those that
  do. All pairs are read in one stream per checkpoint (a pack's inner chunk several leaves
  share is read once), the same C-order blocks on both sides, each side in half the window."""
  opener_a, opener_b = _read.Opener(src_a), _read.Opener(src_b)
  out, opened = {}, []
  for k, ra, rb in pairs:
    try:
      opened.append((k, opener_a.leaf(ra), opener_b.leaf(rb)))
    except Exception as e:
      out[k] = _cannot_compare(e, src_a, src_b)
  differ = {k: 0 for k, _, _ in opened}
  failed: dict[Any, BaseException] = {}
  window = _source.READ_WINDOW_BYTES
  side_a, side_b = (
    _read.read_regions(
      _regions(opened, side, window // 8), _read.Window(window // 2), errors="yield"
    )
    for side in (1, 2)
  )
  for a, b in zip(side_a, side_b):
    k, error = a.region.tag, a.error or b.error
    if error is not None:
      failed.setdefault(k, error)
    elif k not in failed:
      assert a.data is not None and b.data is not None  # (no error)
      differ[k] += _count_different(a.data, b.data)
  for k, leaf, _ in opened:
    if k in failed:
      out[k] = _cannot_compare(failed[k], src_a, src_b)
    elif differ[k]:
      out[k] = f"{differ[k]} of {math.prod(leaf.shape)} elements differ"
  return out


def _regions(opened: list[tuple[int, Any, Any]], side: int, limit: int) -> Iterator[_read.Region]:
  """One side's blocks of every pair (the first side's inner chunks align both)."""
  for k, leaf_a, leaf_b in opened:
    leaf, size = (leaf_a, leaf_b)[side - 1], leaf_a.dtype.itemsize
    for index in _blocks.blocks(leaf_a.shape, size, limit, leaf_a.align):
      yield _read.Region(leaf, index, _chunks.nbytes([b - a for a, b in index], size), k)


def _count_different(a: np.ndarray, b: np.ndarray) -> int:
  """Elements whose bytes differ (bitwise: NaN equals the same NaN, -0.0 differs from 0.0)."""
  itemsize = a.dtype.itemsize
  a8 = np.ascontiguousarray(a).view(np.uint8).reshape(-1, itemsize)
  b8 = np.ascontiguousarray(b).view(np.uint8).reshape(-1, itemsize)
  return int(np.any(a8 != b8, axis=1).sum())


def _per_process_differ(
  src_a: _source.Source, rec_a: _records.Leaf, src_b: _source.Source, rec_b: _records.Leaf
) -> str | None:
  """Per-process values compared process by process (by saved records, bitwise)."""
  n_a, n_b = src_a.manifest.process_count, src_b.manifest.process_count
  if n_a != n_b:
    return f"saved by {n_a} -> {n_b} processes"
  differ = [
    p
    for p in range(n_a)
    if values_under(read_values(src_a, p), rec_a.path)
    != values_under(read_values(src_b, p), rec_b.path)
  ]
  return f"the values of process(es) {differ} differ" if differ else None


def _values_differ(
  src_a: _source.Source, rec_a: _records.Leaf, src_b: _source.Source, rec_b: _records.Leaf
) -> str | None:
  """How two saved values (not arrays) differ, or None."""
  if rec_a.kind == "perprocess":
    return _per_process_differ(src_a, rec_a, src_b, rec_b)
  va, vb = (_leaves.decode_value(r) for r in (rec_a, rec_b))
  if rec_a.kind == "npgen":
    va, vb = va.bit_generator.state, vb.bit_generator.state
    same = json.dumps(va, default=repr, sort_keys=True) == json.dumps(
      vb, default=repr, sort_keys=True
    )
  elif isinstance(va, float) and isinstance(vb, float):
    same = np.float64(va).tobytes() == np.float64(vb).tobytes()
  else:
    same = type(va) is type(vb) and va == vb
  return None if same else f"{compact(va, 30)} -> {compact(vb, 30)}"
