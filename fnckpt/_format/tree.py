"""PURE: pytrees <-> key paths; structure rebuilt from key paths; structure diffs with clear errors.

A key path is stored as a list of ``[kind, key]`` entries, kind one of ``"dict"`` (``DictKey``),
``"seq"`` (``SequenceKey``), ``"attr"`` (``GetAttrKey``) and ``"flat"`` (``FlattenedIndexKey``).
Matching a target against a checkpoint compares the *keys* only (:func:`match_key`), so a tree
saved as a flax struct restores into a dict with the same field names and vice versa.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import jax

from .._errors import CheckpointError, TreeMismatchError

__all__ = [
  "PathEntry",
  "flatten",
  "check_paths",
  "keystr",
  "match_key",
  "unflatten_from_paths",
  "diff",
  "is_empty_node",
  "key_problem",
  "MAX_PATH_DEPTH",
]

PathEntry = tuple[str, Any]  # (kind, key)
Path = tuple[PathEntry, ...]

_KEY_TYPES = (str, int)

# What a key path may hold: readers refuse anything beyond (``parse._path``), so ``save``
# refuses it up front rather than commit a checkpoint that no reader opens.
MAX_PATH_DEPTH = 256
MAX_KEY_CHARS = {"dict": 4096, "attr": 1024}
INT_KEY_RANGE = {"dict": (-(1 << 63), (1 << 64) - 1), "seq": (0, 1 << 31), "flat": (0, 1 << 31)}


def key_problem(kind: str, key: Any) -> str:
  """Why ``(kind, key)`` cannot be stored in a key path, or ``""``.

  >>> key_problem("dict", "x" * 5000)
  'a dict key of 5000 characters (at most 4096)'
  >>> key_problem("seq", 3)
  ''
  """
  if isinstance(key, str):
    limit = MAX_KEY_CHARS.get(kind)
    if limit is None:
      return f"a {kind} key that is a string"
    return "" if len(key) <= limit else f"a {kind} key of {len(key)} characters (at most {limit})"
  if isinstance(key, int) and not isinstance(key, bool) and kind in INT_KEY_RANGE:
    lo, hi = INT_KEY_RANGE[kind]
    return "" if lo <= key <= hi else f"a {kind} key {key} outside [{lo}, {hi}]"
  return f"a {kind} key of type {type(key).__name__}"


def is_empty_node(x: Any) -> bool:
  """Containers with no children (and None): they vanish from a flat leaf list, so we keep them
  as leaves of their own to restore them faithfully."""
  if x is None:
    return True
  if isinstance(x, (dict, list, tuple)) and len(x) == 0:
    return True
  return False


def _entry(k: Any, kp: Any) -> PathEntry:
  """One entry of a pytree key path (``kp``: the whole path, named in errors)."""
  tu = jax.tree_util
  if isinstance(k, tu.DictKey):
    key = k.key
    if not isinstance(key, _KEY_TYPES) or isinstance(key, bool):
      raise CheckpointError(
        f"Unsupported dict key {key!r} (type {type(key).__name__}) at {tu.keystr(kp)}: "
        "checkpoint keys must be str or int. Convert the dict's keys, e.g. "
        "{str(k): v for k, v in d.items()}."
      )
    return ("dict", key)
  if isinstance(k, tu.SequenceKey):
    return ("seq", int(k.idx))
  if isinstance(k, tu.GetAttrKey):
    return ("attr", str(k.name))
  if isinstance(k, tu.FlattenedIndexKey):
    return ("flat", int(k.key))
  raise CheckpointError(f"Unsupported pytree key {k!r} at {tu.keystr(kp)}.")


def keystr(path: Sequence[Sequence[Any]]) -> str:
  """A key path as users see it in errors.

  >>> keystr([("dict", "params"), ("attr", "kernel"), ("seq", 0)])
  "['params'].kernel[0]"
  """
  if not path:
    return "<root>"
  out = []
  for kind, key in path:
    if kind == "attr":
      out.append(f".{key}")
    elif kind == "dict":
      out.append(f"[{key!r}]")
    else:
      out.append(f"[{key}]")
  return "".join(out)


def match_key(path: Sequence[Sequence[Any]]) -> tuple:
  """What two key paths must share to be the same leaf: the keys, not how they are reached."""
  return tuple([key for _, key in path])


def flatten(tree: Any, check: bool = True) -> tuple[list[tuple[Path, Any]], Any]:
  """``[(path, leaf)]`` in pytree order and the treedef; empty containers and None are leaves.
  ``check``: refuse key paths no reader accepts (``False``: the caller knows these paths
  passed before, e.g. a save's plan kept for them).

  >>> leaves, _ = flatten({"a": 1, "b": [], "c": None})
  >>> [(keystr(p), v) for p, v in leaves]
  [("['a']", 1), ("['b']", []), ("['c']", None)]
  """
  try:
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_empty_node)
  except (TypeError, ValueError) as e:  # e.g. a dict whose keys do not sort (1 and "a")
    raise CheckpointError(
      f"The tree cannot be flattened by jax.tree_util ({e}). A dict's keys must sort: use "
      "keys of one type (all str or all int)."
    ) from e
  out = []
  for kp, leaf in pairs:  # (the key path as users see it is made only for an error)
    path = tuple(_entry(k, kp) for k in kp)
    if check:
      _check_path(path, kp)
    out.append((path, leaf))
  return out, treedef


def check_paths(pairs: Sequence[tuple[Path, Any]]) -> None:
  """The key paths of :func:`flatten`'s ``check=False`` pairs, checked as it checks them."""
  for path, _ in pairs:
    _check_path(path, None)


def _check_path(path: Path, kp: Any) -> None:
  """A key path's depth and keys are ones a reader accepts (``kp``: the pytree key path;
  None: named from ``path``)."""
  where = lambda: jax.tree_util.keystr(kp) if kp is not None else keystr(path)  # noqa: E731
  if len(path) > MAX_PATH_DEPTH:
    raise CheckpointError(
      f"The leaf at {where()[:200]} is nested {len(path)} levels deep; a checkpoint's key paths "
      f"hold at most {MAX_PATH_DEPTH}. Flatten that part of the tree."
    )
  for kind, key in path:
    problem = key_problem(kind, key)
    if problem:
      raise CheckpointError(
        f"Cannot save the leaf at {where()[:200]}: its key path holds {problem}, which no "
        "reader accepts. Rename the key (e.g. a shorter string)."
      )


def unflatten_from_paths(paths: Sequence[Sequence[Sequence[Any]]], values: Sequence[Any]) -> Any:
  """Rebuild plain containers from key paths: dicts for dict and attribute keys, lists for
  sequence and flattened-index keys. Used when restoring without a target.

  >>> unflatten_from_paths([[("dict", "a"), ("seq", 0)], [("dict", "a"), ("seq", 1)]], [1, 2])
  {'a': [1, 2]}
  """
  if len(paths) == 1 and len(paths[0]) == 0:
    return values[0]
  root: Any = None

  def container(kind: str) -> Any:
    return [] if kind in ("seq", "flat") else {}

  for path, value in zip(paths, values):
    if root is None:
      root = container(path[0][0])
    node = root
    for i, (_kind, key) in enumerate(path):
      last = i == len(path) - 1
      child = value if last else container(path[i + 1][0])
      if isinstance(node, list):
        while len(node) <= key:
          node.append(None)
        if last or node[key] is None:
          node[key] = child
        node = node[key]
      else:
        if last or key not in node:
          node[key] = child
        node = node[key]
  return {} if root is None else root


def diff(
  saved: Iterable[Sequence[Sequence[Any]]], wanted: Iterable[Sequence[Sequence[Any]]]
) -> tuple[list[str], list[str]]:
  """Key paths only in ``wanted`` (missing from the checkpoint) and only in ``saved``."""
  saved_keys = {match_key(p): keystr(p) for p in saved}
  wanted_keys = {match_key(p): keystr(p) for p in wanted}
  missing = [s for k, s in wanted_keys.items() if k not in saved_keys]
  unexpected = [s for k, s in saved_keys.items() if k not in wanted_keys]
  return missing, unexpected


def mismatch_error(
  location: str,
  *,
  missing: Sequence[str] = (),
  unexpected: Sequence[str] = (),
  mismatched: Sequence[str] = (),
  hint: str = "",
) -> TreeMismatchError:
  """One error listing every problem, so a user fixes them all in one go."""
  lines = [f"The restore target does not match the checkpoint at {location!r}:"]
  limit = 20
  for title, items in (
    ("missing from the checkpoint (in the target only)", missing),
    ("in the checkpoint but not in the target", unexpected),
    ("shape or dtype differs", mismatched),
  ):
    if items:
      lines.append(f"  {len(items)} key path(s) {title}:")
      lines.extend(f"    {item}" for item in list(items)[:limit])
      if len(items) > limit:
        lines.append(f"    ... and {len(items) - limit} more")
  if hint:
    lines.append(hint)
  return TreeMismatchError("\n".join(lines))
