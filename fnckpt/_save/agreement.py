"""Every process of a save passes the same tree: each process's leaves reduced to what must
agree (key path, a digest of the record without its values, what holds it), compared with
process 0's through the coordination service. A reused plan carries its entries (all but the
plain values'), and the processes exchange one digest; the whole list only when they differ,
to name the first differing leaf."""

from __future__ import annotations

import hashlib
import zlib

import jax
import msgpack

from .._errors import CheckpointError
from .._format import records as _records
from .._io import collective as _collective

__all__ = ["Entry", "agree", "entries", "entry"]

Entry = tuple[str, str, str]  # (key path, digest, brief)


def entry(rec: _records.Leaf, held: str | None, data_dir: str) -> Entry:
  """What the processes compare of one leaf (its ``stored`` directory relative to the save's
  ``data_dir``: a reused plan's records were made for another save's)."""
  digest = hashlib.sha256(_skeleton(rec, data_dir) + str(held).encode()).hexdigest()[:16]
  return (rec.where, digest, _brief(rec) + (f" ({_HELD[held]})" if held else ""))


def entries(
  records: tuple[_records.Leaf, ...], holders: list[str | None], data_dir: str
) -> list[Entry]:
  """:func:`entry` of every leaf."""
  return [entry(r, h, data_dir) for r, h in zip(records, holders)]


def agree(session: _collective.Session, mine: list[Entry]) -> None:
  """Every process saves the same tree (key paths, kinds, shapes, dtypes, shardings, what is
  inline): process 0 publishes its entries and their digest; the others compare the digest
  with theirs, and where it differs, the entries, naming the first differing key path (a
  difference fails every process: save() publishes the error; the others raise it at the
  'agreed' barrier)."""
  if not session.multi:
    return
  digest = hashlib.sha256(msgpack.packb([m[:2] for m in mine])).digest()
  if jax.process_index() == 0:  # (its entries first: a process that differs reads them)
    session.share("tree-entries", zlib.compress(msgpack.packb(mine), 1))
  if session.share("tree", digest) != digest:
    shared = session.share("tree-entries", b"")
    theirs = [tuple(x) for x in msgpack.unpackb(zlib.decompress(shared), use_list=False)]
    raise CheckpointError(_disagreement(session.location, mine, theirs))
  session.barrier("agreed")


def _skeleton(rec: _records.Leaf, data_dir: str) -> bytes:
  """What every process must agree on for one leaf: the record without its values."""
  keep = _records.encode(rec)
  for k in ("value", "pack", "subtype"):
    keep.pop(k, None)
  if "inline" in keep:
    keep["inline"] = True
  if "store" in keep:
    keep["store"] = {**keep["store"], "dir": keep["store"]["dir"].removeprefix(data_dir)}
  return msgpack.packb(keep, use_bin_type=True)


_HELD = {
  "host": "numpy",
  "local": "on this process only",
  "all": "on every process",
  "some": "on some processes",
}


def _brief(rec: _records.Leaf) -> str:
  """A leaf as a disagreement shows it, e.g. ``jax float32[64, 128] P('x', None) on mesh
  {'x': 2, 'y': 4}``."""
  parts = [rec.source or rec.kind] + ([rec.type] if rec.type is not None else [])
  if rec.dtype is not None:
    parts.append(f"{rec.dtype}{list(rec.shape)}" if rec.shape is not None else rec.dtype)
  sharding = rec.sharding
  if sharding is not None and sharding.type == "named":
    spec = ", ".join(repr(e) for e in sharding.spec)
    parts.append(f"P({spec}) on mesh {dict(zip(sharding.axes, sharding.sizes))}")
  elif sharding is not None:
    parts.append(f"{sharding.type} sharding")
  return " ".join(map(str, parts))


def _disagreement(location: str, mine, theirs) -> str:
  """The first difference between this process's leaves and process 0's, each a (key path,
  digest, brief)."""
  me = jax.process_index()
  first = next(
    (i for i, (a, b) in enumerate(zip(mine, theirs)) if a[:2] != b[:2]), min(len(mine), len(theirs))
  )
  a = mine[first] if first < len(mine) else None
  b = theirs[first] if first < len(theirs) else None
  if a is not None and b is not None and a[0] == b[0]:
    what = (
      f"the leaf at {a[0]} is {a[2]} on process {me} but {b[2]} on process 0"
      if a[2] != b[2]
      else f"the leaf at {a[0]} ({a[2]}) is stored differently on "
      f"process {me} than on process 0 (what is inline, or the chunk layout)"
    )
  elif b is not None and b[0] not in {m[0] for m in mine}:
    what = f"process 0 has a leaf at {b[0]} ({b[2]}) that process {me} lacks" + (
      f" (it has {a[0]} there)" if a is not None else ""
    )
  elif a is not None and a[0] not in {t[0] for t in theirs}:
    what = f"process {me} has a leaf at {a[0]} ({a[2]}) that process 0 lacks" + (
      f" (it has {b[0]} there)" if b is not None else ""
    )
  else:
    what = (
      f"leaf #{first} is {a[0] if a else '<none>'} on process {me} but "
      f"{b[0] if b else '<none>'} on process 0 (the same keys in another order)"
    )
  return (
    f"Saving to {location!r}: processes {me} and 0 passed different trees: {what}. "
    "Every process must pass the same tree structure, shapes, dtypes and shardings to "
    "save (values of non-global leaves may differ; process 0's are kept; wrap "
    "per-process values in fnckpt.PerProcess). Nothing was written."
  )
