"""Two storage tiers: frequent saves to a fast local directory, fewer to durable storage.

``CheckpointManager(directory, local_directory=FAST, local_save_interval_steps=k,
save_interval_steps=n)``: every ``k``-th step is saved to ``FAST/<step>/`` (the caller waits
only for that save's staging, as for any save). Every ``n``-th (durable) step:

- with one process, is saved to ``FAST`` too and, once committed, copied to
  ``directory/<step>/`` in the background by :func:`copy_step` (no second device-to-host copy:
  the bytes come from the committed local checkpoint, after checking that every object its
  manifest names is there; a bounded number of objects and bytes in flight; ``COMMIT`` last).
  A durable save due while the previous copy is pending waits for it (back-pressure).
- with several processes, is saved by every process straight to ``directory`` (a collective
  save, each process its own chunks), not copied: a local directory per host holds only that
  host's chunks, so a copy by one process would commit an incomplete step.

Both tiers hold the same format, so ``directory`` is an ordinary run directory. The local
tier must not be, or overlap, ``directory`` (:func:`check_separate`). Each process keeps its
own local directory trimmed (:meth:`LocalTier.retain`).

Recovery (:func:`choose`): each process reports the steps committed in *its* local
directory; the step restored is the newest one that is either committed locally on every
process or committed in ``directory``. Each process then reads it from its local copy when it
has one, else from ``directory`` (both hold the same bytes), and falls back to the durable
copy of the same step when its local copy is damaged.

"Restorable from local" means a complete checkpoint: the local directory must be one every
process of the job reads whole (one host: a tmpfs or NVMe path shared by that host's
processes; one process: also ``memory://``). With one local directory per host on several
hosts each holds only the chunks its host wrote (and only process 0's holds the commit
marker), so no local step is complete on every process: then :mod:`fnckpt._manager.held`
and :mod:`fnckpt._manager.peers` restore the newest step the shards every process holds
(replicas included, written beside each local save) cover together, moving them between
processes over the interconnect; else ``directory``, with a warning naming the step skipped.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import threading
import time
import warnings
from typing import Any, Mapping, Sequence

from .._errors import CheckpointError, DamagedError
from .._format import manifest as _manifest
from .._io import paths as _paths
from . import fork as _fork
from .retention_runner import RetentionError, delete_referenced
from .steps import StepIndex

__all__ = ["TierPolicy", "LocalTier", "choose", "copy_step", "check_separate", "expected_keys"]


def _at_least(name: str, value: Any, low: int) -> int:
  if not isinstance(value, int) or isinstance(value, bool) or value < low:
    raise ValueError(f"{name} must be an int >= {low}, got {value!r}.")
  return value


@dataclasses.dataclass(frozen=True)
class TierPolicy:
  """Which steps go to the local tier (every ``local_every``-th) and how many of its step
  directories are kept (the newest ``local_max_to_keep``).

  >>> p = TierPolicy(local_every=2)
  >>> [s for s in range(7) if p.local_due(s)]
  [0, 2, 4, 6]
  """

  local_every: int
  local_max_to_keep: int = 2

  def __post_init__(self):
    _at_least("local_save_interval_steps", self.local_every, 1)
    _at_least("local_max_to_keep", self.local_max_to_keep, 1)

  def local_due(self, step: int) -> bool:
    return step % self.local_every == 0

  def local_to_delete(self, local_steps: Sequence[int], protect: set[int]) -> list[int]:
    """Local steps beyond the newest ``local_max_to_keep``, except ``protect`` (copies
    pending).

    >>> TierPolicy(1, local_max_to_keep=2).local_to_delete([1, 2, 3, 4], protect={1})
    [2]
    """
    keep = set(sorted(local_steps)[-self.local_max_to_keep :]) | protect
    return [s for s in sorted(local_steps) if s not in keep]


def choose(
  local_steps: Sequence[Sequence[int]],
  durable_steps: Sequence[int],
  skipped: set[int] | frozenset[int] = frozenset(),
) -> int | None:
  """PURE: the newest step every process can restore: committed in the local tier of every
  process (``local_steps[p]``), or committed in the durable tier; not in ``skipped``.

  >>> choose([[4, 6], [4, 6]], [2])          # both hosts hold 6 locally
  6
  >>> choose([[4, 6], []], [2])              # process 1's host was replaced: durable 2
  2
  >>> choose([[4, 6], [6]], [2], skipped={6})
  2
  """
  common = set(local_steps[0]) if local_steps else set()
  for steps in local_steps[1:]:
    common &= set(steps)
  return max((common | set(durable_steps)) - set(skipped), default=None)


def expected_keys(manifest: Any) -> list[str]:
  """PURE: every object a committed format-2 checkpoint with this parsed manifest
  (:class:`fnckpt._format.records.Manifest`) must hold besides its manifest and marker: each stored
  array's and pack's ``zarr.json`` and one file per chunk of its grid (``sharding_indexed``:
  one shard file per chunk, default ``c/i/j`` keys), and ``pp/<p>`` of every process when a
  leaf is per-process.

  >>> from fnckpt._format import records as _records
  >>> m = _records.Manifest(2, 0.0, 1, {}, None, (), "data-0",
  ...                       (_records.Pack("data-0/p/0", 10, 8, 8),))
  >>> expected_keys(m)
  ['data-0/p/0/zarr.json', 'data-0/p/0/c/0', 'data-0/p/0/c/1']
  """
  keys: list[str] = []
  grids = [(p.dir, (p.nbytes,), (p.chunk,)) for p in manifest.packs if p.base is None]
  grids += [
    (l.stored.dir, l.shape, l.stored.chunks)
    for l in manifest.leaves
    if l.stored and l.stored.base is None
  ]  # referenced data: copy_referenced
  for where, shape, chunks in grids:
    where = where.strip("/")
    keys.append(f"{where}/zarr.json")
    counts = [-(-n // c) for n, c in zip(shape, chunks)]
    keys += (
      [
        f"{where}/c/" + "/".join(map(str, cell))
        for cell in itertools.product(*(range(n) for n in counts))
      ]
      if all(counts)
      else []
    )
  if manifest.data and any(l.kind == "perprocess" for l in manifest.leaves):
    keys += [f"{manifest.data}/pp/{p}" for p in range(manifest.process_count)]
  return keys


def _spec_key(path: str, options: Mapping[str, Any] | None) -> tuple[str, str]:
  """(the kvstore spec without its path, its path ending in "/"): two locations overlap when
  the first parts are equal and one path starts with the other."""
  spec = dict(_paths.kvstore_spec(path, options))
  where = str(spec.pop("path", "")).rstrip("/") + "/"
  return json.dumps(spec, sort_keys=True, default=str), where


def check_separate(
  local_root: str,
  local_options: Mapping[str, Any] | None,
  durable_root: str,
  durable_options: Mapping[str, Any] | None,
) -> None:
  """Raise :class:`CheckpointError` when the local tier is the durable directory or lies
  inside (or around) it: each durable copy would replace the step it copies.

  >>> check_separate("/tmp/run", None, "/tmp/run/", None)
  Traceback (most recent call last):
  ...
  fnckpt._errors.CheckpointError: local_directory '/tmp/run' is the durable directory '/tmp/run' or overlaps it; each durable copy would delete the step it copies. Pass a local_directory outside it (e.g. a tmpfs or NVMe path).
  """  # noqa: E501 (a doctest's expected error)
  (a_store, a), (b_store, b) = (
    _spec_key(local_root, local_options),
    _spec_key(durable_root, durable_options),
  )
  if a_store == b_store and (a.startswith(b) or b.startswith(a)):
    raise CheckpointError(
      f"local_directory {_paths.display(local_root)!r} is the durable directory "
      f"{_paths.display(durable_root)!r} or overlaps it; each durable copy would delete the "
      "step it copies. Pass a local_directory outside it (e.g. a tmpfs or NVMe path)."
    )


def _checked_source(src: Any, src_path: str, dst_path: str) -> tuple[bytes, list[str]]:
  """The commit marker of the local checkpoint and the keys to copy; raises
  :class:`DamagedError` unless it is committed, its manifest matches the marker, and every
  object the manifest names is there."""
  commit = src.read(_manifest.COMMIT).result()
  if commit.state != "value":
    raise DamagedError(
      f"Cannot copy {_paths.display(src_path)!r} to "
      f"{_paths.display(dst_path)!r}: it is not committed (its "
      f"{_manifest.COMMIT} is missing)."
    )
  manifest = src.read(_manifest.MANIFEST).result()
  want = _manifest.decode_commit(bytes(commit.value), src_path)["manifest_sha256"]
  if manifest.state != "value" or _manifest.digest(bytes(manifest.value)) != want:
    raise DamagedError(
      f"The manifest of {_paths.display(src_path)!r} is missing or does not "
      "match its commit marker; it was not copied."
    )
  parsed = _manifest.decode(bytes(manifest.value), _paths.display(src_path))
  keys = {k.decode("utf-8", "surrogateescape") for k in src.list().result()}
  missing = [k for k in expected_keys(parsed) if k not in keys]
  if missing:
    raise DamagedError(
      f"The local checkpoint {_paths.display(src_path)!r} is incomplete: {len(missing)} "
      f"object(s) its manifest names are missing (e.g. {missing[0]!r}); it was not copied "
      f"and nothing was committed in the durable tier. Check it with fnckpt verify "
      f"{_paths.display(src_path)}."
    )
  return bytes(commit.value), sorted(keys - {_manifest.COMMIT})


def copy_step(
  src_root: str,
  dst_root: str,
  step: int,
  src_options: Mapping[str, Any] | None,
  dst_options: Mapping[str, Any] | None,
  concurrency: int = 32,
  max_bytes: int = 256 << 20,
) -> int:
  """Copy the committed checkpoint ``src_root/<step>`` to ``dst_root/<step>`` (replacing
  whatever is there, its marker first), ``concurrency`` objects and about ``max_bytes`` in
  flight, ``COMMIT`` last; return the bytes copied. Refuses (:class:`DamagedError`, nothing
  committed) a source that is not committed, whose manifest does not match its marker or that
  lacks an object its manifest names, and (:class:`CheckpointError`) overlapping roots."""
  check_separate(src_root, src_options, dst_root, dst_options)
  src_run, dst_run = (
    _paths.Location.of(src_root, src_options),
    _paths.Location.of(dst_root, dst_options),
  )
  src_path, dst_path = src_run.join(str(step)).path, dst_run.join(str(step)).path
  try:
    src = _paths.open_kvstore(src_run.join(str(step)))
    dst = _paths.open_kvstore(dst_run.join(str(step)))
    commit, keys = _checked_source(src, src_path, dst_path)
    _paths.clear(dst, first=(_manifest.COMMIT,))
    copied = _copy_keys(src, dst, keys, concurrency, max_bytes)
    if _checked_source(src, src_path, dst_path)[0] != commit:  # nothing vanished or changed
      # meanwhile
      raise DamagedError(
        f"{_paths.display(src_path)!r} was saved again while being copied; "
        "the copy was not committed."
      )
    manifest = bytes(src.read(_manifest.MANIFEST).result().value)  # checked against commit above
    copied += copy_referenced(
      src_root=src_root,
      dst_root=dst_root,
      step=step,
      manifest=manifest,
      src_options=src_options,
      dst_options=dst_options,
      concurrency=concurrency,
    )
    dst.write(_manifest.COMMIT, commit).result()
  except CheckpointError:
    raise
  except Exception as e:
    raise _paths.io_error(
      e, dst_path, f"copying step {step} from {_paths.display(src_path)!r}"
    ) from e
  return copied


def copy_referenced(
  src_root: str,
  dst_root: str,
  step: int,
  manifest: bytes,
  src_options: Mapping[str, Any] | None,
  dst_options: Mapping[str, Any] | None,
  concurrency: int = 32,
) -> int:
  """The data of other steps that ``step``'s manifest refers to (an incremental save's base),
  copied from ``src_root`` where ``dst_root`` lacks it: ``dst_root/<s>/<data>/`` as in the
  source, and ``dst_root/<s>/REFERENCED`` naming it when ``<s>`` is no committed step there
  (so the durable tier holds every byte its steps refer to; its retention drops that data
  once nothing refers to it). Returns the bytes copied."""
  copied = 0
  src_run, dst_run = (
    _paths.Location.of(src_root, src_options),
    _paths.Location.of(dst_root, dst_options),
  )
  for s, data in sorted(_fork.sibling_refs(src_run, step, manifest)):
    src = _paths.open_kvstore(src_run.join(str(s)))
    dst = _paths.open_kvstore(dst_run.join(str(s)))
    have = set(dst.list(range=_prefix_range(data)).result())
    keys = [k for k in src.list(range=_prefix_range(data)).result() if k not in have]
    if not keys and not have:
      raise DamagedError(
        f"Step {step} of {_paths.display(src_root)!r} refers to the data "
        f"{data} of step {s}, which is missing there; it was not copied."
      )
    if keys and dst.read(_manifest.COMMIT).result().state != "value":
      _fork.write_referenced(dst, {data})  # (first: never a leftover without a marker)
    copied += _copy_keys(
      src, dst, [k.decode("utf-8", "surrogateescape") for k in keys], concurrency
    )
  return copied


def _prefix_range(name: str) -> Any:
  """The keys under the directory ``name/``."""
  import tensorstore as ts

  return ts.KvStore.KeyRange(name + "/", name + "0")


def _copy_keys(
  src: Any, dst: Any, keys: list[str], concurrency: int, max_bytes: int = 256 << 20
) -> int:
  """Read and write ``keys`` with at most ``concurrency`` objects in flight, and a new read
  issued only while the bytes held (read, not yet written) plus the reads in flight (each
  counted as the largest object seen so far; the first alone) stay within ``max_bytes``; one
  object larger than the bound is copied alone. Returns the bytes copied."""
  todo = collections.deque(keys)
  reads: collections.deque[tuple[str, Any]] = collections.deque()  # (key, read)
  writes: collections.deque[tuple[Any, int]] = collections.deque()  # (write, bytes)
  held = copied = 0
  biggest: int | None = None  # None until a read has completed
  while todo or reads or writes:
    idle = not (reads or writes)
    room = (
      biggest is not None
      and len(reads) + len(writes) < concurrency
      and held + (len(reads) + 1) * biggest <= max_bytes
    )
    if todo and (idle or room):
      key = todo.popleft()
      reads.append((key, src.read(key)))
    elif reads and (reads[0][1].done() or not writes):
      key, read = reads.popleft()
      got = read.result()
      if got.state != "value":
        raise DamagedError(
          f"{key!r} vanished from the local checkpoint while being copied; "
          "nothing was committed in the durable tier."
        )
      n = len(got.value)
      writes.append((dst.write(key, got.value), n))
      held, copied, biggest = held + n, copied + n, max(biggest or 0, n)
    else:
      write, n = writes.popleft()
      write.result()
      held -= n
  return copied


class LocalTier:
  """The fast tier of a manager at run time: its step index, policy, and the background work
  after each local commit: the durable copy (one process only), then local retention (every
  process, of its own local directory). Copies and retention passes run one at a time (a
  lock), so retention never deletes a step being copied. Back-pressure: a durable save due
  while the previous step's copy is pending waits for it first (:meth:`wait_copied`), so at
  most one copy is pending at any time."""

  def __init__(self, local: _paths.Location, policy: TierPolicy, durable: _paths.Location):
    check_separate(local.path, local.options, durable.path, durable.options)
    self.index = StepIndex(local)
    self.policy = policy
    self.durable = durable
    self._pending: set[int] = set()  # steps whose durable copy is due and not done
    self._lock = threading.Lock()
    self._idle = threading.Condition()
    self.copying = threading.Lock()  # held by a durable copy (durable retention waits)

  @property
  def pending(self) -> set[int]:
    with self._idle:
      return set(self._pending)

  def begin(self, step: int) -> None:
    """A durable copy of ``step`` is due (once its local save commits)."""
    with self._idle:
      self._pending.add(step)

  def finish(self, step: int) -> None:
    """The durable copy of ``step`` is over (copied, failed or abandoned)."""
    with self._idle:
      self._pending.discard(step)
      self._idle.notify_all()

  def wait_copied(self) -> float:
    """Block until no durable copy is pending; the seconds waited."""
    start = time.monotonic()
    with self._idle:
      self._idle.wait_for(lambda: not self._pending)
    return time.monotonic() - start

  def copy_to_durable(self, step: int) -> float:
    """Copy the committed local ``step`` to the durable tier; return the seconds it took."""
    start = time.monotonic()
    with self._lock, self.copying:
      copy_step(
        self.index.root, self.durable.path, step, self.index.location.options, self.durable.options
      )
    return time.monotonic() - start

  def retain(self, claims: Any) -> None:
    """Delete local step directories (committed, leftovers, marked damaged) beyond the newest
    ``local_max_to_keep``; claimed steps and pending copies are spared; data other steps refer
    to stays (``REFERENCED``)."""
    with self._lock:
      listing = self.index.list(in_flight=claims.saving())
      steps = sorted(set(listing.steps) | set(listing.uncommitted) | set(listing.damaged))
      _, failed = delete_referenced(
        self.index,
        claims,
        lambda busy: self.policy.local_to_delete(steps, set(busy) | self.pending),
      )
    if failed:  # a RetentionError: this process's wait() raises it
      step, error = failed[0]
      failure = RetentionError(
        f"Could not delete local step {step} of "
        f"{self.index.display!r}: {error}. The durable tier is not "
        "affected; the next local retention pass retries."
      )
      warnings.warn(str(failure), RuntimeWarning, stacklevel=1)
      raise failure
