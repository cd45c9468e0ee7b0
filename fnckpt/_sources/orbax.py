"""Reading Orbax PyTree checkpoints (orbax-checkpoint 0.11-0.12) without importing Orbax.

An Orbax PyTree item directory holds ``_METADATA`` (JSON: ``tree_metadata`` maps each leaf to
its key path, ``key_metadata`` = ``[{"key", "key_type"}]`` with key_type 1 a sequence index
and 2 a dict key, and its ``value_metadata.value_type``: ``jax.Array``, ``np.ndarray``,
``scalar``, ``string``, or an empty container ``None/Dict/List/Tuple/NamedTuple``), and one
zarr (v2) or zarr3 array per array or scalar leaf, named by the key path joined with ``.``:
under an OCDBT key-value store rooted at the item directory (``use_ocdbt``, the default;
``manifest.ocdbt`` + ``d/``), or as plain directories. Strings live in ``_strings.json``.
``_sharding`` (optional) records each array's saved sharding.

Everything read is untrusted: the JSON is parsed with size limits and validated into
:class:`fnckpt._format.records.Leaf` records (key paths checked as fnckpt's own), each array is
opened with TensorStore (its zarr metadata gives shape and dtype; the dtype must be one fnckpt
knows), and reads fetch only the chunks a slice overlaps (OCDBT: byte ranges of its data files).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import re
from typing import Any, cast

import numpy as np
import tensorstore as ts

from .._errors import CheckpointError
from .._format import parse as _parse
from .._format import parse_arrays as _parse_arrays
from .._format import records as _records
from .._io import arrays as _arrays
from .._io import paths as _paths

__all__ = ["METADATA", "CHECKPOINT_METADATA", "Entry", "parse_metadata", "open_item", "TooLarge"]

METADATA = "_METADATA"
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
COMMIT_SUCCESS = "commit_success.txt"
MAX_JSON_BYTES = 64 << 20
MAX_JSON_OBJECTS = 1 << 20  # JSON maps in one file ('{' counted before parsing: memory bound)
MAX_PARTS = 64  # keys in one leaf's key path
MAX_TOTAL_PARTS = 1 << 22  # keys in all key paths of one _METADATA
_SEQ_INDEX = re.compile(r"0|[1-9][0-9]{0,8}")
_EMPTY = {
  "None": ("none", "NoneType"),
  "Dict": ("dict", "dict"),
  "List": ("list", "list"),
  "Tuple": ("tuple", "tuple"),
  "NamedTuple": ("tuple", "tuple"),
}
_ARRAYS = ("jax.Array", "np.ndarray", "scalar")
_PLACEHOLDER = "__orbax_placeholder__"


@dataclasses.dataclass(frozen=True)
class Entry:
  """One leaf of ``_METADATA``: its key path, Orbax's parameter name and value type."""

  path: tuple[tuple[str, Any], ...]
  name: str
  value_type: str


def _bad(location: str, what: str) -> CheckpointError:
  return CheckpointError(
    f"The Orbax checkpoint at {location!r} cannot be read: {what}. Check that it was written "
    "by orbax-checkpoint 0.11-0.12 and is complete."
  )


def load_json(raw: bytes, location: str, name: str) -> Any:
  if len(raw) > MAX_JSON_BYTES:
    raise _bad(location, f"{name} is larger than {MAX_JSON_BYTES} bytes")
  if raw.count(b"{") > MAX_JSON_OBJECTS:
    raise _bad(location, f"{name} holds more than {MAX_JSON_OBJECTS} JSON maps")
  try:
    return json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, ValueError, RecursionError) as e:
    raise _bad(location, f"{name} is not valid JSON ({e})") from None


