"""One behaviour suite, every storage backend: ``memory://``, local files, S3 (a real local
SeaweedFS) and GCS (a real local fake-gcs-server).

Every test taking the ``backend`` fixture runs on all four, so each backend is held to the same
contract: round trips with resharding, metadata, async saves, overwrite rules, the commit rule
(marker written last, no extra keys, uncommitted data refused and never listed), checksums,
missing chunks (for arrays in zarr arrays of their own and in packs, see ``LAYOUTS``), the
manager's listing and retention (prefix deletes, nothing left behind, a step being read is not
deleted) and the CLI. Failures that exist only on object stores (a missing bucket, wrong
credentials, an unreachable endpoint) are parametrised over the backends where they can happen,
with the local-files analogue beside them.

Nothing is mocked: the servers are real processes (tests/servers.py); the only patched names are
fnckpt's own test hook ``fnckpt._state.hooks.on_phase`` and, to hold a restore open mid-read, a
wrapper around ``fnckpt._restore.restore._read_all`` that waits before calling the real one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import threading
import time
import uuid
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding, PartitionSpec as P

import fnckpt
from fnckpt._format import records as _records
from fnckpt._io import commit as _commit, paths as _paths
from fnckpt._restore import restore as _restore
from fnckpt import _state

import servers
from tree_utils import assert_placed, assert_trees_all_equal

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = ("memory", "file", "s3", "gcs")
# Retry settings for the bad-input cases: a failure must surface quickly, not after
# TensorStore's default 32 retries with up to 32 s of backoff each.
FAST = {"max_retries": 1, "initial_delay": "10ms", "max_delay": "50ms"}
FAST_ENV = {"FNCKPT_REQUEST_RETRIES": "1", "FNCKPT_REQUEST_INITIAL_DELAY": "10ms",
            "FNCKPT_REQUEST_MAX_DELAY": "50ms"}
BOUND_S = 15.0  # a bad-input error must surface within this many seconds
# Format 2 stores an array larger than inline_bytes (16 KiB) in one of two ways; a test whose
# intent covers stored data runs with both. "packs" (the default): every array of train_state
# (all <= 4 MiB and seen whole by this process) is a byte range of this process's pack, one
# zarr array of one chunk. "arrays": pack_bytes=0 gives each its own zarr array (params/w: 8
# chunks, one per (64, 64) shard).
LAYOUTS = {"packs": {}, "arrays": {"pack_bytes": 0}}
# What a restore says about damaged data (the cause comes from TensorStore's error).
CORRUPT = "its data is corrupt (crc32c checksum mismatch)"
MISSING = "a chunk of its data is missing"


@dataclasses.dataclass
class Backend:
  """A fresh, empty location on one backend, and how to reach it."""
  name: str
  base: str                       # a URL (or local path) nobody else uses
  options: dict[str, Any] | None  # storage_options for fnckpt calls
  env: dict[str, str]             # environment (already applied in this process)
  server: servers.ObjectStoreServer | None = None

  def url(self, *names: str) -> str:
    return _paths.join(self.base, *names)

  def kv(self, url: str) -> ts.KvStore:
    return _paths.open_kvstore(url, self.options)

  def keys(self, url: str) -> list[str]:
    return _paths.list_keys(url, self.options)

  def save(self, tree, url, **kwargs) -> fnckpt.SaveHandle:
    return fnckpt.save(tree, url, storage_options=self.options, **kwargs)

  def restore(self, url, target=None, **kwargs):
    return fnckpt.restore(url, target, storage_options=self.options, **kwargs)

  def metadata(self, url) -> fnckpt.CheckpointMetadata:
    return fnckpt.metadata(url, storage_options=self.options)

  def manager(self, root, **kwargs) -> fnckpt.CheckpointManager:
    return fnckpt.CheckpointManager(root, storage_options=self.options, **kwargs)


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path_factory) -> Backend:
  name = request.param
  if name == "memory":
    return Backend(name, f"memory://test_backends/{uuid.uuid4().hex}", None, {})
  if name == "file":  # not tmp_path: it holds the test's name, and no word of a location
    # ("missing", "checksum"...) may be what makes an error message match
    return Backend(name, str(tmp_path_factory.mktemp("files") / "store"), None, {})
  server = request.getfixturevalue(f"{name}_env")  # the session's server, env applied
  return Backend(name, server.unique_url("backends"), dict(server.storage_options), server.env,
                 server)


# ---------------------------------------------------------------------------------------------
# helpers


def mesh(shape=(2, 4), names=("data", "model"), n=None):
  devices = jax.devices()[:n] if n else None
  return jax.make_mesh(shape, names, devices=devices)


def train_state(step: int = 0) -> dict[str, Any]:
  """A small training state: sharded, replicated and single-device arrays, a typed PRNG key,
  numpy values and Python scalars; the large leaves get files of their own."""
  m = mesh()
  w = (jnp.arange(128 * 256, dtype=jnp.float32).reshape(128, 256) + step) / 7
  return {
      "params": {
          "w": jax.device_put(w, NamedSharding(m, P("data", "model"))),
          "emb": jax.device_put(jnp.arange(64 * 128, dtype=jnp.int32).reshape(64, 128) * 3 + step,
                                NamedSharding(m, P("model"))),
          "norm": jax.device_put(jnp.linspace(0, 1, 8192, dtype=jnp.bfloat16),
                                 NamedSharding(m, P())),           # replicated
          "b": jnp.full((16,), 0.5 + step, jnp.float32),           # small: inline
      },
      "opt": {"mu": np.arange(6000, dtype=np.float64) * step, "count": np.int64(step)},
      "rng": jax.random.key(step),
      "step": step,
      "name": "run-1",
      "empty": {},
  }


def resharded_target(state):
  """Every array of ``state`` onto other meshes: 4x2 with other specs, and 4 devices only."""
  m42, m4 = mesh((4, 2), ("x", "y")), mesh((2, 2), ("a", "b"), n=4)
  sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  p = state["params"]
  return {
      "params": {"w": sds(p["w"], NamedSharding(m42, P("y", "x"))),
                 "emb": sds(p["emb"], NamedSharding(m4, P(None, ("a", "b")))),
                 "norm": sds(p["norm"], NamedSharding(m42, P("x"))),
                 "b": sds(p["b"], NamedSharding(m4, P())),
                 },
      "opt": {"mu": np.zeros_like(state["opt"]["mu"]), "count": np.int64(0)},
      "rng": jax.ShapeDtypeStruct((), jax.random.key(0).dtype,
                                  sharding=NamedSharding(m4, P())),
      "step": 0, "name": "", "empty": {},
  }


def host_tree(tree):
  return jax.tree.map(lambda x: np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key) else x) if isinstance(x, jax.Array) else x, tree)


def manifest_of(backend: Backend, url: str) -> _records.Manifest:
  """The committed checkpoint's validated manifest (its packs too, which metadata() omits)."""
  return _commit.read_header(backend.kv(url), _paths.display(url))[0]


