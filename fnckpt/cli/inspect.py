"""``fnckpt inspect PATH``: one checkpoint's saved tree (key path, kind, dtype, shape, saved
sharding, bytes, where the bytes are or the value), and how much of it this save wrote."""

from __future__ import annotations

import argparse
import json
from typing import cast

import numpy as np

from .._format import leaves as _leaves
from .._format import manifest as _manifest
from .._format import records as _records
from .._format import refs as _refs
from .._format import tree as _tree
from .._sources import read as _read
from .._sources import source as _source
from .text import compact, human, table, when
from .text import lineage as lineage_text
from .text import shape as shape_text
from .text import sharding as sharding_text

__all__ = ["run"]


def value_text(rec: _records.Leaf) -> str:
  """Where a leaf's bytes are, or its value."""
  kind = rec.kind
  if kind in ("array", "key"):
    if rec.inline is not None:
      assert rec.dtype is not None
      value = np.frombuffer(rec.inline, dtype=_leaves.dtype_of(rec.dtype))
      text = np.array2string(
        value.reshape(rec.shape), threshold=8, edgeitems=2, separator=", "
      ).replace("\n", "")
      return f"inline {compact(text, -60)}"
    if rec.packed is not None:
      return f"pack {rec.packed.pack} bytes {rec.packed.offset}+{rec.packed.nbytes}"
    if rec.pieces is not None:
      return f"pieces {shape_text(rec.pieces.chunks)} in the packs (mesh {rec.pieces.mesh})"
    store = rec.stored
    assert store is not None
    blosc = dict(store.blosc or ())
    return (
      f"{store.dir}/ chunks {shape_text(store.chunks)}"
      + (f" zstd {store.zstd}" if store.zstd else "")
      + (f" blosc {blosc['cname']} {blosc['shuffle']}" if blosc else "")
    )
  if kind == "npgen":
    return f"numpy Generator ({rec.value['bit_generator']})"
  if kind == "empty":
    return {"none": "None", "dict": "{}", "list": "[]", "tuple": "()"}[cast(str, rec.type)]
  if kind == "perprocess":
    return "fnckpt.PerProcess: one value per saving process (in pp/<process>)"
  return compact(_leaves.decode_value(rec))


def run(args: argparse.Namespace) -> int:
  src = _source.open_source(args.path, args.storage_options)
  location, manifest = src.location, src.manifest
  commit = _manifest.decode_commit(src.commit, location)
  v = manifest.versions
  print(
    f"{location}: fnckpt format {manifest.version}, written by fnckpt "
    f"{v.get('fnckpt', '?')} (jax {v.get('jax', '?')}, tensorstore "
    f"{v.get('tensorstore', '?')}) on {manifest.process_count} process(es); "
    f"created {when(manifest.created)}, committed "
    f"{when(commit.get('committed'))}"
  )
  if manifest.metadata is not None:
    print(f"metadata: {json.dumps(manifest.metadata, default=repr)}")
  if manifest.fork is not None:
    print(f"lineage: {lineage_text(src)}")
  rows = [["KEY PATH", "KIND", "DTYPE", "SHAPE", "SAVED SHARDING", "BYTES", "STORED / VALUE"]]
  for rec in manifest.leaves:
    if rec.kind in ("array", "key"):
      assert rec.dtype is not None and rec.shape is not None
      dtype = rec.dtype + (f" ({rec.impl})" if rec.kind == "key" else "")
      base = _read.base_of(manifest, rec)
      where = value_text(rec) + (
        f" <- reused from {_refs.display(location, manifest.bases[base].dir)}"
        if base is not None
        else ""
      )
      rows.append(
        [
          _tree.keystr(rec.path),
          rec.kind,
          dtype,
          shape_text(rec.shape),
          sharding_text(rec),
          human(rec.nbytes),
          where,
        ]
      )
    else:
      t = rec.type or rec.dtype or "-"
      rows.append([_tree.keystr(rec.path), rec.kind, str(t), "-", "-", "-", value_text(rec)])
  print(table(rows))
  _summary(manifest)
  return 0


def _summary(manifest: _records.Manifest) -> None:
  """How many leaves are stored how, and (with references) what this save wrote."""
  leaves = manifest.leaves
  total = sum(r.nbytes for r in leaves if r.kind in ("array", "key"))
  arrays = sum(1 for r in leaves if r.is_array)
  stored = sum(1 for r in leaves if r.stored is not None)
  packed = sum(1 for r in leaves if r.packed is not None)
  pieced = sum(1 for r in leaves if r.pieces is not None)
  print(
    f"{len(leaves)} leaves ({arrays} arrays: {stored} stored in their own "
    f"arrays, {packed} in {len(manifest.packs)} pack(s)"
    + (f", {pieced} as pieces in the packs" if pieced else "")
    + f"), {human(total)} of array data"
  )
  reused = [r for r in leaves if _read.base_of(manifest, r) is not None]
  if reused or manifest.bases:
    kept = sum(r.nbytes for r in reused)
    print(
      f"written by this save: {human(total - kept)} in "
      f"{arrays - len(reused)} array(s); reused (references to {len(manifest.bases)} "
      f"earlier checkpoint(s)): {human(kept)} in {len(reused)} array(s)"
    )
