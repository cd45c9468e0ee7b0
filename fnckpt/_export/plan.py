"""PURE: which saved leaves become which safetensors tensors, in which file, at which offsets.

:func:`plan` takes a checkpoint's validated leaf records and the export options and returns a
:class:`Plan`: every output file with its header bytes (written first) and its tensors in data
order, the ``model.safetensors.index.json`` of a sharded export, the header's
``__metadata__``, and the key paths that were left out. Everything that cannot be exported is
found here, before a byte is read or written: one :class:`CheckpointError` lists every key
path whose dtype safetensors cannot hold, every name collision, and an empty selection.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``,
padded with spaces to a multiple of 8), then the tensors' bytes back to back, C order,
little endian, offsets relative to the end of the header.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Mapping, Sequence

import numpy as np

from .._errors import CheckpointError
from .._format import records as _records

__all__ = [
  "SAFETENSORS_DTYPES",
  "Tensor",
  "OutFile",
  "Plan",
  "plan",
  "parse_size",
  "DEFAULT_MAX_SHARD_SIZE",
  "INDEX_NAME",
]

# Saved dtype -> safetensors dtype name: exactly the names the ``safetensors`` library
# (0.8) writes for these numpy/ml_dtypes types (tests/test_export.py checks each against it).
SAFETENSORS_DTYPES = {
  "bool": "BOOL",
  "uint8": "U8",
  "int8": "I8",
  "uint16": "U16",
  "int16": "I16",
  "uint32": "U32",
  "int32": "I32",
  "uint64": "U64",
  "int64": "I64",
  "float16": "F16",
  "bfloat16": "BF16",
  "float32": "F32",
  "float64": "F64",
  "float8_e4m3fn": "F8_E4M3",
  "float8_e5m2": "F8_E5M2",
  "float8_e4m3fnuz": "F8_E4M3FNUZ",
  "float8_e5m2fnuz": "F8_E5M2FNUZ",
  "float8_e8m0fnu": "F8_E8M0",
  "complex64": "C64",
}
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # Hugging Face's "5GB"
MAX_HEADER_BYTES = 100_000_000  # the safetensors library refuses larger headers
INDEX_NAME = "model.safetensors.index.json"
_UNITS = {
  "": 1,
  "B": 1,
  "KB": 10**3,
  "MB": 10**6,
  "GB": 10**9,
  "TB": 10**12,
  "KIB": 1 << 10,
  "MIB": 1 << 20,
  "GIB": 1 << 30,
  "TIB": 1 << 40,
}


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One exported tensor: its name, the saved leaf, the dtype written (the saved one or the
  cast's) and its byte range in the file's data section."""

  name: str
  leaf: _records.Leaf
  dtype: str
  begin: int
  end: int

  @property
  def shape(self) -> tuple[int, ...]:
    assert self.leaf.shape is not None
    return tuple(self.leaf.shape)


@dataclasses.dataclass(frozen=True)
class OutFile:
  """One output file: its name (relative to the output directory, or the output file itself),
  its whole header (length prefix included) and its tensors in data order."""

  name: str
  header: bytes
  tensors: tuple[Tensor, ...]

  @property
  def size(self) -> int:
    return len(self.header) + (self.tensors[-1].end if self.tensors else 0)


@dataclasses.dataclass(frozen=True)
class Plan:
  files: tuple[OutFile, ...]
  index: bytes | None  # model.safetensors.index.json (sharded output only)
  metadata: Mapping[str, str]  # every file's __metadata__
  skipped: tuple[str, ...]  # "<key path>: why" for leaves left out
  total_bytes: int  # tensor data bytes, all files


def parse_size(size: int | str) -> int:
  """A byte count: an int, or a string like ``"5GB"`` (10^9) or ``"512MiB"`` (2^20).

  >>> parse_size("5GB"), parse_size("512MiB"), parse_size(1000)
  (5000000000, 536870912, 1000)
  """
  if isinstance(size, int) and not isinstance(size, bool):
    n = size
  else:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
    if not m or m.group(2) not in _UNITS:
      raise CheckpointError(
        f"max_shard_size={size!r}: expected a number of bytes or a size "
        "like '5GB', '500MB' or '2GiB'."
      )
    n = int(float(m.group(1)) * _UNITS[m.group(2)])
  if n < 1:
    raise CheckpointError(f"max_shard_size={size!r}: it must be at least 1 byte.")
  return n


def _select_path(select: str | Sequence[Any] | None) -> tuple[str, ...]:
  if select is None:
    return ()
  parts = select.split(".") if isinstance(select, str) else [str(k) for k in select]
  if not all(parts):
    raise CheckpointError(
      f"select={select!r}: expected a key path like 'params' or "
      "'params.dense' (keys joined with '.'), with no empty key."
    )
  return tuple(parts)