def stored_keys(backend: Backend, url: str, leaf: str = "w"
                ) -> tuple[str, list[str], list[str]]:
  """(the directory inside the checkpoint that holds ``params/<leaf>``'s bytes: its own zarr
  array or its pack; that directory's chunk keys; the key paths of every leaf stored there)."""
  manifest = manifest_of(backend, url)
  rec = next(r for r in manifest.leaves if r.path == (("dict", "params"), ("dict", leaf)))
  if rec.stored is not None:
    directory, names = rec.stored.dir, [rec.where]
  else:
    assert rec.packed is not None, rec
    directory = manifest.packs[rec.packed.pack].dir
    names = [r.where for r in manifest.leaves
             if r.packed is not None and r.packed.pack == rec.packed.pack]
  assert directory.startswith(manifest.data + "/"), (directory, manifest.data)
  chunks = [k for k in backend.keys(url) if k.startswith(f"{directory}/c/")]
  assert chunks, backend.keys(url)
  return directory, chunks, names


def flip_byte(backend: Backend, url: str, key: str, at: float = 1 / 3, bit: int = 0x01
              ) -> None:
  kv = backend.kv(url)
  data = bytearray(kv.read(key).result().value)
  data[int(len(data) * at)] ^= bit
  kv.write(key, bytes(data)).result()


def sds_of(x, sharding=None) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding or x.sharding)


@pytest.fixture
def phase(monkeypatch):
  """``phase(location, name, fn)``: run ``fn()`` when the save to ``location`` reaches phase
  ``name`` in its writer thread (through fnckpt's own test hook ``_state.hooks.on_phase``)."""
  hooks: dict[tuple[str, str], Any] = {}

  def hook(name):
    thread = threading.current_thread().name
    for (location, when), fn in list(hooks.items()):
      if when == name and thread == f"fnckpt-save:{location}":
        fn()

  monkeypatch.setattr(_state.hooks, "on_phase", hook)

  def add(location, name, fn):
    """Install the hook; returns a function that removes it."""
    key = (_paths.display(location), name)
    hooks[key] = fn
    return lambda: hooks.pop(key, None)
  return add


