"""Save on one mesh, restore onto others (fewer devices, other axes, one device, the host), and
check that every value matches.

    python examples/reshard.py --devices 8            # 8 simulated CPU devices
    python examples/reshard.py --dir gs://bucket/tmp  # any fnckpt location

The meshes are built from ``jax.devices()``, so it runs unchanged on GPUs and TPUs (with one
device every mesh is that device). Exit status 1 if any restored value differs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--devices", type=int, default=None,
                 help="number of simulated CPU devices (jax_num_cpu_devices)")
  p.add_argument("--dir", default=None, help="where to save (default: a temporary directory)")
  args = p.parse_args(argv)

  import jax
  if args.devices:
    jax.config.update("jax_num_cpu_devices", args.devices)
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

  import fnckpt

  devices = jax.devices()
  n = len(devices)

  def mesh(shape, names, devs):
    return jax.make_mesh(shape, names, devices=devs,
                         axis_types=(jax.sharding.AxisType.Auto,) * len(shape))

  # Save: a 2-D mesh over every device; the weight sharded over both axes.
  a = 2 if n % 2 == 0 else 1
  save_mesh = mesh((a, n // a), ("data", "model"), devices)
  size = 1680  # divisible by every device count up to 8, and by 10, 12, 14, 15, 16
  w = jnp.arange(size * size, dtype=jnp.float32).reshape(size, size) / 7.0
  state = {
      "w": jax.device_put(w, NamedSharding(save_mesh, P("data", "model"))),
      "emb": jax.device_put(jnp.linspace(-1, 1, size * 64, dtype=jnp.bfloat16).reshape(size, 64),
                            NamedSharding(save_mesh, P("model", None))),
      "key": jax.device_put(jax.random.key(42), NamedSharding(save_mesh, P())),
      "step": 1000,
  }
  expected = {k: np.asarray(jax.random.key_data(v) if k == "key" else v)
              for k, v in state.items()}
  path = (args.dir or tempfile.mkdtemp(prefix="fnckpt-reshard-")).rstrip("/") + "/ckpt"
  fnckpt.save(state, path, overwrite=True).wait()
  meta = fnckpt.metadata(path)
  print(f"saved {path} from a {dict(save_mesh.shape)} mesh of {n} {devices[0].platform} "
        f"device(s)")
  for name in ("w", "emb"):
    s = meta.tree[name].sharding
    print(f"  {name:4s} {str(meta.tree[name].dtype):9s} {meta.tree[name].shape} saved as "
          f"{s.spec} over {dict(zip(s.axes, s.sizes))}")

  # Restore: onto half the devices with the axes swapped, onto one device, onto the host.
  half = devices[:max(1, n // 2)]
  other = mesh((len(half),), ("x",), half)
  layouts = {
      f"{len(half)} devices, 1-D mesh": {
          "w": NamedSharding(other, P(None, "x")), "emb": NamedSharding(other, P("x")),
          "key": NamedSharding(other, P())},
      "1 device": {k: SingleDeviceSharding(devices[-1]) for k in ("w", "emb", "key")},
  }
  ok = True
  for label, shardings in layouts.items():
    target = {
        "w": jax.ShapeDtypeStruct(w.shape, jnp.float32, sharding=shardings["w"]),
        "emb": jax.ShapeDtypeStruct((size, 64), jnp.bfloat16, sharding=shardings["emb"]),
        "key": jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=shardings["key"]),
        "step": 0,
    }
    restored = fnckpt.restore(path, target)
    got = {k: np.asarray(jax.random.key_data(v) if k == "key" else v)
           for k, v in restored.items()}
    same = all(np.array_equal(got[k], expected[k]) for k in expected)
    ok &= same
    shards = {k: len(restored[k].addressable_shards) for k in ("w", "emb")}
    layout = getattr(restored["w"].sharding, "spec", "one device")
    print(f"restored onto {label}: w as {layout} ({shards['w']} shard(s)), emb in "
          f"{shards['emb']} shard(s), step "
          f"{restored['step']}: {'values match' if same else 'MISMATCH'}")
  host = fnckpt.restore(path)  # no target: numpy arrays on the host
  same = np.array_equal(host["w"], expected["w"]) and np.array_equal(host["emb"], expected["emb"])
  ok &= same
  print(f"restored onto the host (no target): {type(host['w']).__name__}: "
        f"{'values match' if same else 'MISMATCH'}")
  print("OK: every layout restored the same values" if ok else "FAILED: values differ")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
