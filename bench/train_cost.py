"""What checkpointing costs training: steps/s of examples/lm.py with and without saving.

    python bench/train_cost.py --rounds 3        # small: 6 saves, one every 50 steps (~5 min)
    python bench/train_cost.py --sizes 100m --every 10 --phase-saves 2 --rounds 1 --warmup 2
    python bench/train_cost.py --every-step --phase-saves 40 --rounds 2  # a save every step

The example's own pieces (``lm.build``: model, optimizer, shardings, jitted train step and data
iterator) run in this process on ``--devices`` simulated CPU devices (a ``--mesh`` of them).
After a warm-up (compilation), phases alternate: ``off`` trains ``--phase-saves x --every``
steps without saving; ``on`` trains as many with a ``fnckpt.CheckpointManager`` save of the
whole state (what lm.py saves: parameters, AdamW state, step, key, data position) in the
middle of every ``--every``-step interval, so each save has a quiet baseline before it and
its background write ends inside the phase (``spilled`` in the JSON counts those that did
not). Every step is timed until its loss is ready, the ``manager.save`` call included.

Reported per size:
* **pooled**: steps/s of all ``off`` and all ``on`` steps and the slowdown ``1 - on/off``.
  Honest but fragile: on a shared 2-core machine other processes move step times by more
  than a save does, so also:
* **paired**: per save, the seconds it added: the step that saved (blocked time included) and
  the steps of its "window" (those that started while it was still writing or committing)
  against the median of the 10 steps just before it. ``slowdown at every / at 50`` is that
  cost over an interval of ``--every`` / 50 baseline steps (the target: <= 5% at 50). For a
  size too slow to run 50-step intervals, measure with a smaller ``--every`` and read "at 50";
* the **second dip**: how many steps a save's window spans, and how much slower they ran than
  its baseline (median over saves);
* **blocked per save**: the wall time of ``manager.save(...)`` (median) and
  ``SaveHandle.stats.blocking_s``; ``write`` is ``stats.total_s`` (call to committed).

Limits in the same run, after the phases, with no training running: the **CPU seconds of one
save** of the same state (the machine's busy time, ``/proc/stat``, call to committed: the
kernel's writeback threads included) and of **writing and fsyncing the same bytes** to one
file (the kernel's own cost of a write on this
machine, a floor for any library that writes them). On a CPU-bound host (2 cores, training on
both) the cost of a save is about its CPU time, so ``floor at 50`` is the slowdown at 50 that a
save costing no more CPU than the bare write would have: ``cost x write CPU / save CPU``.

``--every-step``: a checkpoint every step. The ``on`` phases save every step (``--phase-saves``
steps a phase) to a local fast tier (``--local-dir``, tmpfs by default) and every
``--durable-every``-th step also to ``--dir`` (the manager's two tiers). Reported: the pooled
slowdown, blocked time per save, and the floor beside it: the CPU seconds of writing the
checkpoint's bytes to the fast tier once (``write_limits`` there), over one step (a CPU-bound
host pays at least that per step). The paired figures need quiet steps between saves, which
every-step saving has none of: they are in the JSON but not the table.

The load average at start and end is printed. ``--json PATH`` writes every figure and step time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class Save:
  step: int
  blocked_s: float                 # wall time of manager.save(...)
  handle: Any                      # fnckpt.SaveHandle
  before: list[float]              # the step times just before it: its local baseline
  save_step_s: float = 0.0         # the step that saved, blocked time included
  window: list[float] = dataclasses.field(default_factory=list)  # step times while writing

  def cost_s(self) -> float:
    """Seconds this save added: its step and its window against the baseline's median."""
    if not self.before:  # (the first step of a phase saving every step)
      return float("nan")
    base = statistics.median(self.before)
    return self.save_step_s + sum(self.window) - (1 + len(self.window)) * base