def crash_before_commit(backend: Backend, phase, url: str, tree) -> None:
  """A real interrupted save: every chunk and the manifest written, no commit marker."""
  def crash():
    raise RuntimeError("simulated crash before the commit")
  remove = phase(url, "committing", crash)
  try:
    handle = backend.save(tree, url)
    with pytest.raises(fnckpt.CheckpointError, match="simulated crash"):
      handle.wait()
  finally:
    remove()


# ---------------------------------------------------------------------------------------------
# the contract, on every backend


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_reshard_and_metadata(backend, layout):
  state = train_state(3)
  url = backend.url("ckpt")
  handle = backend.save(state, url, metadata={"epoch": 2, "note": "x"}, **LAYOUTS[layout])
  stats = handle.wait()
  assert stats.bytes_written >= 128 * 256 * 4
  if layout == "arrays":
    assert stats.chunks_written >= 8  # params/w alone: one chunk per (64, 64) shard
  else:
    assert stats.chunks_written == 1  # one pack of one chunk holds every stored array

  # The same values, placed as the target says, on other meshes and another device count.
  target = resharded_target(state)
  out = backend.restore(url, target)
  for name in ("w", "emb", "norm", "b"):
    assert_placed(out["params"][name], target["params"][name].sharding,
                  np.asarray(state["params"][name]), f"params/{name}")
  assert out["rng"].dtype == state["rng"].dtype
  np.testing.assert_array_equal(jax.random.key_data(out["rng"]),
                                jax.random.key_data(state["rng"]))
  assert_trees_all_equal(host_tree({k: out[k] for k in ("opt", "step", "name", "empty")}),
                         {k: state[k] for k in ("opt", "step", "name", "empty")})

  # No target: host numpy values in plain containers.
  plain = backend.restore(url)
  np.testing.assert_array_equal(plain["params"]["w"], np.asarray(state["params"]["w"]))
  assert isinstance(plain["params"]["emb"], np.ndarray)

  # Metadata: no data read, shapes, dtypes, saved shardings, user metadata.
  meta = backend.metadata(url)
  assert meta.location == _paths.display(url) and meta.user_metadata == {"epoch": 2, "note": "x"}
  w = meta.tree["params"]["w"]
  assert (w.shape, w.dtype, w.nbytes) == ((128, 256), np.dtype(np.float32), 128 * 256 * 4)
  assert w.sharding.axes == ("data", "model") and w.sharding.sizes == (2, 4)
  assert w.sharding.spec == P("data", "model")
  assert meta.tree["params"]["norm"].dtype == jnp.bfloat16
  assert meta.tree["params"]["b"].stored == "inline"
  data_dir = manifest_of(backend, url).data
  assert re.fullmatch(r"data-[0-9a-f]{32}", data_dir), data_dir
  w_rec = next(r for r in meta.leaves if r.where == "['params']['w']")
  if layout == "arrays":
    assert w_rec.packed is None and w_rec.stored.dir == w.stored
    assert w.stored == f"{data_dir}/a/{w_rec.index}", w.stored
    assert w_rec.stored.chunks == (64, 64)
  else:
    assert w_rec.stored is None and w_rec.packed.nbytes == 128 * 256 * 4
    assert w.stored.startswith("pack "), w.stored
  assert meta.tree["step"] == 3 and meta.tree["name"] == "run-1"
  assert meta.process_count == 1 and meta.versions["fnckpt"] == fnckpt.__version__


