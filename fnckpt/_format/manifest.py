"""PURE: the manifest and commit marker <-> msgpack bytes; versioning; validation.

The manifest is one msgpack map (schema in docs/format.md). The commit marker holds the
manifest's SHA-256, so a reader trusts a manifest only if the marker names it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack

from .._errors import CheckpointError, DamagedError
from . import parse as _parse
from . import records as _records

__all__ = [
  "FORMAT_NAME",
  "FORMAT_VERSION",
  "READ_VERSION",
  "MANIFEST",
  "COMMIT",
  "DATA_DIR",
  "encode",
  "decode",
  "pack",
  "encode_commit",
  "decode_commit",
  "digest",
  "check_msgpackable",
]

FORMAT_NAME = "fnckpt"
FORMAT_VERSION = 3  # the format save writes
READ_VERSION = 3  # the newest format this fnckpt reads (docs/format.md)
MANIFEST = "manifest.msgpack"
COMMIT = "COMMIT"
DATA_DIR = "d"  # format 1: arrays at d/<n>/
DATA_PREFIX = "data-"  # format 2: a save's data under data-<32 hex digits>/


def pack(obj: Any, size_hint: int = 0) -> bytes:
  """Plain data -> msgpack bytes, as manifests and commit markers are written (no validation:
  tools and tests that write a manifest by hand use it). ``size_hint``: about the bytes it
  packs to; the packer's buffer starts that large (``packb`` grows one by doubling and
  copying: 27-87 ms for a 10 MB manifest here, against 3-7 ms packed into one buffer).

  >>> unpack(pack({"a": b"xy"}, size_hint=1 << 20))
  {'a': b'xy'}
  """
  if size_hint > _PACK_BUFFER:
    try:
      packer = msgpack.Packer(use_bin_type=True, strict_types=False, buf_size=size_hint)
    except TypeError:  # (msgpack before 1.1: no buf_size)
      return msgpack.packb(obj, use_bin_type=True, strict_types=False)
    return packer.pack(obj)
  return msgpack.packb(obj, use_bin_type=True, strict_types=False)


# Bytes: a manifest estimated larger than this is packed into a buffer of its estimated size.
_PACK_BUFFER = 1 << 20


def unpack(data: bytes) -> Any:
  """msgpack bytes -> Python data (maps with int keys kept, lists for arrays)."""
  return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)


def digest(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def check_msgpackable(value: Any, where: str) -> None:
  """Raise a clear error unless ``value`` is plain msgpack data (None, bool, int, float, str,
  bytes, lists/tuples and dicts with str/int keys of these)."""
  if value is None or isinstance(value, (bool, float, str, bytes)):
    return
  if isinstance(value, int):
    if not -(1 << 63) <= value < (1 << 64):
      raise CheckpointError(f"{where}: integer {value} does not fit in 64 bits; store it as a str.")
    return
  if isinstance(value, (list, tuple)):
    for i, v in enumerate(value):
      check_msgpackable(v, f"{where}[{i}]")
    return
  if isinstance(value, dict):
    for k, v in value.items():
      if not isinstance(k, (str, int)):
        raise CheckpointError(f"{where}: key {k!r} must be str or int.")
      check_msgpackable(v, f"{where}[{k!r}]")
    return
  raise CheckpointError(
    f"{where}: value of type {type(value).__name__} cannot be stored as metadata; use "
    "None, bool, int, float, str, bytes, lists and dicts of these."
  )


def encode(manifest: _records.Manifest) -> bytes:
  """A manifest record (format 2) -> its bytes (:func:`records.encode`, msgpack).

  >>> m = _records.Manifest(2, 0.0, 1, {}, None, (), "data-0")
  >>> decode(encode(m), "x") == m
  True
  """
  if not isinstance(manifest, _records.Manifest):
    raise TypeError(
      f"manifest.encode takes a records.Manifest, not {type(manifest).__name__} "
      "(manifest.pack writes plain data)"
    )
  return pack(_records.encode(manifest), _size_hint(manifest))


def _size_hint(manifest: _records.Manifest) -> int:
  """About the bytes ``manifest`` packs to (its inline leaves, and a few hundred bytes a
  leaf), rounded up a little: one buffer holds it, or grows once.

  >>> _size_hint(_records.Manifest(2, 0.0, 1, {}, None, (), "data-0"))
  65536
  """
  inline = sum(len(l.inline) for l in manifest.leaves if l.inline is not None)
  return (inline + 512 * len(manifest.leaves)) * 9 // 8 + (64 << 10)


def decode(data: bytes, location: str) -> _records.Manifest:
  """Bytes -> validated :class:`_records.Manifest`: a clear error for corrupt bytes, a foreign
  file, a checkpoint from a newer format version, or any invalid field."""
  try:
    manifest = unpack(data)
  except Exception as e:  # msgpack raises several unrelated types
    raise DamagedError(
      f"The manifest of {location!r} is corrupt ({type(e).__name__}: {e}). The checkpoint "
      "cannot be read; restore an earlier one."
    ) from None
  _check_header(manifest, location, "manifest")
  return _parse.parse(manifest, location, READ_VERSION)


def _check_header(obj: Any, location: str, what: str) -> None:
  if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
    raise DamagedError(
      f"The {what} of {location!r} is corrupt or not an fnckpt {what} (no "
      f"'format': '{FORMAT_NAME}' header)."
    )
  version = obj.get("version")
  if not isinstance(version, int) or isinstance(version, bool) or version < 1:
    raise DamagedError(f"The {what} of {location!r} is corrupt: no format version.")
  if version > READ_VERSION:
    raise CheckpointError(
      f"{location!r} was written in fnckpt format version {version}, newer than this fnckpt "
      f"reads (up to {READ_VERSION}). Upgrade fnckpt: pip install -U fnckpt."
    )


def encode_commit(
  manifest_bytes: bytes, committed_at: float, version: int = FORMAT_VERSION
) -> bytes:
  """The commit marker: names the manifest it commits by hash (``version``: the manifest's)."""
  return pack(
    {
      "format": FORMAT_NAME,
      "version": version,
      "manifest_sha256": digest(manifest_bytes),
      "committed": committed_at,
    }
  )


def decode_commit(data: bytes, location: str) -> dict[str, Any]:
  try:
    commit = unpack(data)
  except Exception as e:
    raise DamagedError(f"The commit marker of {location!r} is corrupt ({e}).") from None
  _check_header(commit, location, "commit marker")
  if not isinstance(commit.get("manifest_sha256"), str) or not isinstance(
    commit.get("committed", 0.0), (int, float)
  ):
    raise DamagedError(f"The commit marker of {location!r} is corrupt: no manifest hash.")
  return commit
