"""PURE: where a pieced leaf's chunks lie in the packs (docs/format.md "Pieces", "Version 3").

Format 2 computes it (rule 2: each writing process's pieces region, ``Manifest.layout``);
format 3 records it: ``Pieces.runs`` holds, for each process writing at least one chunk of the
leaf (rule 1, increasing process index), the pack and offset its chunks lie from, back to
back in increasing chunk number. :func:`locate` answers for both; :func:`pieces_runs` and
:func:`writer_runs` read a format-3 record's runs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .records import Leaf, Manifest

__all__ = ["RUN", "Run", "group", "writers", "pieces_runs", "writer_runs", "locate"]

# One run of ``Pieces.runs``: pack index u32 LE, byte offset u64 LE (12 bytes, unaligned).
RUN = np.dtype([("pack", "<u4"), ("offset", "<u8")])


class Run(NamedTuple):
  """One writer's chunks of a pieced leaf: bytes ``[lo, hi)`` of pack ``pack``."""

  process: int
  pack: int
  lo: int
  hi: int


def group(manifest: Manifest, leaf: Leaf) -> Any:
  """The layout group of pieced ``leaf``: ``writers`` (the process writing each chunk, C
  order over the chunk grid), ``rank`` (each chunk's number among its writer's) and
  ``counts`` (chunks per process)."""
  lay = manifest.layout
  return lay.groups[lay.group_of[lay.position[leaf.index]]]


def writers(manifest: Manifest, leaf: Leaf) -> np.ndarray:
  """The processes writing at least one chunk of pieced ``leaf``, increasing (int64)."""
  return np.flatnonzero(group(manifest, leaf).counts)


def pieces_runs(manifest: Manifest, leaf: Leaf) -> tuple[np.ndarray, np.ndarray]:
  """(pack index, byte offset) of each writer's run of a format-3 pieced ``leaf``, writers in
  increasing process order (:func:`writers`), both int64 (parsing bounded the offsets).

  >>> import types
  >>> rec = types.SimpleNamespace(pieces=types.SimpleNamespace(
  ...     runs=np.array([(1, 64), (0, 8)], RUN).tobytes()))
  >>> [a.tolist() for a in pieces_runs(None, rec)]
  [[1, 0], [64, 8]]
  """
  del manifest  # (the runs are the record's own; the manifest's packs are what they index)
  assert leaf.pieces is not None and leaf.pieces.runs is not None
  runs = np.frombuffer(leaf.pieces.runs, dtype=RUN)
  return runs["pack"].astype(np.int64), runs["offset"].astype(np.int64)


def writer_runs(manifest: Manifest, leaf: Leaf) -> list[Run]:
  """Each writer's run of pieced ``leaf`` (format 2 or 3) as one byte range of its pack: the
  unit a format-3 ``Pieces.hashes`` entry covers."""
  procs = writers(manifest, leaf)
  counts = group(manifest, leaf).counts[procs]
  size = manifest.layout.leaf(leaf.index).nbytes
  assert leaf.pieces is not None
  if leaf.pieces.runs is not None:
    packs, starts = pieces_runs(manifest, leaf)
  else:
    packs = np.array([manifest.pack_of(p) for p in procs.tolist()], np.int64)
    starts = np.array(
      [
        manifest.packs[k].pieces + manifest.layout.mine(leaf.index, p)[1]
        for k, p in zip(packs.tolist(), procs.tolist())
      ],
      np.int64,
    )
  return [
    Run(p, k, lo, lo + n * size)
    for p, k, lo, n in zip(procs.tolist(), packs.tolist(), starts.tolist(), counts.tolist())
  ]


def locate(manifest: Manifest, leaf: Leaf, numbers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(pack index, byte offset in it) of chunks ``numbers`` (C order over the chunk grid) of
  pieced ``leaf``: format 3 from its recorded runs, format 2 from the pieces regions."""
  numbers = np.asarray(numbers, np.int64)
  assert leaf.pieces is not None
  if leaf.pieces.runs is None:
    procs, offsets = manifest.layout.locate(leaf.index, numbers)
    packs = np.array([manifest.pack_of(p) for p in procs.tolist()], np.int64)
    base = np.array([manifest.packs[k].pieces for k in packs.tolist()], np.int64)
    return packs, base + offsets
  g = group(manifest, leaf)
  procs = g.writers[numbers]
  w = np.searchsorted(writers(manifest, leaf), procs)
  packs, starts = pieces_runs(manifest, leaf)
  size = manifest.layout.leaf(leaf.index).nbytes
  return packs[w], starts[w] + g.rank[numbers] * size