def test_commit_marker_is_written_last_and_nothing_else(backend, phase):
  """While a save sits between its last data write and its marker, the location holds data and
  manifest but no COMMIT, and every reader refuses it; afterwards exactly the documented keys
  exist (no temporary or renamed objects)."""
  url = backend.url("run", "7")
  at_marker, release = threading.Event(), threading.Event()

  def hold():
    at_marker.set()
    assert release.wait(60)
  phase(url, "committing", hold)
  # Both pack forms: params/w (128 KiB in shards of 16 KiB) as pieces, params/emb and opt/mu
  # packed whole.
  handle = backend.save(train_state(7), url, pack_bytes=64 << 10)
  try:
    assert at_marker.wait(60)
    keys = backend.keys(url)
    assert "manifest.msgpack" in keys and any(k.startswith("data-") for k in keys)
    assert "COMMIT" not in keys
    with pytest.raises(fnckpt.NotCommittedError, match="interrupted save"):
      backend.restore(url)
    with pytest.raises(fnckpt.NotCommittedError):
      backend.metadata(url)
    with pytest.warns(UserWarning, match=r"uncommitted steps \[7\]"):  # (a save in flight)
      assert backend.manager(backend.url("run")).all_steps() == []
  finally:
    release.set()
  handle.wait()
  keys = backend.keys(url)
  assert "COMMIT" in keys
  manifest = manifest_of(backend, url)
  arrays = {r.stored.dir for r in manifest.leaves if r.stored is not None}
  packs = {p.dir for p in manifest.packs}
  assert arrays == {f"{manifest.data}/a/{r.index}" for r in manifest.leaves
                    if r.stored is not None}
  assert not arrays and packs == {f"{manifest.data}/p/0"}  # process 0's pack only
  assert {r.where for r in manifest.leaves if r.packed is not None} == {
      "['opt']['mu']", "['params']['emb']"}
  assert {r.where for r in manifest.leaves if r.pieces is not None} == {"['params']['w']"}
  dirs = arrays | packs
  for key in keys:
    if key in ("COMMIT", "manifest.msgpack"):
      continue
    owner = next((d for d in dirs if key.startswith(d + "/")), None)
    assert owner is not None, f"unexpected key {key!r}"
    assert key == f"{owner}/zarr.json" or key.startswith(f"{owner}/c/"), key
  for d in dirs:  # each whole: its metadata and its chunks
    assert f"{d}/zarr.json" in keys and any(k.startswith(f"{d}/c/") for k in keys), d
  assert backend.manager(backend.url("run")).all_steps() == [7]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_async_save_is_donation_safe_then_wait(backend, layout):
  with contextlib.suppress(Exception):  # failures of earlier tests' saves are not ours
    fnckpt.wait()
  state = train_state(5)
  expected = host_tree(state)
  url = backend.url("async")
  handle = backend.save(state, url, **LAYOUTS[layout])
  assert isinstance(handle, fnckpt.SaveHandle)
  for leaf in jax.tree.leaves(state):  # the caller drops its arrays as soon as save returns
    if isinstance(leaf, jax.Array):
      leaf.delete()
  fnckpt.wait()  # every pending save of this process
  assert handle.done() and handle.wait().total_s > 0
  assert_trees_all_equal(host_tree(backend.restore(url, resharded_target(train_state(5)))),
                         expected)


def test_overwrite_refused_unless_asked(backend):
  url = backend.url("ow")
  old = {"w": np.arange(9000, dtype=np.float32), "old_only": np.ones(9000, np.int16), "v": 1}
  backend.save(old, url).wait()
  with pytest.raises(fnckpt.CheckpointError, match="already exists") as info:
    backend.save({"w": np.zeros(3)}, url)
  assert _paths.display(url) in str(info.value)
  assert backend.restore(url)["v"] == 1  # untouched

  old_manifest = manifest_of(backend, url)
  assert old_manifest.packs  # the old arrays are packed; the new ones get arrays of their own
  new = {"w": np.arange(9000, dtype=np.float32)[::-1].copy(), "v": 2}
  backend.save(new, url, overwrite=True, zstd=3, pack_bytes=0).wait()
  assert_trees_all_equal(backend.restore(url), new)
  manifest = manifest_of(backend, url)
  assert manifest.data != old_manifest.data  # new data never lands in the old directory
  stored = {r.stored.dir for r in manifest.leaves if r.stored is not None}
  assert stored and not manifest.packs
  leftovers = [k for k in backend.keys(url) if k not in ("COMMIT", "manifest.msgpack")
               and "/".join(k.split("/")[:3]) not in stored]
  assert leftovers == []  # the old checkpoint's files are gone, not mixed in


