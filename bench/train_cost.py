"""What checkpointing costs training: steps/s of examples/lm.py with and without saving.

    python bench/train_cost.py                                  # small and 100m, every 50 steps
    python bench/train_cost.py --sizes small --rounds 3 --every 50
    python bench/train_cost.py --sizes 100m --rounds 1 --phase-saves 1

The example's own pieces (``lm.build``: model, optimizer, shardings, jitted train step and data
iterator) run in this process on ``--devices`` simulated CPU devices (a ``--mesh`` of them).
After a warm-up (compilation), phases alternate: ``off`` trains ``--phase-saves x --every``
steps without saving; ``on`` trains as many with a ``fnckpt.CheckpointManager`` save of the
whole state (what lm.py saves) at the first step of every ``--every``-step interval, so each
save's background write ends inside its phase. Every step is timed to the loss being ready
(``block_until_ready``), the save call included.

Reported per size (the figures are pooled over rounds: total steps / total seconds):
* ``steps/s off`` and ``steps/s on``, and the slowdown ``1 - on/off`` (the target: <= 5% at a
  save every 50 steps);
* the **second dip**: steps/s over the steps that started while a save was still writing or
  committing (its "window"), and their slowdown against ``off``;
* **blocked per save**: the wall time of ``manager.save(...)`` (median) and
  ``SaveHandle.stats.blocking_s``; ``write`` is ``stats.total_s`` (call to committed);
* ``cost/save``: the seconds the saves added to the ``on`` phases, per save (``on`` time minus
  its steps at the ``off`` rate), and ``at 50`` the slowdown that cost makes at a save every
  50 steps (the same figure as ``slowdown`` when ``--every 50``; for a size too slow to run
  50-step intervals here, measure with a smaller ``--every`` whose writes still end inside
  the interval: ``spilled`` in the JSON counts those that did not).

Other processes on the same cores skew wall times: the load average at start and end is
printed, and alternating ``off``/``on`` phases spreads that noise over both. ``--json PATH``
writes every figure and per-step time.
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
  window: list[float] = dataclasses.field(default_factory=list)  # step times while writing


@dataclasses.dataclass
class Phase:
  saving: bool
  step_s: list[float] = dataclasses.field(default_factory=list)
  saves: list[Save] = dataclasses.field(default_factory=list)
  spilled: int = 0                 # saves still writing when the phase ended


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--sizes", default="small,100m", help="comma-separated lm.py sizes")
  p.add_argument("--every", type=int, default=50, help="save every K steps")
  p.add_argument("--phase-saves", type=int, default=2, help="saves per 'on' phase (a phase "
                 "is this many intervals of --every steps)")
  p.add_argument("--rounds", type=int, default=2, help="off/on phase pairs per size")
  p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compiles)")
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--mesh", default="2,4")
  p.add_argument("--dir", default=str(ROOT / "tmp" / "train_cost"), help="checkpoints "
                 "(deleted at the end)")
  p.add_argument("--json", default=None, help="write all figures here")
  return p.parse_args(argv)


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
  """``steps`` timed steps; with a manager, a save after the first step of each interval."""
  phase = Phase(saving=manager is not None)
  for i in range(steps):
    writing = [s for s in phase.saves if not s.handle.done()]
    arrays, seconds = timed_step(lm_run, arrays, batches)
    step += 1
    if manager is not None and i % every == 0:
      t0 = time.perf_counter()
      handle = manager.save(step, {**arrays, "step": step, "data": batches.state()})
      blocked = time.perf_counter() - t0
      phase.saves.append(Save(step, blocked, handle))
      seconds += blocked
    for s in writing:
      s.window.append(seconds)
    phase.step_s.append(seconds)
  phase.spilled = sum(not s.handle.done() for s in phase.saves)
  if manager is not None:
    manager.wait()
  return arrays, step, phase


def rate(step_s: list[float]) -> float:
  return len(step_s) / sum(step_s) if step_s else float("nan")


def summarize(phases: list[Phase]) -> dict[str, Any]:
  off = [t for p in phases if not p.saving for t in p.step_s]
  on = [t for p in phases if p.saving for t in p.step_s]
  saves = [s for p in phases for s in p.saves]
  window = [t for s in saves for t in s.window]
  off_rate, on_rate, dip_rate = rate(off), rate(on), rate(window)
  stats = [s.handle.stats for s in saves]
  # what the saves added to the 'on' phases, per save, against the 'off' step time
  cost_per_save = (sum(on) - len(on) / off_rate) / len(saves)
  return {
      "steps_per_s_off": off_rate, "steps_per_s_on": on_rate,
      "slowdown": 1 - on_rate / off_rate, "cost_per_save_s": cost_per_save,
      "slowdown_at_50": cost_per_save / (50 / off_rate + cost_per_save),
      "dip_steps_per_s": dip_rate, "dip_slowdown": 1 - dip_rate / off_rate,
      "dip_steps_per_save": len(window) / len(saves) if saves else 0,
      "saves": len(saves), "spilled": sum(p.spilled for p in phases),
      "blocked_s_median": statistics.median(s.blocked_s for s in saves),
      "blocked_s_max": max(s.blocked_s for s in saves),
      "stats_blocking_s_median": statistics.median(s.blocking_s for s in stats),
      "write_total_s_median": statistics.median(s.total_s for s in stats),
      "step_s_off_median": statistics.median(off), "step_s_on_median": statistics.median(on),
      "phases": [{"saving": p.saving, "step_s": p.step_s,
                  "saves": [{"step": s.step, "blocked_s": s.blocked_s, "window_s": s.window,
                             "stats": dataclasses.asdict(s.handle.stats)} for s in p.saves]}
                 for p in phases],
  }


def bench_size(lm, name: str, args: argparse.Namespace) -> dict[str, Any]:
  import fnckpt
  mesh = lm.make_mesh(tuple(int(n) for n in args.mesh.split(",")))
  t0 = time.perf_counter()
  lm_run = lm.build(lm.SIZES[name], mesh)
  state = lm_run.init()
  arrays = {k: state[k] for k in ("params", "opt_state", "key")}
  batches = lm_run.batches(state["data"])
  for _ in range(args.warmup):
    arrays, _ = timed_step(lm_run, arrays, batches)
  print(f"[{name}] built, initialised and warmed up in {time.perf_counter() - t0:.1f}s",
        flush=True)

  directory = Path(args.dir) / name
  shutil.rmtree(directory, ignore_errors=True)
  manager = fnckpt.CheckpointManager(str(directory), max_to_keep=2)
  step, phases = args.warmup, []
  steps = args.phase_saves * args.every
  for r in range(args.rounds):
    for saving in (False, True):
      arrays, step, phase = run_phase(lm_run, arrays, batches, step, steps, args.every,
                                      manager if saving else None)
      phases.append(phase)
      if saving and r == 0:  # what one checkpoint holds, from its metadata
        saved = lm.checkpoint_size(fnckpt.metadata(manager.path(manager.latest_step())))
      print(f"[{name}] round {r + 1} {'on ' if saving else 'off'}: "
            f"{rate(phase.step_s):.3f} steps/s"
            + "".join(f"; save {s.step}: blocked {s.blocked_s:.3f}s, written in "
                      f"{s.handle.stats.total_s:.2f}s over {len(s.window)} steps"
                      for s in phase.saves), flush=True)
  manager.close()
  shutil.rmtree(directory, ignore_errors=True)
  return {"size": name, "every": args.every, "checkpoint_bytes": saved["bytes"],
          "checkpoint_arrays": saved["arrays"], **summarize(phases)}


def table(results: list[dict[str, Any]]) -> str:
  rows = ["| size | checkpoint | every | steps/s off | steps/s on | slowdown | dip steps/s "
          "(steps) | dip slowdown | blocked/save (stats) | write | cost/save | at 50 |",
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
  for r in results:
    rows.append(
        f"| {r['size']} | {r['checkpoint_bytes'] / 2**20:.1f} MiB | {r['every']} "
        f"| {r['steps_per_s_off']:.3f} "
        f"| {r['steps_per_s_on']:.3f} | {100 * r['slowdown']:.1f}% "
        f"| {r['dip_steps_per_s']:.3f} ({r['dip_steps_per_save']:.1f}) "
        f"| {100 * r['dip_slowdown']:.1f}% | {r['blocked_s_median']:.3f} s "
        f"({r['stats_blocking_s_median']:.3f} s) | {r['write_total_s_median']:.2f} s "
        f"| {r['cost_per_save_s']:.3f} s | {100 * r['slowdown_at_50']:.1f}% |")
  return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  lm = load_example(args.devices)
  load_start = os.getloadavg()
  print(f"devices {args.devices}, mesh {args.mesh}, save every {args.every} steps, "
        f"{args.rounds} round(s) of off/on phases of {args.phase_saves * args.every} steps; "
        f"load average {load_start[0]:.2f}", flush=True)
  results = [bench_size(lm, name, args) for name in args.sizes.split(",")]
  load_end = os.getloadavg()
  print(table(results))
  print(f"load average: {load_start[0]:.2f} at start, {load_end[0]:.2f} at end "
        f"({os.cpu_count()} cores)")
  if args.json:
    Path(args.json).write_text(json.dumps(
        {"argv": sys.argv, "args": vars(args), "load": [load_start, load_end],
         "results": results}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
