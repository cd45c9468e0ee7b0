"""Data that steps and forks refer to: which data a run must keep, deleting steps without
breaking the steps that refer to them, and forking a run without copying its data.

A step refers to another step's data through its manifest's ``bases`` (docs/format.md
"References and hashes"); a fork of the run is recorded under ``<run>/forks/`` with the data
directories of the run it refers to. Deleting a step (retention, ``delete``, ``cleanup``)
removes its commit marker and manifest; its data directories that a committed step or a fork
still refers to stay (``<run>/<step>/REFERENCED`` says so) until nothing refers to them.
"""

from __future__ import annotations

import dataclasses
import posixpath
import secrets
import threading
from typing import Any

import msgpack
import tensorstore as ts

from .._errors import CheckpointError
from .._format import manifest as _manifest
from .._format import parse as _parse
from .._format import perprocess as _perprocess
from .._format import records as _records
from .._format import refs as _refs
from .._io import commit as _commit
from .._io import paths as _paths

__all__ = [
  "REFERENCED",
  "FORKS",
  "LINEAGE",
  "lineage",
  "References",
  "delete_step",
  "collect",
  "fork_step",
]

REFERENCED = "REFERENCED"
FORKS = "forks"
LINEAGE = "LINEAGE"  # in a fork's run directory: {"run": parent (relative), "step"}


class References:
  """The data directories of a run that its committed steps and its forks refer to. A
  committed step's manifest is read once per commit (cached under its marker's stamp)."""

  def __init__(self, run: _paths.Location):
    self.run = run
    self.loc = _refs.locate(run.spec())
    self._lock = threading.Lock()
    self._cache: dict[int, tuple[bytes, frozenset[tuple[int, str]]]] = {}

  def of_step(self, step: int, stamp: bytes) -> frozenset[tuple[int, str]]:
    """(step, data) pairs of this run that committed ``step`` refers to."""
    with self._lock:
      hit = self._cache.get(step)
    if hit is not None and hit[0] == stamp:
      return hit[1]
    kv = _paths.open_kvstore(self.run.join(str(step)))
    where = _paths.join(self.run.path, str(step))
    raw = _commit.read_committed(kv, where)[0]
    # a manifest without bases refers to nothing: not decoded (a save per step of a
    # thousand-leaf tree: a parse of every leaf per save, for nothing)
    out = _siblings(_manifest.decode(raw, where), self.loc, step) if _has_bases(raw) else set()
    with self._lock:
      self._cache[step] = (stamp, frozenset(out))
    return frozenset(out)

  def of_forks(self) -> set[tuple[int, str]]:
    """(step, data) pairs the forks of this run refer to."""
    kv = _paths.open_kvstore(self.run.join(FORKS))
    out = set()
    for key in kv.list().result():
      raw = kv.read(key).result()
      if raw.state != "value":
        continue
      try:
        record = _manifest.unpack(bytes(raw.value))
        for entry in record["data"]:
          step, _, data = entry.partition("/")
          out.add((int(step), data))
      except Exception as e:
        raise CheckpointError(
          f"The fork record {self.run.path}/{FORKS}/{key.decode()} is damaged ({e}); retention "
          "stops rather than delete data a fork may need. Fix or remove that file."
        ) from e
    return out

  def kept(self, listing: Any, doomed: set[int]) -> dict[int, set[str]]:
    """step -> its data directories that a committed step outside ``doomed`` (one marked
    damaged too: a mark is only a memo), or a fork, refers to. ``listing``: a
    :class:`fnckpt._manager.steps.Listing` of the run."""
    committed = listing.referrers
    pairs = set(self.of_forks())
    with self._lock:  # (bounded: only committed steps stay cached)
      for gone in set(self._cache) - set(committed):
        del self._cache[gone]
    for step, stamp in committed.items():
      if step not in doomed:
        try:
          pairs |= self.of_step(step, stamp)
        except CheckpointError:
          if step in listing.damaged or not _commit.is_committed(
            _paths.open_kvstore(self.run.join(str(step)))
          ):
            continue  # deleted meanwhile, or a marked step that cannot be read: unrestorable
          raise
    out: dict[int, set[str]] = {}
    for step, data in pairs:
      out.setdefault(step, set()).add(data)
    return out


def _has_bases(raw: bytes) -> bool:
  """Whether a manifest's bytes may refer to other checkpoints: a map with a ``bases`` entry
  that is not empty (save writes it only when there are bases), or anything else (decoded
  in full then, which refuses what is not a manifest)."""
  try:
    record = _manifest.unpack(raw)
  except Exception:
    return True
  return not isinstance(record, dict) or record.get("bases") not in (None, [])


def _siblings(manifest: _records.Manifest, run: _refs.Location, step: int) -> set[tuple[int, str]]:
  """PURE: (step, data) pairs of the run at ``run`` that its ``step``'s manifest refers to."""
  step_loc = _refs.Location(run.store, posixpath.join(run.path, str(step)), run.absolute, run.spec)
  out = set()
  for b in manifest.bases:
    where = _refs.resolve(step_loc, b.dir, str(step))
    name = posixpath.basename(where)
    if posixpath.dirname(where) == run.path and name.isdigit():
      out.add((int(name), b.data))
  return out


