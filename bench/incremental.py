"""Incremental saves and forks: bytes written and time to committed, against full saves.

    python bench/incremental.py                      # 512 MiB states, 3 runs each
    python bench/incremental.py --mib 128 --runs 2 --dir /mnt/nvme/tmp

Three measurements, each a median over ``--runs`` (8 virtual CPU devices, a (2, 4) mesh):

- ``lora``: a frozen base (8 float32 matrices sharded over the mesh, ~99.5% of the bytes) plus
  LoRA adapters and their AdamW moments (packed leaves). A full save, then an incremental
  save (``base=`` the full one) after the adapters and moments changed. Reported: bytes on
  disk under each new checkpoint (``du``: data, zarr.json, shard indexes, manifest, marker),
  the changed bytes (the adapters and moments), their ratio, and time to committed (every
  save records hashes since format 3). Then a
  manager (``incremental=True, max_to_keep=3``) saves 6 steps; its run's bytes on disk
  against one full state plus the deltas.
- ``dense``: the same matrices, all changed before every save, saved by a plain
  ``fnckpt.save`` (which hashes everything) and as an incremental save on the previous state
  (every chunk hashed before it is written, all changed): time to committed, time the
  caller is blocked, CPU seconds; runs rotated.
- ``fork``: ``CheckpointManager.fork`` of the LoRA run's newest step: wall time and bytes the
  fork wrote.
- ``small``: 200 float32 leaves of 128 KiB, each sharded over the (2, 4) mesh (16 KiB device
  shards), 5 of them changed: bytes an incremental save writes (``save(base=previous)``) over
  the changed bytes, the base a plain save; with
  ``pack_bytes`` 64 KiB (the leaves are then *pieces*, as they are on several
  processes, where no process sees a leaf whole) and with the default 4 MiB (on one process a
  128 KiB leaf is then packed whole).
- ``loop``: a manager (``incremental=True, max_to_keep=3``) saves 8 steps of the LoRA state
  (only adapters and moments change) without waiting between saves (``mgr.wait()`` once at the
  end), and for contrast waiting after each: disk used at the end over one full checkpoint,
  array bytes all saves wrote (``SaveStats.bytes_written``), and how many saves were full.

``--scenario lora`` runs ``lora`` and ``fork``; ``dense``, ``small``, ``loop`` one each;
``all`` (the default) every one.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import fnckpt  # noqa: E402

MiB = 1 << 20


def du(path: str) -> int:
  total = 0
  for d, _, names in os.walk(path):
    total += sum(os.path.getsize(os.path.join(d, n)) for n in names)
  return total


def frozen_base(total_bytes: int, salt: float = 0.0) -> dict:
  mesh = jax.make_mesh((2, 4), ("x", "y"))
  s = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", "y"))
  rows = max(8, int(total_bytes // 8 // 4 // 4096) // 8 * 8)
  out = {}
  for i in range(8):
    f = jax.jit(lambda k: jnp.arange(rows * 4096, dtype=jnp.float32).reshape(rows, 4096) + k,
                out_shardings=s)
    out[f"w{i}"] = f(float(i) + salt)
  return jax.block_until_ready(out)


def adapters(v: int, rank: int = 4) -> dict:
  """LoRA A/B per frozen matrix plus AdamW mu/nu of each (float32, replicated numpy)."""
  out = {}
  for i in range(8):
    a = np.full((4096, rank), v + i, np.float32)
    b = np.full((rank, 4096), -v - i, np.float32)
    out[f"w{i}"] = {"a": a, "b": b, "mu": {"a": a * 0.1, "b": b * 0.1},
                    "nu": {"a": a * 0.01, "b": b * 0.01}}
  return out


def changed_bytes(tree: dict) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def bench_lora(root: str, base: dict, runs: int) -> dict:
  full_t, inc_t, full_b, inc_b = [], [], [], []
  delta = changed_bytes(adapters(0))
  for r in range(runs):
    d = os.path.join(root, f"lora{r}")
    t0 = time.perf_counter()
    fnckpt.save({"frozen": base, "lora": adapters(1), "step": 1}, f"{d}/1").wait()
    full_t.append(time.perf_counter() - t0)
    full_b.append(du(f"{d}/1"))
    t0 = time.perf_counter()
    fnckpt.save({"frozen": base, "lora": adapters(2), "step": 2}, f"{d}/2",
                base=f"{d}/1").wait()
    inc_t.append(time.perf_counter() - t0)
    inc_b.append(du(f"{d}/2"))
    shutil.rmtree(d)
  return {"state_bytes": full_b[0], "changed_bytes": delta,
          "full_committed_s": statistics.median(full_t), "full_bytes": statistics.median(full_b),
          "inc_committed_s": statistics.median(inc_t), "inc_bytes": statistics.median(inc_b),
          "inc_over_changed": statistics.median(inc_b) / delta}


def bench_run_and_fork(root: str, base: dict) -> dict:
  run = os.path.join(root, "run")
  mgr = fnckpt.CheckpointManager(run, max_to_keep=3, incremental=True)
  for v in range(6):  # (a save refers to the newest *committed* step: steps are spaced out)
    mgr.save(v, {"frozen": base, "lora": adapters(v), "step": v})
    mgr.wait()
  run_bytes = du(run)
  t0 = time.perf_counter()
  child = mgr.fork(5, os.path.join(root, "fork"))
  fork_s = time.perf_counter() - t0
  fork_bytes = du(os.path.join(root, "fork"))
  got = child.restore()
  assert got["step"] == 5
  mgr.close()
  child.close()
  return {"run_steps": 6, "kept": 3, "run_bytes": run_bytes, "fork_s": fork_s,
          "fork_bytes": fork_bytes, "fork_record_bytes": du(os.path.join(run, "forks"))}


def cpu_s() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def bench_dense(root: str, mib: int, runs: int) -> dict:
  """Per run a new state (every byte changed): a plain save (format 3: it hashes everything)
  and incrementally (base= the previous run's save: every chunk hashed before it is written,
  all found changed); order rotated."""
  modes = ("plain", "incremental")
  out = {m: ([], [], []) for m in modes}
  prev = None
  for r in range(runs + 1):
    state = frozen_base(mib * MiB, salt=float(r + 1))
    order = modes[r % 2:] + modes[:r % 2]
    for mode in order:
      if mode == "incremental" and prev is None:
        continue
      d = os.path.join(root, f"dense{r}{mode}")
      c0, t0 = cpu_s(), time.perf_counter()
      h = fnckpt.save(state, d, base=prev if mode == "incremental" else None)
      blocked = time.perf_counter() - t0
      h.wait()
      if r > 0:  # (run 0: warm-up, and the first base)
        out[mode][0].append(time.perf_counter() - t0)
        out[mode][1].append(blocked)
        out[mode][2].append(cpu_s() - c0)
    if prev is not None:
      shutil.rmtree(prev)
    prev = os.path.join(root, f"dense{r}plain")
    for mode in ("incremental",):
      shutil.rmtree(os.path.join(root, f"dense{r}{mode}"), ignore_errors=True)
  med = {k: tuple(statistics.median(x) for x in v) for k, v in out.items()}
  best = {k: tuple(min(x) for x in v) for k, v in out.items()}
  return {"med": med, "best": best, "all": out}


SMALL_LEAVES, SMALL_SHAPE, SMALL_CHANGED = 200, (64, 512), tuple(range(0, 200, 40))


def small_state(version: int) -> dict:
  """``small``: 200 float32 (64, 512) leaves (128 KiB) sharded P("x", "y") on the (2, 4)
  mesh (16 KiB device shards); ``version`` 2 changes the leaves in :data:`SMALL_CHANGED`."""
  s = NamedSharding(jax.make_mesh((2, 4), ("x", "y")), P("x", "y"))
  rng = np.random.default_rng(0)
  out = {}
  for i in range(SMALL_LEAVES):
    x = rng.standard_normal(SMALL_SHAPE).astype(np.float32)
    if version == 2 and i in SMALL_CHANGED:
      x += 1
    out[f"l{i:03d}"] = jax.device_put(x, s)
  return jax.block_until_ready(out)


def bench_small(root: str) -> list[dict]:
  """Per ``pack_bytes``: an incremental save of the state with 5 leaves changed on a plain
  save; bytes on disk and array bytes written, over changed."""
  v1, v2 = small_state(1), small_state(2)
  changed = len(SMALL_CHANGED) * v1["l000"].nbytes
  rows = []
  for pack_kib in (64, 4096):
    kw = {"pack_bytes": pack_kib << 10}
    for kind in ("plain",):
      d = os.path.join(root, f"small-{pack_kib}-{kind}")
      fnckpt.save(v1, f"{d}/1", **kw).wait()
      stats = fnckpt.save(v2, f"{d}/2", base=f"{d}/1", **kw).wait()
      meta = fnckpt.metadata(f"{d}/1").tree["l001"]
      rows.append({"pack_kib": pack_kib, "base": kind, "base_layout": meta.stored.split(" ")[0],
                   "base_bytes": du(f"{d}/1"), "inc_bytes": du(f"{d}/2"),
                   "written": stats.bytes_written, "reused": stats.bytes_reused,
                   "changed": changed})
      shutil.rmtree(d)
  return rows


def print_small(rows: list[dict]) -> None:
  print(f"small: {SMALL_LEAVES} leaves of 128 KiB (16 KiB device shards), "
        f"{len(SMALL_CHANGED)} changed ({rows[0]['changed'] / 1024:.0f} KiB); incremental save "
        "on a base: bytes on disk (du) / changed bytes, array bytes written / changed")
  for r in rows:
    layout = "zarr arrays" if "/a/" in r["base_layout"] else r["base_layout"]
    print(f"  pack_bytes {r['pack_kib']} KiB, {r['base']:6s} base ({layout} in the base, "
          f"{r['base_bytes'] / MiB:.1f} MiB): {r['inc_bytes'] / MiB:.3f} MiB = "
          f"{r['inc_bytes'] / r['changed']:.3f}x; array bytes {r['written'] / MiB:.3f} MiB = "
          f"{r['written'] / r['changed']:.3f}x ({r['reused'] / MiB:.3f} MiB reused)")


def bench_loop(root: str, base: dict, steps: int = 8, wait_each: bool = False) -> dict:
  """A manager (``incremental=True, max_to_keep=3``) saves ``steps`` steps of the LoRA state,
  only the adapters changing, waiting after each save or only at the end."""
  full = os.path.join(root, "loop-full")
  fnckpt.save({"frozen": base, "lora": adapters(0), "step": 0}, full).wait()
  full_bytes = du(full)
  shutil.rmtree(full)
  run = os.path.join(root, f"loop-{'wait' if wait_each else 'nowait'}")
  mgr = fnckpt.CheckpointManager(run, max_to_keep=3, incremental=True)
  handles = []
  t0 = time.perf_counter()
  for v in range(steps):
    handles.append(mgr.save(v, {"frozen": base, "lora": adapters(v), "step": v}))
    if wait_each:
      mgr.wait()
  issued = time.perf_counter() - t0
  mgr.wait()
  total = time.perf_counter() - t0
  mgr.close()
  stats = [h.stats for h in handles]
  out = {"steps": steps, "full_bytes": full_bytes, "disk": du(run), "issued_s": issued,
         "total_s": total, "written": sum(s.bytes_written for s in stats),
         "reused": sum(s.bytes_reused for s in stats),
         "full_saves": sum(1 for s in stats if s.bytes_reused == 0),
         "pattern": " ".join("F" if s.bytes_reused == 0 else "I" for s in stats)}
  shutil.rmtree(run)
  return out


def print_loop(root: str, base: dict) -> None:
  for wait_each in (False, True):
    r = bench_loop(root, base, wait_each=wait_each)
    how = "waiting after each save" if wait_each else "no wait between saves"
    print(f"loop ({how}): manager incremental=True, max_to_keep=3, {r['steps']} steps; "
          f"saves issued in {r['issued_s']:.2f} s, all committed after {r['total_s']:.2f} s")
    print(f"  disk at the end {r['disk'] / MiB:.1f} MiB = {r['disk'] / r['full_bytes']:.3f}x one "
          f"full checkpoint ({r['full_bytes'] / MiB:.1f} MiB); array bytes written by all saves "
          f"{r['written'] / MiB:.1f} MiB = {r['written'] / r['full_bytes']:.2f}x one full, "
          f"reused {r['reused'] / MiB:.1f} MiB; {r['full_saves']} of {r['steps']} saves full "
          f"(F: nothing reused, I: incremental; in step order: {r['pattern']})")


def print_lora(root: str, base: dict, args: argparse.Namespace) -> None:
  lora = bench_lora(root, base, args.runs)
  print(f"lora: state {lora['state_bytes'] / MiB:.1f} MiB on disk, changed "
        f"{lora['changed_bytes'] / MiB:.2f} MiB ({100 * lora['changed_bytes'] / lora['state_bytes']:.2f}%)")
  print(f"  full save: {lora['full_committed_s']:.3f} s to committed, "
        f"{lora['full_bytes'] / MiB:.1f} MiB written")
  print(f"  incremental: {lora['inc_committed_s']:.3f} s to committed, "
        f"{lora['inc_bytes'] / MiB:.3f} MiB written = {lora['inc_over_changed']:.3f}x the "
        "changed bytes (manifest, marker, zarr.json and shard index included)")
  rf = bench_run_and_fork(root, base)
  full = lora["full_bytes"]
  print(f"  manager, 6 steps, keep 3: {rf['run_bytes'] / MiB:.1f} MiB on disk = "
        f"{rf['run_bytes'] / full:.3f}x one full checkpoint")
  print(f"fork: {rf['fork_s'] * 1000:.1f} ms, {rf['fork_bytes']} bytes in the fork "
        f"(+ {rf['fork_record_bytes']} bytes of fork record in the parent)")


def print_dense(root: str, args: argparse.Namespace) -> None:
  dense = bench_dense(root, args.mib, args.runs)
  med, best = dense["med"], dense["best"]
  print(f"dense ({args.mib} MiB, every byte changed), medians: committed s / blocked s / "
        "CPU s of the process")
  for mode in ("plain", "incremental"):
    c, b, cpu = med[mode]
    print(f"  {mode:12s} {c:.3f} / {b:.3f} / {cpu:.2f}  ({100 * (c / med['plain'][0] - 1):+.1f}%"
          f" committed, {100 * (cpu / med['plain'][2] - 1):+.1f}% CPU vs plain); best "
          f"{best[mode][0]:.3f} / {best[mode][1]:.3f} / {best[mode][2]:.2f} "
          f"({100 * (best[mode][0] / best['plain'][0] - 1):+.1f}% committed, "
          f"{100 * (best[mode][2] / best['plain'][2] - 1):+.1f}% CPU)")
  print(f"  runs: {dense['all']}")


SCENARIOS: dict[str, Callable] = {
    "lora": lambda root, args: print_lora(root, frozen_base(args.mib * MiB), args),
    "dense": print_dense,
    "small": lambda root, args: print_small(bench_small(root)),
    "loop": lambda root, args: print_loop(root, frozen_base(args.mib * MiB)),
}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--mib", type=int, default=512, help="size of the frozen base / dense state")
  p.add_argument("--runs", type=int, default=3)
  p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
  p.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all",
                 help="run one scenario (lora includes the manager run and the fork)")
  args = p.parse_args()
  root = tempfile.mkdtemp(prefix="fnckpt-inc-", dir=args.dir)
  print(f"python bench/incremental.py --mib {args.mib} --runs {args.runs} --scenario "
        f"{args.scenario}; {os.cpu_count()} cores, load average {os.getloadavg()}")
  try:
    for name, run in SCENARIOS.items():
      if args.scenario in (name, "all"):
        run(root, args)
    print(f"  load average now: {os.getloadavg()}")
  finally:
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  main()
