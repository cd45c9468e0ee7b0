"""What a save is asked to do, as one record: :class:`SaveOptions`, made once where
:func:`fnckpt.save` (or the manager) is called, checked as it is made, and passed down to
``save.start`` and the planner. What is saved (the tree, its metadata, the base) and where
(a :class:`fnckpt._io.paths.Location`) are not options."""

from __future__ import annotations

import dataclasses

from .._errors import CheckpointError
from .._io import arrays as _arrays
from .._io import commit as _commit
from .._layout import packing as _packing

__all__ = ["SaveOptions", "INLINE_BYTES"]

# Arrays of at most this many bytes are stored inside the manifest (no files of their own).
INLINE_BYTES = 16 << 10


@dataclasses.dataclass(frozen=True, kw_only=True)
class SaveOptions:
  """The keyword options of :func:`fnckpt.save` (see there), checked when made: a bad size
  or compression raises the :class:`~fnckpt.CheckpointError` ``save`` raises. Hashable and
  compared by value; ``codecs`` is derived from ``compression`` and ``zstd``.

  >>> SaveOptions(zstd=3).codecs, SaveOptions(pack_bytes=0).pieces
  ((3, None), False)
  >>> SaveOptions(inline_bytes=-1)  # doctest: +ELLIPSIS
  Traceback (most recent call last):
  ...
  fnckpt._errors.CheckpointError: save(inline_bytes=-1): expected an int in [0, 1073741824] ...
  """

  overwrite: bool = False
  budget_bytes: int | None = None  # checked when the save starts (its default is measured)
  inline_bytes: int = INLINE_BYTES
  pack_bytes: int = _packing.PACK_LEAF_BYTES
  compression: str | None = None
  zstd: int | None = None
  barrier_timeout_s: float = _commit.DEFAULT_BARRIER_TIMEOUT_S
  codecs: _arrays.Codecs = dataclasses.field(init=False, compare=False, repr=False)

  def __post_init__(self) -> None:
    _check_sizes(self.inline_bytes, self.pack_bytes)
    try:
      codecs = _arrays.compression_options(self.compression, self.zstd)
    except ValueError as e:
      raise CheckpointError(str(e)) from None
    object.__setattr__(self, "codecs", codecs)

  @property
  def pieces(self) -> bool:
    """Whether small shards of sharded arrays go into the packs (docs/format.md "Pieces")."""
    return self.pack_bytes > 0 and not any(self.codecs)


def _check_sizes(inline_bytes: object, pack_bytes: object) -> None:
  for name, v, hi, default in (
    ("inline_bytes", inline_bytes, 1 << 30, INLINE_BYTES),
    ("pack_bytes", pack_bytes, _packing.PACK_CHUNK_BYTES, _packing.PACK_LEAF_BYTES),
  ):
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= hi:
      raise CheckpointError(
        f"save({name}={v!r}): expected an int in [0, {hi}] (bytes); the default is {default}."
      )