@dataclasses.dataclass
class Phase:
  saving: bool
  step_s: list[float] = dataclasses.field(default_factory=list)
  saves: list[Save] = dataclasses.field(default_factory=list)
  spilled: int = 0                 # saves still writing when the phase ended


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--sizes", default="small", help="comma-separated lm.py sizes (100m: ~6-12 s "
                 "a step on 2 cores, so measure it with a smaller --every)")
  p.add_argument("--every", type=int, default=50, help="save every K steps")
  p.add_argument("--phase-saves", type=int, default=2, help="saves per 'on' phase (a phase "
                 "is this many intervals of --every steps)")
  p.add_argument("--rounds", type=int, default=2, help="off/on phase pairs per size")
  p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compiles)")
  p.add_argument("--batch", type=int, default=None, help="sequences per step (default: the "
                 "size's; an accelerator trains 100m on far more than its 8)")
  p.add_argument("--staging", choices=("owned", "asarray"), default=None, help="force how "
                 "saves take shards off the devices (default: the platform's; see "
                 "fnckpt/_save/copies.py)")
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--mesh", default="2,4")
  p.add_argument("--dir", default=str(ROOT / "tmp" / "train_cost"), help="checkpoints "
                 "(deleted at the end)")
  p.add_argument("--every-step", action="store_true", help="a checkpoint every step: the "
                 "'on' phases save every step to a local fast tier (--local-dir) and every "
                 "--durable-every-th to --dir; a phase is --phase-saves steps")
  p.add_argument("--local-dir", default=None, help="the fast tier of --every-step (default: "
                 "/dev/shm/fnckpt-train-cost where /dev/shm exists, else under --dir)")
  p.add_argument("--durable-every", type=int, default=50, help="with --every-step: every "
                 "K-th step also reaches --dir")
  p.add_argument("--json", default=None, help="write all figures here")
  args = p.parse_args(argv)
  if args.every_step:
    args.every = 1
    if args.local_dir is None:
      shm = Path("/dev/shm")
      args.local_dir = str(shm / "fnckpt-train-cost" if shm.is_dir() else
                           Path(args.dir) / "fast")
  return args


def load_example(devices: int):
  """examples/lm.py as a module (JAX's CPU device count is set before any backend starts)."""
  import jax
  jax.config.update("jax_num_cpu_devices", devices)
  sys.path.insert(0, str(ROOT / "examples"))
  import lm
  return lm


def timed_step(lm_run, arrays, batches) -> tuple[Any, float]:
  import jax
  t0 = time.perf_counter()
  arrays, loss = lm_run.train_step(arrays, jax.device_put(next(batches), lm_run.tokens_sharding))
  loss.block_until_ready()
  return arrays, time.perf_counter() - t0


def run_phase(lm_run, arrays, batches, step: int, steps: int, every: int,
              manager: Any | None) -> tuple[Any, int, Phase]:
  """``steps`` timed steps; with a manager, a save in the middle of each interval."""
  phase = Phase(saving=manager is not None)
  for i in range(steps):
    writing = [s for s in phase.saves if not s.handle.done()]
    arrays, seconds = timed_step(lm_run, arrays, batches)
    step += 1
    if manager is not None and i % every == every // 2:
      t0 = time.perf_counter()
      handle = manager.save(step, {**arrays, "step": step, "data": batches.state()})
      blocked = time.perf_counter() - t0
      seconds += blocked
      phase.saves.append(Save(step, blocked, handle, phase.step_s[-10:], seconds))
    for s in writing:
      s.window.append(seconds)
    phase.step_s.append(seconds)
  phase.spilled = sum(not s.handle.done() for s in phase.saves)
  if manager is not None:
    manager.wait()
  return arrays, step, phase


def rate(step_s: list[float]) -> float:
  return len(step_s) / sum(step_s) if step_s else float("nan")


def summarize(phases: list[Phase], every: int) -> dict[str, Any]:
  off = [t for p in phases if not p.saving for t in p.step_s]
  on = [t for p in phases if p.saving for t in p.step_s]
  saves = [s for p in phases for s in p.saves]
  stats = [s.handle.stats for s in saves]
  paired = [s for s in saves if s.before]  # (every step saving: the first of each phase has
  base = statistics.median(t for s in paired for t in s.before)  # no quiet steps before it)
  cost = statistics.median(s.cost_s() for s in paired)
  dips = [statistics.mean(s.window) / statistics.median(s.before) - 1 for s in paired
          if s.window]
  return {
      "steps_per_s_off": rate(off), "steps_per_s_on": rate(on),
      "slowdown": 1 - rate(on) / rate(off),
      "cost_per_save_s": cost, "baseline_step_s": base,
      "slowdown_at_every": cost / (every * base + cost),
      "slowdown_at_50": cost / (50 * base + cost),
      "dip_slowdown": statistics.median(dips) if dips else 0.0,
      "dip_steps_per_save": statistics.mean(len(s.window) for s in saves),
      "saves": len(saves), "spilled": sum(p.spilled for p in phases),
      "blocked_s_median": statistics.median(s.blocked_s for s in saves),
      "blocked_s_max": max(s.blocked_s for s in saves),
      "stats_blocking_s_median": statistics.median(s.blocking_s for s in stats),
      "write_total_s_median": statistics.median(s.total_s for s in stats),
      "phases": [{"saving": p.saving, "step_s": p.step_s,
                  "saves": [{"step": s.step, "blocked_s": s.blocked_s, "before_s": s.before,
                             "save_step_s": s.save_step_s, "window_s": s.window,
                             "cost_s": s.cost_s(), "stats": dataclasses.asdict(s.handle.stats)}
                            for s in p.saves]}
                 for p in phases],
  }


