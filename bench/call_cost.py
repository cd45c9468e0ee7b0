"""What one save or restore call costs when a training loop makes it again and again: the same
structure, shapes, dtypes and shardings every time, new values.

    python bench/call_cost.py                       # the three states, 6 saves + 3 restores each
    python bench/call_cost.py --states transformer --saves 11 --profile /tmp/prof

One process, 8 virtual CPU devices (where staging is a zero-copy view, so what a save blocks
for is the library's own work). Per state, in the same run:

- ``blocked``: ``fnckpt.save(tree, path)`` wall time (what a training loop waits for), each
  save with new values (``tree + k``, computed on the devices before the call and not timed);
  ``first`` is save 1 (it makes the plan), ``steady`` the median of saves 2..N;
- ``floor``: ``np.asarray`` of every addressable shard (each shard's bytes on the host: what
  any checkpointer must do before the caller may change the arrays), median over the saves;
- ``warm floor``: the same, right after the save, on the same arrays: JAX has made (and
  cached on them) each shard's array and host view, which is most of the floor's cost on
  fresh arrays; what is left is a lower bound no save of fresh arrays reaches;
- ``bare pinned copy``: one ``jax.device_put`` of every distinct shard into ``pinned_host``
  memory, waited for (the floor of owned staging, ``--staging owned``: real copies, as on an
  accelerator);
- ``restore``: ``fnckpt.restore(path, target)`` onto the saved shardings (first, then the
  median of the later ones), each bitwise checked against the tree saved;
- ``device_put``: ``jax.device_put`` of the same values as host arrays onto the target's
  shardings (what a restore must at least do after reading).

States: ``100m`` (examples/lm.py's 100m model: params + AdamW moments + key, 8-way data
parallel), ``mixed`` and ``transformer`` (``bench/states.py``, quick, mesh (2, 4)). The
target of issue 33: steady blocked <= 1.5 x floor + 5 ms. ``--json PATH`` writes every figure.

Before and after a change, on one machine:

    git worktree add /tmp/before <rev>
    mkdir /tmp/before && git archive <rev> | tar -x -C /tmp/before
    python bench/call_cost.py --before /tmp/before --rounds 2 --json both.json

(each arm in fresh processes, alternating; ``FNCKPT_TREE=<tree>`` runs one arm by hand).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if sys.path and os.path.abspath(sys.path[0]) == str(ROOT / "bench"):
  del sys.path[0]  # (run as a script: bench/ on the path shadows modules jax imports)
sys.path.insert(0, str(ROOT))
if os.environ.get("FNCKPT_TREE"):  # another checkout's fnckpt, measured by this script
  sys.path.insert(0, os.environ["FNCKPT_TREE"])

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import numpy as np  # noqa: E402

import fnckpt  # noqa: E402
from bench import states  # noqa: E402

STATES = ("100m", "mixed", "transformer")


def build_state(name: str):
  """(tree, target) of ``name`` on 8 CPU devices."""
  if name == "100m":
    sys.path.insert(0, str(ROOT / "examples"))
    import lm

    run = lm.build(lm.SIZES["100m"], lm.make_mesh(None))
    state = run.init()
    tree = {k: state[k] for k in ("params", "opt_state", "key")}
    target = {k: run.target[k] for k in ("params", "opt_state", "key")}
    return tree, target
  leaves = states.leaves_for(name, "quick")
  mesh = states.make_mesh("a")
  return states.build(leaves, mesh), states.target(leaves, mesh, "a")


def _bump(x):
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return jax.random.split(x, 1)[0]
  return x + 1


def new_values(tree):
  """The same arrays plus one (keys split), on the same shardings."""
  shardings = jax.tree.map(lambda x: x.sharding, tree)
  return jax.jit(lambda t: jax.tree.map(_bump, t), out_shardings=shardings)(tree)


def floor_s(tree) -> float:
  """``np.asarray`` of every addressable shard of every array leaf."""
  t0 = time.perf_counter()
  for x in jax.tree.leaves(tree):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    for s in x.addressable_shards:
      np.asarray(s.data)
  return time.perf_counter() - t0


def pinned_s(tree) -> float:
  """A bare copy of every distinct shard into pinned host memory, one ``jax.device_put`` for
  all, waited for: what a save with owned staging must at least do (``--staging owned``)."""
  shards = []
  for x in jax.tree.leaves(tree):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    shards += [s.data for s in x.addressable_shards if s.replica_id == 0]
  t0 = time.perf_counter()
  kinds = [jax.sharding.SingleDeviceSharding(next(iter(s.devices())), memory_kind="pinned_host")
           for s in shards]
  jax.block_until_ready(jax.device_put(shards, kinds))
  return time.perf_counter() - t0


def _host(x):
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return x  # (a key array is put as it is)
  return np.asarray(x)


def equal(a, b) -> bool:
  def same(x, y):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    return x.sharding == y.sharding and np.array_equal(np.asarray(x), np.asarray(y))

  return all(jax.tree.leaves(jax.tree.map(same, a, b)))


def bench_state(name: str, saves: int, restores: int, root: str, profile: str | None) -> dict:
  tree, target = build_state(name)
  leaves = jax.tree.leaves(tree)
  out: dict = {"state": name, "arrays": len(leaves),
               "shards": sum(len(x.addressable_shards) for x in leaves),
               "bytes": sum(x.nbytes for x in leaves if hasattr(x, "nbytes")),
               "blocked": [], "committed": [], "floor": [], "warm": [], "pinned": [],
               "restore": [],
               "device_put": []}
  prof = cProfile.Profile() if profile else None
  saved = []
  for k in range(saves):
    tree = new_values(tree)
    jax.block_until_ready(tree)
    out["floor"].append(floor_s(tree))
    out["pinned"].append(pinned_s(tree))
    path = f"{root}/{name}-{k}"
    if prof is not None and k > 0:
      prof.enable()
    t0 = time.perf_counter()
    handle = fnckpt.save(tree, path)
    out["blocked"].append(time.perf_counter() - t0)
    if prof is not None:
      prof.disable()
    out["warm"].append(floor_s(tree))  # (the shards' arrays and views now made, cached)
    out["committed"].append(handle.wait().total_s)
    saved.append((path, tree))
  host = jax.tree.map(_host, saved[-1][1])
  shardings = jax.tree.map(lambda x: x.sharding, target)
  out["verified"] = True
  for k in range(restores):
    path, want = saved[-1 - (k % len(saved))]
    t0 = time.perf_counter()
    got = fnckpt.restore(path, target)
    jax.block_until_ready(got)
    out["restore"].append(time.perf_counter() - t0)
    out["verified"] &= equal(got, want)
    del got
    t0 = time.perf_counter()
    put = jax.device_put(host, shardings)
    jax.block_until_ready(put)
    out["device_put"].append(time.perf_counter() - t0)
    del put
  for k in range(saves):
    shutil.rmtree(f"{root}/{name}-{k}", ignore_errors=True)
  if prof is not None:
    prof.dump_stats(f"{profile}-{name}.prof")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
  return out


def summary(r: dict) -> dict:
  steady = statistics.median(r["blocked"][1:]) if len(r["blocked"]) > 1 else r["blocked"][0]
  floor = statistics.median(r["floor"])
  rest = r["restore"][1:] or r["restore"]
  return {"state": r["state"], "arrays": r["arrays"], "shards": r["shards"],
          "first_ms": 1e3 * r["blocked"][0], "steady_ms": 1e3 * steady, "floor_ms": 1e3 * floor,
          "target_ms": 1e3 * (1.5 * floor + 0.005), "meets": steady <= 1.5 * floor + 0.005,
          "warm_ms": 1e3 * statistics.median(r["warm"]),
          "pinned_ms": 1e3 * statistics.median(r["pinned"]),
          "committed_ms": 1e3 * statistics.median(r["committed"]),
          "restore_first_s": r["restore"][0], "restore_s": statistics.median(rest),
          "device_put_s": statistics.median(r["device_put"]), "verified": r["verified"]}


def table(rows: list[dict]) -> str:
  lines = ["| state | arrays / shards | first save blocked | steady blocked | floor | target "
           "(1.5 x floor + 5 ms) | warm floor | bare pinned copy | committed | restore first / "
           "steady | device_put | bitwise |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
  for s in rows:
    lines.append(
        f"| {s['state']} | {s['arrays']:,} / {s['shards']:,} | {s['first_ms']:.1f} ms | "
        f"{s['steady_ms']:.1f} ms | {s['floor_ms']:.1f} ms | {s['target_ms']:.1f} ms "
        f"({'met' if s['meets'] else 'NOT met'}) | {s['warm_ms']:.1f} ms | "
        f"{s['pinned_ms']:.1f} ms | "
        f"{s['committed_ms']:.0f} ms | "
        f"{s['restore_first_s']:.2f} / {s['restore_s']:.2f} s | {s['device_put_s']:.2f} s | "
        f"{'yes' if s['verified'] else 'NO'} |")
  return "\n".join(lines)


def compare(args: argparse.Namespace, argv: list[str]) -> int:
  """``--before TREE``: this checkout and TREE's fnckpt, each in fresh processes, ``--rounds``
  times in alternating order; every figure and the per-state medians of each into ``--json``
  (``{"before": rows, "after": rows, "runs": ...}``, drawn by bench/charts.py)."""
  import subprocess

  rest, skip = [], False
  for a in argv:  # the same arguments, minus the comparison's own
    if skip:
      skip = False
    elif a in ("--before", "--rounds", "--json"):
      skip = True
    elif not a.startswith(("--before=", "--rounds=", "--json=")):
      rest.append(a)
  runs: dict[str, list[list[dict]]] = {"before": [], "after": []}
  for r in range(args.rounds):
    for arm in (("before", "after") if r % 2 == 0 else ("after", "before")):
      out = tempfile.mktemp(suffix=".json")
      env = {**os.environ, "FNCKPT_TREE": args.before if arm == "before" else ""}
      got = subprocess.run([sys.executable, __file__, *rest, "--json", out], env=env,
                           capture_output=True, text=True)
      print(f"round {r + 1} {arm}:\n{got.stdout.strip()}", flush=True)
      if got.returncode:
        raise SystemExit(f"{arm}: {got.stderr[-3000:]}")
      runs[arm].append(json.loads(Path(out).read_text()))
      os.remove(out)
  result = {arm: [_median_rows([rows[k] for rows in runs[arm]]) for k in range(len(runs[arm][0]))]
            for arm in runs}
  result.update({"runs": runs, "before_tree": args.before, "rounds": args.rounds,
                 "argv": ["bench/call_cost.py", *argv], "cpus": os.cpu_count(),
                 "jax": jax.__version__})
  for arm in ("before", "after"):
    print(f"{arm} (medians of {args.rounds} rounds):\n{table(result[arm])}")
  if args.json:
    Path(args.json).write_text(json.dumps(result, indent=1))
  return 0


def _median_rows(rows: list[dict]) -> dict:
  """One state's figures: each number the median over rounds."""
  out = dict(rows[0])
  for k, v in rows[0].items():
    if isinstance(v, float):  # (counts, e.g. arrays, are the same every round)
      out[k] = statistics.median(r[k] for r in rows)
  out["meets"] = out["steady_ms"] <= out["target_ms"]
  out["verified"] = all(r["verified"] for r in rows)
  return out


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--before", default=None, help="another checkout (a tree holding fnckpt/): "
                 "compare it with this one, in fresh processes (see compare)")
  p.add_argument("--rounds", type=int, default=2, help="with --before: rounds of each")
  p.add_argument("--states", default=",".join(STATES))
  p.add_argument("--saves", type=int, default=6)
  p.add_argument("--restores", type=int, default=3)
  p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp dir)")
  p.add_argument("--profile", default=None, help="cProfile saves 2..N into PREFIX-<state>.prof")
  p.add_argument("--staging", choices=("default", "owned", "asarray"), default="default",
                 help="force the staging mode (owned: copies into host memory the save owns, "
                 "as on accelerators)")
  p.add_argument("--batch", type=int, default=None, help="owned copies per jax.device_put "
                 "(default: fnckpt's Copies.BATCH)")
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  if args.before:
    return compare(args, argv)
  if args.staging != "default":
    from fnckpt import _state
    _state.hooks.staging = args.staging
  if args.batch is not None:
    from fnckpt._save import copies
    copies.Copies.BATCH = args.batch
  print(f"fnckpt {fnckpt.__version__} ({os.path.dirname(fnckpt.__file__)}), jax {jax.__version__}, {jax.device_count()} CPU devices, "
        f"staging {args.staging}, load {os.getloadavg()[0]:.2f}", flush=True)
  root = tempfile.mkdtemp(prefix="fnckpt-call-cost-", dir=args.dir)
  try:
    rows = []
    for name in args.states.split(","):
      rows.append(summary(bench_state(name, args.saves, args.restores, root, args.profile)))
      print(table(rows[-1:]).splitlines()[-1], flush=True)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  print(table(rows))
  print(f"load at end {os.getloadavg()[0]:.2f}")
  if args.json:
    Path(args.json).write_text(json.dumps(rows, indent=1))
  return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
  raise SystemExit(main())