def parse_metadata(m: Any, location: str) -> tuple[list[Entry], dict[str, Any]]:
  """``_METADATA``'s leaves (placeholders dropped) and its options (``use_ocdbt``, ...).

  >>> e, o = parse_metadata({"tree_metadata": {"('a',)": {
  ...     "key_metadata": [{"key": "a", "key_type": 2}],
  ...     "value_metadata": {"value_type": "scalar"}}}, "use_ocdbt": True}, "x")
  >>> e[0].path, e[0].name, o["use_ocdbt"]
  ((('dict', 'a'),), 'a', True)
  """
  tree = m.get("tree_metadata") if isinstance(m, dict) else None
  if not isinstance(tree, dict):
    raise _bad(location, f"{METADATA} has no 'tree_metadata' map")
  entries, parts = [], 0
  for label, leaf in tree.items():
    entry = _entry(label, leaf, location)
    parts += len(entry.path)
    if parts > MAX_TOTAL_PARTS:
      raise _bad(
        location, f"the key paths of {METADATA} hold more than {MAX_TOTAL_PARTS} keys in all"
      )
    if entry.value_type != _PLACEHOLDER:
      entries.append(entry)
  options = {}
  for k in ("use_ocdbt", "use_zarr3", "store_array_data_equal_to_fill_value"):
    if k in m:
      if not isinstance(m[k], bool):
        raise _bad(location, f"{METADATA}'s {k!r} must be true or false")
      options[k] = m[k]
  options["custom_metadata"] = m.get("custom_metadata")
  try:
    _parse._check_tree([e.path for e in entries])
  except _parse._Bad as e:
    raise _bad(location, f"the key paths of {METADATA} do not form a tree ({e})") from None
  return entries, options


def _entry(label: Any, leaf: Any, location: str) -> Entry:
  where = f"{METADATA} entry {str(label)[:80]}"
  keys = leaf.get("key_metadata") if isinstance(leaf, dict) else None
  value = leaf.get("value_metadata") if isinstance(leaf, dict) else None
  if not isinstance(keys, list) or not keys or not isinstance(value, dict):
    raise _bad(location, f"{where} needs 'key_metadata' (a list) and 'value_metadata' (a map)")
  if len(keys) > MAX_PARTS:
    raise _bad(location, f"{where} has a key path of {len(keys)} keys, more than {MAX_PARTS}")
  path: list[tuple[str, Any]] = []
  for k in keys:
    key = k.get("key") if isinstance(k, dict) else None
    kind = k.get("key_type") if isinstance(k, dict) else None
    if not isinstance(key, str) or len(key) > 4096 or kind not in (1, 2):
      raise _bad(
        location, f"{where} has a key {str(k)[:80]}, expected {{'key': str, 'key_type': 1 or 2}}"
      )
    if kind == 1:
      if not _SEQ_INDEX.fullmatch(key):
        raise _bad(location, f"{where} has the sequence index {key[:20]!r}")
      path.append(("seq", int(key)))
    else:
      path.append(("dict", key))
  name = ".".join(str(k) for _, k in path)
  if name.startswith("/") or any(p in ("", ".", "..") for p in name.split("/")):
    raise _bad(
      location,
      f"{where}: the parameter name {name[:80]!r} is not a plain relative "
      "path inside the checkpoint",
    )
  vtype = value.get("value_type")
  if not isinstance(vtype, str):
    raise _bad(location, f"{where} has no 'value_type'")
  return Entry(tuple(path), name, vtype)


def _array_spec(kv_spec: dict[str, Any], name: str, options: dict[str, Any]) -> dict[str, Any]:
  if options["use_ocdbt"]:
    kvstore = {
      "driver": "ocdbt",
      "base": kv_spec,
      "path": name + "/",
      "cache_pool": "cache_pool#ocdbt",
    }
  else:
    kvstore = {**kv_spec, "path": kv_spec.get("path", "") + name + "/"}
  # Orbax stores every chunk unless told not to store those equal to the fill value.
  fill = not options.get("store_array_data_equal_to_fill_value", False)
  return {
    "driver": "zarr3" if options.get("use_zarr3") else "zarr",
    "kvstore": kvstore,
    "fill_missing_data_reads": fill,
    "recheck_cached_data": False,
    "recheck_cached_metadata": False,
  }


def _scalar_leaf(i: int, e: Entry, value: np.ndarray, location: str) -> _records.Leaf:
  if value.shape != ():
    raise _bad(location, f"the scalar at {_records.keystr(e.path)} has shape {value.shape}")
  v = value.item()
  kind = {"b": "bool", "i": "int", "u": "int", "f": "float", "c": "complex"}.get(
    value.dtype.kind, "float" if "float" in value.dtype.name else None
  )
  if kind is None:
    raise _bad(location, f"the scalar at {_records.keystr(e.path)} has dtype {value.dtype}")
  return _records.Leaf(
    i,
    e.path,
    "scalar",
    type=kind,
    value=type({"bool": True, "int": 0, "float": 0.0, "complex": 0j}[kind])(v),
  )


