"""restore() and metadata().

restore matches the target to the saved leaves by key path (one error listing every problem),
then reads, for each array, only the slices this process's devices need, each distinct slice
once, under a host-memory budget, and places them with the target's shardings.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence, cast

import jax
import numpy as np

from .. import _state
from .._errors import CheckpointError, DamagedError
from .._format import leaves as _leaves
from .._format import perprocess as _perprocess
from .._format import records as _records
from .._format import tree as _tree
from .._io import attempt as _attempt
from .._io import commit as _commit
from .._io import paths as _paths
from .._layout import chunks as _chunks
from .._sources import source as _source
from .._sources.source import Source
from . import broadcast as _broadcast
from . import match_cache as _match_cache
from . import place as _place
from . import reshard as _reshard
from . import shardings as _shardings
from .options import RestoreOptions

__all__ = ["restore", "metadata", "CheckpointMetadata", "ArrayMetadata", "SavedSharding"]


@dataclasses.dataclass(frozen=True)
class SavedSharding:
  """How an array was sharded when saved: mesh axis names and sizes, and the PartitionSpec
  (``type`` is ``"named"``; ``"single"`` for one device; other JAX shardings by class name)."""

  type: str
  axes: tuple[str, ...] = ()
  sizes: tuple[int, ...] = ()
  spec: jax.sharding.PartitionSpec | None = None

  def to_sharding(self, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Sharding:
    """The same sharding on ``devices`` (default: all devices), if their count fits."""
    if self.type != "named":
      return jax.sharding.SingleDeviceSharding((devices or jax.devices())[0])
    mesh = jax.make_mesh(self.sizes, self.axes, devices=devices)
    return jax.sharding.NamedSharding(mesh, cast(jax.sharding.PartitionSpec, self.spec))


@_state.memo(None)  # one entry per PRNG implementation name
def _key_data_ndim(impl: str) -> int:
  """How many trailing dimensions a key of ``impl`` adds to its key data (abstract: no device
  work, no backend started)."""
  return len(jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl))).shape)


@dataclasses.dataclass(frozen=True)
class ArrayMetadata:
  """A saved array leaf: what :func:`fnckpt.metadata` returns in place of its data.

  ``dtype`` is the stored dtype; for a typed PRNG key (``impl`` set) ``shape``/``dtype`` are
  those of its key data. ``stored`` is ``"inline"`` or the directory inside the checkpoint."""

  shape: tuple[int, ...]
  dtype: np.dtype
  sharding: SavedSharding | None
  impl: str | None
  stored: str
  nbytes: int

  @property
  def key_shape(self) -> tuple[int, ...]:
    """The shape of the saved array as users see it: for a typed PRNG key array, without the
    trailing dimensions of its key data (``shape`` (8, 2) -> ``key_shape`` (8,))."""
    if self.impl is None:
      return self.shape
    return self.shape[: len(self.shape) - _key_data_ndim(self.impl)]


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
  """A checkpoint's description. ``tree``: nested dicts/lists with :class:`ArrayMetadata` for
  arrays and the values themselves for everything else. ``format``: ``"fnckpt"``, or
  ``"orbax"`` / ``"safetensors"`` for checkpoints of those libraries (their
  ``format_version``, ``created`` and ``process_count`` are 0: not recorded; an Orbax
  checkpoint's ``custom_metadata`` or a safetensors ``__metadata__`` is ``user_metadata``)."""

  location: str
  tree: Any
  user_metadata: Any
  format_version: int
  versions: dict[str, str]
  created: float
  process_count: int
  leaves: tuple[_records.Leaf, ...] = dataclasses.field(repr=False, default=())
  format: str = "fnckpt"


def _saved_sharding(rec: _records.Sharding | None) -> SavedSharding | None:
  if rec is None:
    return None
  if rec.type != "named":
    return SavedSharding(rec.type)
  return SavedSharding("named", rec.axes, rec.sizes, jax.sharding.PartitionSpec(*rec.spec))


def _array_metadata(rec: _records.Leaf) -> ArrayMetadata:
  assert rec.dtype is not None and rec.shape is not None  # (an array leaf's)
  dtype = _leaves.dtype_of(rec.dtype)
  shape = tuple(rec.shape)
  return ArrayMetadata(
    shape,
    dtype,
    _saved_sharding(rec.sharding),
    rec.impl,
    _storage_of(rec),
    _chunks.nbytes(shape, dtype.itemsize),
  )


def _storage_of(rec: _records.Leaf) -> str:
  """Where a leaf's bytes are: "inline", a zarr array's directory, or "pack <k>" (``k``: the
  index in the manifest's ``packs``)."""
  if rec.stored is not None:
    return rec.stored.dir
  if rec.packed is not None:
    return f"pack {rec.packed.pack}"
  if rec.pieces is not None:
    return "pieces"
  return "inline"


def metadata(path: str, *, storage_options: dict[str, Any] | None = None) -> CheckpointMetadata:
  """Describe a committed checkpoint without reading array data (also an Orbax PyTree
  checkpoint or safetensors, see :func:`restore`: their arrays' zarr metadata or headers are
  read, and Orbax scalars).

  >>> import numpy as np, fnckpt, tempfile
  >>> d = tempfile.mkdtemp()
  >>> _ = fnckpt.save({"w": np.zeros((2, 3), np.float32)}, f"{d}/c").wait()
  >>> fnckpt.metadata(f"{d}/c").tree["w"].shape
  (2, 3)
  """
  return metadata_at(_paths.Location.of(path, storage_options))


def metadata_at(where: _paths.Location) -> CheckpointMetadata:
  """:func:`metadata` of the checkpoint at ``where``."""
  src = _source.open_any(where)
  return _describe(src.location, src.manifest, src.format)


def _describe(
  location: str, manifest: _records.Manifest, format: str = "fnckpt"
) -> CheckpointMetadata:
  leaves = manifest.leaves
  values = [
    _array_metadata(r)
    if r.is_array
    else _perprocess.PerProcess(None)
    if r.kind == "perprocess"
    else _leaves.decode_value(r)
    for r in leaves
  ]
  tree = _tree.unflatten_from_paths([r.path for r in leaves], values)
  return CheckpointMetadata(
    location=location,
    tree=tree,
    user_metadata=manifest.metadata,
    format_version=manifest.version,
    versions=dict(manifest.versions),
    created=manifest.created,
    process_count=manifest.process_count,
    leaves=leaves,
    format=format,
  )


# --- what the target asks for, per leaf ----------------------------------------------------


@dataclasses.dataclass
class _Want:
  rec: _records.Leaf
  host: bool = True  # numpy result (no sharding)
  sharding: jax.sharding.Sharding | None = None
  final: Any = None  # moved there once placed (_shardings.Placement)
  dtype: np.dtype | None = None
  value: Any = None  # for non-array targets: the target leaf
  array_target: bool = True
  from_scalar: bool = False  # a saved scalar into a 0-d array target


def _is_sharding_tree(target: Any) -> bool:
  leaves = jax.tree_util.tree_leaves(target)
  return bool(leaves) and all(isinstance(l, jax.sharding.Sharding) for l in leaves)


def _prefix_shardings(
  location: str, target: Any, records: list[_records.Leaf], partial: bool
) -> list[_Want]:
  """A prefix tree of shardings: each array gets the sharding of its nearest prefix. Every
  prefix must lead to saved leaves (else a TreeMismatchError); with ``partial=True`` only the
  leaves under some prefix are restored."""
  if isinstance(target, jax.sharding.Sharding):
    by_prefix, names = {(): target}, {(): "<root>"}
  else:
    pairs, _ = _tree.flatten(target)
    by_prefix = {_tree.match_key(p): s for p, s in pairs}
    names = {_tree.match_key(p): _tree.keystr(p) for p, _ in pairs}
  wants, used, problems, resolver = [], set(), [], _shardings.Resolver()
  for rec in records:
    key = _tree.match_key(rec.path)
    found = next((key[:i] for i in range(len(key), -1, -1) if key[:i] in by_prefix), None)
    if found is None and partial:
      continue
    used.add(found)
    placement = _shardings.Placement(None)
    if found is not None and rec.is_array:
      try:
        placement = resolver.leaf(rec.where, by_prefix[found], _saved_shape(rec))
      except CheckpointError as e:
        problems.append(str(e))
    wants.append(
      _Want(
        rec, host=placement.sharding is None, sharding=placement.sharding, final=placement.final
      )
    )
  missing = [names[k] for k in by_prefix if k not in used]
  if missing or problems:
    raise _tree.mismatch_error(
      location,
      missing=missing,
      mismatched=problems,
      hint="fnckpt.metadata(path).tree shows what the checkpoint holds.",
    )
  return wants


def _saved_shape(rec: _records.Leaf) -> tuple[int, ...]:
  """The shape a target sharding must hold: the array's, or a PRNG key array's key shape."""
  return tuple(cast(tuple, rec.shape)) if rec.kind != "key" else _array_metadata(rec).key_shape


def _target_spec(leaf: Any) -> tuple[str, Any, Any]:
  """(kind, shape, dtype) of a target leaf; kind 'array', 'key', 'host' or 'value'."""
  if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      return "key", tuple(leaf.shape), None
    return "array", tuple(leaf.shape), np.dtype(leaf.dtype)
  if isinstance(leaf, np.ndarray):  # byte order is not part of the dtype asked for
    return "host", tuple(leaf.shape), leaf.dtype.newbyteorder("=")
  if isinstance(leaf, jax.sharding.Sharding):
    return "array", None, None
  return "value", None, None


def _match(
  location: str, records: list[_records.Leaf], pairs, treedef, partial: bool, cast: bool
) -> tuple[list[_Want], Any]:
  """Each target leaf (``pairs``, flattened) matched to its saved leaf: what to read and where
  it goes; every mismatch raised at once (a TreeMismatchError naming each key path)."""
  rec_keys = [_tree.match_key(r.path) for r in records]
  pair_keys = [_tree.match_key(p) for p, _ in pairs]
  by_key = dict(zip(rec_keys, records))
  missing, mismatched, wants, resolver = [], [], [], _shardings.Resolver()
  for (path, leaf), key in zip(pairs, pair_keys):
    rec = by_key.get(key)
    if rec is None:
      missing.append(_tree.keystr(path))
      continue
    try:
      want = _want(leaf, rec, cast, resolver)
    except CheckpointError as e:  # a target sharding that cannot be resolved (names where)
      mismatched.append(str(e))
      continue
    if isinstance(want, str):
      mismatched.append(f"{_tree.keystr(path)}: {want}")
    else:
      wants.append(want)
  unexpected = []
  if not partial:
    wanted = set(pair_keys)
    unexpected = [_tree.keystr(r.path) for r, k in zip(records, rec_keys) if k not in wanted]
  if missing or unexpected or mismatched:
    hint = (
      "To restore a subset of the checkpoint, pass partial=True."
      if unexpected and not missing and not mismatched
      else "fnckpt.metadata(path).tree shows what the checkpoint holds."
    )
    raise _tree.mismatch_error(
      location, missing=missing, unexpected=unexpected, mismatched=mismatched, hint=hint
    )
  return wants, treedef


def _want(leaf: Any, rec: _records.Leaf, cast: bool, resolver: _shardings.Resolver) -> _Want | str:
  """What to read for one target leaf, or why the saved leaf cannot fill it (a target
  sharding that cannot be resolved raises a CheckpointError naming the key path)."""
  if isinstance(leaf, _perprocess.PerProcess) or rec.kind == "perprocess":
    return _per_process_problem(leaf, rec) or _Want(rec, value=leaf.value, array_target=False)
  kind, shape, dtype = _target_spec(leaf)
  if kind == "key":
    if rec.kind != "key":
      return f"the target is a PRNG key array, the checkpoint holds {_saved_desc(rec)}"
    key_shape = _array_metadata(rec).key_shape
    if shape != key_shape:
      return f"key shape {key_shape} saved, {shape} in the target"
    placed = resolver.leaf(rec.where, leaf, key_shape)
    return _Want(rec, host=False, sharding=placed.sharding, final=placed.final)
  if kind == "value":
    if rec.is_array and not isinstance(leaf, (bool, int, float, complex)):
      return f"the target is {type(leaf).__name__}, the checkpoint holds {_saved_desc(rec)}"
    return _Want(rec, value=leaf, array_target=False, host=rec.is_array)
  if rec.kind in ("scalar", "npscalar") and shape in (None, ()):
    # e.g. flax's TrainState.step: a Python int when saved, a 0-d array in
    # jax.eval_shape(init) (or after a jitted step)
    problem = _scalar_problem(rec, dtype, cast)
    placed = _placement(resolver, rec, leaf, kind, ())
    return problem or _Want(
      rec,
      host=kind == "host",
      sharding=placed.sharding,
      final=placed.final,
      dtype=dtype,
      from_scalar=True,
    )
  if rec.kind != "array":
    return f"the target is an array, the checkpoint holds {_saved_desc(rec)}"
  assert rec.shape is not None and rec.dtype is not None
  saved_shape, saved_dtype = tuple(rec.shape), _leaves.dtype_of(rec.dtype)
  if shape is not None and shape != saved_shape:
    return f"shape {saved_shape} saved, {shape} in the target"
  if dtype is not None and dtype != saved_dtype and not cast:
    return f"dtype {saved_dtype} saved, {dtype} in the target (pass cast=True to convert)"
  placed = _placement(resolver, rec, leaf, kind, saved_shape)
  return _Want(rec, host=kind == "host", sharding=placed.sharding, final=placed.final, dtype=dtype)


def _placement(
  resolver: _shardings.Resolver, rec: _records.Leaf, leaf: Any, kind: str, shape: tuple[int, ...]
) -> _shardings.Placement:
  if kind == "host":
    return _shardings.Placement(None)
  return resolver.leaf(rec.where, leaf, shape)


def _per_process_problem(leaf: Any, rec: _records.Leaf) -> str:
  if not isinstance(leaf, _perprocess.PerProcess):
    return (
      "the checkpoint holds per-process values (fnckpt.PerProcess) here; put "
      "fnckpt.PerProcess(None) (or a template of the value) in the target"
    )
  if rec.kind != "perprocess":
    return f"the target is fnckpt.PerProcess, the checkpoint holds {_saved_desc(rec)}"
  return ""


def _scalar_problem(rec: _records.Leaf, dtype: np.dtype | None, cast: bool) -> str:
  """Why a saved scalar cannot fill a 0-d array target of ``dtype`` ('' if it can): it must
  be a number of the same kind (bool, integer in range, floating, complex) unless cast."""
  value = _leaves.decode_value(rec)
  if isinstance(value, (str, bytes)):
    return f"the target is an array, the checkpoint holds {_saved_desc(rec)}"
  if dtype is None or cast:
    return ""
  saved = np.asarray(value)
  if saved.dtype == dtype:
    return ""
  kind = {"b": "b", "i": "i", "u": "i", "f": "f", "c": "c"}
  target_kind = "f" if "float" in dtype.name else kind.get(dtype.kind)
  if rec.kind == "scalar" and kind.get(saved.dtype.kind) == target_kind:
    if target_kind != "i" or np.iinfo(dtype).min <= value <= np.iinfo(dtype).max:
      return ""
  return (
    f"{_saved_desc(rec)} {value!r} saved, a {dtype} array in the target (pass cast=True to convert)"
  )


def _saved_desc(rec: _records.Leaf) -> str:
  """What a saved leaf is, with its article: 'an array float32[4, 2]', 'None', 'a str value'."""
  if rec.kind in ("array", "key"):
    what = "a PRNG key array" if rec.kind == "key" else "an array"
    return f"{what} {rec.dtype}{list(cast(tuple, rec.shape))}"
  if rec.kind == "scalar":
    return f"a{'n' if rec.type == 'int' else ''} {rec.type} value"
  if rec.kind == "empty":
    return "None" if rec.type == "none" else f"an empty {rec.type}"
  return {
    "npgen": "a numpy Generator",
    "bigint": "an int value",
    "perprocess": "per-process values (fnckpt.PerProcess)",
    "npscalar": f"a numpy {rec.dtype} scalar",
  }[rec.kind]


# --- reading -----------------------------------------------------------------------------


def _data_sharding(want: _Want, rec: _records.Leaf) -> jax.sharding.Sharding | None:
  """For a PRNG key: the sharding of its key data (trailing dimensions unsharded)."""
  s = want.sharding
  if rec.kind != "key" or s is None:
    return s
  assert rec.shape is not None
  trailing = len(rec.shape) - len(_array_metadata(rec).key_shape)
  if isinstance(s, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(
      s.mesh,
      jax.sharding.PartitionSpec(
        *s.spec, *([None] * (len(rec.shape) - len(s.spec) - trailing)), *([None] * trailing)
      ),
    )
  if isinstance(s, jax.sharding.SingleDeviceSharding):
    return s
  raise CheckpointError(
    f"PRNG key at {rec.where}: only NamedSharding or "
    "SingleDeviceSharding targets are supported for key arrays."
  )


def restore(
  path: str,
  target: Any = None,
  *,
  partial: bool = False,
  cast: bool = False,
  budget_bytes: int | None = None,
  per_process_from: int | None = None,
  storage_options: dict[str, Any] | None = None,
  broadcast: bool | None = None,
  barrier_timeout_s: float = _commit.DEFAULT_BARRIER_TIMEOUT_S,
) -> Any:
  """Restore a committed checkpoint.

  Args:
    path: the checkpoint's location (as given to :func:`fnckpt.save`). Also an Orbax PyTree
      checkpoint (its item directory, or a step directory holding one PyTree item), a
      ``.safetensors`` file, a ``model.safetensors.index.json``, or a directory of
      ``.safetensors`` files (tensor names split on ``.`` are the key paths), with the same
      matching rules.
    target: what to restore into. ``None``: host values in plain containers (dicts for dict
      keys and attributes, lists for sequences): every array as a writable ``np.ndarray``,
      typed PRNG keys as key arrays on the default device, scalars, strings, None, empty
      containers and numpy Generators as saved. A pytree of ``jax.ShapeDtypeStruct`` (with
      ``sharding``; none: the default device) or of arrays: the same tree, each array
      placed with that sharding (a different mesh, device count or PartitionSpec than saved
      is fine). A ``Sharding`` or a prefix tree of them: every array below it placed so.
      ``np.ndarray`` leaves give numpy results; other leaves (ints, strings, None) take the
      saved value; a 0-d array target takes a saved Python number.
    partial: allow the target to hold only a subset of the checkpoint's key paths.
    cast: convert arrays whose saved dtype differs from the target's (else an error).
    budget_bytes: bytes of reads in flight (default: 128 MiB, enough to keep a disk or an
      object store busy; a slice larger than this is read alone).
    per_process_from: the saved process whose :class:`fnckpt.PerProcess` values this process
      takes (default: its own index; required when the process count changed).
    storage_options: settings for ``gs://``/``s3://``.
    broadcast: with several processes, read each stored byte of an array that the target
      replicates across processes once (spread over the replica groups) and fill the other
      replicas over the interconnect (a jitted reshard: collective, every process must
      restore). ``False``: every process reads all it holds. ``None`` (default): on when the
      target replicates some array across processes and the devices are accelerators or the
      checkpoint is on ``gs://``/``s3://`` (docs/guides/multi-process.md: CPU processes reading
      local files are faster without). Same values either way.
    barrier_timeout_s: deadline of each broadcast wave (its barrier and its collective); a
      process lost during the broadcast fails every other with a CheckpointError naming it.

  >>> import jax, jax.numpy as jnp, numpy as np, fnckpt, tempfile
  >>> d = tempfile.mkdtemp()
  >>> _ = fnckpt.save({"w": jnp.arange(8.0)}, f"{d}/c").wait()
  >>> target = {"w": jax.ShapeDtypeStruct(
  ...     (8,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))}
  >>> fnckpt.restore(f"{d}/c", target)["w"].sum()
  Array(28., dtype=float32)
  """
  where = _paths.Location.of(path, storage_options)
  options = RestoreOptions(
    partial=partial,
    cast=cast,
    budget_bytes=budget_bytes,
    per_process_from=per_process_from,
    broadcast=broadcast,
    barrier_timeout_s=barrier_timeout_s,
  )
  return restore_at(where, target, options)


def restore_at(
  where: _paths.Location, target: Any = None, options: RestoreOptions | None = None
) -> Any:
  """:func:`restore` of the checkpoint at ``where`` as ``options`` ask (None: the
  defaults)."""
  options = options if options is not None else RestoreOptions()
  with _state.collector.paused():  # (tens of thousands of objects made: docs/performance.md)
    return _restore(where, target, options)


def _restore(where: _paths.Location, target: Any, options: RestoreOptions) -> Any:
  """:func:`restore`, the collector paused; a collective one (:func:`_collective`) inside
  its attempt (:mod:`fnckpt._io.attempt`: a failure on any process fails every process)."""
  on = _collective(where, target, options)
  with _attempt.collective(where.display, "restore", options.barrier_timeout_s, on):
    return _restore_in(where, target, options)


def _collective(where: _paths.Location, target: Any, options: RestoreOptions) -> bool:
  """Whether this restore may broadcast (so is collective), from what every process has
  before anything can fail: several processes, a target, and ``broadcast`` (or its
  default's rule) on. Then it always starts with the attempt's agreement."""
  return (
    jax.process_count() > 1
    and target is not None
    and _broadcast.decide(
      options.broadcast,
      [None],  # (as if some leaf were replicated across processes)
      cpu=jax.devices()[0].platform == "cpu",
      remote=where.display.startswith(("gs://", "s3://")),
    )
  )


def _restore_in(where: _paths.Location, target: Any, options: RestoreOptions) -> Any:
  src = _source.open_any(where)
  location, records = src.location, list(src.manifest.leaves)
  if target is None:
    wants, treedef = [_Want(r) for r in records], None
  elif _is_sharding_tree(target):
    wants, treedef = _prefix_shardings(location, target, records, options.partial), None
  else:
    wants, treedef = _match_cache.matched(
      location,
      records,
      target,
      partial=options.partial,
      cast=options.cast,
      match=_match,
      want=lambda leaf, rec: _want(leaf, rec, options.cast, _shardings.Resolver()),
    )

  values = _read_all(src, wants, options.budget(), options.broadcast, options.barrier_timeout_s)
  _fill_per_process(src, wants, values, options.per_process_from)
  if treedef is None:
    return _tree.unflatten_from_paths([w.rec.path for w in wants], values)
  return jax.tree_util.tree_unflatten(treedef, values)


def _read_all(
  src: Source, wants: list[_Want], budget: int, broadcast: bool | None, timeout_s: float
) -> list[Any]:
  """Every wanted leaf's value: plain values decoded, arrays read (at most ``budget`` bytes
  held) and placed with their shardings (``_place``); with broadcast, the arrays replicated
  across processes read once and resharded in waves (:func:`_read_broadcast`). PerProcess
  leaves are left for :func:`_fill_per_process`."""
  values: list[Any] = [None] * len(wants)
  reads: dict[int, _place.Read] = {}
  for i, w in enumerate(wants):
    if w.rec.kind == "perprocess":
      continue
    if w.rec.is_array:
      reads[i] = _start_read(w)
    else:
      values[i] = _plain_value(w)
  readers = _readers(reads)
  if not _broadcast.decide(
    broadcast,
    readers,
    cpu=jax.devices()[0].platform == "cpu",
    remote=src.location.startswith(("gs://", "s3://")),
  ):
    readers = {}
  _attempt.agree(waves=bool(readers), plan=_plan_entries(wants, reads))  # (barrier 0)
  local = {i: r for i, r in reads.items() if i not in readers}

  def read_local() -> None:
    _place.read_arrays(src, local, budget)
    for i, r in local.items():
      values[i] = _finish_leaf(r.want, _assembled(r))

  if readers:  # (a failure reading these is published at the first wave: see below)
    _read_broadcast(src, reads, readers, values, budget, timeout_s, before=read_local)
  else:
    read_local()
  return values


def _plan_entries(wants: list[_Want], reads: dict[int, _place.Read]) -> list[tuple[str, str]]:
  """What every process of a collective restore must agree on, per leaf: its key path, and
  the target's shape, dtype and sharding (with its devices' order) when it spans processes,
  else how it is held (a process's own leaves may differ)."""
  out = []
  for i, w in enumerate(wants):
    r = reads.get(i)
    if r is None or r.sharding is None or r.sharding.is_fully_addressable:
      what = w.rec.kind if r is None else "host" if r.sharding is None else "on this process"
    else:
      ids = [d.id for d in getattr(r.sharding, "_device_assignment", ())]
      what = f"{w.dtype}{list(r.shape)} {r.sharding} on devices {ids}"
    out.append((_tree.keystr(w.rec.path), what))
  return out


def _readers(reads: dict[int, _place.Read]) -> dict[int, _broadcast.Reader]:
  """The read-once plans of the leaves that have one (stored bytes, a target replicated
  across processes)."""
  out: dict[int, _broadcast.Reader] = {}
  if jax.process_count() == 1:  # (reader_of: None for every leaf)
    return out
  for i, r in reads.items():
    rec = r.want.rec
    if r.sharding is None or rec.inline is not None:
      continue
    align = (
      rec.stored.inner
      if rec.stored is not None
      else rec.pieces.chunks
      if rec.pieces is not None
      else None
    )
    reader = _broadcast.reader_of(
      r.sharding,
      r.shape,
      _leaves.dtype_of(rec.dtype).itemsize,
      packed=rec.packed is not None,
      align=align,
    )
    if reader is not None:
      out[i] = reader
  return out


def _read_broadcast(
  src: Source,
  reads: dict[int, _place.Read],
  readers: dict[int, _broadcast.Reader],
  values: list[Any],
  budget: int,
  timeout_s: float,
  before: Callable[[], None],
) -> None:
  """The leaves of ``readers``, wave by wave: each process reads its parts (onto the reader
  shardings), then one collective reshard per wave fills the replicas. A wave holds at most
  ``budget`` reader bytes per process (one larger leaf alone): the memory the reshard adds.

  Whatever fails on this process before a wave's barrier (``before``: the leaves read
  without broadcast; the wave's reads; the previous wave's leaves finished) is published
  there (:func:`_reshard.failed`), so the others raise at once instead of at the deadline."""
  _reshard.start(src.location)
  finish: list[tuple[int, Any]] = []
  for k, wave in enumerate(_broadcast.waves(readers, budget)):
    _reshard.reading(src.location, k)
    try:
      if k == 0:
        before()
      for i, value in finish:
        values[i] = _finish_leaf(reads[i].want, value)
      parts = {
        i: dataclasses.replace(reads[i], sharding=readers[i].sharding, sliced=True, parts={})
        for i in wave
      }
      _place.read_arrays(src, parts, budget)
      assembled = [_assembled(parts[i]) for i in wave]
    except Exception as e:
      _reshard.failed(src.location, k, e, timeout_s)
      raise
    moved = _reshard.reshard(
      assembled,
      [readers[i].target for i in wave],
      [reads[i].want.rec.where for i in wave],
      src.location,
      k,
      timeout_s,
    )
    finish = list(zip(wave, moved))
  for i, value in finish:  # (past the last collective: a failure here waits for no one)
    values[i] = _finish_leaf(reads[i].want, value)
  _reshard.done(src.location)


def _assembled(r: _place.Read) -> Any:
  """A read leaf as one value: placed whole, a host array, or its device slices made one
  global array."""
  if r.placed is not None:  # placed whole (packed, inline)
    return r.placed
  if None in r.parts:  # a host target
    return r.parts[None]
  assert r.sharding is not None  # (a device target's)
  parts = [r.parts[d] for d in r.sharding.addressable_devices]
  return jax.make_array_from_single_device_arrays(  # dtype: for none on this process
    r.shape,
    r.sharding,
    parts,
    dtype=parts[0].dtype if parts else r.want.dtype or _leaves.dtype_of(r.want.rec.dtype),
  )


def _plain_value(w: _Want) -> Any:
  """A non-array leaf's value (or, for a 0-d array target, the saved number as an array)."""
  rec = w.rec
  keep_target = not w.array_target and rec.kind == "empty"
  value = w.value if keep_target else _leaves.decode_value(rec)
  if not w.from_scalar:
    return value
  host = np.asarray(value)
  host = host if w.dtype is None else _leaves.cast(host, w.dtype, w.rec.where)
  if w.host:
    return host
  value = _place.place(
    host, w.sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  )
  return value if w.final is None else _move(w, value)


def _start_read(w: _Want) -> _place.Read:
  sharding = None if w.host else _data_sharding(w, w.rec)
  if sharding is None and not w.host:
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  assert w.rec.shape is not None
  return _place.Read(w, tuple(w.rec.shape), sharding)


def _fill_per_process(
  src: Source, wants: list[_Want], values: list[Any], source: int | None
) -> None:
  """Each ``fnckpt.PerProcess`` leaf: this process's own saved value (or ``source``'s)."""
  mine = [i for i, w in enumerate(wants) if w.rec.kind == "perprocess"]
  if not mine:
    return
  saved, first = src.manifest.process_count, wants[mine[0]].rec.where
  if source is None:
    if saved != jax.process_count():
      raise CheckpointError(
        f"{first} holds fnckpt.PerProcess values of {saved} processes, but this job has "
        f"{jax.process_count()}. Pass restore(..., per_process_from=<a saved process index>) "
        "to choose whose values each process takes."
      )
    source = jax.process_index()
  if not isinstance(source, int) or not 0 <= source < saved:
    raise CheckpointError(
      f"per_process_from={source!r}: the checkpoint at {src.location!r} "
      f"was saved by processes 0..{saved - 1}."
    )
  key = _perprocess.values_key(cast(str, src.manifest.data), source)  # (format 2 on)
  where = f"{src.location}/{key}"
  try:
    got = src.kv.read(key).result()
    problem = "" if got.state == "value" else "missing"
  except Exception as e:
    got, problem = None, f"unreadable ({type(e).__name__}: {_paths.redact(str(e))})"
  if problem:
    if not _commit.unchanged(src.kv, src.commit):
      raise _commit.changed_error(src.location)
    error = DamagedError if problem == "missing" else CheckpointError
    raise error(
      f"The per-process values of process {source} ({where}) are {problem}: the "
      "checkpoint is damaged. Restore an earlier one."
    )
  assert got is not None
  leaves = _perprocess.decode(got.value, where)
  for i in mine:
    values[i] = _perprocess.value_at(leaves, wants[i].rec.path, wants[i].value, where)


def _finish_leaf(w: _Want, value: Any) -> Any:
  rec = w.rec
  if rec.kind == "key":
    if isinstance(value, np.ndarray):
      value = jax.numpy.asarray(value)
    value = jax.random.wrap_key_data(value, impl=rec.impl)
    return value if w.final is None else _move(w, value)
  if not w.array_target:  # e.g. a Python scalar target for a saved 0-d array
    t = type(w.value)
    if isinstance(w.value, (bool, int, float, complex)) and np.ndim(value) == 0:
      return t(np.asarray(value).item())
    return np.asarray(value)
  if isinstance(value, np.ndarray) and not w.host:
    return jax.device_put(value)
  return value if w.final is None else _move(w, value)


def _move(w: _Want, value: jax.Array) -> jax.Array:
  """A placed array moved to the target's memory kind or layout (``_Want.final``)."""
  try:
    return jax.device_put(value, w.final)
  except Exception as e:
    raise CheckpointError(
      f"{w.rec.where}: restored, but cannot be moved to the target's "
      f"{w.final} ({type(e).__name__}: {e}); give this key path a "
      "sharding of device memory."
    ) from None