def bench_size(lm, name: str, args: argparse.Namespace) -> dict[str, Any]:
  import fnckpt
  mesh = lm.make_mesh(tuple(int(n) for n in args.mesh.split(",")))
  t0 = time.perf_counter()
  size = lm.SIZES[name]
  if args.batch:
    size = dataclasses.replace(size, batch=args.batch)
  lm_run = lm.build(size, mesh)
  state = lm_run.init()
  arrays = {k: state[k] for k in ("params", "opt_state", "key")}
  batches = lm_run.batches(state["data"])
  for _ in range(args.warmup):
    arrays, _ = timed_step(lm_run, arrays, batches)
  print(f"[{name}] built, initialised and warmed up in {time.perf_counter() - t0:.1f}s",
        flush=True)

  directory = Path(args.dir) / name
  shutil.rmtree(directory, ignore_errors=True)
  tier: dict[str, Any] = {}
  if args.every_step:  # every step to the fast tier, every --durable-every-th to --dir
    local = Path(args.local_dir) / name
    shutil.rmtree(local, ignore_errors=True)
    tier = {"save_interval_steps": args.durable_every, "local_directory": str(local),
            "local_save_interval_steps": 1, "local_max_to_keep": 2}
  manager = fnckpt.CheckpointManager(str(directory), max_to_keep=2, **tier)
  step, phases = args.warmup, []
  steps = args.phase_saves * args.every
  for r in range(args.rounds):
    for saving in (False, True):
      arrays, step, phase = run_phase(lm_run, arrays, batches, step, steps, args.every,
                                      manager if saving else None)
      phases.append(phase)
      if saving and r == 0:  # what one checkpoint holds, from its metadata
        newest = manager.latest_step()
        where = (manager.path(newest) if not args.every_step else
                 str(Path(tier["local_directory"]) / str(newest)))
        saved = lm.checkpoint_size(fnckpt.metadata(where))
      print(f"[{name}] round {r + 1} {'on ' if saving else 'off'}: "
            f"{rate(phase.step_s):.3f} steps/s"
            + "".join(f"; save {s.step}: blocked {s.blocked_s:.3f}s, written in "
                      f"{s.handle.stats.total_s:.2f}s over {len(s.window)} steps"
                      for s in phase.saves), flush=True)
  manager.close()
  limits = write_limits(fnckpt, {**arrays, "step": step}, saved["bytes"], directory)
  if args.every_step:  # the floor of a save per step: writing its bytes to the fast tier
    local_limits = write_limits(fnckpt, {**arrays, "step": step}, saved["bytes"], local,
                                repeat=20)
    limits.update({f"local_{k}": v for k, v in local_limits.items()})
    shutil.rmtree(local, ignore_errors=True)
  shutil.rmtree(directory, ignore_errors=True)
  return {"size": name, "batch": size.batch, "staging": args.staging or "default",
          "every": args.every, "every_step": args.every_step,
          "durable_every": args.durable_every if args.every_step else None,
          "checkpoint_bytes": saved["bytes"],
          "checkpoint_arrays": saved["arrays"], **limits, **summarize(phases, args.every)}


def cpu_s() -> float:
  """Busy CPU seconds of the whole machine (``/proc/stat``: all but idle and iowait), so the
  kernel's writeback threads count too (a process's own ``os.times`` misses them, and how much
  of a write they take varies from run to run)."""
  with open("/proc/stat") as f:
    ticks = [int(v) for v in f.readline().split()[1:]]
  return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def write_limits(fnckpt, arrays: Any, nbytes: int, directory: Path,
                 repeat: int = 1) -> dict[str, float]:
  """CPU seconds (and wall) of one save of ``arrays`` and of writing + fsyncing ``nbytes`` to
  one file, here and now (nothing else running in this process); the mean of ``repeat`` of
  each (``/proc/stat`` counts 10 ms ticks: a small save needs several)."""
  directory.mkdir(parents=True, exist_ok=True)
  c0, t0 = cpu_s(), time.perf_counter()
  for k in range(repeat):
    fnckpt.save(arrays, str(directory / f"limit{k}")).wait()
  save_cpu, save_wall = (cpu_s() - c0) / repeat, (time.perf_counter() - t0) / repeat
  for k in range(repeat):
    shutil.rmtree(directory / f"limit{k}", ignore_errors=True)
  block = bytes(64 << 20)
  c0, t0 = cpu_s(), time.perf_counter()
  for k in range(repeat):
    with open(directory / f"raw{k}", "wb") as f:
      for start in range(0, nbytes, len(block)):
        f.write(block[:min(len(block), nbytes - start)])
      f.flush()
      os.fsync(f.fileno())
  raw_cpu, raw_wall = (cpu_s() - c0) / repeat, (time.perf_counter() - t0) / repeat
  for k in range(repeat):
    os.remove(directory / f"raw{k}")
  return {"save_cpu_s": save_cpu, "save_wall_s": save_wall, "raw_write_cpu_s": raw_cpu,
          "raw_write_wall_s": raw_wall}


