"""Recovery from peers' fast tiers (several processes): writing what a process holds, reporting
it, and the collective restore of a step from the shards the processes hold.

The plan is :mod:`fnckpt._manager.held` (pure). Here: :func:`write` (after a local save
commits: the pieces, then the record), :func:`report` (the records this process holds
intact), and :func:`restore`: each process reads the pieces it is the reader of from its own
fast tier (a process that holds nothing reads nothing), the processes agree that every read
succeeded (else every process returns None and the manager falls back), and one jitted
``psum`` per wave over each array's replica axes fills every device: on the devices of each
replica group exactly one (the reader's) carries the shard's bytes (viewed as unsigned
integers, so the sum is bitwise exact), the others zeros. XLA's collectives move the bytes
(Gloo over TCP between CPU processes; ICI/NVLink/IB on accelerators). Host leaves (small)
travel through the coordination service from their reader.
"""

from __future__ import annotations

import base64
import json
import time
import warnings
import zlib
from typing import Any, Callable, Sequence

import jax
import numpy as np

from .._errors import CheckpointError
from .._io import attempt as _attempt
from .._io import commit as _commit
from .._io import paths as _paths
from . import held as _held
from . import regrid as _regrid

__all__ = ["write", "report", "restore", "read_pieces", "exchange", "spread", "uint"]

POLL_S = 0.05


def write(
  where: _paths.Location, staged: _held.Staged, step: int, process: int, count: int
) -> None:
  """Write this process's held pieces of ``step`` under ``where`` (its local step
  directory), then their record (last: a record names only pieces already there)."""
  staged = _held.materialize(staged)
  kv = _paths.open_kvstore(where)
  kv.delete_range(_prefix(f"held/{process}/")).result()
  futures = [
    kv.write(_held.piece_key(process, i, j), data) for (i, j), data in staged.pieces.items()
  ]
  for f in futures:
    f.result()
  record = _held.make_record(staged, step, process, count)
  kv.write(_held.record_key(process), record.encode()).result()


def forget(where: _paths.Location, process: int) -> None:
  """Delete this process's record of a step about to be saved again (before its save)."""
  kv = _paths.open_kvstore(where)
  kv.delete_range(_prefix(_held.record_key(process))).result()


def _prefix(name: str) -> Any:
  import tensorstore as ts

  return ts.KvStore.KeyRange(name, name + "\xff")


def _record(kv: Any, process: int, count: int, step: int) -> tuple[_held.HeldRecord | None, str]:
  """This process's record of ``step`` if it is there, matches, and names only pieces that
  are there; else None and why it cannot be used (empty: no record of ``step`` at all)."""
  got = kv.read(_held.record_key(process)).result()
  if got.state != "value":
    return None, ""
  try:
    rec = _held.HeldRecord.decode(bytes(got.value))
  except Exception:
    return None, "its record of what this process holds is unreadable"
  if rec.step != step:
    return None, ""
  if (rec.process, rec.count) != (process, count):
    return None, ""  # (another job's: :func:`_foreign`)
  return (rec, "") if _intact(kv, rec) else (None, "some of its held pieces are missing")


def _intact(kv: Any, rec: _held.HeldRecord) -> bool:
  """Whether every piece ``rec`` names is there."""
  q = rec.process
  have = {
    k.decode("utf-8", "surrogateescape") for k in kv.list(range=_prefix(f"held/{q}/")).result()
  }
  return {_held.piece_key(q, i, j) for i, h in enumerate(rec.held) for j in h} <= have


def _foreign(kv: Any, process: int, count: int, step: int) -> tuple[_regrid.Foreign | None, str]:
  """What the records of ``step`` another job wrote here hold intact (those of one grid: the
  first with one), or None and why they cannot be used (empty: there are none)."""
  names = [k.decode("utf-8", "surrogateescape") for k in kv.list(range=_prefix("held/")).result()]
  records = []
  for name in sorted(n for n in names if n.endswith(".json") and n.count("/") == 1):
    got = kv.read(name).result()
    try:
      rec = _held.HeldRecord.decode(bytes(got.value))
    except Exception:
      continue
    if rec.step == step and (rec.process, rec.count) != (process, count):
      records.append(rec)
  if not records:
    return None, ""
  grids = [r for r in records if r.grid]
  if not grids:
    return None, (
      f"it was saved by {records[0].count} processes and this job has {count}, and its "
      "records (written by an older fnckpt) do not name the pieces' places"
    )
  grid = grids[0].grid
  held = {r.process: r.held for r in grids if r.grid == grid and _intact(kv, r)}
  return _regrid.Foreign(grids[0].count, grid, held), ""


