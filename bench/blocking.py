"""How long fnckpt.save() blocks the caller, per staging mode, against raw device-to-host copies.

    python bench/blocking.py                    # 1 GiB on the default backend, 5 rounds
    python bench/blocking.py --gib 0.5 --runs 5 --dir /mnt/nvme/tmp
    python bench/blocking.py --budget-mib 256   # a save larger than the budget (it streams)

The state: 8 float32 arrays, sharded over a (2, 4) mesh in four different ways (both axes,
rows, columns, the other order), so every device holds 1/8 of it and every array is written as
8 chunks; 8 virtual CPU devices when the backend is CPU, else the first 8 devices (or fewer:
the mesh then is (1, n)). Per round, in one process, the arms alternate their order:

- ``save default`` / ``save owned``: ``fnckpt.save()`` with the backend's default staging and
  with copies into host memory the save owns (``_state.hooks.staging = "owned"``: a
  ``pinned_host`` ``device_put`` per shard): ``blocked`` is the wall time of the call (what a
  training loop waits for), ``total`` until ``wait()`` returns (committed), ``rss`` the peak
  RSS above the RSS before the call (VmHWM reset first), over the state's bytes;
- ``save asarray``: the old path, ``np.asarray`` of each shard (the CPU default; on an
  accelerator a copy JAX caches on the caller's array);
- ``device_get``: ``jax.device_get`` of every shard a save writes (the same bytes);
- ``pinned put``: a bare ``jax.device_put`` of every such shard into ``pinned_host`` memory,
  all started, then waited for;
- ``pinned+numpy``: the same, then ``np.asarray`` of each pinned copy (what the writer does
  with an owned copy): equal to ``pinned put`` if numpy gets a view of the pinned buffer,
  slower and bigger if it copies once more.

After each save arm, ``cached`` says whether a host copy was left on the caller's arrays
(``_npy_value``, on the array or any of its per-device arrays), and the first round restores
each save arm's checkpoint onto the same shardings and compares it bitwise (``verified``).

Each arm gets a fresh copy of the state (made on the devices, not timed), so nothing one arm
leaves cached on the arrays (``np.asarray`` caches its host copy on GPU/TPU arrays) helps
another. GB/s = the state's bytes / the time. Medians over the rounds, and per-round ratios
owned / default. On CPU, ``device_get`` and the default staging are views of the device
buffers (no copy); on an accelerator they are real copies.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # freed buffers go back to the OS (RSS is held)
  os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
  os.execv(sys.executable, [sys.executable] + sys.argv)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

import jax  # noqa: E402

if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu"):
  jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import fnckpt  # noqa: E402
from fnckpt import _state  # noqa: E402

MiB = 1 << 20
ARMS = ("save default", "save owned", "save asarray", "device_get", "pinned put", "pinned+numpy")
STAGING = {"save default": None, "save owned": "owned", "save asarray": "asarray"}


def make_state(total_bytes: int) -> dict[str, jax.Array]:
  """8 float32 arrays of ``total_bytes / 8``, each sharded a different way."""
  devices = jax.devices()[:8]
  shape = (2, 4) if len(devices) == 8 else (1, len(devices))
  mesh = jax.make_mesh(shape, ("x", "y"), devices=devices)
  P = jax.sharding.PartitionSpec
  specs = [P("x", "y"), P(("x", "y")), P(None, ("x", "y")), P("y", "x")]
  rows = max(8, int(total_bytes // 8 // 4 // 4096) // 8 * 8)
  state = {}
  for i in range(8):
    s = jax.sharding.NamedSharding(mesh, specs[i % len(specs)])
    f = jax.jit(lambda k, i=i: jnp.arange(rows * 4096, dtype=jnp.float32).reshape(rows, 4096)
                + k, out_shardings=s)
    state[f"layer{i}"] = f(float(i))
  jax.block_until_ready(state)
  return state


def fresh(state: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """A copy of the state on the same devices (new buffers, nothing cached on them)."""
  out = jax.jit(lambda t: jax.tree.map(lambda x: x + 0, t))(state)
  return jax.block_until_ready(out)


def _rss(field: str = "VmRSS") -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  return 0


def _shards(state) -> list[jax.Array]:
  """Every shard a save writes (replica 0 of each)."""
  return [s.data for a in state.values() for s in a.addressable_shards if s.replica_id == 0]


def cached(state: dict[str, jax.Array]) -> bool:
  """Whether a host copy is cached on any of the caller's arrays or their per-device arrays."""
  return any(getattr(x, "_npy_value", None) is not None
             or any(getattr(s.data, "_npy_value", None) is not None for s in x.addressable_shards)
             for x in state.values())


def verify(x: dict[str, jax.Array], path: str) -> bool:
  """Restore ``path`` onto ``x``'s shardings and compare it with ``x`` bitwise."""
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in x.items()}
  got = fnckpt.restore(path, target)
  return all(got[k].sharding == x[k].sharding and bool(jnp.array_equal(got[k], x[k]))
             for k in x)


