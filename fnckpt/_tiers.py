"""Two storage tiers: frequent saves to a fast local directory, fewer copied to durable storage.

``CheckpointManager(directory, local_directory=FAST, local_save_interval_steps=k,
save_interval_steps=n)``: every ``k``-th step is saved to ``FAST/<step>/`` (the caller waits
only for that save's staging, as for any save); every ``n``-th is saved there too and, once
committed, copied to ``directory/<step>/`` in the background by :func:`copy_step` (no second
device-to-host copy: the bytes come from the committed local checkpoint; reads and writes with
at most ``concurrency`` in flight; ``COMMIT`` written last, after the manifest's SHA-256 is
checked against it). Both tiers hold the same format, so ``directory`` is an ordinary run
directory.

Recovery (:func:`choose`): each process reports the steps committed in *its* local
directory; the step restored is the newest one that is either committed locally on every
process or committed in ``directory``. Each process then reads it from its local copy when it
has one, else from ``directory`` (both hold the same bytes), and falls back to the durable
copy of the same step when its local copy is damaged.

"Restorable from local" means a complete checkpoint: the local directory must be one every
process of the job reads whole (one host: a tmpfs or NVMe path shared by that host's
processes; one process: also ``memory://``). With one local directory per host on several
hosts each holds only the chunks its host wrote (and only process 0's holds the commit
marker), so no local step is complete on every process and recovery uses ``directory``:
never wrong data, but no fast recovery (Orbax's emergency manager copies replicas between
peers for that; not done here).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
import warnings
from typing import Any, Sequence

from . import _manifest, _paths
from ._errors import CheckpointError, DamagedError

__all__ = ["TierPolicy", "LocalTier", "choose", "copy_step"]


@dataclasses.dataclass(frozen=True)
class TierPolicy:
  """Which tiers a step goes to: local every ``local_every`` steps, durable (copied from the
  local save) on the durable interval.

  >>> p = TierPolicy(local_every=2)
  >>> [s for s in range(7) if p.local_due(s)]
  [0, 2, 4, 6]
  """
  local_every: int
  local_max_to_keep: int = 2

  def __post_init__(self):
    for name, low in (("local_save_interval_steps", 1), ("local_max_to_keep", 1)):
      v = self.local_every if name.startswith("local_save") else self.local_max_to_keep
      if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise ValueError(f"{name} must be an int >= {low}, got {v!r}.")

  def local_due(self, step: int) -> bool:
    return step % self.local_every == 0

  def local_to_delete(self, local_steps: Sequence[int], protect: set[int]) -> list[int]:
    """Local steps beyond the newest ``local_max_to_keep``, except ``protect`` (copies
    pending).

    >>> TierPolicy(1, local_max_to_keep=2).local_to_delete([1, 2, 3, 4], protect={1})
    [2]
    """
    keep = set(sorted(local_steps)[-self.local_max_to_keep:]) | protect
    return [s for s in sorted(local_steps) if s not in keep]


def choose(local_steps: Sequence[Sequence[int]], durable_steps: Sequence[int],
           skipped: set[int] = frozenset()) -> int | None:
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


def copy_step(src_root: str, dst_root: str, step: int, src_options: dict[str, Any] | None,
              dst_options: dict[str, Any] | None, concurrency: int = 32) -> int:
  """Copy the committed checkpoint ``src_root/<step>`` to ``dst_root/<step>`` (replacing
  whatever is there, its marker first), ``concurrency`` objects in flight, ``COMMIT`` last;
  return the bytes copied. Raises :class:`CheckpointError` naming both locations."""
  src_path, dst_path = _paths.join(src_root, str(step)), _paths.join(dst_root, str(step))
  try:
    src = _paths.open_kvstore(src_path, src_options)
    dst = _paths.open_kvstore(dst_path, dst_options)
    keys = [k.decode("utf-8", "surrogateescape") for k in src.list().result()]
    commit = src.read(_manifest.COMMIT).result()
    if commit.state != "value":
      raise CheckpointError(f"Cannot copy {_paths.display(src_path)!r} to "
                            f"{_paths.display(dst_path)!r}: it is not committed.")
    _paths.clear(dst, first=(_manifest.COMMIT,))
    copied = _copy_keys(src, dst, [k for k in keys if k != _manifest.COMMIT], concurrency)
    manifest = src.read(_manifest.MANIFEST).result()
    want = _manifest.decode_commit(bytes(commit.value), src_path)["manifest_sha256"]
    if manifest.state != "value" or _manifest.digest(bytes(manifest.value)) != want:
      raise DamagedError(f"The manifest of {_paths.display(src_path)!r} does not match its "
                         "commit marker; it was not copied.")
    copied += copy_referenced(src_root, dst_root, step, bytes(manifest.value), src_options,
                              dst_options, concurrency)
    dst.write(_manifest.COMMIT, bytes(commit.value)).result()
  except CheckpointError:
    raise
  except Exception as e:
    raise _paths.io_error(e, dst_path, f"copying step {step} from "
                          f"{_paths.display(src_path)!r}") from e
  return copied


def copy_referenced(src_root: str, dst_root: str, step: int, manifest: bytes,
                    src_options: dict[str, Any] | None, dst_options: dict[str, Any] | None,
                    concurrency: int = 32) -> int:
  """The data of other steps that ``step``'s manifest refers to (an incremental save's base),
  copied from ``src_root`` where ``dst_root`` lacks it: ``dst_root/<s>/<data>/`` as in the
  source, and ``dst_root/<s>/REFERENCED`` naming it when ``<s>`` is no committed step there
  (so the durable tier holds every byte its steps refer to; its retention drops that data
  once nothing refers to it). Returns the bytes copied."""
  from . import _fork
  copied = 0
  for s, data in sorted(_fork.sibling_refs(src_root, step, manifest, src_options)):
    src = _paths.open_kvstore(_paths.join(src_root, str(s)), src_options)
    dst = _paths.open_kvstore(_paths.join(dst_root, str(s)), dst_options)
    have = set(dst.list(range=_prefix_range(data)).result())
    keys = [k for k in src.list(range=_prefix_range(data)).result() if k not in have]
    if not keys and not have:
      raise DamagedError(f"Step {step} of {_paths.display(src_root)!r} refers to the data "
                         f"{data} of step {s}, which is missing there; it was not copied.")
    if keys and dst.read(_manifest.COMMIT).result().state != "value":
      _fork.write_referenced(dst, {data})  # (first: never a leftover without a marker)
    copied += _copy_keys(src, dst, [k.decode("utf-8", "surrogateescape") for k in keys],
                         concurrency)
  return copied


def _prefix_range(name: str) -> Any:
  """The keys under the directory ``name/``."""
  import tensorstore as ts
  return ts.KvStore.KeyRange(name + "/", name + "0")


def _copy_keys(src: Any, dst: Any, keys: list[str], concurrency: int,
               max_bytes: int = 256 << 20) -> int:
  """Read and write ``keys``: a batch of ``concurrency`` reads in flight while the writes of
  the previous ones go on; at most ``concurrency`` writes and ``max_bytes`` (plus one object)
  held. Returns the bytes copied."""
  copied, held, writes = 0, 0, collections.deque()
  for start in range(0, len(keys), concurrency):
    reads = [(k, src.read(k)) for k in keys[start:start + concurrency]]
    for key, read in reads:
      got = read.result()
      if got.state != "value":
        raise DamagedError(f"{key!r} vanished from the local checkpoint while being copied.")
      writes.append((dst.write(key, got.value), len(got.value)))
      held += len(got.value)
      copied += len(got.value)
      while writes and (held > max_bytes or len(writes) > concurrency):
        write, n = writes.popleft()
        write.result()
        held -= n
  for write, _ in writes:
    write.result()
  return copied


class LocalTier:
  """The fast tier of a manager at run time: its step index, policy, and the background work
  after each local commit (process 0): the durable copy, then local retention. Copies run one
  at a time (a lock), so retention never deletes a step being copied."""

  def __init__(self, root: str, policy: TierPolicy, storage_options: dict[str, Any] | None,
               durable_root: str, durable_options: dict[str, Any] | None):
    from ._steps import StepIndex  # (_steps imports nothing of this module)
    self.index = StepIndex(root, storage_options)
    self.policy = policy
    self.storage_options = storage_options
    self.durable_root, self.durable_options = durable_root, durable_options
    self.pending: set[int] = set()  # steps whose durable copy is due and not done
    self._lock = threading.Lock()
    self.copying = threading.Lock()  # held by a durable copy (durable retention waits)

  def copy_to_durable(self, step: int) -> float:
    """Copy the committed local ``step`` to the durable tier; return the seconds it took."""
    start = time.monotonic()
    with self._lock, self.copying:
      copy_step(self.index.root, self.durable_root, step, self.storage_options,
                self.durable_options)
    return time.monotonic() - start

  def retain(self, claims: Any) -> None:
    """Delete local steps beyond the newest ``local_max_to_keep`` (claimed steps spared)."""
    from ._retention_runner import RetentionError, delete_referenced
    with self._lock:
      listing = self.index.list(in_flight=claims.saving())
      _, failed = delete_referenced(self.index, claims, listing, lambda busy: (
          self.policy.local_to_delete(listing.steps, busy)))
    if failed:  # a RetentionError: every process's wait() raises it
      step, error = failed[0]
      failure = RetentionError(f"Could not delete local step {step} of "
                               f"{self.index.display!r}: {error}. The durable tier is not "
                               "affected; the next local retention pass retries.")
      warnings.warn(str(failure), RuntimeWarning, stacklevel=1)
      raise failure