def sibling_refs(run: _paths.Location, step: int, manifest: bytes) -> set[tuple[int, str]]:
  """(step, data) pairs of the run ``run`` that the manifest bytes of its ``step`` refer to
  (decoded and validated like every manifest)."""
  decoded = _manifest.decode(manifest, _paths.join(run.path, str(step)))
  return _siblings(decoded, _refs.locate(run.spec()), step)


def write_referenced(kv: ts.KvStore, data: set[str]) -> None:
  """Write (or extend) the ``REFERENCED`` marker of the step directory ``kv``."""
  got = kv.read(REFERENCED).result()
  try:
    old = set(_manifest.unpack(bytes(got.value))["data"]) if got.state == "value" else set()
  except Exception:  # undecodable: only informative (retention reads the manifests)
    old = set()
  kv.write(
    REFERENCED, msgpack.packb({"format": _manifest.FORMAT_NAME, "data": sorted(old | set(data))})
  ).result()


def delete_step(run: _paths.Location, step: int, keep: set[str]) -> None:
  """Delete ``step``: its commit marker first; its data directories in ``keep`` (referred to
  by others) stay, with a ``REFERENCED`` marker naming them. Once the marker is gone the
  fork records are read again: a fork written meanwhile (by another job) keeps its data too
  (a fork checks the marker after writing its record: one of the two sees the other)."""
  where = run.join(str(step))
  path = where.path
  kv = _paths.open_kvstore(where)
  try:
    if keep:
      _write_referenced(kv, keep)
    kv.delete_range(ts.KvStore.KeyRange(_manifest.COMMIT, _manifest.COMMIT + "\0")).result()
  except Exception as e:
    raise _paths.io_error(e, path, "deleting") from e
  late = {d for s, d in References(run).of_forks() if s == step} - keep
  if late:
    keep = keep | late
    try:
      _write_referenced(kv, keep)
    except Exception as e:
      raise _paths.io_error(e, path, "deleting") from e
  if not keep:
    _paths.delete_prefix(where, first=(REFERENCED,))
    return
  try:
    tops = {k.decode("utf-8", "replace").split("/", 1)[0] for k in kv.list().result()}
    for top in sorted(tops - set(keep) - {REFERENCED}):
      kv.delete_range(ts.KvStore.KeyRange(top, top + "\0")).result()
      kv.delete_range(ts.KvStore.KeyRange(top + "/", top + "0")).result()
  except Exception as e:
    raise _paths.io_error(e, path, "deleting") from e


def _write_referenced(kv: ts.KvStore, keep: set[str]) -> None:
  kv.write(
    REFERENCED, msgpack.packb({"format": _manifest.FORMAT_NAME, "data": sorted(keep)})
  ).result()


def collect(run: _paths.Location, held: list[int], kept: dict[int, set[str]]) -> None:
  """Held steps (``REFERENCED``): drop the data nothing refers to any more (a held step whose
  data is all still referred to is left as it is)."""
  for step in held:
    keep = kept.get(step, set())
    kv = _paths.open_kvstore(run.join(str(step)))
    tops = {k.decode("utf-8", "replace").split("/", 1)[0] for k in kv.list().result()}
    if keep and not tops - keep - {REFERENCED}:
      continue
    delete_step(run, step, keep)


