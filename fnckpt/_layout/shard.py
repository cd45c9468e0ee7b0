"""PURE: the bytes of one pack chunk's file, as zarr3 ``sharding_indexed`` lays them out.

A pack (docs/format.md) is a 1-D ``uint8`` zarr3 array whose chunks are shards of ``inner``-byte
inner chunks, inner codecs ``bytes`` + ``crc32c``, index codecs ``bytes`` + ``crc32c``, index at
the end. The file of a chunk holding ``nbytes`` bytes of the array (the last chunk may hold
fewer than ``chunk``) is, as TensorStore writes it:

* each stored inner chunk ``k`` in order (``k < ceil(nbytes / inner)``: every inner chunk of
  the array's bytes, zeros too), its ``inner`` bytes then their crc32c (``u32`` little-endian),
  at ``k * (inner + 4)``;
* the index: per inner chunk of the whole chunk grid (``chunk // inner`` of them), its
  ``u64`` offset and ``u64`` length, little-endian (both ``2**64 - 1`` for one not stored),
  then the crc32c of the index.

:class:`ShardImage` maps a chunk's bytes to their place in that file, so the file can be
assembled in place and written as is (``fnckpt._io.direct``). Nothing here reads or writes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["ShardImage", "CRC_BYTES", "MISSING"]

CRC_BYTES = 4
MISSING = (1 << 64) - 1  # an index entry's offset and length for an inner chunk not stored


@dataclasses.dataclass(frozen=True)
class ShardImage:
  """The file of one pack chunk: ``nbytes`` of the array's bytes (a multiple of ``inner``, as
  packs are padded to ``inner``) in a chunk of ``chunk`` bytes (a multiple of ``inner``).

  >>> s = ShardImage(8, 16, 4)
  >>> s.stored, s.index_offset, s.size
  (2, 16, 84)
  >>> s.place(2, 4)   # chunk bytes [2, 6) cross an inner chunk's end
  [(2, 0, 2), (8, 2, 2)]
  """

  nbytes: int
  chunk: int
  inner: int

  def __post_init__(self) -> None:
    if not self.fits(self.nbytes, self.chunk, self.inner):
      raise ValueError(f"not a pack chunk: {self}")

  @staticmethod
  def fits(nbytes: int, chunk: int, inner: int) -> bool:
    """Whether a chunk of these sizes has a :class:`ShardImage` (else TensorStore writes it).

    >>> ShardImage.fits(8, 16, 4), ShardImage.fits(6, 16, 4)
    (True, False)
    """
    return inner > 0 and chunk % inner == 0 and nbytes % inner == 0 and 0 < nbytes <= chunk

  @property
  def stored(self) -> int:
    """Inner chunks stored (those of the array's bytes)."""
    return self.nbytes // self.inner

  @property
  def entries(self) -> int:
    """Index entries: every inner chunk of the chunk grid."""
    return self.chunk // self.inner

  @property
  def index_offset(self) -> int:
    return self.stored * (self.inner + CRC_BYTES)

  @property
  def size(self) -> int:
    """The file's bytes."""
    return self.index_offset + 16 * self.entries + CRC_BYTES

  def data_offset(self, k: int) -> int:
    """Where inner chunk ``k``'s bytes start in the file (its crc32c follows them)."""
    return k * (self.inner + CRC_BYTES)

  def place(self, offset: int, n: int) -> list[tuple[int, int, int]]:
    """Chunk bytes ``[offset, offset + n)`` in the file: ``(file offset, offset from the
    start of the range, length)`` per inner chunk they touch, in order."""
    if offset < 0 or n < 0 or offset + n > self.nbytes:
      raise ValueError(f"bytes [{offset}, {offset + n}) are not in {self}")
    out, at = [], offset
    while at < offset + n:
      k, within = divmod(at, self.inner)
      take = min(self.inner - within, offset + n - at)
      out.append((self.data_offset(k) + within, at - offset, take))
      at += take
    return out

  def index(self) -> np.ndarray:
    """The index entries (``(entries, 2)`` little-endian ``u64``: offset, length).

    >>> ShardImage(4, 8, 4).index().tolist()
    [[0, 8], [18446744073709551615, 18446744073709551615]]
    """
    out = np.full((self.entries, 2), MISSING, "<u8")
    k = np.arange(self.stored, dtype=np.uint64)
    out[: self.stored, 0] = k * np.uint64(self.inner + CRC_BYTES)
    out[: self.stored, 1] = self.inner + CRC_BYTES
    return out
