"""Local pack chunks written by fnckpt (``fnckpt._io.direct``, past the page cache): the files
are the bytes TensorStore's zarr3 driver writes for the same chunk, whatever the sizes, when
``O_DIRECT`` is refused, and in a whole save (against ``_state.hooks.direct_writes = False``,
TensorStore's path); a failed write fails the save and leaves nothing committed."""

from __future__ import annotations

import errno
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding, PartitionSpec as P

import fnckpt
from fnckpt import _state
from fnckpt._io import arrays as _store, direct as _direct
from fnckpt._layout import packing as _packing, pieces as _pieces
from fnckpt._layout.shard import ShardImage
from fnckpt._save import buffers as _buffers


def _tensorstore_file(tmp_path, data: np.ndarray, start: int, chunk: int, inner: int,
                      nbytes: int) -> bytes:
  """The file TensorStore writes for chunk ``start // chunk`` of a pack of ``nbytes``."""
  spec = _store.pack_spec({"driver": "file", "path": f"{tmp_path}/"}, "ts", nbytes, chunk, inner)
  store = _store.open_array({**spec, "store_data_equal_to_fill_value": True},
                            ts.Context({"cache_pool": {"total_bytes_limit": 0}}),
                            mode="create").result()
  _store.write_chunk(store, ((start, start + data.nbytes),), data).result()
  with open(tmp_path / "ts" / "c" / str(start // chunk), "rb") as f:
    return f.read()


def _direct_file(tmp_path, data: np.ndarray, image: ShardImage, buf: np.ndarray | None = None
                 ) -> bytes:
  """The file ``_io.direct`` writes for ``data`` assembled as ``image`` (in ``buf``)."""
  if buf is None:
    buf = _buffers.take(_direct.aligned_size(image))
  buf[:] = 0xEE   # (an earlier chunk's bytes: every byte of the file must be written)
  for at, skip, n in image.place(0, data.nbytes):
    buf[at:at + n] = data[skip:skip + n]
  path = str(tmp_path / "direct" / "c" / "0")
  _direct.encode(buf, image)
  _direct.write_chunk(path, image, buf)
  assert not [f for f in os.listdir(os.path.dirname(path)) if f.endswith(".__lock")]
  with open(path, "rb") as f:
    return f.read()


@pytest.mark.parametrize("nbytes,chunk,inner,start", [
    (4096, 4096, 4096, 0),            # one inner chunk, the whole pack
    (3 * 1000, 5 * 1000, 1000, 5000),  # the last chunk of a pack: fewer inner chunks stored
    (8 * 4096, 8 * 4096, 4096, 0),
    (12345 * 3, 12345 * 3, 12345, 0),  # an inner chunk of an odd size
])
def test_a_chunk_file_is_what_tensorstore_writes(tmp_path, nbytes, chunk, inner, start):
  data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
  data[:inner // 2] = 0   # (zeros too are stored: store_data_equal_to_fill_value)
  want = _tensorstore_file(tmp_path, data, start, chunk, inner, start + nbytes)
  image = ShardImage(nbytes, chunk, inner)
  assert image.size == len(want)
  assert _direct_file(tmp_path, data, image) == want


def test_refused_o_direct_writes_the_same_bytes_through_the_page_cache(tmp_path, monkeypatch):
  """A file system that refuses ``O_DIRECT`` at open (tmpfs), and a buffer it cannot write
  direct (not aligned): the same file either way."""
  data = np.arange(3 * 4096, dtype=np.uint32).view(np.uint8)[:3 * 4096]
  image = ShardImage(3 * 4096, 4 * 4096, 4096)
  want = _tensorstore_file(tmp_path, data, 0, 4 * 4096, 4096, 3 * 4096)
  unaligned = np.empty(_direct.aligned_size(image) + 1, np.uint8)[1:]
  assert unaligned.ctypes.data % _direct.ALIGN
  assert _direct_file(tmp_path / "a", data, image, unaligned) == want
  real_open = os.open

  def no_direct(path, flags, *args):
    if flags & os.O_DIRECT:
      raise OSError(errno.EINVAL, "Invalid argument")
    return real_open(path, flags, *args)
  monkeypatch.setattr(os, "open", no_direct)
  assert _direct_file(tmp_path / "b", data, image) == want


def test_other_errors_are_not_swallowed(tmp_path, monkeypatch):
  image = ShardImage(4096, 4096, 4096)
  buf = _buffers.take(_direct.aligned_size(image))
  buf[:] = 1

  def full(fd, data):
    raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(os, "write", full)
  with pytest.raises(OSError, match="No space left"):
    _direct.write_chunk(str(tmp_path / "c" / "0"), image, buf)
  assert not os.path.exists(tmp_path / "c" / "0")


def test_only_plain_local_locations_are_written_directly(monkeypatch):
  assert _direct.local_root({"driver": "file", "path": "/a/"}) == "/a/"
  assert _direct.local_root({"driver": "memory", "path": "a/"}) is None
  assert _direct.local_root({"driver": "file", "path": "/a/", "file_io_sync": False}) is None
  monkeypatch.setattr(_state.hooks, "direct_writes", False)
  assert _direct.local_root({"driver": "file", "path": "/a/"}) is None


def test_shard_image_places_bytes_around_the_checksums():
  s = ShardImage(3 * 8, 4 * 8, 8)
  assert (s.stored, s.entries, s.index_offset, s.size) == (3, 4, 36, 36 + 64 + 4)
  assert s.place(0, 24) == [(0, 0, 8), (12, 8, 8), (24, 16, 8)]
  assert s.place(7, 2) == [(7, 0, 1), (12, 1, 1)]
  assert s.place(16, 0) == []
  assert s.index()[:, 0].tolist()[:3] == [0, 12, 24] and s.index()[3, 1] == (1 << 64) - 1
  with pytest.raises(ValueError):
    s.place(20, 5)
  with pytest.raises(ValueError):
    ShardImage(12, 32, 8)   # not a multiple of inner: TensorStore writes such a chunk


def _tree():
  """Packed leaves (replicated, numpy, odd sizes) and pieces (small shards): about 5 MiB of
  pack, several chunks of 2 MiB (the pack chunk shrunk) of 1 MiB inner chunks."""
  mesh = jax.make_mesh((2, 4), ("a", "b"), devices=jax.devices())
  rng = np.random.default_rng(0)
  tree = {}
  for i in range(24):
    n = 16384 * (1 + i % 5) + 8 * (i % 3)
    x = rng.standard_normal(n).astype(np.float32)
    if i % 3 == 0:
      tree[f"np{i}"] = x
    elif i % 3 == 1:
      tree[f"rep{i}"] = jax.device_put(x, NamedSharding(mesh, P()))
    else:
      m = n - n % 8
      tree[f"shard{i}"] = jax.device_put(x[:m], NamedSharding(mesh, P(("a", "b"))))
  tree["zeros"] = jnp.zeros(70000, jnp.float32)
  tree["step"] = 3
  return tree


def _chunk_files(path: str) -> dict[str, bytes]:
  out = {}
  for root, _, files in os.walk(path):
    for f in files:
      rel = os.path.relpath(os.path.join(root, f), path).split(os.sep)
      if len(rel) > 2 and rel[1] == "p":
        with open(os.path.join(root, f), "rb") as fh:
          out["/".join(rel[1:])] = fh.read()
  return out


def test_a_save_writes_the_pack_files_tensorstore_writes(tmp_path, monkeypatch):
  monkeypatch.setattr(_packing, "PACK_CHUNK_BYTES", 2 << 20)
  monkeypatch.setattr(_pieces, "PACK_CHUNK_BYTES", 2 << 20)
  written = []   # (pack chunks and the manifest)
  real = _direct.write_file
  monkeypatch.setattr(_direct, "write_file", lambda *a: (written.append(a[0]), real(*a))[1])
  tree = _tree()
  for direct in (True, False, True):   # (the second direct save: buffers from the pool)
    monkeypatch.setattr(_state.hooks, "direct_writes", direct)
    fnckpt.save(tree, str(tmp_path / f"c{len(written)}-{direct}"), budget_bytes=1 << 20,
                pack_bytes=1 << 20, inline_bytes=1024).wait()
  paths = sorted(os.listdir(tmp_path))
  files = [_chunk_files(str(tmp_path / p)) for p in paths]
  assert sum(1 for k in files[0] if "/c/" in k) >= 3
  assert files[0] == files[1] == files[2]   # (zarr.json too)
  assert len(written) == 2 * (sum(1 for k in files[0] if "/c/" in k) + 1)
  assert sum(w.endswith("/manifest.msgpack") for w in written) == 2   # (not with the hook off)
  for p in paths:
    got = fnckpt.restore(str(tmp_path / p), jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, jax.Array) else x, tree))
    for k, v in tree.items():
      assert np.asarray(got[k]).tobytes() == np.asarray(v).tobytes(), (p, k)


def test_a_leaf_of_several_parts_is_gathered_into_the_chunk_as_raw_gathers_it():
  from fnckpt._save.staged_leaf import Staged
  x = np.arange(6 * 8, dtype=np.float32).reshape(6, 8)
  parts = [((slice(0, 6), slice(0, 4)), x[:, :4].copy()), ((slice(0, 6), slice(4, 8)),
                                                           x[:, 4:].copy())]
  leaf = Staged((6, 8), np.dtype(np.float32), parts)
  dst = np.full(leaf.nbytes + 3, 0xAB, np.uint8)
  assert leaf.gather_into(dst[1:1 + leaf.nbytes])   # (at an unaligned place)
  assert dst[1:1 + leaf.nbytes].tobytes() == leaf.raw().tobytes() == x.tobytes()
  assert dst[0] == dst[-2] == dst[-1] == 0xAB
  one = Staged((6, 8), np.dtype(np.float32), [((slice(0, 6), slice(0, 8)), x)])
  assert not one.gather_into(np.empty(one.nbytes, np.uint8))   # (raw() is a view: no copy)
  big = Staged((6, 8), np.dtype(">f4"), [(i, p.astype(">f4")) for i, p in parts])
  assert not big.gather_into(np.empty(big.nbytes, np.uint8))   # (stored little-endian)


def test_two_writers_of_one_key_never_tear_the_file(tmp_path):
  """Concurrent writes of one key (two saves to one directory reached by two spellings):
  each writes its own temporary file, so the key always holds one writer's bytes whole."""
  import threading
  path = str(tmp_path / "k" / "manifest.msgpack")
  datas = [bytes([i]) * (400_000 + 4096 * i) for i in range(2)]
  errors = []

  def write(data):
    buf = _buffers.take(_direct.aligned_size(len(data)))
    try:
      for _ in range(20):
        _direct.write_bytes(path, data, buf)
    except BaseException as e:  # (reported below)
      errors.append(e)
  threads = [threading.Thread(target=write, args=(d,)) for d in datas]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert errors == []
  with open(path, "rb") as f:
    assert f.read() in datas
  assert not [f for f in os.listdir(os.path.dirname(path)) if f.endswith(".__lock")]


def test_a_failed_write_leaves_no_temporary_file(tmp_path, monkeypatch):
  path = str(tmp_path / "k" / "c" / "0")
  os.makedirs(os.path.dirname(path))

  def full(fd):
    raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(os, "fsync", full)
  buf = _buffers.take(_direct.ALIGN)
  with pytest.raises(OSError, match="No space left"):
    _direct.write_bytes(path, b"x" * 100, buf)
  monkeypatch.undo()
  assert os.listdir(os.path.dirname(path)) == []


def test_a_crc32c_module_that_cannot_compute_leaves_writing_to_tensorstore(tmp_path, monkeypatch):
  """(``CRC32C_SW_MODE=none`` on a CPU without the instruction: every call raises.)"""
  class Broken:
    @staticmethod
    def crc32c(data):
      raise RuntimeError("no hardware crc32c and software mode disabled")
  assert _direct.local_root({"driver": "file", "path": str(tmp_path) + "/"}) is not None
  monkeypatch.setattr(_direct, "_crc32c", Broken)
  assert _direct.local_root({"driver": "file", "path": str(tmp_path) + "/"}) is None
  tree = {f"w{i}": np.full((64, 64), i, np.float32) for i in range(8)}
  fnckpt.save(tree, str(tmp_path / "c")).wait()
  got = fnckpt.restore(str(tmp_path / "c"))
  assert all(np.array_equal(got[k], v) for k, v in tree.items())