def _selected(
  leaves: Sequence[_records.Leaf], select: tuple[str, ...], select_arg: Any, location: str
) -> list[tuple[_records.Leaf, tuple[str, ...]]]:
  """The leaves under ``select``, each with its key path relative to it (a selected leaf:
  its own last key)."""
  n, out = len(select), []
  for leaf in leaves:
    keys = tuple(str(k) for _, k in leaf.path)
    if keys[:n] == select:
      out.append((leaf, keys[n:] or keys[-1:]))
  if not out and select:
    tops = sorted({str(l.path[0][1]) for l in leaves if l.path})
    raise CheckpointError(
      f"select={select_arg!r} matches no key path of the checkpoint at {location!r}; its "
      f"top-level keys are {tops[:20]}. Select one of them (keys joined with '.', e.g. "
      "'params.dense'); `fnckpt inspect` lists every key path."
    )
  return out


def _name(rel: tuple[str, ...], rename: Sequence[tuple[str, str]], prefix: str) -> str:
  name = ".".join(rel)
  for old, new in rename:  # longest first; whole keys only
    if name == old or name.startswith(old + "."):
      name = (new + name[len(old) :]).lstrip(".") if new else name[len(old) + 1 :]
      break
  return f"{prefix}.{name}" if prefix and name else prefix or name


def _rename_pairs(rename: Mapping[str, str] | None) -> list[tuple[str, str]]:
  pairs = [(str(o).strip("."), str(n).strip(".")) for o, n in (rename or {}).items()]
  if any(not o for o, _ in pairs):
    raise CheckpointError(
      f"rename={rename!r}: every OLD must be a non-empty key prefix "
      "(use prefix= to prepend to every name)."
    )
  return sorted(pairs, key=lambda p: -len(p[0]))


def _is_float(name: str) -> bool:
  """Floating point, ml_dtypes' types included (numpy's issubdtype misses bfloat16, fp8)."""
  import jax.numpy as jnp

  return bool(jnp.issubdtype(_records.np_dtype(name), jnp.floating))


def _out_dtype(leaf: _records.Leaf, cast: str | None) -> str | None:
  """The dtype written for an array leaf: the cast for floating leaves, else its own."""
  if cast is not None and leaf.dtype is not None and _is_float(leaf.dtype):
    return cast
  return leaf.dtype if leaf.dtype in SAFETENSORS_DTYPES else None


def _check_cast(dtype: Any) -> str | None:
  if dtype is None:
    return None
  try:
    name = _records.np_dtype(
      str(np.dtype(dtype).name if not isinstance(dtype, str) else dtype)
    ).name
  except Exception:
    name = None
  if name not in SAFETENSORS_DTYPES or not _is_float(name):
    floats = [d for d in SAFETENSORS_DTYPES if _is_float(d)]
    raise CheckpointError(
      f"dtype={dtype!r}: expected a floating dtype safetensors holds: {', '.join(floats)}."
    )
  return name


def _meta_value(leaf: _records.Leaf) -> str | None:
  """A scalar's text for ``__metadata__`` (None: not a number, bool or string)."""
  if leaf.kind == "bigint":
    return str(leaf.value)  # values are strings (the safetensors library refuses numbers)
  if leaf.kind == "npscalar":
    assert leaf.dtype is not None
    dt = _records.np_dtype(leaf.dtype)
    if not (np.issubdtype(dt, np.integer) or _is_float(dt.name) or dt == bool):  # noqa: E721
      return None
    return json.dumps(np.frombuffer(leaf.value, dtype=dt)[0].item())
  if leaf.kind == "scalar" and leaf.type in ("bool", "int", "float", "str"):
    return leaf.value if leaf.type == "str" else json.dumps(leaf.value)
  return None


def _classify(picked, cast, rename, prefix):
  """(tensors as (name, leaf, dtype), metadata, skipped, refusals)."""
  tensors, metadata, skipped, refused = [], {"format": "pt"}, [], []
  for leaf, rel in picked:
    name = _name(rel, rename, prefix)
    if leaf.kind == "key":
      refused.append(
        f"{leaf.where}: a PRNG key array ({leaf.impl}); safetensors holds plain arrays only"
      )
    elif leaf.kind == "array":
      dtype = _out_dtype(leaf, cast)
      if dtype is None:
        refused.append(f"{leaf.where}: dtype {leaf.dtype}, which safetensors cannot hold")
      else:
        tensors.append((name, leaf, dtype))
    elif (text := _meta_value(leaf)) is not None and name not in metadata:
      metadata[name] = text
    elif text is not None:
      skipped.append(f"{leaf.where}: its name {name!r} is taken in __metadata__")
    else:
      skipped.append(
        f"{leaf.where}: {leaf.kind} {leaf.type or ''}".rstrip()
        + " (not an array, number or string)"
      )
  return tensors, metadata, skipped, refused


