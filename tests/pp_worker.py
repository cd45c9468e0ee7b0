"""A child process for tests/test_perprocess.py: saves or restores a tree holding
fnckpt.PerProcess values under jax.distributed; prints ``RESULT <json>``."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mp_worker  # noqa: E402


def state(me: int):
  import numpy as np
  import fnckpt
  return {"w": np.arange(6.0).reshape(2, 3),            # global: process 0's value is kept
          "loader": fnckpt.PerProcess({"epoch": 3, "offset": 1000 * (me + 1),
                                       "order": np.arange(4) + me,
                                       "rng": np.random.default_rng(me)}),
          "step": 5}


def main(cfg):
  mp_worker.setup(cfg)
  import jax
  import numpy as np
  import fnckpt
  me = jax.process_index()
  if cfg["mode"] == "apart":
    apart(cfg["path"], me)
    return
  if cfg["mode"] == "local":
    dev = jax.local_devices()[0]
    small = [jax.device_put(np.full(10000, me, np.float32), dev) for _ in range(4)]  # packed
    big = jax.device_put(np.full(2 << 20, me, np.float32), dev)  # 8 MiB: its own array
    fnckpt.save({"small": small, "big": big, "step": me}, cfg["path"],
                barrier_timeout_s=120).wait()
    mp_worker.result({"saved": True})
    return
  if cfg["mode"] == "save":
    fnckpt.save(state(me), cfg["path"], barrier_timeout_s=120).wait()
    mp_worker.result({"saved": True})
    return
  kwargs = {} if cfg.get("from") is None else {"per_process_from": cfg["from"]}
  try:
    got = fnckpt.restore(cfg["path"], {"w": np.zeros((2, 3)), "loader": fnckpt.PerProcess(None),
                                       "step": 0}, **kwargs)
  except fnckpt.CheckpointError as e:
    mp_worker.result({"error": str(e)})
    return
  v = got["loader"].value
  mp_worker.result({"process": me, "offset": v["offset"], "order": v["order"].tolist(),
                    "draw": float(v["rng"].random()), "w": got["w"].tolist(),
                    "step": got["step"]})


def apart(path, me):
  """Save a packed and an inline leaf with a sharding over both processes, then restore a
  different one on each process: restore must make no cross-process call (a collective
  here would hang or fail, as the processes ask for different things)."""
  import jax
  import numpy as np
  import fnckpt
  mesh = jax.make_mesh((2, 2), ("x", "y"), devices=jax.devices())
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  values = {"b": np.arange(128 * 64, dtype=np.float32).reshape(128, 64),   # 32 KiB: packed
            "f": np.arange(8, dtype=np.float32)}                           # inline
  tree = {k: jax.make_array_from_callback(v.shape, rep, lambda i, v=v: v[i])
          for k, v in values.items()}
  fnckpt.save(tree, path, barrier_timeout_s=120).wait()
  name = "b" if me == 0 else "f"
  got = fnckpt.restore(path, {name: rep}, partial=True)[name]
  local = [np.asarray(s.data).tobytes() == values[name].tobytes()
           for s in got.addressable_shards]
  mp_worker.result({"name": name, "sharding": str(got.sharding.spec), "ok": all(local),
                    "shards": len(local)})


if __name__ == "__main__":
  main(json.loads(sys.argv[1]))