def exists(kv: ts.KvStore, key: str) -> ts.Future:
  """A read of none of ``key``'s bytes: its ``state`` says whether the key exists."""
  return kv.read(key, byte_range=slice(0, 0))


class TooLarge(ValueError):
  """A value longer than ``limit`` bytes (:func:`read_bounded`)."""

  def __init__(self, limit: int):
    super().__init__(f"it is larger than {limit} bytes")
    self.limit = limit


def read_bounded(kv: ts.KvStore, key: str, limit: int) -> bytes | None:
  """A whole value, or None if missing; :class:`TooLarge` if it is longer than ``limit``
  (probed first: a byte range past a value's end is an error, not a short read)."""
  probe = kv.read(key, byte_range=slice(limit, limit + 1))
  try:
    if probe.result().state != "value":
      return None
    too_long = True
  except ValueError as e:  # OUT_OF_RANGE: shorter than limit + 1 bytes
    if _paths.status_code(e) != "OUT_OF_RANGE":
      raise
    too_long = False
  if too_long:
    raise TooLarge(limit)
  whole = kv.read(key).result()
  if whole.state == "value" and len(whole.value) > limit:  # (it grew since the probe)
    raise TooLarge(limit)
  return bytes(whole.value) if whole.state == "value" else None


def _read_json(kv: ts.KvStore, key: str, location: str, required: bool = True) -> Any:
  try:
    raw = read_bounded(kv, key, MAX_JSON_BYTES)
  except TooLarge as e:
    raise _bad(location, f"{key}: {e}") from None
  except ValueError as e:
    raise _paths.io_error(e, f"{location}/{key}", "reading") from None
  if raw is None:
    if required:
      raise _bad(location, f"{key} is missing")
    return None
  return load_json(raw, location, key)


def _sharding(raw: Any, ndim: int) -> _records.Sharding | None:
  """An Orbax ``_sharding`` entry as fnckpt's record (None if it is not one fnckpt reads:
  the saved sharding is informational, the target's is what restore uses)."""
  try:
    s = json.loads(raw) if isinstance(raw, str) else None
    if not isinstance(s, dict):
      return None
    if s.get("sharding_type") == "SingleDeviceSharding":
      return _records.Sharding("single")
    if s.get("sharding_type") != "NamedSharding":
      return None
    spec = s.get("partition_spec", [])
    return _parse_arrays._sharding(
      {"type": "named", "axes": s.get("axis_names"), "sizes": s.get("shape"), "spec": spec[:ndim]},
      ndim,
    )
  except (_parse._Bad, ValueError, TypeError, AttributeError):
    return None


def _shardings(kv: ts.KvStore, location: str) -> dict[str, Any]:
  """``_sharding``: base64 of the parameter name -> a JSON string (absent: no shardings)."""
  try:
    raw = _read_json(kv, "_sharding", location, required=False)
  except CheckpointError:
    return {}
  out = {}
  for k, v in (raw or {}).items() if isinstance(raw, dict) else ():
    try:
      out[base64.b64decode(k, validate=True).decode("utf-8")] = v
    except (ValueError, UnicodeDecodeError):
      continue
  return out


class Reader:
  """Slices of an Orbax item's arrays (leaf ``i`` is ``stores[i]``)."""

  format = "orbax"

  def __init__(self, location: str, stores: dict[int, ts.TensorStore], names: dict[int, str]):
    self.location, self.stores, self.names = location, stores, names

  def slice_reader(self, rec: _records.Leaf):
    store = self.stores[rec.index]
    return lambda index, batch=None: _arrays.read_slice(store, index, batch)

  def read_bytes(self, rec: _records.Leaf, index) -> int:
    """What reading one slice holds in memory (for restore's read budget): TensorStore
    decodes every chunk the slice overlaps whole, so the chunk-aligned box around it."""
    assert rec.stored is not None
    return box_bytes(rec.stored.chunks, index, _records.itemsize(rec.dtype))

  def read_error(self, rec: _records.Leaf, e: Exception) -> CheckpointError:
    if isinstance(e, CheckpointError):
      return e
    text = _paths.error_text(e)
    cause = {
      "checksum": "its data is corrupt (checksum mismatch)",
      "corrupt": "its data is corrupt or truncated",
      "missing": "a chunk of its data is missing",
    }.get(_paths.read_failure(e), f"reading failed ({type(e).__name__}: {text})")
    return CheckpointError(
      f"Cannot restore {rec.where} from the Orbax checkpoint at {self.location!r} (array "
      f"{self.names[rec.index]!r}): {cause}. The checkpoint is damaged or incomplete; "
      f"restore an earlier step. [{text}]"
    )