def _check_names(tensors, metadata, location: str) -> None:
  seen: dict[str, str] = {}
  problems = []
  for name, leaf, _ in tensors:
    if not name:
      problems.append(
        f"{leaf.where}: its name is empty (the checkpoint is one array, or "
        "rename= left nothing of it); give prefix="
      )
    elif name == "__metadata__" or name in seen:
      other = seen.get(name, "the header's __metadata__")
      problems.append(
        f"{leaf.where}: its name {name!r} is also that of {other}; rename= or "
        "prefix= can tell them apart"
      )
    seen.setdefault(name, leaf.where)
  if problems:
    raise CheckpointError(
      f"Cannot export the checkpoint at {location!r} to safetensors:\n  " + "\n  ".join(problems)
    )


def _split(tensors: list, max_size: int | None) -> list[list]:
  """Tensors into files in checkpoint order, a new file when the next tensor would take the
  current one past ``max_size`` (a tensor larger than that gets a file of its own)."""
  files: list[list] = [[]]
  size = 0
  for t in tensors:
    n = t[1].nbytes * _records.itemsize(t[2]) // _records.itemsize(t[1].dtype)
    if max_size is not None and files[-1] and size + n > max_size:
      files.append([])
      size = 0
    files[-1].append(t)
    size += n
  return files


def _header(entries: list, metadata: Mapping[str, str], where: str) -> tuple[bytes, tuple]:
  """A file's header bytes and its :class:`Tensor` records. Tensors are laid out largest
  element size first (a stable order otherwise), so with the 8-byte-aligned data section every
  tensor starts at a multiple of its element size, as the safetensors library lays them out."""
  entries = sorted(entries, key=lambda t: -_records.itemsize(t[2]))
  body: dict[str, Any] = {"__metadata__": dict(metadata)}
  out, offset = [], 0
  for name, leaf, dtype in entries:
    n = math.prod(leaf.shape) * _records.itemsize(dtype)
    out.append(Tensor(name, leaf, dtype, offset, offset + n))
    body[name] = {
      "dtype": SAFETENSORS_DTYPES[dtype],
      "shape": list(leaf.shape),
      "data_offsets": [offset, offset + n],
    }
    offset += n
  text = json.dumps(body, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)
  if len(text) > MAX_HEADER_BYTES:
    raise CheckpointError(
      f"The safetensors header of {where} would be {len(text)} bytes, more than the "
      f"{MAX_HEADER_BYTES} the safetensors library reads. Export to a directory with a "
      "smaller max_shard_size (fewer tensors per file)."
    )
  return len(text).to_bytes(8, "little") + text, tuple(out)


def plan(
  leaves: Sequence[_records.Leaf],
  location: str,
  *,
  single: str | None,
  select: str | Sequence[Any] | None = None,
  dtype: Any = None,
  prefix: str | None = None,
  rename: Mapping[str, str] | None = None,
  max_shard_size: int | str | None = None,
) -> Plan:
  """The export of ``leaves`` (a checkpoint's records): one file named ``single``, or (None)
  shards ``model-0000i-of-0000N.safetensors`` with an index.

  >>> from fnckpt._format import records as _records
  >>> leaf = _records.Leaf(0, (("dict", "w"),), "array", "float32", (2,), inline=bytes(8))
  >>> p = plan([leaf], "ckpt", single="w.safetensors", prefix="model")
  >>> [(t.name, t.dtype, t.begin, t.end) for t in p.files[0].tensors], p.files[0].size
  ([('model.w', 'float32', 0, 8)], 112)
  """
  if single and max_shard_size is not None:
    raise CheckpointError(
      f"max_shard_size={max_shard_size!r} applies to a directory output; "
      f"{single!r} is one file. Give a directory name to get shards."
    )
  cast = _check_cast(dtype)
  picked = _selected(leaves, _select_path(select), select, location)
  tensors, metadata, skipped, refused = _classify(
    picked, cast, _rename_pairs(rename), (prefix or "").strip(".")
  )
  if refused:
    raise CheckpointError(
      f"Cannot export the checkpoint at {location!r} to safetensors:\n  "
      + "\n  ".join(refused)
      + "\nExport a subtree without these leaves (select='params', "
      "or `fnckpt export --select params`); a floating dtype can also be converted with "
      "dtype='bfloat16'."
    )
  _check_names(tensors, metadata, location)
  groups = _split(tensors, None if single else parse_size(max_shard_size or DEFAULT_MAX_SHARD_SIZE))
  names = (
    [single]
    if single
    else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
  )
  files = tuple(OutFile(n, *_header(g, metadata, n)) for n, g in zip(names, groups))
  total = sum(f.tensors[-1].end for f in files if f.tensors)
  index = None
  if not single:
    weight_map = {t.name: f.name for f in files for t in f.tensors}
    index = json.dumps(
      {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2
    ).encode()
  return Plan(files, index, metadata, tuple(skipped), total)
