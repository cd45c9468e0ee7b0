"""The machine's own limits, measured in the same run as the libraries (numpy + os only).

Each limit is the best of a few repeats (a limit is what the machine can do; the libraries'
figures are medians). Latency (fsync) is a median.

* memcpy GB/s: ``np.copyto`` of a large, already-touched buffer;
* disk write GB/s: buffered ``os.write`` of a file + ``fsync`` (the time includes the fsync);
* disk read GB/s, cold: after ``fsync`` + ``posix_fadvise(DONTNEED)`` evicts the file's pages;
  warm: the same file read again (page cache);
* fsync latency: small write + fsync, the per-commit cost that dominates tiny checkpoints;
* raw TensorStore, per state (:func:`tensorstore_rw`, run in a worker that has the state's
  arrays on the host): the state written as one plain zarr3 array per leaf (codecs ``bytes`` +
  ``crc32c``, no ``sharding_indexed``), each chunk once, until durable; then read back cold.
  What a checkpointer built on TensorStore could do with nothing of its own on top.

Also the helpers the runners share: evicting a directory from the page cache, counting the
files/bytes of a checkpoint, describing the machine and the disk under a directory.
The device-side limit (``jax.device_get`` of the sharded state) needs JAX and the state, so it is
measured in a worker: see ``runners.op_device_limits``.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import subprocess
import time

import numpy as np

GB = 1e9
CHUNK = 16 << 20


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
  src = np.ones(nbytes // 8, np.float64)
  dst = np.empty_like(src)
  np.copyto(dst, src)                    # touch both buffers first
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    np.copyto(dst, src)
    times.append(time.perf_counter() - t)
  return src.nbytes / min(times) / GB


def evict(path: str) -> None:
  """Flush and drop from the page cache every file under ``path`` (a file or a directory)."""
  files = [path] if os.path.isfile(path) else [
      os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
  for f in files:
    try:
      fd = os.open(f, os.O_RDONLY)
    except OSError:
      continue
    try:
      os.fsync(fd)
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)


def _read_all(path: str, buf: memoryview) -> int:
  n = 0
  with open(path, "rb", buffering=0) as f:
    while True:
      k = f.readinto(buf)
      if not k:
        return n
      n += k


def disk_gbps(directory: str, nbytes: int, repeats: int = 3) -> dict[str, float]:
  """Best write (+fsync), cold read and warm read bandwidth of one file in ``directory``."""
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, f"limits-{os.getpid()}.bin")
  data = np.random.default_rng(0).integers(0, 255, CHUNK, dtype=np.uint8)  # incompressible
  buf = memoryview(bytearray(CHUNK))
  w, rc, rw = [], [], []
  try:
    for _ in range(repeats):
      t = time.perf_counter()
      fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
      try:
        for _ in range(nbytes // CHUNK):
          os.write(fd, data)
        os.fsync(fd)
      finally:
        os.close(fd)
      w.append(time.perf_counter() - t)
      evict(path)
      t = time.perf_counter()
      n = _read_all(path, buf)
      rc.append(time.perf_counter() - t)
      t = time.perf_counter()
      _read_all(path, buf)
      rw.append(time.perf_counter() - t)
      os.unlink(path)
  finally:
    if os.path.exists(path):
      os.unlink(path)
  return {"disk_write_gbps": n / min(w) / GB,
          "disk_read_cold_gbps": n / min(rc) / GB,
          "disk_read_warm_gbps": n / min(rw) / GB}


def fsync_ms(directory: str, repeats: int = 50) -> float:
  """Median time to create a 4 KiB file, write it and fsync it (one small object, durably)."""
  os.makedirs(directory, exist_ok=True)
  times = []
  for i in range(repeats):
    path = os.path.join(directory, f"fsync-{os.getpid()}-{i}")
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, b"x" * 4096)
    os.fsync(fd)
    os.close(fd)
    times.append(time.perf_counter() - t)
    os.unlink(path)
  return statistics.median(times) * 1e3


def fsync_dirs(path: str) -> None:
  """``fsync`` every directory under ``path`` and its parent: new entries become durable
  (TensorStore's file kvstore fsyncs each file and the directory it renames it into, not the
  directories it creates)."""
  dirs = [os.path.dirname(os.path.abspath(path))] + [d for d, _, _ in os.walk(path)]
  for d in dirs:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)


def _zarr3_spec(path: str, x: np.ndarray | None, chunk: tuple[int, ...] | None) -> dict:
  """A plain zarr3 array on the file kvstore: regular chunks, ``bytes`` + ``crc32c``."""
  spec: dict = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path + "/"}}
  if x is not None:
    codec = {"name": "bytes"}
    if x.dtype.itemsize > 1:
      codec["configuration"] = {"endian": "little"}
    spec["metadata"] = {
        "shape": list(x.shape), "data_type": x.dtype.name, "codecs": [codec, {"name": "crc32c"}],
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk)}}}
    spec["create"] = True
  return spec


def _ts_write(ts, root: str, arrays: list) -> None:
  """Create every array, write each whole (chunk-aligned: each chunk once), all concurrently."""
  ctx = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
  opens = [ts.open(_zarr3_spec(os.path.join(root, name), x, chunk), context=ctx)
           for name, x, chunk in arrays]
  writes = [f.result().write(x, can_reference_source_data_indefinitely=True)
            for f, (_, x, _) in zip(opens, arrays)]
  for w in writes:
    w.result()
  fsync_dirs(root)


def _ts_read(ts, root: str, arrays: list) -> list[np.ndarray]:
  """Open every array (reads its zarr.json) and read it whole into a new numpy array."""
  ctx = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
  opens = [ts.open(_zarr3_spec(os.path.join(root, name), None, None), context=ctx)
           for name, _, _ in arrays]
  reads = [f.result().read() for f in opens]
  return [r.result() for r in reads]


def tensorstore_rw(directory: str, arrays: list, repeats: int = 3) -> dict[str, float]:
  """Best write (to durable) and best cold read of ``arrays``, ``[(name, host numpy array,
  chunk shape)]``, as one plain zarr3 array per leaf under ``directory`` (file kvstore).

  The write creates every array and writes it whole from host memory (TensorStore's defaults:
  each chunk file fsynced and renamed into place), then fsyncs every directory; the read
  evicts the files from the page cache (as the restore workers do) and reads each array whole.
  The first read is checked against the data written.
  """
  import tensorstore as ts
  nbytes = sum(x.nbytes for _, x, _ in arrays)
  w, r, stats = [], [], {}
  for i in range(repeats):
    root = os.path.join(directory, f"run{i}")
    shutil.rmtree(root, ignore_errors=True)
    t = time.perf_counter()
    _ts_write(ts, root, arrays)
    w.append(time.perf_counter() - t)
    stats = dir_stats(root)
    evict(root)
    t = time.perf_counter()
    got = _ts_read(ts, root, arrays)
    r.append(time.perf_counter() - t)
    if i == 0 and not all(np.array_equal(g, x) for g, (_, x, _) in zip(got, arrays)):
      raise AssertionError("raw TensorStore read back other values than it wrote")
    del got
    shutil.rmtree(root, ignore_errors=True)
  return {"ts_write_s": min(w), "ts_read_s": min(r), "ts_bytes": nbytes,
          "ts_files": stats.get("files"), "ts_disk_bytes": stats.get("bytes")}


def measure(directory: str, nbytes: int) -> dict[str, float]:
  out = {"memcpy_gbps": memcpy_gbps(nbytes)}
  out.update(disk_gbps(directory, nbytes))
  out["fsync_ms"] = fsync_ms(directory)
  return out


def dir_stats(path: str) -> dict[str, int]:
  files = nbytes = 0
  for d, _, fs in os.walk(path):
    for f in fs:
      files += 1
      nbytes += os.path.getsize(os.path.join(d, f))
  return {"files": files, "bytes": nbytes}


def _first_line(cmd: list[str]) -> str:
  try:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return ""


def machine(directory: str) -> dict[str, str]:
  cpu = ""
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
  except OSError:
    pass
  ram = 0
  try:
    with open("/proc/meminfo") as f:
      ram = int(next(l.split()[1] for l in f if l.startswith("MemTotal"))) * 1024
  except (OSError, StopIteration):
    pass
  df = _first_line(["df", "-hT", directory]).splitlines()[-1:]
  disk = " ".join(df[0].split()[:3]) if df else "?"   # device, fs type, size
  usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return {"cpu": cpu or platform.processor() or "?", "cores": str(usable),
          "ram_gib": f"{ram / 2**30:.1f}", "disk": disk, "kernel": platform.release(),
          "python": platform.python_version()}