def report(local_index: Any, saving: set[int]) -> _held.HeldReport:
  """This process's :class:`HeldReport`: the steps of its fast tier it holds a record of (and
  those it holds one of that cannot be used, with why)."""
  import socket

  p, n = jax.process_index(), jax.process_count()
  listing = local_index.list(in_flight=saving)
  steps, unusable, foreign = {}, {}, {}
  for step in sorted(set(listing.steps) | set(listing.uncommitted)):
    kv = _paths.open_kvstore(local_index.at(step))
    try:
      rec, why = _record(kv, p, n, step)
      other, other_why = (None, "") if rec is not None else _foreign(kv, p, n, step)
    except Exception:  # an unreadable fast tier holds nothing
      rec, why, other, other_why = None, "", None, ""
    if rec is not None:
      steps[step] = (rec.layout, rec.counts, rec.held)
    elif other is not None:
      foreign[step] = other
    elif why or other_why:
      unusable[step] = why or other_why
  return _held.HeldReport(p, socket.gethostname(), steps, unusable, foreign)


def _read_mine(
  where: _paths.Location, readers: list[list[int]], process: int, step: int
) -> dict[tuple[int, int], bytes]:
  """The pieces this process is the reader of (of its own record)."""
  want = [(i, j) for i, row in enumerate(readers) for j, p in enumerate(row) if p == process]
  return read_pieces(where, {process: want} if want else {}, step)


def read_pieces(
  where: _paths.Location, want: dict[int, list[tuple[int, int]]], step: int
) -> dict[tuple[int, int], bytes]:
  """The pieces ``want[q]`` (``(leaf, position)``) of the record of process ``q`` (of the
  job that wrote it) of ``step`` under ``where``, checked against the record's crc32. A
  process that holds nothing reads nothing."""
  if not want:
    return {}
  kv = _paths.open_kvstore(where)
  step_path = _paths.display(where.path)
  out = {}
  for q, pieces in want.items():
    got = kv.read(_held.record_key(q)).result()
    rec = _held.HeldRecord.decode(bytes(got.value)) if got.state == "value" else None
    if rec is None or rec.step != step or rec.process != q:
      raise CheckpointError(
        f"the record of step {step} of process {q} in {step_path!r} vanished or changed"
      )
    reads = {(i, j): kv.read(_held.piece_key(q, i, j)) for i, j in pieces}
    for (i, j), f in reads.items():
      got = f.result()
      k = rec.held[i].index(j)
      if got.state != "value" or zlib.crc32(bytes(got.value)) != rec.crcs[i][k]:
        raise CheckpointError(
          f"piece {j} of leaf {i} of step {step} of process {q} in {step_path!r} is missing "
          "or damaged"
        )
      out[(i, j)] = bytes(got.value)
  return out


def exchange(
  attempt: _attempt.Attempt,
  step: int,
  read: Callable[[], dict[tuple[int, int], bytes]],
  hosts: Sequence[int],
) -> tuple[dict[tuple[int, int], bytes], dict[int, Any]] | None:
  """The attempt's first barrier: every process's ``read()`` (its pieces) succeeded, or None
  on every process with a warning naming each failure. Then ``(the pieces read, the host
  leaves)``: each of ``hosts`` (the host leaves this process reads) travels from its reader
  through the coordination service."""
  p = jax.process_index()
  try:
    mine, error = read(), None
  except Exception as e:
    mine, error = {}, f"process {p}: {type(e).__name__}: {_paths.error_text(e)}"
  sent = {f"{i}": base64.b64encode(mine[(i, 0)]).decode() for i in hosts if (i, 0) in mine}
  mine_json = json.dumps({"error": error, "host": sent})
  outcome = [json.loads(o) for o in attempt.gather(f"peers-read-{step}", mine_json)]
  errors = [o["error"] for o in outcome if o["error"]]
  if errors:
    attempt.closed = True  # (every process returns None here)
    warnings.warn(
      f"Restoring step {step} from the processes' fast tiers failed ("
      f"{'; '.join(errors)}); falling back to the durable tier.",
      RuntimeWarning,
      stacklevel=6,
    )
    return None
  host = {
    int(i): _held.host_value(base64.b64decode(v)) for o in outcome for i, v in o["host"].items()
  }
  return mine, host


def restore(
  location: str,
  where: _paths.Location,
  step: int,
  reports: Sequence[_held.HeldReport],
  target: Any,
  timeout_s: float,
) -> Any:
  """Collective: ``step`` restored into ``target`` from the processes' held shards, or None
  on every process (with a warning) when some process could not read its pieces. One
  attempt (:mod:`fnckpt._io.attempt`): its first barrier exchanges the reads' outcomes, its
  second starts the collective; a failure on any process fails every process at once."""
  with _attempt.collective(f"{location}#peers", "peers", timeout_s, on=True) as attempt:
    return _restore(
      attempt, location, where, step, reports=reports, target=target, timeout_s=timeout_s
    )


