"""How the ``fnckpt`` command writes things: sizes, times, tables, shapes, shardings, values,
the cause of a failed read, regions and lineage."""

from __future__ import annotations

import time
from typing import Any, Sequence, cast

from .._format import records as _records
from .._format import refs as _refs
from .._io import paths as _paths
from .._layout import chunks as _chunks
from .._sources import source as _source

__all__ = [
  "human",
  "when",
  "table",
  "shape",
  "sharding",
  "compact",
  "cause",
  "region",
  "lineage",
  "desc",
]


def human(n: float | None) -> str:
  """Bytes as people read them.

  >>> human(512), human(3 << 20), human(None)
  ('512 B', '3.0 MiB', '-')
  """
  if n is None:
    return "-"
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if n < 1024 or unit == "TiB":
      return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return str(n)


def when(t: float | None) -> str:
  return "-" if not t else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def table(rows: Sequence[Sequence[str]]) -> str:
  """Rows as left-aligned columns.

  >>> print(table([["A", "BB"], ["ccc", "d"]]))
  A    BB
  ccc  d
  """
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def shape(dims: Sequence[int]) -> str:
  return "(" + ", ".join(str(n) for n in dims) + ("," if len(dims) == 1 else "") + ")"


def sharding(rec: _records.Leaf) -> str:
  s = rec.sharding
  if s is None:
    return "host" if rec.is_array else "-"
  if s.type != "named":
    return "single device" if s.type == "single" else s.type
  spec = ", ".join(
    "None"
    if e is None
    else repr(e)
    if isinstance(e, str)
    else "(" + ", ".join(repr(x) for x in e) + ")"
    for e in s.spec
  )
  mesh = ",".join(f"{a}={n}" for a, n in zip(s.axes, s.sizes))
  return f"P({spec}) mesh({mesh})"


def compact(value: Any, limit: int = 60) -> str:
  """``repr(value)`` (a str as is, when ``limit`` < 0) cut to ``abs(limit)`` characters."""
  text = value if isinstance(value, str) and limit < 0 else repr(value)
  limit = abs(limit)
  return text if len(text) <= limit else text[: limit - 3] + "..."


# TensorStore appends the spec of the array to some errors; the spec names the codecs
# (crc32c included) and paths, so no word in it says what went wrong.
def cause(e: BaseException) -> str:
  """What a failed open or read means (:func:`_paths.read_failure`), with TensorStore's text."""
  text = _paths.error_text(e)
  what = {
    "checksum": "checksum mismatch (corrupt data)",
    "missing": "missing data",
    "corrupt": "corrupt data (cannot be decoded)",
    "metadata": "its zarr.json does not match the manifest",
  }.get(_paths.read_failure(e))
  return f"{what} [{text}]" if what else f"{type(e).__name__}: {text}"


def region(index: _chunks.Index) -> str:
  """
  >>> region(((0, 32), (24, 48)))
  '[0:32, 24:48]'
  """
  return "[" + ", ".join(f"{a}:{b}" for a, b in index) + "]"


def lineage(src: _source.Source) -> str:
  fork = src.manifest.fork
  if fork is None:
    return ""
  return f"fork of run {_refs.display(src.location, fork.run)!r} at step {fork.step}"


def desc(rec: _records.Leaf) -> str:
  """A leaf's kind, dtype and shape as diff compares them."""
  if rec.kind in ("array", "key"):
    what = "key" if rec.kind == "key" else "array"
    return f"{what} {rec.dtype}{list(cast(tuple, rec.shape))}"
  if rec.kind == "scalar":
    return cast(str, rec.type)
  if rec.kind == "perprocess":
    return "fnckpt.PerProcess"
  return rec.kind if rec.kind != "empty" else f"empty {rec.type}"