def box_bytes(chunks, index, itemsize: int) -> int:
  """Bytes of the chunks (of shape ``chunks``, grid origin 0) that the box ``index``
  (``(lo, hi)`` per axis) overlaps; 0 for an empty box.

  >>> box_bytes((4, 4), ((1, 2), (0, 8)), 4)    # 1 row of 2 chunks of 4 x 4 float32
  128
  """
  n = itemsize
  for (lo, hi), c in zip(index, chunks):
    if hi <= lo:
      return 0
    n *= (-(-hi // c) - lo // c) * c
  return n


def _key_impls(kv: ts.KvStore, location: str) -> dict[str, str]:
  """The typed PRNG keys' implementations (parameter name -> impl) that Orbax records in
  ``array_metadatas/process_N`` (``ext_metadata.random_key_impl``; Orbax reads the first
  file, so do we); only implementations fnckpt knows. Absent or unreadable: none."""
  try:
    names = sorted(kv.list(ts.KvStore.KeyRange("array_metadatas/", "array_metadatas0")).result())
    raw = _read_json(kv, names[0].decode(), location, required=False) if names else None
  except (CheckpointError, ValueError, UnicodeDecodeError):
    return {}
  entries = raw.get("array_metadatas") if isinstance(raw, dict) else None
  out = {}
  for entry in entries if isinstance(entries, list) else ():
    m = entry.get("array_metadata") if isinstance(entry, dict) else None
    ext = m.get("ext_metadata") if isinstance(m, dict) else None
    impl = ext.get("random_key_impl") if isinstance(ext, dict) else None
    if isinstance(m, dict) and isinstance(m.get("param_name"), str) and impl in _records.PRNG_IMPLS:
      out[m["param_name"]] = impl
  return out


def _key_impl(impls: dict[str, str], e: Entry, store: ts.TensorStore) -> str | None:
  """A jax.Array's PRNG implementation, if it is a typed key's data (uint32, its last
  dimension the implementation's key words)."""
  impl = impls.get(e.name) if e.value_type == "jax.Array" else None
  if impl is None or store.dtype.name != "uint32" or store.rank == 0:
    return None
  return impl if int(store.shape[-1]) == _records.PRNG_IMPLS[impl] else None


def _open_arrays(kv_spec, ctx, entries, options) -> dict[int, ts.Future]:
  return {
    i: ts.open(_array_spec(kv_spec, e.name, options), read=True, context=ctx)
    for i, e in enumerate(entries)
    if e.value_type in _ARRAYS
  }


def open_item(
  kv_spec: dict[str, Any], ctx: ts.Context, kv: ts.KvStore, location: str
) -> tuple[_records.Manifest, Reader]:
  """An Orbax PyTree item directory (the one holding ``_METADATA``): validated leaf records
  and a reader of their arrays. Opens every array (its zarr metadata) and reads scalars."""
  entries, options = parse_metadata(_read_json(kv, METADATA, location), location)
  if "use_ocdbt" not in options:
    options["use_ocdbt"] = exists(kv, "manifest.ocdbt").result().state == "value"
  opens = _open_arrays(kv_spec, ctx, entries, options)
  strings = (
    _read_json(kv, "_strings.json", location)
    if any(e.value_type == "string" for e in entries)
    else {}
  )
  shardings = _shardings(kv, location)
  impls = _key_impls(kv, location)
  leaves: list[_records.Leaf | None] = []  # (None: a scalar's, until it is read)
  stores, names, scalars = {}, {}, {}
  for i, e in enumerate(entries):
    where = _records.keystr(e.path)
    if e.value_type in _EMPTY:
      kind, name = _EMPTY[e.value_type]
      leaves.append(_records.Leaf(i, e.path, "empty", type=kind, name=name))
    elif e.value_type == "string":
      value = strings.get(e.name) if isinstance(strings, dict) else None
      if not isinstance(value, str):
        raise _bad(location, f"the string at {where} is not in _strings.json")
      leaves.append(_records.Leaf(i, e.path, "scalar", type="str", value=value))
    elif e.value_type in _ARRAYS:
      store = _opened(opens[i], where, e, location)
      if e.value_type == "scalar":
        if store.rank != 0:  # (before reading it: a "scalar" of 2**40 elements)
          raise _bad(
            location,
            f"the scalar at {where} ({e.name!r}) has shape {tuple(store.shape)}, expected ()",
          )
        scalars[i] = (e, store.read())
        leaves.append(None)
        continue
      leaves.append(_array_leaf(i, e, store, _key_impl(impls, e, store), shardings))
      stores[i], names[i] = store, e.name
    else:
      raise _bad(
        location,
        f"the leaf at {where} has Orbax value type {e.value_type[:60]!r}, "
        "which fnckpt does not read (arrays, scalars, strings and empty containers "
        "only)",
      )
  for i, (e, fut) in scalars.items():
    try:
      value = fut.result()
    except Exception as ex:
      raise _bad(
        location,
        f"the scalar at {_records.keystr(e.path)} ({e.name!r}) cannot be "
        f"read ({_paths.error_text(ex)[:300]})",
      ) from None
    leaves[i] = _scalar_leaf(i, e, np.asarray(value), location)
  manifest = _records.Manifest(
    0,
    0.0,
    0,
    {"format": "orbax"},
    options["custom_metadata"],
    cast(tuple[_records.Leaf, ...], tuple(leaves)),
  )
  return manifest, Reader(location, stores, names)


def _array_leaf(i: int, e: Any, store: ts.TensorStore, impl: Any, shardings) -> _records.Leaf:
  """The record of an Orbax array (or typed PRNG key array, ``impl``) leaf."""
  shape = tuple(store.shape)
  return _records.Leaf(
    index=i,
    path=e.path,
    kind="array" if impl is None else "key",
    impl=impl,
    dtype=store.dtype.name,
    shape=shape,
    source="jax" if e.value_type == "jax.Array" else "numpy",
    sharding=_sharding(shardings.get(e.name), len(shape)),
    stored=_records.Stored(e.name, _chunks(store), _chunks(store), None),
  )


def _chunks(store: ts.TensorStore) -> tuple[int, ...]:
  try:
    # (a shape or dimension None raises TypeError: handled below)
    return tuple(int(c) for c in store.chunk_layout.read_chunk.shape)  # type: ignore[union-attr, arg-type]
  except Exception:
    return tuple(store.shape)


def _opened(fut: ts.Future, where: str, e: Entry, location: str) -> ts.TensorStore:
  try:
    store = fut.result()
  except Exception as ex:
    kind = _paths.read_failure(ex)
    raise _bad(
      location,
      f"the array of {where} ({e.name!r}) cannot be opened ("
      f"{'it is missing' if kind == 'missing' else _paths.error_text(ex)[:300]})",
    ) from None
  if (
    store.dtype.name not in _records.DTYPES
    or store.rank > _records.MAX_DIMS
    or math.prod(store.shape) > _records.MAX_ELEMENTS
  ):
    raise _bad(
      location,
      f"the array of {where} ({e.name!r}) has dtype {store.dtype.name} "
      f"and shape {tuple(store.shape)}, which fnckpt does not read",
    )
  _check_chunks(store, where, e, location)
  return store


def _check_chunks(store: ts.TensorStore, where: str, e: Entry, location: str) -> None:
  """TensorStore decodes a whole chunk (and a zarr3 shard's index) to read any part of it:
  a chunk or shard larger than the array along any axis (an empty axis counts as 1) would
  allocate more than the array needs, up to aborting the interpreter. Orbax writes chunks of
  at most a shard's shape, which fits in the array."""
  shape = tuple(int(n) for n in store.shape)
  try:
    layout = store.chunk_layout
    grids = {"chunk": layout.read_chunk.shape, "shard": layout.write_chunk.shape}
  except Exception as ex:
    raise _bad(
      location,
      f"the array of {where} ({e.name!r}) has no readable chunk layout "
      f"({_paths.error_text(ex)[:200]})",
    ) from None
  for what, grid in grids.items():
    chunk = tuple(grid) if grid is not None else ()  # (rank 0: None)
    if len(chunk) != len(shape) or not all(
      isinstance(c, int) and 1 <= c <= max(n, 1) for c, n in zip(chunk, shape)
    ):
      raise _bad(
        location,
        f"the array of {where} ({e.name!r}) has shape {shape} and {what} "
        f"shape {chunk}; a {what} must fit in the array along every axis",
      )