def _restore(
  attempt: _attempt.Attempt,
  location: str,
  where: _paths.Location,
  step: int,
  reports: Sequence[_held.HeldReport],
  target: Any,
  timeout_s: float,
) -> Any:
  layouts = _held.layouts_of(target)
  assert layouts is not None  # (peers are chosen only for a target they can restore)
  readers = _held.holders(reports, step, _held.digest(layouts))
  p = jax.process_index()
  hosts = [i for i, l in enumerate(layouts) if l.dtype == "host" and readers[i][0] == p]
  got = exchange(attempt, step, lambda: _read_mine(where, readers, p, step), hosts)
  if got is None:
    return None
  mine, host = got
  leaves, treedef = jax.tree_util.tree_flatten(target)
  arrays = {
    i: _assemble(leaf, layouts[i], readers[i], mine, i, p)
    for i, leaf in enumerate(leaves)
    if layouts[i].dtype != "host"
  }
  moved = spread(attempt, location, step, list(arrays.values()), timeout_s)
  out = dict(zip(arrays, moved))
  return jax.tree_util.tree_unflatten(
    treedef, [host[i] if i in host else out[i] for i in range(len(leaves))]
  )


def uint(dtype: np.dtype) -> np.dtype:
  return np.dtype(f"uint{8 * np.dtype(dtype).itemsize}")


def _assemble(
  leaf: Any,
  layout: _held.LeafLayout,
  readers: list[int],
  mine: dict[tuple[int, int], bytes],
  i: int,
  process: int,
) -> tuple[jax.Array, np.dtype]:
  """The global array (unsigned view) on ``leaf``'s sharding: on each replica group, the
  reader's first device with the shard holds its bytes, every other device zeros."""
  sharding, dtype = leaf.sharding, np.dtype(leaf.dtype)
  position = {index: j for j, index in enumerate(layout.indices)}
  shard_shape = sharding.shard_shape(layout.shape)
  bufs, used = [], set()
  for device, index in sharding.addressable_devices_indices_map(layout.shape).items():
    j = position[_held.norm_index(index, layout.shape)]
    if readers[j] == process and j not in used:
      used.add(j)
      data = np.frombuffer(mine[(i, j)], dtype=dtype).reshape(shard_shape).view(uint(dtype))
    else:
      data = np.zeros(shard_shape, uint(dtype))
    bufs.append(jax.device_put(data, device))
  return jax.make_array_from_single_device_arrays(layout.shape, sharding, bufs), dtype


def spread(
  attempt: _attempt.Attempt,
  location: str,
  step: int,
  arrays: list[tuple[jax.Array, np.dtype]],
  timeout_s: float,
  then: Callable[[list[jax.Array]], list[jax.Array]] | None = None,
) -> list[jax.Array]:
  """Every array summed over its replica axes (one jitted computation), bitcast back to
  its dtype (then given to ``then``: a reshard); collective, behind the attempt's barrier,
  with a deadline."""
  phase = f"peers-{step}"
  _commit.report(attempt.location, f"{phase}: spreading")
  attempt.barrier(phase)
  attempt.closed = True  # (the last barrier: a failure in the collective is each one's own)
  deadline = time.monotonic() + timeout_s
  fns = [_summed(x.sharding, dtype) for x, dtype in arrays]
  try:
    summed = jax.jit(lambda *xs: tuple(f(x) for f, x in zip(fns, xs)))(*(x for x, _ in arrays))
    out: list[Any] = then(list(summed)) if then is not None else list(summed)
    for x in out:
      while not x.is_ready():
        if time.monotonic() > deadline:
          raise TimeoutError("the collective did not finish by the deadline")
        time.sleep(POLL_S)
      x.block_until_ready()
  except Exception as e:
    raise CheckpointError(
      f"Restoring step {step} of {_paths.display(location)!r} from the "
      f"processes' fast tiers failed in the collective on process "
      f"{jax.process_index()}: {type(e).__name__}: {e}"
    ) from None
  finally:
    _commit.forget(attempt.location)
  for x, _ in arrays:
    x.delete()
  return list(out)


def _summed(sharding: Any, dtype: np.dtype) -> Any:
  """``x -> psum(x, replica axes)`` per shard, bitcast to ``dtype`` (bool: ``!= 0``)."""
  mesh, spec = sharding.mesh, sharding.spec
  used = {a for s in spec if s is not None for a in (s if isinstance(s, tuple) else (s,))}
  axes = tuple(a for a in mesh.axis_names if a not in used)

  def body(x):
    x = jax.lax.psum(x, axes) if axes else x
    return x != 0 if dtype == np.bool_ else jax.lax.bitcast_convert_type(x, dtype)

  return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