def run_save(arm: str, x, root: str, budget: int | None, check: bool) -> dict:
  """One save arm: blocked, to committed, peak staged; cached and (``check``) verified."""
  path = os.path.join(root, arm.replace(" ", "_"))
  t0 = time.perf_counter()
  _state.hooks.staging = STAGING[arm]
  try:
    h = fnckpt.save(x, path, budget_bytes=budget)
    out = {"blocked": time.perf_counter() - t0}
    stats = h.wait()
  finally:
    _state.hooks.staging = None
  out.update(total=time.perf_counter() - t0, staged_peak=stats.peak_staged_bytes,
             cached=cached(x))
  if check:
    out["verified"] = verify(x, path)
  shutil.rmtree(path)
  return out


def run_arm(arm: str, state, root: str, budget: int | None, check: bool = False) -> dict:
  """One timed arm on a fresh copy of ``state``: seconds blocked (and to committed), peak RSS
  above the RSS before it."""
  x = fresh(state)
  shards = _shards(x)
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
  base = _rss()
  t0 = time.perf_counter()
  if arm.startswith("save"):
    out = run_save(arm, x, root, budget, check)
  elif arm == "device_get":
    got = jax.device_get(shards)
    out = {"blocked": time.perf_counter() - t0}
    del got
  else:
    got = [jax.device_put(s, s.sharding.with_memory_kind("pinned_host")) for s in shards]
    jax.block_until_ready(got)
    if arm == "pinned+numpy":
      got = [np.asarray(g) for g in got]
    out = {"blocked": time.perf_counter() - t0}
    del got
  out["rss"] = _rss("VmHWM") - base
  return out


def report(rows: list[dict[str, dict]], nbytes: int) -> None:
  """Medians per arm, then the per-round ratios owned / default."""
  print(f"\nmedians over {len(rows)} rounds ({nbytes / MiB:.0f} MiB):")
  print(f"{'arm':<14} {'blocked s':>10} {'GB/s':>8} {'total s':>9} {'peak RSS / state':>17}")
  for arm in ARMS:
    b = statistics.median(r[arm]["blocked"] for r in rows)
    t = [r[arm]["total"] for r in rows if "total" in r[arm]]
    rss = statistics.median(r[arm]["rss"] for r in rows)
    flags = [f"{k} {sorted({r[arm][k] for r in rows if k in r[arm]})}"
             for k in ("cached", "verified") if any(k in r[arm] for r in rows)]
    print(f"{arm:<14} {b:>10.4f} {nbytes / b / 1e9:>8.2f} "
          f"{statistics.median(t) if t else float('nan'):>9.3f} {rss / nbytes:>17.3f}  "
          + "; ".join(flags))
  for key in ("blocked", "total", "rss"):
    ratios = [r["save owned"][key] / max(r["save default"][key], 1e-9) for r in rows]
    print(f"owned / default, {key}: median {statistics.median(ratios):.2f} "
          f"(rounds: {', '.join(f'{v:.2f}' for v in ratios)})")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1)")
  ap.add_argument("--runs", type=int, default=5)
  ap.add_argument("--budget-mib", type=int, default=None, help="save(budget_bytes=) in MiB")
  ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
  args = ap.parse_args(argv)
  budget = args.budget_mib * MiB if args.budget_mib else None
  state = make_state(int(args.gib * (1 << 30)))
  nbytes = sum(a.nbytes for a in state.values())
  dev = jax.devices()[0]
  root = tempfile.mkdtemp(prefix="fnckpt-blocking-", dir=args.dir)
  print(f"state: {nbytes / MiB:.0f} MiB in {len(state)} arrays on {jax.device_count()} "
        f"{dev.platform} devices ({dev.device_kind}); memories {dev.addressable_memories()}; "
        f"writing under {root}; jax {jax.__version__}, fnckpt {fnckpt.__version__}, "
        f"{os.cpu_count()} cores; budget {args.budget_mib or 'default'} MiB")
  for arm in ARMS[:3]:  # warm-up: thread pools, drivers, first-call compiles
    run_arm(arm, {"w": state["layer0"]}, root, budget)
  rows = []
  try:
    for i in range(args.runs):
      order = ARMS if i % 2 == 0 else ARMS[::-1]
      row = {arm: run_arm(arm, state, root, budget, check=i == 0) for arm in order}
      rows.append(row)
      print(f"round {i + 1}: " + "  ".join(
          f"{a}: {row[a]['blocked']:.4f} s" + (f" / {row[a]['total']:.2f} s" if "total" in row[a]
                                                else "") + f" rss {row[a]['rss'] / MiB:.0f} MiB"
          for a in ARMS), flush=True)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  report(rows, nbytes)
  return 0


if __name__ == "__main__":
  sys.exit(main())
