"""PURE: the field checks every part of manifest parsing uses (:mod:`fnckpt._format.parse`,
:mod:`fnckpt._format.parse_arrays`): :class:`_Bad` (a field is invalid) and ``_req``, typed
fields (integers in a range, bounded strings and lists, maps with exactly the known keys,
hashes, dtypes, shapes), storage directories (:func:`check_dir`) and references to other
checkpoints (:func:`check_rel`), a ``base`` index, and ``_error``, the manifest's one
:class:`CheckpointError`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from .._errors import CheckpointError
from .records import _NAME, DTYPES, HASH_BYTES, MAX_DIMS, MAX_ELEMENTS, MAX_UP, Base


class _Bad(Exception):
  """A field is invalid: raised inside parsing, turned into a CheckpointError naming the leaf.
  ``whole``: the message is about the record itself ("it lacks 'data'"), not one of its
  fields ("'created' must be ...", which the manifest's error words "its 'created' ...")."""

  def __init__(self, message: str, whole: bool = False):
    super().__init__(message)
    self.whole = whole


def _req(cond: bool, what: str | Callable[[], str], whole: bool = False) -> None:
  """Raise ``_Bad(what)`` unless ``cond``; a callable ``what`` is only formatted on failure
  (messages quote the offending value: formatting them eagerly cost more than parsing)."""
  if not cond:
    raise _Bad(what() if callable(what) else what, whole)


def _int(v: Any, what: str, lo: int = 0, hi: int = MAX_ELEMENTS) -> int:
  _req(
    isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi,
    lambda: f"{what} must be an integer in [{lo}, {hi}], found {_short(v)}",
  )
  return v


def _str(v: Any, what: str, limit: int = 4096) -> str:
  _req(
    isinstance(v, str) and len(v) <= limit, lambda: f"{what} must be a string, found {_short(v)}"
  )
  return v


def _short(v: Any) -> str:
  text = repr(v)
  return text if len(text) <= 60 else text[:57] + "..."


def _keys(d: Any, what: str, required: Sequence[str], optional: Sequence[str] = ()) -> dict:
  """``d`` is a map with the ``required`` keys and no others than ``optional``. ``what``
  names it in the message: ``"it"`` for the record itself (its errors are ``whole``)."""
  whole = what == "it"
  _req(isinstance(d, dict), lambda: f"{what} must be a map, found {_short(d)}", whole)
  missing = [k for k in required if k not in d]
  _req(not missing, f"{what} lacks {missing[0]!r}" if missing else "", whole)
  unknown = [k for k in d if k not in required and k not in optional]
  _req(
    not unknown,
    lambda: (
      f"{what} has an unknown field {_short(unknown[0]) if unknown else ''} "
      "(written by a newer fnckpt?)"
    ),
    whole,
  )
  return d


def check_dir(path: Any, what: str) -> str:
  """A storage directory inside the checkpoint: relative, normalized, plain names only.

  >>> check_dir("a/3", "dir")
  'a/3'
  """
  _str(path, what, 512)
  parts = path.split("/")
  _req(
    bool(path) and all(_NAME.fullmatch(p) and p not in (".", "..") for p in parts),
    lambda: (
      f"{what} must be a relative path of plain names inside the checkpoint, found {_short(path)}"
    ),
  )
  return path


def check_rel(path: Any, what: str) -> str:
  """A reference to another checkpoint or run: up to 64 ``..`` names, then plain names.

  >>> check_rel("5", "dir"), check_rel("../../runs/a/5", "dir")
  ('5', '../../runs/a/5')
  """
  _str(path, what, 2048)
  parts = path.split("/")
  up = 0
  while up < len(parts) and parts[up] == "..":
    up += 1
  rest = parts[up:]
  _req(
    up <= MAX_UP and rest and all(_NAME.fullmatch(p) and p not in (".", "..") for p in rest),
    lambda: f"{what} must be up to {MAX_UP} '..' then plain names, found {_short(path)}",
  )
  return path


def _hash(v: Any, what: str, n: int = HASH_BYTES) -> bytes:
  _req(isinstance(v, bytes) and len(v) == n, lambda: f"{what} must be {n} bytes, found {_short(v)}")
  return v


def _error(location: str, what: str) -> CheckpointError:
  return CheckpointError(
    f"The manifest of {location!r} is invalid: {what}. The checkpoint cannot be read safely; "
    "restore an earlier one (or check the tool that wrote or edited it)."
  )


def _list(v: Any, what: str, limit: int = 1 << 26) -> list:
  _req(isinstance(v, list) and len(v) <= limit, lambda: f"{what} must be a list, found {_short(v)}")
  return v


def _base_of(v: Any, d: str, what: str, bases: tuple[Base, ...]) -> int | None:
  """A ``base`` index (or None): it names an entry of ``bases`` whose data holds ``d``."""
  if v is None:
    return None
  k = _int(v, f"{what}.base", 0, max(len(bases) - 1, 0))
  _req(k < len(bases), lambda: f"{what}.base names no entry of 'bases'")
  _req(
    d.startswith(bases[k].data + "/"),
    lambda: f"{what}.dir {_short(d)} lies outside the referenced data {bases[k].data!r}",
  )
  return k


def _dtype(v: Any) -> str:
  _req(
    v in DTYPES if isinstance(v, str) else False,
    lambda: f"dtype {_short(v)} is not one fnckpt stores",
  )
  return v


def _shape(v: Any) -> tuple[int, ...]:
  _list(v, "'shape'", MAX_DIMS)
  shape = tuple(_int(s, "a dimension", 0, MAX_ELEMENTS) for s in v)
  _req(math.prod(shape) <= MAX_ELEMENTS, lambda: f"shape {list(shape)} is too large")
  return shape