def floor_at_50(r: dict[str, Any]) -> float:
  """The slowdown at 50 of a save that cost only the bare write's CPU (see the docstring)."""
  cost = r["cost_per_save_s"] * r["raw_write_cpu_s"] / max(r["save_cpu_s"], 1e-9)
  return cost / (50 * r["baseline_step_s"] + cost)


def every_step_table(results: list[dict[str, Any]]) -> str:
  """--every-step: what a checkpoint every step costs, beside the floor of this machine (the
  CPU seconds of writing the checkpoint's bytes to the fast tier, per step)."""
  rows = ["| size | checkpoint | fast tier | steps/s off / on (pooled) | slowdown (pooled) "
          "| blocked per save (stats) | to committed | CPU per step: save / bare write "
          "(same run) | floor: bare write per step |",
          "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
  for r in results:
    base = 1 / r["steps_per_s_off"]
    floor = r["local_raw_write_cpu_s"] / (base + r["local_raw_write_cpu_s"])
    rows.append(
        f"| {r['size']} (batch {r['batch']}) | {r['checkpoint_bytes'] / 2**20:.1f} MiB, "
        f"{r['checkpoint_arrays']} arrays | every step (durable every {r['durable_every']}) "
        f"| {r['steps_per_s_off']:.3f} / {r['steps_per_s_on']:.3f} | "
        f"{100 * r['slowdown']:.1f}% | {1e3 * r['blocked_s_median']:.1f} ms "
        f"({1e3 * r['stats_blocking_s_median']:.1f} ms) | {r['write_total_s_median']:.2f} s | "
        f"{1e3 * r['local_save_cpu_s']:.1f} ms / {1e3 * r['local_raw_write_cpu_s']:.1f} ms | "
        f"{100 * floor:.1f}% |")
  return "\n".join(rows)


def table(results: list[dict[str, Any]]) -> str:
  rows = ["| size | checkpoint | every | steps/s off / on (pooled) | slowdown (pooled) "
          "| blocked/save (stats) | write | dip: steps, slowdown | cost/save (paired) "
          "| slowdown at every / at 50 (paired) | CPU: save / write+fsync (same run) "
          "| floor at 50 |",
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
  for r in results:
    rows.append(
        f"| {r['size']} (batch {r['batch']}, staging {r['staging']}) "
        f"| {r['checkpoint_bytes'] / 2**20:.1f} MiB, {r['checkpoint_arrays']} "
        f"arrays | {r['every']} | {r['steps_per_s_off']:.3f} / {r['steps_per_s_on']:.3f} "
        f"| {100 * r['slowdown']:.1f}% | {r['blocked_s_median']:.3f} s "
        f"({r['stats_blocking_s_median']:.3f} s) | {r['write_total_s_median']:.2f} s "
        f"| {r['dip_steps_per_save']:.1f}, {100 * r['dip_slowdown']:+.1f}% "
        f"| {r['cost_per_save_s']:.3f} s | {100 * r['slowdown_at_every']:.2f}% / "
        f"{100 * r['slowdown_at_50']:.2f}% | {r['save_cpu_s']:.2f} s / "
        f"{r['raw_write_cpu_s']:.2f} s | {100 * floor_at_50(r):.2f}% |")
  return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  lm = load_example(args.devices)
  if args.staging:
    from fnckpt import _state
    _state.hooks.staging = args.staging
  load_start = os.getloadavg()
  import jax
  dev = jax.devices()[0]
  print(f"{jax.device_count()} {dev.platform} device(s) ({dev.device_kind}), jax "
        f"{jax.__version__}; mesh {args.mesh}, save every {args.every} steps, "
        f"{args.rounds} round(s) of off/on phases of {args.phase_saves * args.every} steps; "
        f"load average {load_start[0]:.2f}", flush=True)
  results = [bench_size(lm, name, args) for name in args.sizes.split(",")]
  load_end = os.getloadavg()
  print(every_step_table(results) if args.every_step else table(results))
  print(f"load average: {load_start[0]:.2f} at start, {load_end[0]:.2f} at end "
        f"({os.cpu_count()} cores)")
  if args.json:
    Path(args.json).write_text(json.dumps(
        {"argv": sys.argv, "args": vars(args), "load": [load_start, load_end],
         "results": results}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
