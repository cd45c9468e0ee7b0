"""Read-once planning (``_layout.spread``, ``_restore.broadcast``): pure, one process, no I/O.

The multi-process behaviour (bytes read, values, a lost process) is in
``tests/test_broadcast_mp.py``.
"""

import math

import jax
import numpy as np
import pytest

import fnckpt
from fnckpt._layout import spread
from fnckpt._restore import broadcast


def grid(sizes, names, devices_per_process):
  """A mesh whose processes hold consecutive flat positions (as jax.make_mesh lays out hosts)."""
  n = math.prod(sizes)
  return spread.Grid(tuple(names), tuple(sizes),
                     (np.arange(n) // devices_per_process).reshape(sizes))


CASES = [
    # sizes, names, devices/process, spec, shape, groups (processes per shard)
    ((2, 4), ("r", "s"), 4, (("s",), ()), (64, 8), 2),          # 2 slices, FSDP inside
    ((4, 2), ("r", "s"), 2, (("s",), ()), (64, 8), 4),
    ((2, 2), ("x", "y"), 1, ((), ()), (8, 6), 4),                # replicated over 4 processes
    ((8, 4), ("data", "model"), 4, (("model",), ()), (64, 32), 8),
    ((2, 4), ("x", "y"), 2, (("x",), ("y",)), (8, 8), 1),        # no replication
    ((4, 8), ("r", "s"), 8, ((), ("s",)), (12, 16), 4),          # dim 0 takes r (12 % 4)
]


@pytest.mark.parametrize("sizes,names,per,spec,shape,groups", CASES)
def test_reader_reads_each_byte_once_spread_evenly(sizes, names, per, spec, shape, groups):
  g = grid(sizes, names, per)
  nbytes = math.prod(shape) * 4
  held = spread.bytes_per_process(g, spec, shape, 4)
  rspec, factor = spread.reader_spec(g, spec, shape)
  read = spread.bytes_per_process(g, rspec, shape, 4)
  assert spread.replica_groups(g, spec) == groups
  assert factor == groups
  assert read.sum() == nbytes                   # once across the job
  assert held.sum() == groups * nbytes          # today: once per replica group
  assert (read == read[0]).all()                # spread evenly
  assert (read * factor == held).all()          # each process reads 1/R of what it holds


def test_reader_spec_appends_minor_so_a_shard_is_a_run_of_reader_blocks():
  g = grid((2, 4), ("r", "s"), 4)
  rspec, _ = spread.reader_spec(g, (("s",), ()), (64, 8))
  assert rspec == (("s", "r"), ())
  # the target shard of s=1 (rows 16..32) is the reader blocks 2 and 3 (rows 16..24, 24..32)
  blocks = spread._blocks(g, rspec, 2)
  assert blocks[:, 1].tolist() == [2, 3]


def test_reader_spec_leaves_what_does_not_divide():
  g = grid((3,), ("x",), 1)
  assert spread.reader_spec(g, ((),), (7,)) == (((),), 1)
  assert spread.reader_spec(g, ((), ()), (7, 9)) == (((), ("x",)), 3)


def test_axis_inside_a_process_is_not_spread():
  g = grid((2, 4), ("r", "s"), 4)   # s: the 4 devices of one process
  assert spread.crossing_axes(g) == ("r",)
  assert spread.reader_spec(g, ((), ()), (8, 8)) == ((("r",), ()), 2)


def test_contiguous_blocks_for_packed_leaves():
  g = grid((2,), ("x",), 1)
  assert spread.contiguous_blocks(g, (("x",), ()), (4, 3))
  assert spread.contiguous_blocks(g, ((), ("x",)), (1, 4))
  assert not spread.contiguous_blocks(g, ((), ("x",)), (4, 4))


def test_waves_fit_the_budget_and_are_deterministic():
  costs = [3, 3, 3, 10, 1, 1]
  w = spread.waves(costs, 6)
  assert w == [[0, 1], [2], [3], [4, 5]] == spread.waves(costs, 6)
  assert all(sum(costs[i] for i in wave) <= 6 or len(wave) == 1 for wave in w)


def test_one_process_has_no_reader():
  mesh = jax.make_mesh((8,), ("x",))
  s = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  assert broadcast.reader_of(s, (64, 8), 4, packed=False) is None
  assert broadcast.reader_of(jax.sharding.SingleDeviceSharding(jax.devices()[0]), (4,), 4,
                             packed=False) is None


def test_broadcast_argument_is_checked(tmp_path):
  fnckpt.save({"w": np.arange(8.0)}, str(tmp_path / "c")).wait()
  with pytest.raises(TypeError, match=r"broadcast=.yes.: expected True, False or None"):
    fnckpt.restore(str(tmp_path / "c"), broadcast="yes")


@pytest.mark.parametrize("flag", [None, True, False])
def test_one_process_restores_the_same_with_any_broadcast(tmp_path, flag):
  """One process: nothing is replicated across processes; every setting is today's read."""
  w = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
  fnckpt.save({"w": w, "p": np.ones((2048, 4), np.int32)}, str(tmp_path / "c")).wait()
  s = jax.sharding.NamedSharding(jax.make_mesh((8,), ("x",)), jax.sharding.PartitionSpec())
  got = fnckpt.restore(str(tmp_path / "c"), s, broadcast=flag)
  assert np.asarray(got["w"]).tobytes() == w.tobytes()
  assert got["w"].sharding == s


def test_reader_follows_the_stored_chunks():
  """Reads fetch whole chunks: parts go where they stay whole chunks; a chunk larger than
  any part (an Orbax leaf saved from one device) is not split (every replica would fetch it
  whole: no saving, only a collective)."""
  g = grid((2, 2), ("r", "s"), 1)
  # 256-row target shards of 512-row chunks: splitting rows again fetches the same chunk twice
  assert spread.reader_spec(g, (("s",), ()), (512, 4096), align=(512, 512)) == \
      ((("s",), ("r",)), 2)
  assert spread.reader_spec(g, ((), ()), (1024, 1024), align=(1024, 1024)) == (((), ()), 1)
  assert spread.reader_spec(g, ((), ()), (1024, 1024), align=(128, 1024)) == \
      ((("r", "s"), ()), 4)
