"""Pack chunks written straight to local files, past the page cache (``O_DIRECT``).

A pack chunk's file (:class:`fnckpt._layout.shard.ShardImage`: inner chunks with their
crc32c, then the index) is assembled in place in a page-aligned host buffer, its checksums
filled in here, and written with one ``O_DIRECT`` write, the same bytes TensorStore's zarr3
driver would write. Through the page cache the same write first had the kernel take fresh
pages for the whole file (measured on the bench machine: 64 MiB took 150-200 ms before its
``fsync``, against 50 ms written direct), and TensorStore first copied the chunk into its
transaction (into fresh memory). Only for ``file`` locations (other stores go through
TensorStore), and only where ``O_DIRECT`` and the ``crc32c`` module exist; a file system that
refuses ``O_DIRECT`` (tmpfs) gets the same bytes written through the page cache.

Durability as TensorStore's file kvstore does it: the bytes go to ``<key>.__lock``, which is
``fsync``-ed, renamed to ``<key>``, and the directory ``fsync``-ed. The manifest of a local
checkpoint is written so too (:func:`write_bytes`: 9.9 MB for 2,000 leaves with 1,000 inline).
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from typing import Any

import numpy as np

from .. import _state
from .._layout.shard import CRC_BYTES, ShardImage

try:  # (a dependency; without it packs are written through TensorStore as before)
  import crc32c as _crc32c
except ImportError:  # pragma: no cover
  _crc32c = None  # type: ignore[assignment]

__all__ = [
  "ALIGN",
  "local_root",
  "chunk_path",
  "aligned_size",
  "encode",
  "write_chunk",
  "write_file",
  "write_bytes",
]

# Bytes: the buffer's address and the write's length are multiples of this (every device's
# logical block size divides it).
ALIGN = 4096


def local_root(kv_spec: dict[str, Any]) -> str | None:
  """The directory of a local location whose pack chunks are written here (``None``: through
  TensorStore: another store, a kvstore with options, no ``O_DIRECT``, no ``crc32c``, or
  turned off by ``_state.hooks.direct_writes``).

  >>> local_root({"driver": "memory", "path": "x/"}) is None
  True
  """
  if (
    not _state.hooks.direct_writes
    or not _crc32c_works()
    or not hasattr(os, "O_DIRECT")
    or kv_spec.get("driver") != "file"
    or set(kv_spec) != {"driver", "path"}
  ):
    return None
  return kv_spec["path"]


def _crc32c_works() -> bool:
  """The ``crc32c`` module is there and computes (with ``CRC32C_SW_MODE=none`` on a CPU
  without the instruction every call raises: then TensorStore writes, as without it)."""
  try:
    return _crc32c is not None and _crc32c.crc32c(b"123456789") == 0xE3069283
  except Exception:  # (any failure: not used)
    return False


def chunk_path(root: str, pack_dir: str, k: int) -> str:
  """The file of chunk ``k`` of the pack at ``pack_dir`` (zarr3 default key encoding).

  >>> chunk_path("/ckpt/", "data-0/p/0", 1)
  '/ckpt/data-0/p/0/c/1'
  """
  return f"{root}{pack_dir.strip('/')}/c/{k}"


def aligned_size(image: ShardImage | int) -> int:
  """The buffer bytes a chunk's file (or a file of that many bytes) is assembled in (its size
  rounded up to :data:`ALIGN`).

  >>> aligned_size(ShardImage(8, 16, 4)), aligned_size(4097)
  (4096, 8192)
  """
  n = image.size if isinstance(image, ShardImage) else image
  return -(-n // ALIGN) * ALIGN


def encode(buf: np.ndarray, image: ShardImage) -> None:
  """Fill in ``buf``'s checksums and index (its inner chunks' bytes are in place)."""
  step = image.inner + CRC_BYTES
  crcs = np.empty(image.stored, "<u4")
  for k in range(image.stored):
    at = k * step
    crcs[k] = _crc32c.crc32c(buf[at : at + image.inner])  # type: ignore[arg-type]  # (numpy's stubs)
  slots = buf[: image.index_offset].reshape(image.stored, step)[:, image.inner :]
  slots[:] = crcs.view(np.uint8).reshape(image.stored, CRC_BYTES)
  index = image.index().view(np.uint8).reshape(-1)
  at = image.index_offset
  buf[at : at + index.nbytes] = index
  end = at + index.nbytes
  buf[end : end + CRC_BYTES] = np.array([_crc32c.crc32c(index)], "<u4").view(np.uint8)  # type: ignore[arg-type]
  buf[image.size :] = 0  # (the aligned write's tail, truncated away: no stale bytes on disk)


def write_chunk(path: str, image: ShardImage, buf: np.ndarray) -> None:
  """Write the chunk assembled and :func:`encode`-d in ``buf`` (:func:`aligned_size` bytes,
  :data:`ALIGN`-aligned) to ``path``, durably. It needs the GIL only between its system
  calls (the caller encodes: a thread waiting for the GIL before each of 64 checksums while
  the writer thread builds the manifest was seen to start its write 100 ms late)."""
  write_file(path, buf, image.size)


def write_bytes(path: str, data: bytes, buf: np.ndarray) -> None:
  """Write ``data`` as the file ``path`` (the manifest), durably, through ``buf`` (at least
  :func:`aligned_size` of it, :data:`ALIGN`-aligned: its bytes are overwritten)."""
  n = len(data)
  buf[:n] = np.frombuffer(data, np.uint8)
  buf[n:] = 0
  write_file(path, buf, n)


def write_file(path: str, buf: np.ndarray, size: int) -> None:
  """Write ``buf[:size]`` as the file ``path`` (``buf`` whole with ``O_DIRECT``, then cut to
  ``size``), ``fsync`` it, rename it into place and ``fsync`` the directory. The bytes go
  first to a temporary file of this write's own (``*.__lock``: hidden from TensorStore's
  listings, removed if the write fails), so two writers of one key never share a file."""
  parent = os.path.dirname(path)
  _make_dir(parent)
  tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex}.__lock"
  fd = _open(tmp)
  try:
    try:
      _write_all(fd, memoryview(buf).cast("B"), size)  # type: ignore[arg-type]  # (numpy's stubs)
      os.ftruncate(fd, size)
      os.fsync(fd)
    finally:
      os.close(fd)
    os.rename(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise
  _fsync_dir(parent)


def _open(path: str) -> int:
  flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
  try:
    return os.open(path, flags | os.O_DIRECT, 0o666)
  except OSError as e:
    if e.errno != errno.EINVAL:  # (EINVAL: the file system refuses O_DIRECT)
      raise
    return os.open(path, flags, 0o666)


def _write_all(fd: int, data: memoryview, size: int) -> None:
  """Write ``data`` (all of it while ``O_DIRECT`` holds; through the page cache only
  ``data[:size]``, once the file system refused an aligned write)."""
  at, end = 0, len(data)
  while at < end:
    try:
      n = os.write(fd, data[at:end])
    except OSError as e:
      direct = os.O_DIRECT & _fcntl_flags(fd)
      if e.errno != errno.EINVAL or not direct:
        raise
      _set_flags(fd, _fcntl_flags(fd) & ~os.O_DIRECT)
      end = size
      continue
    if n <= 0:
      raise OSError(errno.EIO, f"write() wrote nothing at byte {at} of {end}")
    at += n


def _fcntl_flags(fd: int) -> int:
  import fcntl  # (POSIX only, as O_DIRECT)

  return fcntl.fcntl(fd, fcntl.F_GETFL)


def _set_flags(fd: int, flags: int) -> None:
  import fcntl

  fcntl.fcntl(fd, fcntl.F_SETFL, flags)


def _make_dir(path: str) -> None:
  """``path`` exists (each directory created with its parent ``fsync``-ed: the chunk may be
  written before TensorStore creates the pack's ``zarr.json``, and its directory)."""
  if os.path.isdir(path):
    return
  parent = os.path.dirname(path)
  if parent != path:
    _make_dir(parent)
  try:
    os.mkdir(path)
  except FileExistsError:
    return
  _fsync_dir(parent)


def _fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)
