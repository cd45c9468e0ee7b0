"""PURE: which saved leaves become which arrays and metadata of an Orbax PyTree checkpoint.

:func:`plan` takes a checkpoint's validated leaf records and returns an :class:`OrbaxPlan`:
every array and scalar to write (:class:`OrbaxArray`: its Orbax parameter name, zarr chunk
shape and, for a ``jax.Array``, its saved shard shape and sharding), and the bytes of the
small files orbax-checkpoint 0.12.8's ``StandardCheckpointer().save`` writes beside them:
``_METADATA``, ``_sharding``, ``array_metadatas/process_0`` and (for strings, as
``PyTreeCheckpointer`` writes them) ``_strings.json``. Everything Orbax cannot hold is found
here, before a byte is read or written: one :class:`CheckpointError` lists every such key path.

The layout (``fnckpt._sources.orbax`` reads the same): ``_METADATA`` maps ``str(tuple of key
names)`` to ``{"key_metadata": [{"key", "key_type"}], "value_metadata": {"value_type",
"skip_deserialize", "write_shape"?}}`` (key_type 1: a sequence index or a flattened node's,
2: a dict key or an attribute); each array is a zarr (v2) array named by the key names joined
with ``.``, zstd level 1, in OCDBT; ``_sharding`` maps the base64 (URL-safe) of a
``jax.Array``'s name to a JSON string of its sharding; ``array_metadatas/process_0`` lists each
``jax.Array``'s write shape, chunk shape and (a typed PRNG key) ``random_key_impl``.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
from typing import Any, Mapping, Sequence

import numpy as np

from .._errors import CheckpointError
from .._format import records as _records

__all__ = [
  "OrbaxArray",
  "OrbaxPlan",
  "plan",
  "chunk_shape",
  "write_shape",
  "UNSUPPORTED_DTYPES",
  "HANDLER",
]

# Dtypes fnckpt saves that TensorStore's zarr (v2) driver, which Orbax writes, cannot hold
# (tensorstore 0.1.86; tests/test_orbax_out.py checks the list against it).
UNSUPPORTED_DTYPES = frozenset(("float8_e4m3", "uint2", "uint4"))
HANDLER = "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"
_EMPTY = {"none": "None", "dict": "Dict", "list": "List", "tuple": "Tuple"}
_SEQ_KINDS = ("seq", "flat")  # Orbax's key_type 1; "dict" and "attr" are 2


@dataclasses.dataclass(frozen=True)
class OrbaxArray:
  """One zarr array to write: ``leaf`` (an array or key leaf, or a number: ``value`` holds
  it as a 0-d array), Orbax's parameter ``name`` and ``value_type``, the zarr ``chunks``;
  a ``jax.Array``'s shard shape (``write_shape``) and ``_sharding`` JSON text; ``whole``:
  read in one piece (a leaf stored inline or in a pack, small enough), else chunk by chunk."""

  leaf: _records.Leaf
  name: str
  value_type: str
  dtype: str
  shape: tuple[int, ...]
  chunks: tuple[int, ...]
  write_shape: tuple[int, ...] | None = None
  sharding: str | None = None
  value: np.ndarray | None = None
  whole: bool = False

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * _records.itemsize(self.dtype)


@dataclasses.dataclass(frozen=True)
class OrbaxPlan:
  """The arrays to write (stored leaves, then numbers) and the small files (name -> bytes,
  relative to the item directory) written after them."""

  arrays: tuple[OrbaxArray, ...]
  files: Mapping[str, bytes]
  total_bytes: int  # array data bytes, numbers included


def write_shape(leaf: _records.Leaf) -> tuple[int, ...]:
  """What one device writes of a leaf saved with a named sharding, as Orbax's
  replica-parallel save cuts it (the whole shape for any other sharding): each dimension
  divided by the mesh axes its PartitionSpec entry names, then the first dimension the
  number of replicas (the other axes' sizes multiplied) divides, divided by it.

  >>> s = _records.Sharding("named", ("data", "model"), (2, 4), ("data", None))
  >>> write_shape(_records.Leaf(0, (), "array", "float32", (64, 32), sharding=s))
  (8, 32)
  """
  assert leaf.shape is not None
  s = leaf.sharding
  if s is None or s.type != "named":
    return tuple(leaf.shape)
  out, used = list(leaf.shape), 1
  for d, entry in enumerate(s.spec[: len(out)]):
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    div = math.prod(s.sizes[s.axes.index(n)] for n in names if n in s.axes)
    out[d], used = -(-out[d] // div), used * div
  replicas = math.prod(s.sizes) // used
  if replicas > 1 and math.prod(out) > 0:
    axis = next((k for k, n in enumerate(out) if n % replicas == 0), None)
    if axis is not None:
      out[axis] //= replicas
  return tuple(out)


def chunk_shape(shard: Sequence[int], itemsize: int, limit: int) -> tuple[int, ...]:
  """The zarr chunk shape for a shard shape: the shard itself when it fits in ``limit``
  bytes (what Orbax writes), else C-order blocks of it (single indices of the leading
  dimensions, a run of the first one that fits, whole trailing ones), the run a divisor of
  its dimension when one is at least half the most that fits.

  >>> chunk_shape((32, 8), 4, 1 << 20), chunk_shape((1000, 10), 4, 4000), chunk_shape((), 4, 8)
  ((32, 8), (100, 10), ())
  >>> chunk_shape((4, 3, 1000), 1, 3000), chunk_shape((7, 5), 1, 15)
  ((1, 3, 1000), (3, 5))
  """
  ws = [max(1, int(n)) for n in shard]
  if math.prod(ws) * itemsize <= limit:
    return tuple(ws)
  k = next((d for d in range(len(ws)) if math.prod(ws[d + 1 :]) * itemsize <= limit), len(ws) - 1)
  most = max(1, limit // (math.prod(ws[k + 1 :]) * itemsize))
  step = next(
    (s for s in range(most, max(most // 2, most - 4096), -1) if ws[k] % s == 0 and s >= 1), most
  )
  return (1,) * k + (step,) + tuple(ws[k + 1 :])


def _name_of(path: tuple[tuple[str, Any], ...]) -> tuple[str, ...]:
  return tuple(str(k) for _, k in path)


def _sharding_json(leaf: _records.Leaf) -> str:
  """Orbax's ``_sharding`` text: a NamedSharding's mesh shape, axis names and PartitionSpec
  (no device ids: Orbax then lays the mesh over ``jax.devices()``, in order). Any other
  sharding (one device; fnckpt records no device) is one device's: a one-device mesh of the
  device with id 0, which every JAX platform has, where Orbax's SingleDeviceSharding would
  name a platform's device (``cpu:0``)."""
  s = leaf.sharding
  if s is not None and s.type == "named":
    spec = [e if e is None or isinstance(e, str) else list(e) for e in s.spec]
    return json.dumps(
      {
        "sharding_type": "NamedSharding",
        "shape": list(s.sizes),
        "axis_names": list(s.axes),
        "partition_spec": spec,
      }
    )
  return json.dumps(
    {
      "sharding_type": "NamedSharding",
      "shape": [1],
      "axis_names": ["device"],
      "partition_spec": [],
      "device_mesh": {"mesh": [{"id": 0}]},
    }
  )


def _scalar_value(leaf: _records.Leaf) -> np.ndarray | None:
  """A number leaf as the 0-d array Orbax's ScalarHandler writes (``np.asarray(value)``);
  None if it is not a number Orbax holds."""
  if leaf.kind == "npscalar":
    assert leaf.dtype is not None
    if leaf.dtype in UNSUPPORTED_DTYPES:
      return None
    return np.frombuffer(leaf.value, dtype=_records.np_dtype(leaf.dtype)).reshape(())
  if leaf.kind == "scalar" and leaf.type in ("bool", "int", "float", "complex"):
    return np.asarray(leaf.value)
  return None


def _why_not(leaf: _records.Leaf) -> str:
  if leaf.kind == "perprocess":
    return "a PerProcess value (one per process); Orbax holds one value per key path"
  if leaf.kind == "bigint":
    return "an int outside int64/uint64, which Orbax's scalars cannot hold"
  if leaf.kind == "npgen":
    return "a numpy Generator, which Orbax's PyTree checkpoints cannot hold"
  if leaf.kind in ("array", "key", "npscalar"):
    return f"dtype {leaf.dtype}, which Orbax's zarr arrays cannot hold"
  return f"a {leaf.type} value, which Orbax's PyTree checkpoints cannot hold"


@dataclasses.dataclass
class _Build:
  """What :func:`plan` collects, leaf by leaf."""

  window: int
  arrays: list[OrbaxArray] = dataclasses.field(default_factory=list)
  numbers: list[OrbaxArray] = dataclasses.field(default_factory=list)
  tree: dict[str, Any] = dataclasses.field(default_factory=dict)
  strings: dict[str, str] = dataclasses.field(default_factory=dict)
  refused: list[str] = dataclasses.field(default_factory=list)
  names: dict[str, str] = dataclasses.field(default_factory=dict)

  def add(self, leaf: _records.Leaf) -> None:
    keys = _name_of(leaf.path)
    name = ".".join(keys)
    if not self._check_name(leaf, name):
      return
    if leaf.kind in ("array", "key") and leaf.dtype not in UNSUPPORTED_DTYPES:
      self._array(leaf, keys, name)
    elif (value := _scalar_value(leaf)) is not None:
      self.numbers.append(
        OrbaxArray(leaf, name, "scalar", value.dtype.name, (), (), value=np.array(value))
      )
      self._entry(leaf, keys, "scalar")
    elif leaf.kind == "scalar" and leaf.type == "str":
      self.strings[name] = leaf.value
      self._entry(leaf, keys, "string")
    elif leaf.kind == "empty" and leaf.type in _EMPTY:
      self._entry(leaf, keys, _EMPTY[leaf.type], skip=True)
    else:
      self.refused.append(f"{leaf.where}: {_why_not(leaf)}")

  def _check_name(self, leaf: _records.Leaf, name: str) -> bool:
    if not leaf.path or any(p in ("", ".", "..") for p in name.split("/")):
      what = "it is the whole tree" if not leaf.path else f"its name {name!r}"
      self.refused.append(
        f"{leaf.where or '(the root)'}: {what} is not a plain relative path, which "
        "Orbax names each array by (key names joined with '.')"
      )
      return False
    if name in self.names:
      self.refused.append(
        f"{leaf.where}: its Orbax name {name!r} (key names joined with '.') is also that of "
        f"{self.names[name]}"
      )
      return False
    self.names[name] = leaf.where
    return True

  def _array(self, leaf: _records.Leaf, keys: tuple[str, ...], name: str) -> None:
    assert leaf.shape is not None and leaf.dtype is not None
    jax_array = leaf.source == "jax" or leaf.kind == "key"
    shard = write_shape(leaf) if jax_array else tuple(leaf.shape)
    size, limit = _records.itemsize(leaf.dtype), max(1, self.window // 16)
    # Inline and packed bytes are read as C-order ranges only: such a leaf is read whole
    # when that fits in the window, else in chunks that are C-order ranges of it.
    ranges_only = leaf.inline is not None or leaf.packed is not None
    whole = ranges_only and 3 * leaf.nbytes <= self.window
    chunks = chunk_shape(leaf.shape if ranges_only and not whole else shard, size, limit)
    a = OrbaxArray(
      leaf,
      name,
      "jax.Array" if jax_array else "np.ndarray",
      leaf.dtype,
      tuple(leaf.shape),
      chunks,
      write_shape=tuple(max(1, n) for n in shard) if jax_array else None,
      sharding=_sharding_json(leaf) if jax_array else None,
      whole=whole,
    )
    self.arrays.append(a)
    self._entry(leaf, keys, a.value_type, shape=a.write_shape)

  def _entry(self, leaf, keys, value_type: str, skip: bool = False, shape=None) -> None:
    value: dict[str, Any] = {"value_type": value_type, "skip_deserialize": skip}
    if shape is not None:
      value["write_shape"] = list(shape)
    self.tree[str(keys)] = {
      "key_metadata": [
        {"key": k, "key_type": 1 if kind in _SEQ_KINDS else 2}
        for (kind, _), k in zip(leaf.path, keys)
      ],
      "value_metadata": value,
    }


def _files(b: _Build, custom_metadata: Any) -> dict[str, bytes]:
  meta = {
    "tree_metadata": b.tree,
    "use_ocdbt": True,
    "use_zarr3": False,
    "store_array_data_equal_to_fill_value": True,
    "custom_metadata": custom_metadata,
  }
  files = {"_METADATA": json.dumps(meta).encode()}
  jax_arrays = [a for a in b.arrays if a.value_type == "jax.Array"]
  if jax_arrays:
    shardings = {base64.urlsafe_b64encode(a.name.encode()).decode(): a.sharding for a in jax_arrays}
    files["_sharding"] = json.dumps(shardings, separators=(",", ":")).encode()
    entries = []
    for a in jax_arrays:
      ext = {"random_key_impl": a.leaf.impl} if a.leaf.kind == "key" else None
      entries.append(
        {
          "array_metadata": {
            "param_name": a.name,
            "write_shape": list(a.write_shape or ()),
            "chunk_shape": list(a.chunks),
            "ext_metadata": ext,
          }
        }
      )
    files["array_metadatas/process_0"] = json.dumps({"array_metadatas": entries}).encode()
  if b.strings:
    files["_strings.json"] = json.dumps(b.strings, separators=(",", ":")).encode()
  return files


def _custom_metadata(metadata: Any) -> Any:
  """The checkpoint's own ``metadata`` as ``_METADATA``'s ``custom_metadata`` when it is
  JSON (else None: msgpack also holds bytes and non-string keys, which JSON does not)."""
  try:
    return json.loads(json.dumps(metadata, allow_nan=False))
  except (TypeError, ValueError):
    return None


def plan(
  leaves: Sequence[_records.Leaf], location: str, *, window: int, metadata: Any = None
) -> OrbaxPlan:
  """The Orbax checkpoint of ``leaves`` (a checkpoint's records), read through a window of
  ``window`` bytes: zarr chunks of at most a sixteenth of it (a shard that fits is one
  chunk, as Orbax writes it); ``metadata``: the checkpoint's own, kept when it is JSON.

  >>> from fnckpt._format import records as _records
  >>> w = _records.Leaf(0, (("dict", "w"),), "array", "float32", (2,), "numpy", inline=bytes(8))
  >>> step = _records.Leaf(1, (("dict", "step"),), "scalar", type="int", value=7)
  >>> p = plan([w, step], "ckpt", window=1 << 20)
  >>> [(a.name, a.value_type, a.chunks) for a in p.arrays], sorted(p.files)
  ([('w', 'np.ndarray', (2,)), ('step', 'scalar', ())], ['_METADATA'])
  """
  b = _Build(window)
  for leaf in leaves:
    b.add(leaf)
  if b.refused:
    raise CheckpointError(
      f"Cannot export the checkpoint at {location!r} to Orbax:\n  "
      + "\n  ".join(b.refused)
      + "\nRestore it, replace or drop these leaves (e.g. a PerProcess value by one "
      "process's, a big int by a string), save it again and export that."
    )
  arrays = tuple(b.arrays) + tuple(b.numbers)
  return OrbaxPlan(arrays, _files(b, _custom_metadata(metadata)), sum(a.nbytes for a in arrays))
