"""The script of test_targets' multi-process case: ``python tests/targets_worker.py '<json>'``.

Each child joins a ``jax.distributed`` job on 127.0.0.1 (``mp_worker.setup``), restores the
checkpoint at ``path`` into targets that a process may hold (an abstract mesh of the whole job,
devices of another process only, a mesh of the wrong size) and reports, per target, the
restored shards checked or the CheckpointError's text; any other exception fails the child.
Importing this module has no side effects.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mp_worker  # noqa: E402  (setup, result; no side effects)

from test_targets import value_of  # noqa: E402  (the saved values)

NAMES = ("w", "packed", "zarr", "pieces")


def targets():
  import jax
  from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P
  mine = jax.process_index()
  others = [d for d in jax.devices() if d.process_index != mine]
  explicit = (jax.sharding.AxisType.Explicit,) * 2
  return {
      "abstract-job": NamedSharding(AbstractMesh((2, 4), ("data", "model"),
                                                 axis_types=explicit), P("data", "model")),
      "abstract-too-large": NamedSharding(AbstractMesh((4, 4), ("data", "model")), P("data")),
      "other-process-device": jax.sharding.SingleDeviceSharding(others[0]),
      "other-process-mesh": NamedSharding(Mesh(np.array(others).reshape(2, 2), ("a", "b")),
                                          P("a", "b")),
  }


def mode_targets(cfg):
  import jax
  import fnckpt
  outcomes = {leaf: {} for leaf in NAMES}
  for leaf in NAMES:
    value = value_of(leaf)
    for name, sharding in targets().items():
      target = {leaf: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)}
      try:
        got = fnckpt.restore(cfg["path"], target, partial=True)[leaf]
      except fnckpt.CheckpointError as e:
        outcomes[leaf][name] = {"error": str(e)}
        continue
      want = sharding
      if name.startswith("abstract"):
        want = jax.sharding.NamedSharding(jax.make_mesh(
            (2, 4), ("data", "model"), axis_types=sharding.mesh.axis_types), sharding.spec)
      assert got.sharding == want, (leaf, name)
      outcomes[leaf][name] = {"shards": mp_worker.check_addressable(name, got, value)}
  mp_worker.result({"process": jax.process_index(), "outcomes": outcomes})


if __name__ == "__main__":
  mp_worker.main(globals(), devices=4)