def fork_step(run: _paths.Location, step: int, directory: str) -> str:
  """Make ``directory/<step>`` a checkpoint that refers to ``run/<step>``'s data (nothing
  copied but per-process values; ``directory`` on the run's storage, with its options),
  record the fork under ``run/forks/`` first; return the fork record's key."""
  root, fork_dir = run.path, _paths.Location.of(directory, run.options)
  src, dst = run.join(str(step)), fork_dir.join(str(step))
  src_path, dst_path = src.path, dst.path
  kv = _paths.open_kvstore(src)
  manifest, _, commit = _commit.read_header(kv, src_path)
  if manifest.version < 2:  # its d/ is no data-<hex> directory a Base can name
    raise CheckpointError(
      f"Cannot fork {src_path!r}: it is a format-1 checkpoint (fnckpt 0.1), whose data no "
      "other checkpoint can refer to. Restore it and save it again with this fnckpt (e.g. "
      f"mgr.save({step}, mgr.restore({step}), force=True)), then fork it."
    )
  src_loc, dst_loc, run_loc = (_refs.locate(where.spec()) for where in (src, dst, run))
  fork_run = posixpath.dirname(dst_loc.path)
  if src_loc.store != dst_loc.store:
    raise CheckpointError(
      f"Cannot fork {src_path!r} into {directory!r}: a fork must be on "
      "the same storage (scheme, bucket, options) as its parent."
    )
  if fork_run == run_loc.path or fork_run.startswith(run_loc.path + "/"):
    raise CheckpointError(
      f"Cannot fork into {directory!r}: it is (inside) the run "
      f"{root!r} itself. Fork into a directory beside it."
    )
  new_bases = _rebase(manifest, src_loc, dst_loc)
  packs, leaves = manifest.packs, manifest.leaves
  if _owns_data(manifest):  # (the parent step's own data, if it has any)
    assert manifest.data is not None
    new_bases.append(_records.Base(_refs.relative(src_loc.path, fork_run), manifest.data))
    packs, leaves = _point_at(manifest, len(new_bases) - 1)
  fork = _records.Fork(_refs.relative(run_loc.path, fork_run), step)
  forked = dataclasses.replace(
    manifest,
    bases=tuple(new_bases),
    fork=fork,
    packs=packs,
    leaves=leaves,
    data=f"{_manifest.DATA_PREFIX}{secrets.token_hex(16)}",
  )
  body = _manifest.encode(forked)
  _manifest.decode(body, dst_path)  # what we write must read back (checked before writing)
  data = sorted(
    {
      f"{posixpath.basename(_refs.resolve(dst_loc, b.dir, dst_path))}/{b.data}"
      for b in new_bases
      if posixpath.dirname(_refs.resolve(dst_loc, b.dir, dst_path)) == run_loc.path
    }
  )
  record = msgpack.packb(
    {
      "format": _manifest.FORMAT_NAME,
      "run": _refs.relative(fork_run, run_loc.path),
      "step": step,
      "data": data,
    }
  )
  name = secrets.token_hex(16)
  forks = _paths.open_kvstore(run.join(FORKS))
  forks.write(name, record).result()
  _paths.open_kvstore(fork_dir).write(
    LINEAGE, msgpack.packb({"format": _manifest.FORMAT_NAME, "run": fork.run, "step": fork.step})
  ).result()
  out = _paths.open_kvstore(dst)
  assert forked.data is not None
  _copy_per_process(kv, out, manifest, forked.data)
  out.write(_manifest.MANIFEST, body).result()
  _check_parent_unchanged(kv, src_path, commit, forks, name)
  _commit.write_commit(out, body, forked.version)
  return name


def _check_parent_unchanged(
  kv: ts.KvStore, src_path: str, commit: bytes, forks: ts.KvStore, name: str
) -> None:
  """After the fork record is written: the parent step must still be the one forked (a
  deletion by another job that missed the record would have removed its marker first)."""
  if _commit.unchanged(kv, commit):
    return
  forks.delete_range(ts.KvStore.KeyRange(name, name + "\0")).result()
  raise CheckpointError(
    f"Cannot fork {src_path!r}: it was deleted or replaced (by another job) while the fork "
    "was being written, so the fork is not committed. Fork a step that is kept (see "
    "manager.all_steps())."
  )


def _rebase(
  manifest: _records.Manifest, src_loc: _refs.Location, dst_loc: _refs.Location
) -> list[_records.Base]:
  """The parent's bases, as references from the fork's step directory."""
  start = posixpath.dirname(dst_loc.path)
  return [
    _records.Base(_refs.relative(_refs.resolve(src_loc, b.dir, "fork"), start), b.data)
    for b in manifest.bases
  ]


def _owns_data(manifest: _records.Manifest) -> bool:
  return any(p.base is None for p in manifest.packs) or any(
    l.stored is not None and l.stored.base is None for l in manifest.leaves
  )


def _point_at(
  manifest: _records.Manifest, k: int
) -> tuple[tuple[_records.Pack, ...], tuple[_records.Leaf, ...]]:
  """The parent's packs and leaf records, those of its own data referring to base ``k`` (the
  parent step) instead."""
  packs = tuple(p if p.base is not None else dataclasses.replace(p, base=k) for p in manifest.packs)
  leaves = tuple(
    l
    if l.stored is None or l.stored.base is not None
    else dataclasses.replace(l, stored=dataclasses.replace(l.stored, base=k))
    for l in manifest.leaves
  )
  return packs, leaves


def _copy_per_process(
  src: ts.KvStore, dst: ts.KvStore, manifest: _records.Manifest, data: str
) -> None:
  """PerProcess values live under a checkpoint's own data: copy them (small)."""
  if not any(l.kind == "perprocess" for l in manifest.leaves):
    return
  assert manifest.data is not None  # (format 2 on: per-process values live under it)
  for p in range(manifest.process_count):
    got = src.read(_perprocess.values_key(manifest.data, p)).result()
    if got.state == "value":
      dst.write(_perprocess.values_key(data, p), got.value).result()


def lineage(run: _paths.Location) -> str:
  """'fork of run <parent> at step <n>' for a forked run directory, else ''."""
  got = _paths.open_kvstore(run).read(LINEAGE).result()
  if got.state != "value":
    return ""
  try:
    rec = _manifest.unpack(bytes(got.value))
    parent_run = _parse.check_rel(rec["run"], "run")
    parent = _refs.display(_paths.join(run.display, "x"), parent_run)
    return f"fork of run {parent!r} at step {int(rec['step'])}"
  except Exception:
    return f"fork (its {LINEAGE} record is unreadable)"
