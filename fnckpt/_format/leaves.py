"""Leaf kinds: what a pytree leaf becomes in the manifest, and back.

Each kind is one branch of :func:`leaf_record` and one of :func:`decode_value`. Arrays are
described here (dtype, shape, saved sharding) and their bytes go either inline into the
manifest (small ones) or to a zarr3 array (``fnckpt._io.arrays``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _state
from .._errors import CheckpointError
from . import records as _records
from .manifest import check_msgpackable
from .tree import keystr

__all__ = [
  "leaf_record",
  "decode_value",
  "sharding_record",
  "dtype_of",
  "is_key_array",
  "host_value",
  "to_little_endian",
]

_SCALARS = (bool, int, float, complex, str, bytes)


def dtype_of(name: str) -> np.dtype:
  """``'bfloat16'`` -> numpy dtype (ml_dtypes' extended types included)."""
  try:
    return np.dtype(jnp.dtype(name))
  except TypeError:
    raise CheckpointError(
      f"Unknown dtype {name!r} in the checkpoint; upgrade jax/ml_dtypes."
    ) from None


def is_key_array(x: Any) -> bool:
  return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


@_state.memo(256)
def sharding_record(sharding: Any) -> _records.Sharding | None:
  """A saved sharding without device ids: mesh axis names and sizes plus the PartitionSpec
  (once per sharding: records are immutable, so leaves of one sharding share it)."""
  if sharding is None:
    return None
  if isinstance(sharding, jax.sharding.NamedSharding):
    spec: list[str | tuple[str, ...] | None] = []
    for entry in sharding.spec:
      if entry is None or isinstance(entry, str):
        spec.append(entry)
      elif isinstance(entry, tuple):
        spec.append(tuple(str(e) for e in entry))
      else:  # P.UNCONSTRAINED and future markers
        spec.append(str(entry))
    mesh = sharding.mesh
    sizes = tuple(int(mesh.shape[a]) for a in mesh.axis_names)
    return _records.Sharding(
      "named", tuple(str(a) for a in mesh.axis_names), sizes, tuple(spec), math.prod(sizes)
    )
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return _records.Sharding("single")
  return _records.Sharding(type(sharding).__name__, devices=len(sharding.device_set))


@_state.memo(256)
def _dtype_name(dtype: np.dtype) -> str:
  """``dtype.name``, cached: numpy computes it anew on every access (about 2 us, on the path
  of every saved leaf)."""
  return dtype.name


def _stored_name(dtype: np.dtype) -> str | None:
  """The name of a dtype fnckpt stores (numeric and bool, ml_dtypes' bfloat16, int4, float8_*
  included), else None (strings, objects, dates, void, structured dtypes, ``longdouble``)."""
  name = _dtype_name(dtype)
  return name if dtype.fields is None and name in _records.DTYPES else None


def to_little_endian(a: np.ndarray) -> np.ndarray:
  if a.dtype.byteorder == ">":
    return a.astype(a.dtype.newbyteorder("<"))
  return a


def host_bytes(data: Any) -> bytes:
  """An array's C-order little-endian bytes (as stored inline), from numpy or a jax.Array
  this process holds whole."""
  host = data if isinstance(data, np.ndarray) else host_value(data)
  return to_little_endian(np.ascontiguousarray(host)).tobytes()


def inline_array(leaf: _records.Leaf) -> np.ndarray:
  """An inline array leaf's value: a writable copy (results must be writable like read ones;
  ``frombuffer`` over bytes is read-only)."""
  assert leaf.inline is not None and leaf.dtype is not None
  return checked_bools(
    np.frombuffer(leaf.inline, dtype=dtype_of(leaf.dtype)).reshape(leaf.shape).copy(), leaf
  )


def cast(host: np.ndarray, dtype: Any, where: str) -> np.ndarray:
  """``host`` as ``dtype``. ml_dtypes has no direct cast between some narrow floats
  (``float8_e8m0fnu`` and the other fp8/fp4 types): those go through float32, which holds
  every value of both exactly, so the result is the direct cast's.

  >>> import ml_dtypes, numpy as np
  >>> cast(np.array([2.0], ml_dtypes.float8_e8m0fnu), ml_dtypes.float8_e4m3fn, "x")
  array([2], dtype='float8_e4m3fn')
  """
  try:
    return host.astype(dtype)
  except TypeError:
    pass
  try:
    return host.astype(np.float32).astype(dtype)
  except TypeError as e:
    raise CheckpointError(
      f"{where}: cannot convert {host.dtype} to {np.dtype(dtype)} ({e}). "
      "Convert it to a type numpy can cast first."
    ) from None


def checked_bools(host: np.ndarray, leaf: _records.Leaf) -> np.ndarray:
  """``host`` unchanged, unless it is a bool array viewed from stored bytes holding a byte
  other than 0 and 1: numpy and JAX would give such a value inconsistent results (it is
  neither ``True`` nor ``False`` bitwise), so it is damage, named by the leaf's key path.
  (TensorStore refuses such bytes in stored arrays itself.)

  >>> import numpy as np
  >>> checked_bools(np.array([0, 1], np.uint8).view(np.bool_), None)
  array([False,  True])
  """
  if host.dtype == np.bool_ and host.size and host.view(np.uint8).max() > 1:
    where = leaf.where if leaf is not None else "an array"
    raise CheckpointError(
      f"{where}: a bool array holds a byte other than 0 and 1, which fnckpt never writes: "
      "the checkpoint is damaged. Restore another checkpoint (or verify this one with "
      "`fnckpt verify`)."
    )
  return host


def host_value(x: jax.Array) -> np.ndarray:
  """A process-local copy of a small jax.Array that this process can fully see."""
  if x.is_fully_addressable:
    return np.array(x)
  return np.array(x.addressable_data(0))


def _plain(obj: Any) -> Any:
  """Numpy bit-generator state -> msgpack data (big ints and arrays tagged)."""
  if isinstance(obj, dict):
    return {k: _plain(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [_plain(v) for v in obj]
  if isinstance(obj, np.ndarray):
    a = to_little_endian(obj)
    return {"__ndarray__": [a.dtype.name, list(a.shape), a.tobytes()]}
  if isinstance(obj, (int, np.integer)) and not isinstance(obj, bool):
    v = int(obj)
    return v if -(1 << 63) <= v < (1 << 63) else {"__int__": str(v)}
  return obj


def _unplain(obj: Any) -> Any:
  if isinstance(obj, dict):
    if "__ndarray__" in obj:
      name, shape, data = obj["__ndarray__"]
      return np.frombuffer(data, dtype=dtype_of(name)).reshape(shape).copy()
    if "__int__" in obj:
      return int(obj["__int__"])
    return {k: _unplain(v) for k, v in obj.items()}
  if isinstance(obj, list):
    return [_unplain(v) for v in obj]
  return obj


def _unsupported(path, leaf) -> CheckpointError:
  t = type(leaf)
  code = (
    " A function is code, not state: save only the arrays (Equinox: "
    "eqx.partition(model, eqx.is_array)[0]; Flax NNX: nnx.split(model)[1]) and rebuild "
    "the rest in code."
    if callable(leaf)
    else ""
  )
  return CheckpointError(
    f"Unsupported leaf at {keystr(path)}: {t.__module__}.{t.__qualname__}. fnckpt saves "
    "jax.Array (any dtype, typed PRNG keys included), numpy arrays and scalars, Python "
    "bool/int/float/complex/str/bytes/None, empty containers and numpy Generators. If this "
    "is a container, register it as a pytree node (jax.tree_util.register_dataclass or "
    "register_pytree_with_keys); otherwise convert it to one of these before saving." + code
  )


def leaf_record(index: int, path: Any, leaf: Any) -> tuple[_records.Leaf, Any]:
  """One leaf -> (its record, the array whose bytes must be stored or None).

  Array kinds get ``dtype``, ``shape``, ``source`` and ``sharding``, and no storage yet (the
  caller decides it: ``inline``, ``stored``, ``packed`` or ``pieces``); small values carry
  ``value`` (:func:`fnckpt._format.records.encode` gives the manifest's map).

  >>> leaf_record(0, (("dict", "step"),), 3)[0].value
  3
  """
  path = tuple(path)
  if leaf is None or (isinstance(leaf, (dict, list, tuple)) and len(leaf) == 0):
    t = "none" if leaf is None else type(leaf).__name__
    return _records.Leaf(
      index,
      path,
      "empty",
      type=t if t in ("none", "dict", "list", "tuple") else "tuple",
      name=f"{type(leaf).__module__}.{type(leaf).__qualname__}",
    ), None
  if isinstance(leaf, jax.Array):
    kind, impl, data = "array", None, leaf
    if is_key_array(leaf):
      kind, impl, data = "key", str(jax.random.key_impl(leaf)), jax.random.key_data(leaf)
    return _records.Leaf(
      index=index,
      path=path,
      kind=kind,
      dtype=_dtype_name(np.dtype(data.dtype)),
      shape=tuple(data.shape),
      source="jax",
      sharding=sharding_record(leaf.sharding),
      impl=impl,
    ), data
  if isinstance(leaf, np.ndarray):
    name = _stored_name(leaf.dtype)
    if name is None:
      raise CheckpointError(
        f"Unsupported numpy dtype {leaf.dtype} at {keystr(path)}: only bool, integer, "
        "float16/32/64, complex64/128 and ml_dtypes' types (bfloat16, int4, float8_*) are "
        "stored. Convert it before saving (e.g. longdouble with .astype(np.float64), strings "
        "to a list of str)."
      )
    return _records.Leaf(index, path, "array", name, leaf.shape, "numpy"), leaf
  return _value_record(index, path, leaf), None


def _value_record(index: int, path: Any, leaf: Any) -> _records.Leaf:
  """A leaf that is not an array: its value goes into the record."""
  if isinstance(leaf, np.generic):
    if _stored_name(leaf.dtype) is None:
      raise _unsupported(path, leaf)
    a = to_little_endian(np.asarray(leaf))
    return _records.Leaf(index, path, "npscalar", a.dtype.name, value=a.tobytes())
  if isinstance(leaf, _SCALARS):
    if isinstance(leaf, int) and not isinstance(leaf, bool) and not -(1 << 63) <= leaf < (1 << 64):
      return _records.Leaf(index, path, "bigint", value=int(leaf))
    t = type(leaf)
    base: type = next(b for b in _SCALARS if isinstance(leaf, b))
    return _records.Leaf(
      index,
      path,
      "scalar",
      type=base.__name__,
      value=base(leaf),
      subtype=None if t is base else f"{t.__module__}.{t.__qualname__}",
    )
  if isinstance(leaf, np.random.Generator):
    state = _plain(leaf.bit_generator.state)
    check_msgpackable(state, keystr(path))
    return _records.Leaf(index, path, "npgen", value=state)
  raise _unsupported(path, leaf)


def decode_value(leaf: _records.Leaf) -> Any:
  """A non-array leaf's value from its validated record."""
  kind = leaf.kind
  if kind == "empty":
    assert leaf.type is not None
    return {"none": None, "dict": {}, "list": [], "tuple": ()}[leaf.type]
  if kind in ("scalar", "bigint"):
    return leaf.value
  if kind == "npscalar":
    assert leaf.dtype is not None
    return checked_bools(np.frombuffer(leaf.value, dtype=dtype_of(leaf.dtype)), leaf)[0]
  if kind == "npgen":
    state = _unplain(leaf.value)
    try:
      bitgen = getattr(np.random, state["bit_generator"])()  # an allow-listed name
      bitgen.state = state
    except Exception as e:  # numpy checks the state itself
      raise CheckpointError(
        f"The numpy Generator at {leaf.where} has an invalid saved state "
        f"({type(e).__name__}: {e}); the checkpoint is damaged."
      ) from None
    return np.random.Generator(bitgen)
  raise CheckpointError(f"Leaf kind {kind!r} at {leaf.where} is not a plain value.")
