"""The script the interop tests' children run: ``python tests/interop_worker.py '<json>'``.

``config["mode"]`` picks a ``mode_*`` function (and ``mp_worker``'s modes, e.g. ``restore``,
are available too). Every child joins a ``jax.distributed`` job on 127.0.0.1
(``mp_worker.setup``) and reports one line ``RESULT <json>``. Importing this module has no
side effects.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mp_worker  # noqa: E402  (setup, expected values; no side effects)
from mp_worker import make_mesh, make_state, result  # noqa: E402


def mode_orbax_save(cfg):
  """Save ``leaves`` (global arrays on ``mesh``) plus ``step`` = 7 with the real Orbax: a
  ``StandardCheckpointer`` to ``path`` (``use_ocdbt`` as given), or a ``CheckpointManager``
  with ``StandardSave`` at step 7 of ``path`` when ``manager``."""
  import jax
  import orbax.checkpoint as ocp
  mesh = make_mesh(*cfg["mesh"])
  state = make_state(cfg["leaves"], mesh)
  state["step"] = 7
  if cfg.get("manager"):
    mgr = ocp.CheckpointManager(cfg["path"])
    mgr.save(7, args=ocp.args.StandardSave(state))
    mgr.wait_until_finished()
    mgr.close()
  else:
    ckpt = ocp.Checkpointer(ocp.StandardCheckpointHandler(use_ocdbt=cfg.get("use_ocdbt", True)))
    ckpt.save(cfg["path"], args=ocp.args.StandardSave(state))
    ckpt.close()
  result({"process": jax.process_index()})


def _bytes_read() -> int:
  import tensorstore as ts
  for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read"):
    return sum(v["value"] for v in m["values"])
  return 0


def rows_value(shape) -> np.ndarray:
  """The test tensor of the per-process read tests: random (incompressible) float32."""
  return np.random.default_rng(0).standard_normal(tuple(shape), dtype=np.float32)


def mode_rows(cfg):
  """Restore the tensor ``name`` (``shape``, values :func:`rows_value`) of the checkpoint at
  ``path`` (safetensors or Orbax) sharded along its rows over every device of the job; check
  this process's shards and report how many bytes of files this process read."""
  import jax
  import fnckpt
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = make_mesh([jax.device_count()], ["x"])
  shape = tuple(cfg["shape"])
  before = _bytes_read()
  got = fnckpt.restore(cfg["path"], {cfg["name"]: jax.ShapeDtypeStruct(
      shape, np.float32, sharding=NamedSharding(mesh, P("x")))}, partial=True)
  used = _bytes_read() - before
  checked = mp_worker.check_addressable(cfg["name"], got[cfg["name"]], rows_value(shape))
  result({"process": jax.process_index(), "bytes_read": used, "checked_shards": checked})


if __name__ == "__main__":
  mp_worker.main({**vars(mp_worker), **globals()}, devices=4)
