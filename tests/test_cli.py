"""The ``fnckpt`` command, run as a subprocess the way users run it. Its environment names a
JAX platform that does not exist, so any attempt to start a JAX backend would fail: the CLI
must need no devices."""

import os
import re
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fnckpt
from fnckpt import _state

ENV = {**os.environ, "JAX_PLATFORMS": "no_such_platform"}


def cli(*args, console_script=False):
  cmd = ([shutil.which("fnckpt")] if console_script else [sys.executable, "-m", "fnckpt"])
  r = subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True, env=ENV,
                     timeout=120)
  return r.returncode, r.stdout, r.stderr


def train_state(step):
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  w = jnp.arange(64 * 96, dtype=jnp.float32).reshape(64, 96) + step
  return {
      "params": {"w": jax.device_put(w, NamedSharding(mesh, P("data", "model"))),
                 "b": jnp.full((4,), 0.5, jnp.bfloat16)},
      "step": step,
      "key": jax.random.key(step),
      "data": np.random.default_rng(step),
  }


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A run directory: committed steps 10 and 20 (with metrics) and an interrupted step 30.
  Both storage forms of format 3 are there: step 10 as saved by default (``params/w``, 24 KiB,
  in process 0's pack), step 20 with ``pack_bytes=0`` (``params/w`` in a zarr array of its own,
  8 chunks of (32, 24)); small arrays are inline in both."""
  root = tmp_path_factory.mktemp("cli") / "run"
  with fnckpt.CheckpointManager(str(root)) as mgr:
    mgr.save(10, train_state(10), metrics={"loss": 0.75})
  with fnckpt.CheckpointManager(str(root), save_options={"pack_bytes": 0}) as mgr:
    mgr.save(20, train_state(20), metrics={"loss": 0.25})
  original = _state.hooks.on_phase

  def crash(name):
    if name == "committing":
      raise RuntimeError("simulated crash")
  _state.hooks.on_phase = crash
  try:
    with pytest.raises(fnckpt.CheckpointError):
      fnckpt.save(train_state(30), str(root / "30")).wait()
  finally:
    _state.hooks.on_phase = original
  return root


def test_ls(run):
  rc, out, err = cli("ls", run)
  assert rc == 0, err
  lines = out.splitlines()
  assert lines[0].split() == ["STEP", "STATUS", "DATA", "WRITTEN", "LEAVES", "FILES",
                              "COMMITTED", "METRICS"]
  row10, row20, row30 = lines[1].split(), lines[2].split(), lines[3].split()
  assert row10[:2] == ["10", "committed"] and "loss=0.75" in lines[1]
  assert row20[:2] == ["20", "committed"] and "loss=0.25" in lines[2]
  assert row10[2:4] == ["24.0", "KiB"] and row10[6] == "5"  # 64*96*4 + 8 + 8 bytes; 5 leaves
  assert row10[4:6] == ["24.0", "KiB"]  # all written by that save (no base)
  assert row30[:2] == ["30", "UNCOMMITTED"]
  assert "2 committed, 1 uncommitted; latest: 20" in out
  rc, out, err = cli("ls", run.parent / "nothing-here")
  assert rc == 1 and "No checkpoints under" in err


def test_inspect_console_script(run):
  rc, out, err = cli("inspect", run / "20", console_script=True)
  assert rc == 0, err
  assert '"metrics": {"loss": 0.25}' in out
  rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("[")}
  w = rows["['params']['w']"]
  assert "float32" in w and "(64, 96)" in w and "24.0 KiB" in w
  assert "P('data', 'model') mesh(data=2,model=4)" in w and "chunks (32, 24)" in w
  assert "bfloat16" in rows["['params']['b']"] and "inline [0.5, 0.5, 0.5, 0.5]" in rows[
      "['params']['b']"]
  assert "(threefry2x32)" in rows["['key']"] and "inline" in rows["['key']"]
  assert rows["['step']"].split()[-1] == "20"
  assert "numpy Generator (PCG64)" in rows["['data']"]
  assert "5 leaves (3 arrays: 1 stored in their own arrays, 0 in 0 pack(s)), 24.0 KiB" in out

  # Step 10: params/w is a byte range of process 0's pack.
  rc, out, err = cli("inspect", run / "10")
  assert rc == 0, err
  rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("[")}
  w = rows["['params']['w']"]
  assert "float32" in w and "(64, 96)" in w and "24.0 KiB" in w and "chunks" not in w
  assert "pack 0 bytes 0+24576" in w
  assert "inline [0.5, 0.5, 0.5, 0.5]" in rows["['params']['b']"]
  assert "5 leaves (3 arrays: 0 stored in their own arrays, 1 in 1 pack(s)), 24.0 KiB" in out


def test_inspect_uncommitted_and_missing(run):
  rc, out, err = cli("inspect", run / "30")
  assert rc == 2 and "interrupted save" in err
  rc, out, err = cli("inspect", run / "404")
  assert rc == 2 and "No checkpoint at" in err
  rc, out, err = cli("inspect")
  assert rc == 2 and "usage:" in err


def test_verify_ok_then_corrupt_then_missing(run, tmp_path):
  ckpt = tmp_path / "20"
  shutil.copytree(run / "20", ckpt)
  rc, out, err = cli("verify", ckpt)
  assert rc == 0, out + err
  assert out.strip() == f"OK {ckpt} (crc32c and xxh3-128 content hashes)"   # format 3
  assert "100.0% 8/8 chunks 24.0 KiB/24.0 KiB" in err  # the progress bar, on stderr

  chunks = sorted(p for p in ckpt.glob("data-*/a/*/c/*/*") if p.is_file())
  assert len(chunks) == 8  # params/w: its own zarr array, one file per (32, 24) chunk
  data = bytearray(chunks[5].read_bytes())
  data[3] ^= 0x40  # one flipped bit in the data of one chunk
  chunks[5].write_bytes(bytes(data))
  rc, out, err = cli("verify", "-q", ckpt)
  assert rc == 1
  assert "DAMAGED ['params']['w']" in out and "checksum mismatch" in out
  assert f"FAILED {ckpt}: 1 problem(s)." in out
  assert err == ""  # --quiet: no progress bar

  chunks[2].unlink()
  rc, out, err = cli("verify", "-q", ckpt)
  assert rc == 1
  damaged = [l for l in out.splitlines() if l.startswith("DAMAGED")]
  assert len(damaged) == 1 and "['params']['w']" in damaged[0]
  assert "missing data" in damaged[0] and "(and 1 more damaged chunk(s))" in damaged[0]


def test_verify_pack_corrupt_then_missing(run, tmp_path):
  """Step 10 keeps params/w in a pack: damage to the pack is reported as the pack, naming the
  leaves in it and its storage path."""
  ckpt = tmp_path / "10"
  shutil.copytree(run / "10", ckpt)
  rc, out, err = cli("verify", ckpt)
  assert rc == 0, out + err
  assert out.strip().startswith(f"OK {ckpt} (crc32c")
  assert "100.0% 1/1 chunks 24.0 KiB/24.0 KiB" in err
  (pack_dir,) = ckpt.glob("data-*/p/0")
  (chunk,) = [p for p in pack_dir.glob("c/*") if p.is_file()]
  data = bytearray(chunk.read_bytes())
  data[100] ^= 0x01  # one flipped bit inside params/w's bytes
  chunk.write_bytes(bytes(data))
  rc, out, err = cli("verify", "-q", ckpt)
  assert rc == 1 and err == ""
  (damaged,) = [l for l in out.splitlines() if l.startswith("DAMAGED")]
  assert damaged.startswith("DAMAGED pack 0 (['params']['w']) ")
  assert f"({pack_dir})" in damaged and "checksum mismatch" in damaged
  assert f"FAILED {ckpt}: 1 problem(s)." in out

  chunk.unlink()  # a missing pack chunk is damage, never zeros
  rc, out, err = cli("verify", "-q", ckpt)
  assert rc == 1
  (damaged,) = [l for l in out.splitlines() if l.startswith("DAMAGED")]
  assert damaged.startswith("DAMAGED pack 0 (['params']['w']) ") and "missing data" in damaged
  assert "checksum" not in damaged


def test_verify_names_the_cause_from_the_error_not_the_path(tmp_path, capsys):
  """Damage is classified by TensorStore's error (status code, its own words), never by words
  that happen to be in the checkpoint's path or in the array spec TensorStore appends (which
  names the crc32c codec)."""
  from fnckpt.cli import main
  tree = {"a": np.arange(8192, dtype=np.float32), "b": np.arange(8192, dtype=np.int32)}
  lying = {"missing": tmp_path / "crc32c checksum Digest mismatch DATA_LOSS",
           "corrupt": tmp_path / "missing NOT_FOUND not found"}
  for path in lying.values():
    fnckpt.save(tree, str(path), pack_bytes=0).wait()

  def damaged(path):
    assert main(["verify", "-q", str(path)]) == 1
    return [l for l in capsys.readouterr().out.splitlines() if l.startswith("DAMAGED")]

  def cause(line, after, code):  # the classification: between the region and TS's message
    return re.search(re.escape(after) + r" (.*?) \[" + code + ":", line).group(1)

  (chunk,) = lying["missing"].glob("data-*/a/0/c/0")
  chunk.unlink()
  (line,) = damaged(lying["missing"])
  assert line.startswith("DAMAGED ['a']")
  assert cause(line, "): chunk [0:8192]:", "NOT_FOUND") == "missing data"
  (meta,) = lying["missing"].glob("data-*/a/1/zarr.json")
  meta.unlink()  # the open error carries the spec (with "crc32c" in it): still "missing"
  lines = damaged(lying["missing"])
  assert len(lines) == 2 and lines[1].startswith("DAMAGED ['b']")
  assert cause(lines[1], "): cannot open its array:", "NOT_FOUND") == "missing data"
  assert "zarr.json" in lines[1] and "tensorstore_spec" not in lines[1]  # no spec shown

  (chunk,) = lying["corrupt"].glob("data-*/a/1/c/0")
  data = bytearray(chunk.read_bytes())
  data[10] ^= 0x04
  chunk.write_bytes(bytes(data))
  (line,) = damaged(lying["corrupt"])
  assert line.startswith("DAMAGED ['b']")
  assert cause(line, "): chunk [0:8192]:", "DATA_LOSS") == "checksum mismatch (corrupt data)"


def test_verify_a_manifest_that_disagrees_with_zarr_json(tmp_path, capsys):
  """A manifest claiming a far larger array than its zarr.json (a damaged or forged manifest
  that still matches its commit marker): one clear problem, counted without enumerating the
  8 Mi inner chunks the manifest claims (the fuzz harness saw that as a hang)."""
  import msgpack
  from fnckpt._format import hashes as _hashes, manifest as _manifest
  from fnckpt.cli import main
  ckpt = tmp_path / "c"
  fnckpt.save({"a": np.zeros((64, 40), np.float32)}, str(ckpt), inline_bytes=0,
              pack_bytes=0).wait()
  m = msgpack.unpackb((ckpt / "manifest.msgpack").read_bytes(), raw=False)
  m["leaves"][0]["shape"] = [1 << 29, 40]
  assert m["version"] == 3 and m["leaves"][0]["store"]["chunks"] == [64, 40]
  # format 3 requires a 16-byte hash per chunk: 8 Mi chunks (128 MiB; else the manifest is
  # invalid as a whole, and verify never gets to the array); the real chunk's hash is kept
  assert len(m["leaves"][0]["chunk_hashes"]) == 16
  m["leaves"][0]["chunk_hashes"] += bytes((16 << 23) - 16)
  m["leaves"][0]["hash"] = _hashes.digest(m["leaves"][0]["chunk_hashes"])
  raw = _manifest.pack(m)
  (ckpt / "manifest.msgpack").write_bytes(raw)
  (ckpt / "COMMIT").write_bytes(_manifest.encode_commit(raw, time.time()))
  assert main(["verify", str(ckpt)]) == 1
  out, err = capsys.readouterr()
  (line,) = [l for l in out.splitlines() if l.startswith("DAMAGED")]
  assert line.startswith("DAMAGED ['a'] (") and "cannot open its array: its zarr.json does not "\
      "match the manifest [FAILED_PRECONDITION" in line and "tensorstore_spec" not in line
  assert "100.0% 8388608/8388608 chunks 80.0 GiB/80.0 GiB" in err


def test_verify_run_directory_and_uncommitted(run):
  rc, out, err = cli("verify", "-q", run)
  assert rc == 0, out
  assert "uncommitted steps [30]" in out and "2 of 2 checkpoints OK." in out
  rc, out, err = cli("verify", "-q", run / "30")
  assert rc == 1 and "interrupted save" in out


def test_diff(run, tmp_path):
  rc, out, err = cli("diff", run / "10", run / "20")
  assert rc == 0 and "same trees" in out, out + err
  rc, out, err = cli("diff", "--values", run / "10", run / "20")
  assert rc == 1
  assert "! ['params']['w']: values differ (6144 of 6144 elements differ)" in out
  assert "! ['step']: values differ (10 -> 20)" in out
  assert "['params']['b']" not in out  # equal values are not listed

  other = tmp_path / "other"
  state = train_state(10)
  w = np.array(state["params"]["w"])
  w[3, 7] = -1.0
  state["params"]["w"] = jax.device_put(w, state["params"]["w"].sharding)
  del state["params"]["b"]
  state["params"]["extra"] = np.zeros((2, 2), np.int8)
  state["key"] = jnp.zeros((3,), jnp.uint32)
  fnckpt.save(state, str(other), metadata={"step": 10, "metrics": {"loss": 0.75}}).wait()
  rc, out, err = cli("diff", "--values", run / "10", other)
  assert rc == 1
  lines = out.splitlines()
  assert lines[:2] == [f"--- {run / '10'}", f"+++ {other}"]
  assert "- ['params']['b']: array bfloat16[4]" in lines
  assert "+ ['params']['extra']: array int8[2, 2]" in lines
  assert "~ ['key']: key uint32[2] -> array uint32[3]" in lines
  assert "! ['params']['w']: values differ (1 of 6144 elements differ)" in lines
  assert len(lines) == 6, out


def test_per_process_values(tmp_path, capsys):
  """fnckpt.PerProcess leaves (values in data-<hex>/pp/<process>): shown by inspect, read and
  validated by verify (a missing or corrupt file is damage), compared by diff --values."""
  from fnckpt.cli import main
  def tree(epoch):
    return {"w": np.arange(6000, dtype=np.float32),
            "loader": fnckpt.PerProcess({"epoch": epoch, "order": np.arange(5)})}
  a, b, c = (tmp_path / n for n in "abc")
  for path, epoch in ((a, 3), (b, 3), (c, 4)):
    fnckpt.save(tree(epoch), str(path)).wait()
  rc, out, err = cli("inspect", a)  # no JAX backend needed
  assert rc == 0, err
  row = next(l for l in out.splitlines() if l.startswith("['loader']"))
  assert "perprocess" in row and "fnckpt.PerProcess" in row and "pp/<process>" in row
  rc, out, err = cli("verify", "-q", a)
  assert rc == 0 and out.strip().startswith(f"OK {a} (crc32c"), out + err

  assert main(["diff", "--values", str(a), str(b)]) == 0
  assert main(["diff", "--values", str(a), str(c)]) == 1
  out = capsys.readouterr().out
  assert "! ['loader']: values differ (the values of process(es) [0] differ)" in out
  assert "['w']" not in out

  (values,) = c.glob("data-*/pp/0")
  values.write_bytes(b"\xc1 not msgpack")
  assert main(["verify", "-q", str(c)]) == 1
  (line,) = [l for l in capsys.readouterr().out.splitlines() if l.startswith("DAMAGED")]
  assert line.startswith(f"DAMAGED per-process values of process 0 (['loader']) ({values}):")
  assert "corrupt" in line
  values.unlink()
  assert main(["verify", "-q", str(c)]) == 1
  (line,) = [l for l in capsys.readouterr().out.splitlines() if l.startswith("DAMAGED")]
  assert line.startswith(f"DAMAGED per-process values of process 0 (['loader']) ({values}):")
  assert "missing data" in line


def test_in_process_single_checkpoint_and_missing_zarr_json(run, tmp_path, capsys):
  from fnckpt.cli import main
  assert main(["ls", str(run / "20")]) == 0
  out = capsys.readouterr().out
  assert "is a single checkpoint" in out and out.splitlines()[2].split()[:2] == [".", "committed"]

  ckpt = tmp_path / "20"
  shutil.copytree(run / "20", ckpt)
  next(ckpt.glob("data-*/a/*/zarr.json")).unlink()
  assert main(["verify", "-q", str(ckpt)]) == 1
  out = capsys.readouterr().out
  assert "DAMAGED ['params']['w']" in out and "cannot open its array: missing data" in out

  packed = tmp_path / "10"  # a pack's zarr.json
  shutil.copytree(run / "10", packed)
  next(packed.glob("data-*/p/0/zarr.json")).unlink()
  assert main(["verify", "-q", str(packed)]) == 1
  out = capsys.readouterr().out
  assert "DAMAGED pack 0 (['params']['w'])" in out and "cannot open its array: missing data" in out


def test_storage_option_errors_are_one_line(run):
  """--storage-option KEY=VALUE: bad syntax, an unknown key or a bad value is exit 2 with one
  line naming the option and the fix; the keys are checked by the code save/restore use."""
  cases = [
      (["ls", run, "--storage-option", "endpoint"],
       "fnckpt ls: error: --storage-option 'endpoint': expected KEY=VALUE, found no '='. "
       "Write e.g. --storage-option endpoint=http://127.0.0.1:8333 or --storage-option "
       "max_retries=2."),
      (["--storage-option", "=2", "verify", run],
       "fnckpt verify: error: --storage-option '=2': expected KEY=VALUE, found no KEY before "
       "'='."),
      (["--storage-option", "endpint=http://127.0.0.1:1", "inspect", "s3://fnckpt-b/run/1"],
       "fnckpt inspect: error: --storage-option: Unknown storage option 'endpint' for "
       "'s3://fnckpt-b/run/1' (did you mean 'endpoint'?). Options for s3:// are: "),
      (["ls", "s3://fnckpt-b/run", "--storage-option", "max_retries=-1"],
       "fnckpt ls: error: --storage-option: storage option 'max_retries' for "
       "'s3://fnckpt-b/run' must be an integer >= 0, got -1."),
      (["diff", "--storage-option", "region=eu-west-1", run / "10", run / "20"],
       f"fnckpt diff: error: --storage-option: storage_options ['region'] are not used by "
       f"'{run / '10'}'; they apply to gs:// and s3:// locations only."),
  ]
  for argv, expected in cases:
    rc, out, err = cli(*argv)
    assert rc == 2 and out == "", (argv, out, err)
    assert len(err.splitlines()) == 1 and err.startswith(expected), (argv, err)
  # A bad location is not blamed on the options.
  rc, out, err = cli("inspect", "s3:///run", "--storage-option", "max_retries=1")
  assert rc == 2 and err.startswith("fnckpt inspect: error: 's3:///run' names no bucket"), err


def test_storage_options_are_parsed_and_passed(run, monkeypatch, capsys):
  """VALUEs are JSON when they parse, else strings; options given before and after the command
  are all passed, as one storage_options dict, to every storage access."""
  from fnckpt import cli as fcli
  from fnckpt._io import paths as _paths
  assert fcli._storage_options(["max_retries=2", "endpoint=http://127.0.0.1:8333",
                                "requester_pays=true", "initial_delay=10ms",
                                'credentials={"type": "anonymous"}', "region=1e"]) == {
      "max_retries": 2, "endpoint": "http://127.0.0.1:8333", "requester_pays": True,
      "initial_delay": "10ms", "credentials": {"type": "anonymous"}, "region": "1e"}
  seen = []
  real_spec = _paths.kvstore_spec

  def kvstore_spec(path, options=None):  # every open, listing and scan builds its spec here
    seen.append(options)
    return real_spec(path, None)  # a local run: the options are only recorded
  monkeypatch.setattr(_paths, "kvstore_spec", kvstore_spec)
  argv = ["--storage-option", "max_retries=2", "verify", "-q", str(run),
          "--storage-option", "max_delay=1s"]
  assert fcli.main(argv) == 0
  assert "2 of 2 checkpoints OK." in capsys.readouterr().out
  assert len(seen) >= 5  # the check, the listing, the step scan, each step opened
  assert {str(options) for options in seen} == {"{'max_retries': 2, 'max_delay': '1s'}"}


def test_verify_says_when_the_checkpoint_changed_while_being_read(tmp_path, monkeypatch,
                                                                  capsys):
  """A checkpoint overwritten between verify's header read and its chunk reads: the failed
  reads are reported as the change (as restore reports it), not as damage."""
  from fnckpt import cli as fcli
  from fnckpt._sources import source as _source
  ckpt = str(tmp_path / "c")
  fnckpt.save({"w": np.arange(40000, dtype=np.float32)}, ckpt, pack_bytes=0).wait()
  real_open = _source.open_source

  def open_then_overwrite(path, options=None):
    src = real_open(path, options)
    fnckpt.save({"w": np.zeros(40000, np.float32)}, ckpt, pack_bytes=0, overwrite=True).wait()
    return src
  monkeypatch.setattr(_source, "open_source", open_then_overwrite)
  assert fcli.main(["verify", "-q", ckpt]) == 1
  (line,) = [l for l in capsys.readouterr().out.splitlines() if l.startswith("DAMAGED")]
  assert line.startswith(f"DAMAGED {ckpt}: The checkpoint at '{ckpt}' changed while being "
                         "read"), line


_ONE_FILE_CASES = (
    ("one", {"w": np.arange(1 << 21, dtype=np.float32).reshape(2048, 1024)},
     dict(inline_bytes=0, pack_bytes=0)),
    ("many", {f"l{i:02d}": np.full(1 << 16, i, np.float32) for i in range(40)}, {}))


@pytest.mark.parametrize("name, tree, kw", _ONE_FILE_CASES, ids=["one", "many"])
def test_verify_reads_a_chunk_file_once(tmp_path, name, tree, kw):
  """verify reads the 8 inner chunks of one chunk file in one request, as restore does (one
  ts.Batch; it was a request each: 12 in all), and 40 packed leaves of one pack in one read
  of the pack; checking content hashes (format 3) must not read the data again."""
  from tree_utils import CountIO
  from fnckpt.cli import main
  a = str(tmp_path / f"{name}-a")
  fnckpt.save(tree, a, **kw).wait()
  with CountIO() as restore:
    fnckpt.restore(a)
  with CountIO() as verify:
    assert main(["verify", "-q", a]) == 0
  assert verify["read"] == restore["read"] + 1, (name, verify.delta, restore.delta)  # zarr.json
  assert 0 < verify["bytes_read"] - restore["bytes_read"] < 4096, name


@pytest.mark.parametrize("name, tree, kw", _ONE_FILE_CASES, ids=["one", "many"])
def test_diff_reads_a_chunk_file_once(tmp_path, name, tree, kw):
  """diff --values of 40 packed leaves in one pack reads each side's pack once (each leaf read
  its pack inner chunk again: 164 requests, 84 MB for 10.5 MB of data), and a stored array's
  chunk file in one request, as restore does."""
  from tree_utils import CountIO
  from fnckpt.cli import main
  a, b = str(tmp_path / f"{name}-a"), str(tmp_path / f"{name}-b")
  for path in (a, b):
    fnckpt.save(tree, path, **kw).wait()
  with CountIO() as restore:
    fnckpt.restore(a)
  with CountIO() as diff:
    assert main(["diff", "--values", a, b]) == 0
  assert diff["read"] == 2 * restore["read"], (name, diff.delta, restore.delta)
  assert diff["bytes_read"] == 2 * restore["bytes_read"], name


def test_diff_and_verify_hold_at_most_their_read_window(tmp_path, monkeypatch, capsys):
  """diff --values reads both checkpoints block by block, each in half the read window, and
  verify checks bool bytes in blocks of an eighth of it: packed leaves were read whole (and
  a slab of the full window per side)."""
  from fnckpt._sources import read as _read, source as _source
  from fnckpt.cli import main
  windows = []

  class Window(_read.Window):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      windows.append(self)
  monkeypatch.setattr(_read, "Window", Window)
  monkeypatch.setattr(_source, "READ_WINDOW_BYTES", 64 << 10)
  tree = {"w": np.arange(1 << 18, dtype=np.float32), "m": np.ones(1 << 19, np.bool_)}
  fnckpt.save(tree, str(tmp_path / "a")).wait()
  tree["w"][12345] = -1
  fnckpt.save(tree, str(tmp_path / "b")).wait()
  assert main(["diff", "--values", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
  assert "! ['w']: values differ (1 of 262144 elements differ)" in capsys.readouterr().out
  assert [w.limit for w in windows] == [32 << 10] * 2
  assert all(w.peak <= w.limit and w.reads == (1 << 20) // (8 << 10) + (1 << 19) // (8 << 10)
             for w in windows), [(w.peak, w.reads) for w in windows]
  windows.clear()
  assert main(["verify", "-q", str(tmp_path / "a")]) == 0
  (bools,) = [w for w in windows if w.largest == 8 << 10]
  assert bools.peak <= bools.limit == 64 << 10 and bools.reads == (1 << 19) // (8 << 10)