def test_uncommitted_save_is_refused_and_never_listed(backend, phase):
  root = backend.url("run")
  backend.save(train_state(1), _paths.join(root, "1")).wait()
  crash_before_commit(backend, phase, _paths.join(root, "2"), train_state(2))
  url2 = _paths.join(root, "2")
  assert "manifest.msgpack" in backend.keys(url2) and "COMMIT" not in backend.keys(url2)
  for read in (backend.restore, backend.metadata):
    with pytest.raises(fnckpt.NotCommittedError, match="interrupted save") as info:
      read(url2)
    assert _paths.display(url2) in str(info.value)
  with pytest.raises(fnckpt.CheckpointError, match="interrupted save"):
    backend.save(train_state(2), url2)  # not clobbered silently either
  with pytest.warns(UserWarning, match=r"uncommitted steps \[2\]"):
    mgr = backend.manager(root)
  assert mgr.all_steps() == [1] and mgr.latest_step() == 1 and mgr.uncommitted_steps() == [2]

  # A committed checkpoint whose marker is deleted through the kvstore is no checkpoint.
  backend.kv(_paths.join(root, "1")).delete_range(ts.KvStore.KeyRange("COMMIT", "COMMIT\0")).result()
  with pytest.raises(fnckpt.NotCommittedError):
    backend.restore(_paths.join(root, "1"))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    assert backend.manager(root).all_steps() == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_flipped_byte_is_a_checksum_error_naming_the_leaf(backend, layout):
  url = backend.url("flip")
  state = train_state(0)
  backend.save(state, url, **LAYOUTS[layout]).wait()
  directory, chunks, damaged = stored_keys(backend, url)
  flip_byte(backend, url, chunks[0])
  with pytest.raises(fnckpt.CheckpointError, match=re.escape(CORRUPT)) as info:
    backend.restore(url)
  text = str(info.value)
  assert any(name in text for name in damaged), text
  # the storage path, quoted: fnckpt's own words, not TensorStore's message that it appends
  assert f"'{_paths.display(url)}/{directory}'" in text, text
  if layout == "arrays":
    assert damaged == ["['params']['w']"]
  else:  # the chunk's crc32c covers every leaf in it: each one read is an error
    assert damaged == ["['opt']['mu']", "['params']['emb']", "['params']['w']"]
  # Reading the damaged leaf alone names it.
  with pytest.raises(fnckpt.CheckpointError, match=re.escape(CORRUPT)) as info:
    backend.restore(url, {"params": {"w": sds_of(state["params"]["w"])}}, partial=True)
  assert "['params']['w']" in str(info.value)
  assert f"'{_paths.display(url)}/{directory}'" in str(info.value)
  # The other leaves are intact: a partial restore without the damaged ones works.
  target = {k: v for k, v in state.items() if k != "params"}
  if layout == "packs":
    target["opt"] = {"count": state["opt"]["count"]}
  assert backend.restore(url, target, partial=True)["step"] == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_missing_chunk_is_an_error_never_zeros(backend, layout):
  url = backend.url("gap")
  backend.save(train_state(0), url, **LAYOUTS[layout]).wait()
  directory, chunks, damaged = stored_keys(backend, url, "emb")
  assert "['params']['emb']" in damaged
  backend.kv(url).delete_range(ts.KvStore.KeyRange(chunks[-1], chunks[-1] + "\0")).result()
  target = resharded_target(train_state(0))
  with pytest.raises(fnckpt.CheckpointError, match=re.escape(MISSING)) as info:
    backend.restore(url, target)
  assert any(name in str(info.value) for name in damaged), str(info.value)
  with pytest.raises(fnckpt.CheckpointError, match=re.escape(MISSING)) as info:
    backend.restore(url, {"params": {"emb": target["params"]["emb"]}}, partial=True)
  assert "['params']['emb']" in str(info.value)
  assert f"'{_paths.display(url)}/{directory}'" in str(info.value)


def test_restore_names_the_cause_from_the_error_not_the_path(backend):
  url = backend.url("crc32c-checksum")  # words of another cause, in the path only
  backend.save(train_state(0), url, **LAYOUTS["arrays"]).wait()
  _, chunks, _ = stored_keys(backend, url)
  backend.kv(url).delete_range(ts.KvStore.KeyRange(chunks[0], chunks[0] + "\0")).result()
  with pytest.raises(fnckpt.CheckpointError) as info:
    backend.restore(url)
  assert MISSING in str(info.value) and CORRUPT not in str(info.value), str(info.value)


def test_nothing_at_the_location(backend):
  url = backend.url("nothing-here")
  for read in (backend.restore, backend.metadata):
    with pytest.raises(fnckpt.CheckpointError, match="No checkpoint at") as info:
      read(url)
    assert not isinstance(info.value, fnckpt.NotCommittedError)
    assert _paths.display(url) in str(info.value)


def test_manager_lists_committed_steps_and_retention_deletes_prefixes(backend, phase):
  root = backend.url("mgr")
  with backend.manager(root, max_to_keep=2, keep_every=4) as mgr:
    for step in range(7):
      mgr.save(step, train_state(step), metrics={"loss": 1.0 / (step + 1)})
    mgr.wait()
    assert mgr.all_steps() == [0, 4, 5, 6] and mgr.latest_step() == 6
    assert mgr.metrics(5) == {"loss": pytest.approx(1 / 6)}
    # Prefix deletes: nothing at all is left of the deleted steps.
    assert sorted({k.split("/")[0] for k in backend.keys(root)}) == ["0", "4", "5", "6"]
    if backend.name == "file":
      assert sorted(os.listdir(root)) == ["0", "4", "5", "6"]
    restored = mgr.restore(target=resharded_target(train_state(6)))
    assert_trees_all_equal(host_tree(restored), host_tree(train_state(6)))

  crash_before_commit(backend, phase, _paths.join(root, "7"), train_state(7))
  with pytest.warns(UserWarning, match="uncommitted"):
    mgr = backend.manager(root, max_to_keep=2, keep_every=4)
  with mgr:
    assert mgr.all_steps() == [0, 4, 5, 6] and mgr.uncommitted_steps() == [7]
    assert mgr.latest_step() == 6
    mgr.save(7, train_state(7)).wait()  # replaces the leftover
    mgr.wait()
    assert mgr.all_steps() == [0, 4, 6, 7]


def test_retention_never_deletes_a_step_being_read(backend, monkeypatch):
  root = backend.url("reading")
  reading, release = threading.Event(), threading.Event()
  real_read_all = _restore._read_all

  def held_read_all(src, *args, **kwargs):
    if src.location.endswith("/1"):
      reading.set()
      assert release.wait(60)
    return real_read_all(src, *args, **kwargs)

  monkeypatch.setattr(_restore, "_read_all", held_read_all)
  result: dict[str, Any] = {}
  with backend.manager(root, max_to_keep=1) as mgr:
    mgr.save(1, train_state(1)).wait()

    def read():
      try:
        result["value"] = mgr.restore(1)
      except BaseException as e:  # noqa: BLE001 - reported below
        result["error"] = e
    reader = threading.Thread(target=read)
    reader.start()
    try:
      assert reading.wait(60)
      mgr.save(2, train_state(2)).wait()
      mgr.wait()  # retention has run: step 1 is beyond max_to_keep but is being read
      assert 1 in mgr.all_steps()
    finally:
      release.set()
      reader.join(60)
    assert "error" not in result, result.get("error")
    np.testing.assert_array_equal(result["value"]["params"]["w"],
                                  np.asarray(train_state(1)["params"]["w"]))
    mgr.save(3, train_state(3)).wait()
    mgr.wait()
    assert mgr.all_steps() == [3]  # once nobody reads it, step 1 goes


# ---------------------------------------------------------------------------------------------
# the CLI (a subprocess with the backend's environment; memory:// lives in one process only, so
# there the same commands run in this process)


def run_cli(backend: Backend, capsys, *argvs: list[str], env: dict[str, str] | None = None,
            unset: tuple[str, ...] = ()) -> list[tuple[int, str, str]]:
  if backend.name == "memory":
    from fnckpt import cli
    results = []
    for argv in argvs:
      code = cli.main(argv)
      out, err = capsys.readouterr()
      results.append((code, out, err))
    return results
  full_env = {**os.environ, **backend.env, **(env or {}), "JAX_PLATFORMS": "no_such_platform"}
  for name in unset:
    full_env.pop(name, None)
  procs = [subprocess.Popen([sys.executable, "-m", "fnckpt", *argv], env=full_env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for argv in argvs]  # concurrently: each pays the interpreter start once
  results = []
  for p in procs:
    out, err = p.communicate(timeout=120)
    results.append((p.returncode, out, err))
  return results


def test_cli_ls_inspect_verify(backend, phase, capsys):
  root = backend.url("cli")
  with backend.manager(root) as mgr:  # step 10: its arrays in a pack (the default)
    mgr.save(10, train_state(10), metrics={"loss": 0.5})
  with backend.manager(root, save_options=LAYOUTS["arrays"]) as mgr:  # 20: arrays of their own
    mgr.save(20, train_state(20), metrics={"loss": 0.25})
  crash_before_commit(backend, phase, _paths.join(root, "30"), train_state(30))
  # damage step 10's pack
  step10 = _paths.join(root, "10")
  pack_dir, chunks, packed = stored_keys(backend, step10)
  assert packed == ["['opt']['mu']", "['params']['emb']", "['params']['w']"]
  flip_byte(backend, step10, chunks[0], at=1 / 2, bit=0x80)
  capsys.readouterr()

  missing = _paths.join(root, "99")
  (ls_code, ls, _), (in_code, inspect, _), (in10_code, inspect10, _), (ver_code, verify, _), \
      (miss_code, _, miss_err) = run_cli(
          backend, capsys, ["ls", root], ["inspect", _paths.join(root, "20")],
          ["inspect", step10], ["verify", "--quiet", root], ["inspect", missing])

  assert ls_code == 0, ls
  rows = {line.split()[0]: line for line in ls.splitlines()[1:] if line.split()}
  assert "committed" in rows["10"] and "committed" in rows["20"] and "loss=0.25" in rows["20"]
  assert "UNCOMMITTED" in rows["30"]
  assert "2 committed, 1 uncommitted; latest: 20" in ls

  assert in_code == 0, inspect
  assert _paths.display(_paths.join(root, "20")) in inspect
  w_row = next(line for line in inspect.splitlines() if line.startswith("['params']['w']"))
  assert "float32" in w_row and "(128, 256)" in w_row and "P('data', 'model')" in w_row
  assert "/a/" in w_row and "chunks (64, 64)" in w_row
  assert in10_code == 0, inspect10
  w_row = next(line for line in inspect10.splitlines() if line.startswith("['params']['w']"))
  assert "P('data', 'model')" in w_row and "pack 0 bytes" in w_row

  assert ver_code == 1, verify
  assert f"OK {_paths.display(_paths.join(root, '20'))}" in verify
  (damaged,) = [line for line in verify.splitlines() if line.startswith("DAMAGED")]
  assert damaged.startswith(f"DAMAGED pack 0 ({', '.join(packed)}) "
                            f"({_paths.display(step10)}/{pack_dir})"), damaged
  assert "checksum mismatch (corrupt data)" in damaged
  assert f"FAILED {_paths.display(step10)}: 1 problem(s)." in verify

  assert miss_code == 2 and _paths.display(missing) in miss_err
  assert "Traceback" not in miss_err


def test_cli_takes_the_s3_endpoint_from_storage_option(s3_env, capsys):
  """`--storage-option` is the CLI's storage_options: with no endpoint in its environment, the
  S3 endpoint given only as `--storage-option endpoint=...` (before or after the command) is
  used by every read of ls, inspect and verify."""
  backend = Backend("s3", s3_env.unique_url("cli-options"), dict(s3_env.storage_options),
                    s3_env.env, s3_env)
  root = backend.url("run")
  with backend.manager(root) as mgr:
    mgr.save(10, train_state(10), metrics={"loss": 0.5})
  with backend.manager(root, save_options=LAYOUTS["arrays"]) as mgr:
    mgr.save(20, train_state(20), metrics={"loss": 0.25})
  option = ["--storage-option", f"endpoint={s3_env.endpoint}"]
  retries = ["--storage-option", "max_retries=2"]
  no_endpoint = ("FNCKPT_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
  (ls_code, ls, ls_err), (in_code, inspect, in_err), (ver_code, verify, ver_err) = run_cli(
      backend, capsys, option + ["ls", root], ["inspect", _paths.join(root, "20")] + option,
      option + retries + ["verify", "--quiet", root], unset=no_endpoint)
  assert ls_code == 0, ls + ls_err
  assert "2 committed, 0 uncommitted; latest: 20" in ls and "loss=0.25" in ls
  assert in_code == 0, in_err
  w_row = next(line for line in inspect.splitlines() if line.startswith("['params']['w']"))
  assert "float32" in w_row and "chunks (64, 64)" in w_row
  assert ver_code == 0, verify + ver_err
  for step in (10, 20):
    assert f"OK {_paths.display(_paths.join(root, str(step)))}" in verify
  assert "2 of 2 checkpoints OK." in verify


# ---------------------------------------------------------------------------------------------
# bad input: each failure where it can happen -> a CheckpointError naming the URL, quickly,
# never echoing a secret


BAD_CASES = ["s3-missing-bucket", "gcs-missing-bucket", "s3-wrong-credentials",
             "s3-unreachable", "gcs-unreachable", "file-not-a-directory"]


@pytest.fixture(params=BAD_CASES)
def bad(request, monkeypatch, tmp_path):
  """(url, storage_options, env for subprocesses, secrets that must never be shown)."""
  kind, _, case = request.param.partition("-")
  secrets = []
  if kind == "file":
    (tmp_path / "a-file").write_text("not a directory")
    return str(tmp_path / "a-file" / "ckpt"), None, {}, secrets
  server = request.getfixturevalue(f"{kind}_env")
  if kind == "s3":
    secrets.append(server.env["AWS_SECRET_ACCESS_KEY"])
  options = {**server.storage_options, **FAST}
  env = dict(FAST_ENV)
  url = server.unique_url("bad")
  if case == "missing-bucket":
    url = f"{url.split('://')[0]}://fnckpt-no-such-bucket/run"
  elif case == "wrong-credentials":
    wrong = "wrong-" + uuid.uuid4().hex
    secrets.append(wrong)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    env["AWS_SECRET_ACCESS_KEY"] = wrong
  elif case == "unreachable":
    (port,) = servers._free_ports(1)  # nothing listens there
    endpoint = f"http://127.0.0.1:{port}"
    if kind == "s3":
      options["endpoint"] = endpoint
      env["FNCKPT_S3_ENDPOINT"] = endpoint
    else:  # TensorStore has no per-call GCS endpoint: the variable is read at each open
      monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", endpoint)
      env["TENSORSTORE_GCS_HTTP_URL"] = endpoint
  return url, options, env, secrets


def _fails_clearly(fn, url, secrets, match=None) -> str:
  start = time.monotonic()
  with pytest.raises(fnckpt.CheckpointError) as info:
    fn()
  elapsed = time.monotonic() - start
  text = str(info.value)
  assert elapsed < BOUND_S, f"took {elapsed:.1f}s: {text}"
  assert _paths.display(url) in text, text
  for secret in secrets:
    assert secret not in text
  if match:
    assert any(m in text for m in match), text
  return text


def test_bad_location_fails_clearly(bad, request):
  url, options, env, secrets = bad
  case = request.node.callspec.params["bad"]
  expect = {"missing-bucket": ["bucket does not exist", "No checkpoint at"],
            "wrong-credentials": ["Access was denied", "access was denied"],
            "unreachable": ["could not be reached"],
            "not-a-directory": ["Not a directory"]}[case.partition("-")[2]]
  tree = {"w": np.arange(20000, dtype=np.float32), "step": 1}
  _fails_clearly(lambda: fnckpt.save(tree, url, storage_options=options).wait(), url, secrets,
                 [e for e in expect if e != "No checkpoint at"])
  _fails_clearly(lambda: fnckpt.restore(url, storage_options=options), url, secrets, expect)
  _fails_clearly(lambda: fnckpt.metadata(url, storage_options=options), url, secrets, expect)
  # The CLI, configured through the environment only.
  full_env = {**os.environ, **env, "JAX_PLATFORMS": "no_such_platform"}
  p = subprocess.run([sys.executable, "-m", "fnckpt", "inspect", url], env=full_env, cwd=REPO,
                     capture_output=True, text=True, timeout=60)
  assert p.returncode == 2, (p.stdout, p.stderr)
  assert _paths.display(url) in p.stderr and "Traceback" not in p.stderr, p.stderr
  for secret in secrets:
    assert secret not in p.stderr + p.stdout
  # The manager (last: everything above must pass whatever happens below).
  if case == "gcs-missing-bucket":
    # fake-gcs-server lists a missing bucket as empty (real GCS answers 404), so the manager
    # starts with no steps; its first save must then fail clearly.
    mgr = fnckpt.CheckpointManager(url, storage_options=options)
    assert mgr.all_steps() == []
    _fails_clearly(lambda: mgr.save(0, tree).wait(), _paths.join(url, "0"), secrets, expect)
    _fails_clearly(mgr.wait, _paths.join(url, "0"), secrets, expect)  # reported once more
    mgr.close()
    return
  _fails_clearly(lambda: fnckpt.CheckpointManager(url, storage_options=options), url, secrets,
                 expect)
