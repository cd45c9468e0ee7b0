"""fnckpt vs Orbax vs the machine's limits, all measured in one run.

    python bench/run.py --quick          # ~3.5 minutes on 2 cores: 250 MiB state, 2 runs each
    python bench/run.py                  # full: 1.45 GiB state + mixed, 5 runs each (~19 minutes)
    python bench/run.py --dir /mnt/nvme/bench --libs fnckpt,orbax --states transformer,small,mixed

Every measurement runs in a fresh worker process (``bench/runners.py``); runs of the two
libraries alternate so that drift on a shared machine hits both. Figures are medians over runs;
fnckpt/Orbax ratios are medians of the per-run ratios (run i of fnckpt against run i of Orbax).
A failed worker becomes an error cell in the table and an entry in the JSON, never a crash.

Writes ``bench/results/<date>.md`` and ``bench/results/<date>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from bench import limits  # noqa: E402  (numpy + os only; no JAX in this process)
from bench.runners import LIBS, RESULT_MARK  # noqa: E402

STATES = ("transformer", "small", "mixed")   # bench/states.py (not imported here: no JAX)
QUICK_STATES = ("transformer", "small")       # mixed adds ~2.5 min (Orbax: ~20 s per save of it)

MiB = 2**20
GB = 1e9


# ----------------------------------------------------------------------------- workers

def worker(args: dict, timeout: float, log: list) -> dict:
  """Run one measurement in a fresh process; always returns a dict with ``ok``."""
  cmd = [sys.executable, "-m", "bench.runners", json.dumps(args)]
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  t = time.perf_counter()
  try:
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [l for l in p.stdout.splitlines() if l.startswith(RESULT_MARK)]
    if lines:
      out = json.loads(lines[-1][len(RESULT_MARK):])
    else:
      out = {"ok": False, "error": f"exit code {p.returncode}, no result"}
    if not out.get("ok"):
      out["stderr_tail"] = p.stderr[-3000:]
  except subprocess.TimeoutExpired:
    out = {"ok": False, "error": f"timed out after {timeout:.0f} s"}
  out["wall_s"] = time.perf_counter() - t
  label = " ".join(str(args[k]) for k in ("op", "lib", "state", "mesh", "run") if k in args)
  status = "ok" if out.get("ok") else f"ERROR {out.get('error')}"
  print(f"  {label:<40s} {out['wall_s']:6.1f} s  {status}", file=sys.stderr, flush=True)
  log.append({"args": args, "result": out})
  return out


# ----------------------------------------------------------------------------- aggregation

def median(xs: list) -> float | None:
  xs = [x for x in xs if x is not None]
  return statistics.median(xs) if xs else None


def per_run(results: list[dict], fn) -> list:
  """``fn(result)`` for each run (None where the run failed), in run order."""
  out = []
  for r in results:
    try:
      out.append(fn(r) if r.get("ok") else None)
    except (KeyError, IndexError, TypeError):
      out.append(None)
  return out


def pair_ratio(a: list, b: list) -> float | None:
  return median([x / y for x, y in zip(a, b) if x is not None and y is not None and y > 0])


def metrics_for(saves: list[dict], restores: dict[str, list[dict]]) -> dict[str, list]:
  """Per-run values of every table metric for one library (lists aligned by run index)."""
  m: dict[str, list] = {
      "save_block_first_s": per_run(saves, lambda r: r["saves"][0]["blocking_s"]),
      "save_block_s": per_run(saves, lambda r: r["saves"][-1]["blocking_s"]),
      "save_commit_first_s": per_run(saves, lambda r: r["saves"][0]["commit_s"]),
      "save_commit_s": per_run(saves, lambda r: r["saves"][-1]["commit_s"]),
      "save_cpu_s": per_run(saves, lambda r: r["saves"][-1]["cpu_s"]),
      "save_rss_first": per_run(saves, lambda r: r["saves"][0]["rss_peak_bytes"]),
      "save_rss": per_run(saves, lambda r: r["saves"][-1]["rss_peak_bytes"]),
      "files": per_run(saves, lambda r: r["saves"][-1]["files"]),
      "disk_bytes": per_run(saves, lambda r: r["saves"][-1]["bytes"]),
  }
  for mesh, rs in restores.items():
    m[f"restore_{mesh}_s"] = per_run(rs, lambda r: r["restore_s"])
    m[f"restore_{mesh}_rss"] = per_run(rs, lambda r: r["rss_extra_bytes"])
    m[f"restore_{mesh}_cpu_s"] = per_run(rs, lambda r: r["cpu_s"])
    m[f"restore_{mesh}_read"] = per_run(rs, lambda r: r.get("read_bytes"))
  return m


def verified(restores: list[dict]) -> str:
  flags = [r.get("verified") for r in restores if r.get("ok") and "verified" in r]
  if not flags:
    return "not checked"
  return "ok" if all(flags) else "WRONG VALUES"


# ----------------------------------------------------------------------------- table

def fmt(v: float | None, kind: str) -> str:
  if v is None:
    return "—"
  if kind == "s":
    return f"{v:.3g} s" if v >= 0.01 else f"{v * 1e3:.2g} ms"
  if kind == "mib":
    return f"{v / MiB:,.0f} MiB" if abs(v) >= 10 * MiB else f"{v / MiB:.2g} MiB"
  if kind == "gbps":
    return f"{v:.3g} GB/s"
  if kind == "x":
    return f"{v:.2f}x" if v < 100 else f"{v:,.0f}x"
  if kind == "n":
    return f"{v:,.0f}"
  return str(v)


ROWS = [
    # key, label, kind, limit key, limit label
    ("save_block_s", "save: caller blocked (steady)", "s", "d2h_s", "device→host, best way"),
    ("save_block_first_s", "save: caller blocked (1st in process)", "s", "d2h_s", "device→host, best way"),
    ("save_commit_s", "save: to committed (steady)", "s", "write_s", "max(D2H, write+fsync)"),
    ("save_commit_s", "save: to committed (steady), vs raw TensorStore", "s", "ts_write_s",
     "raw TensorStore write"),
    ("save_commit_first_s", "save: to committed (1st)", "s", "write_s", "max(D2H, write+fsync)"),
    ("save_gbps", "save throughput (state / to committed)", "gbps", "disk_write_gbps", "disk write (+fsync)"),
    ("restore_a_s", "restore, same mesh (cold cache)", "s", "read_a_s", "max(cold read, host→device)"),
    ("restore_a_s", "restore, same mesh, vs raw TensorStore", "s", "ts_read_s",
     "raw TensorStore read, cold"),
    ("restore_b_s", "restore, other mesh + specs", "s", "read_b_s", "max(cold read, host→device)"),
    ("restore_gbps", "restore throughput, same mesh", "gbps", "disk_read_cold_gbps", "disk read, cold"),
    ("save_cpu_s", "save: CPU time, all threads (steady)", "s", None, ""),
    ("restore_a_cpu_s", "restore same mesh: CPU time", "s", None, ""),
    ("restore_b_cpu_s", "restore other mesh: CPU time", "s", None, ""),
    ("save_rss_first", "save: peak RSS over baseline (fresh process)", "mib", "state_bytes", "state size"),
    ("save_rss", "save: peak RSS over baseline (steady)", "mib", "state_bytes", "state size"),
    ("restore_a_rss", "restore same mesh: peak RSS beyond result", "mib", "state_bytes", "state size"),
    ("restore_b_rss", "restore other mesh: peak RSS beyond result", "mib", "state_bytes", "state size"),
    ("restore_a_read", "restore same mesh: bytes read from storage", "mib", "state_bytes",
     "state size (bytes needed)"),
    ("restore_b_read", "restore other mesh: bytes read from storage", "mib", "state_bytes",
     "state size (bytes needed)"),
    ("disk_bytes", "bytes on disk", "mib", "state_bytes", "state size"),
    ("files", "files on disk", "n", None, ""),
]
HIGHER_IS_BETTER = {"save_gbps", "restore_gbps"}


def state_table(s: dict, libs: list[str]) -> list[str]:
  agg, lim = s["aggregate"], s["limits"]
  other = [l for l in libs if l != "fnckpt"]
  cols = ["metric", *libs]
  if "fnckpt" in libs and other:
    cols.append(f"fnckpt/{other[0]}")
  cols += ["limit", *[f"{l}/limit" for l in libs]]
  lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  for key, label, kind, lkey, llabel in ROWS:
    cells = [label]
    for lib in libs:
      a = agg.get(lib, {})
      v = a.get("median", {}).get(key)
      cells.append(fmt(v, kind) if v is not None or not a.get("errors") else "error")
    if "fnckpt" in libs and other:
      cells.append(fmt(agg.get("ratio", {}).get(key), "x"))
    limit = lim.get(lkey) if lkey else None
    cells.append(f"{fmt(limit, kind if kind != 'n' else 'mib')} ({llabel})" if limit else "")
    for lib in libs:
      v = agg.get(lib, {}).get("median", {}).get(key)
      cells.append(fmt(v / limit, "x") if v is not None and limit else "")
    lines.append("| " + " | ".join(cells) + " |")
  return lines


def state_header(name: str, s: dict, libs: list[str]) -> list[str]:
  d = s["limits"]
  ts_res = s.get("ts_limits") or {}
  if ts_res.get("ok"):
    raw_ts = (f"write {fmt(d.get('ts_write_s'), 's')} ({fmt(d.get('ts_write_gbps'), 'gbps')}), "
              f"cold read {fmt(d.get('ts_read_s'), 's')} ({fmt(d.get('ts_read_gbps'), 'gbps')}), "
              f"{fmt(d.get('ts_files'), 'n')} files")
  else:
    raw_ts = f"error: {ts_res.get('error', 'not measured')}"
  return [
      f"## State `{name}`: {d.get('leaves', '?')} leaves, {fmt(d.get('state_bytes'), 'mib')} "
      f"({fmt(d.get('device_bytes'), 'mib')} on devices with replicas); "
      f"save on mesh (2,4), restore on (2,4) and on (4,2) with other PartitionSpecs", "",
      f"Device limits: device→host `jax.device_get` {fmt(d.get('device_get_gbps'), 'gbps')}, "
      f"`np.array` per leaf {fmt(d.get('np_array_gbps'), 'gbps')}, "
      f"copy of each unique shard into new buffers {fmt(d.get('shards_copy_gbps'), 'gbps')}, "
      f"into preallocated ones {fmt(d.get('shards_copyto_gbps'), 'gbps')} "
      f"(the state at memcpy speed: {fmt(d.get('memcpy_s'), 's')}); host→device "
      f"`jax.device_put` onto the saved mesh {fmt(d.get('h2d_a_gbps'), 'gbps')}, "
      f"onto the other mesh {fmt(d.get('h2d_b_gbps'), 'gbps')}.  ",
      "Raw TensorStore (one plain zarr3 array per leaf, chunk = saved shard, `bytes` + `crc32c`, "
      f"file kvstore, from host memory; best of {ts_res.get('repeats', '?')}): {raw_ts}.  ",
      "Values verified after restore (checksums, run 1): " + ", ".join(
          f"{lib} {s['aggregate'].get(lib, {}).get('verified', '?')}" for lib in libs), ""]


def markdown(report: dict) -> str:
  m, lim, libs = report["machine"], report["limits"], report["libs"]
  out = [f"# fnckpt benchmark — {report['date']}", "",
         f"Command: `{report['command']}`  ",
         f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, disk {m['disk']} "
         f"(data dir `{report['dir']}`), Linux {m['kernel']}, Python {m['python']}  ",
         f"Versions: {', '.join(f'{k} {v}' for k, v in report['versions'].items())}  ",
         f"Mode: {report['mode']}, {report['runs']} runs per figure (median), "
         f"{report['n_saves']} saves per save process; 8 virtual CPU devices. Load average "
         f"{report['load'][0]:.2f} at start, {report['load'][1]:.2f} at end (other processes "
         "on these cores skew every figure).", "",
         "## Machine limits (same run)", "",
         "| memcpy | disk write (+fsync) | disk read, cold | disk read, warm | create+write+fsync 4 KiB |",
         "|---|---|---|---|---|",
         f"| {fmt(lim.get('memcpy_gbps'), 'gbps')} | {fmt(lim.get('disk_write_gbps'), 'gbps')} | "
         f"{fmt(lim.get('disk_read_cold_gbps'), 'gbps')} | {fmt(lim.get('disk_read_warm_gbps'), 'gbps')} | "
         f"{lim.get('fsync_ms', 0):.2f} ms |", ""]
  for name, s in report["states"].items():
    out += state_header(name, s, libs)
    out += state_table(s, libs)
    for lib in libs:
      st = s["aggregate"].get(lib, {}).get("lib_stats")
      if st:
        out += ["", f"{lib}'s own save stats (steady save, medians): " + ", ".join(
            f"{k} {fmt(v, 's') if k.endswith('_s') else fmt(v, 'mib') if k.endswith('bytes') else fmt(v, 'n')}"
            for k, v in st.items() if v is not None)]
    errs = [f"- {lib}: {e}" for lib in libs for e in s["aggregate"].get(lib, {}).get("errors", [])]
    if errs:
      out += ["", "Errors:", *errs]
    out.append("")
  out += ["Notes: times are medians over runs; `x/limit` > 1 means slower (or bigger) than the "
          "limit, < 1 for throughput means a fraction of it. 'steady' = last save of a process that "
          "saved before (a training loop), '1st' includes first-call costs. Restores start with the "
          "checkpoint evicted from the page cache. On CPU devices the restored arrays live in host "
          "RAM, so restore memory is reported beyond the result's own bytes. GB = 1e9 bytes, "
          "MiB = 2^20 bytes.", ""]
  return "\n".join(out)


# ----------------------------------------------------------------------------- orchestration

def versions() -> dict[str, str]:
  from importlib import metadata
  out = {}
  for pkg in ("fnckpt", "orbax-checkpoint", "jax", "jaxlib", "tensorstore", "numpy"):
    try:
      out[pkg] = metadata.version(pkg)
    except metadata.PackageNotFoundError:
      out[pkg] = "in-tree" if pkg == "fnckpt" else "missing"
  return out


@contextlib.contextmanager
def s3_location(enabled: bool):
  """Where checkpoints go. ``--s3``: a local S3 server (tests/servers.py).

  # ---- S3 HOOK (to be filled in) ----------------------------------------------------------
  # (bench/s3.py already compares fnckpt on S3 with fnckpt on local files; this hook is for the
  # fnckpt-vs-Orbax tables on S3.)
  # tests/servers.py provides ``s3_server()``: start it here and yield an ``s3://bucket/...``
  # base path plus the environment both libraries need (endpoint, credentials). Then:
  #   * limits: replace the disk limits with PUT/GET throughput of one large object via
  #     tensorstore's s3 kvstore (and per-object latency instead of fsync);
  #   * runners.ckpt_path / limits.dir_stats / limits.evict: list objects instead of walking
  #     a directory; no page cache to evict;
  #   * orbax: pass the s3:// path to CheckpointManager (etils epath) if it supports it,
  #     else report 'unsupported' for orbax rows.
  # ------------------------------------------------------------------------------------------
  """
  if not enabled:
    yield None
    return
  raise NotImplementedError("--s3 is not wired yet: see the S3 HOOK in bench/run.py")


def state_limits(machine_lim: dict, dev: dict, ts_res: dict, sb: int | None) -> dict:
  """The limits of one state: the machine's, the device worker's and raw TensorStore's."""
  lim = dict(machine_lim)
  lim.update({k: dev.get(k) for k in ("leaves", "device_bytes", "device_get_s")})
  lim.update({k: ts_res.get(k) for k in ("ts_write_s", "ts_read_s", "ts_files", "ts_disk_bytes")})
  lim["state_bytes"] = sb
  if not sb:
    return lim
  d2h = [dev[k] for k in ("device_get_s", "np_array_s", "shards_copy_s", "shards_copyto_s")
         if dev.get(k)]
  lim["d2h_s"] = min(d2h) if d2h else None
  times = {**dev, "ts_write_s": lim["ts_write_s"], "ts_read_s": lim["ts_read_s"]}
  for k in ("device_get", "np_array", "shards_copy", "shards_copyto", "h2d_a", "h2d_b",
            "ts_write", "ts_read"):
    if times.get(f"{k}_s"):
      lim[f"{k}_gbps"] = sb / times[f"{k}_s"] / GB
  lim["memcpy_s"] = sb / (lim["memcpy_gbps"] * GB)
  lim["write_s"] = max(lim["d2h_s"] or 0, sb / (lim["disk_write_gbps"] * GB) + lim["fsync_ms"] / 1e3)
  read = sb / (lim["disk_read_cold_gbps"] * GB)
  lim["read_a_s"] = max(read, dev.get("h2d_a_s") or 0)
  lim["read_b_s"] = max(read, dev.get("h2d_b_s") or 0)
  return lim


def aggregate(libs: list[str], save_res: dict, rest_res: dict, sb: int | None) -> tuple[dict, dict]:
  """Per-run metrics per library, and their medians, errors, own stats and ratios."""
  agg: dict[str, Any] = {}
  per: dict[str, dict[str, list]] = {}
  for lib in libs:
    m = metrics_for(save_res[lib], rest_res[lib])
    if sb:
      m["save_gbps"] = [sb / x / GB if x else None for x in m["save_commit_s"]]
      m["restore_gbps"] = [sb / x / GB if x else None for x in m["restore_a_s"]]
    per[lib] = m
    stats = per_run(save_res[lib], lambda r: r["saves"][-1]["lib_stats"])
    keys = sorted({k for st in stats if isinstance(st, dict) for k, v in st.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)})
    errors = sorted({r["error"] for r in save_res[lib] + rest_res[lib]["a"] + rest_res[lib]["b"]
                     if not r.get("ok")})
    agg[lib] = {"median": {k: median(v) for k, v in m.items()}, "errors": errors,
                "lib_stats": {k: median([st.get(k) for st in stats if isinstance(st, dict)])
                              for k in keys},
                "verified": f"same mesh {verified(rest_res[lib]['a'])}, "
                            f"other mesh {verified(rest_res[lib]['b'])}"}
  if "fnckpt" in libs and len(libs) > 1:
    other = [l for l in libs if l != "fnckpt"][0]
    agg["ratio"] = {k: pair_ratio(per["fnckpt"][k], per[other][k]) for k in per["fnckpt"]}
  return per, agg


def run_state(name: str, a, dirs: dict, log: list) -> dict:
  mode, libs, runs, timeout = a.mode, a.libs, a.runs, a.timeout
  base = os.path.join(a.dir, name)
  shutil.rmtree(base, ignore_errors=True)
  os.makedirs(base)
  fp_file = os.path.join(base, "fingerprint.json")
  print(f"state {name}:", file=sys.stderr)
  repeats = 2 if mode == "quick" else 3
  dev = worker({"op": "device_limits", "state": name, "mode": mode, "repeats": repeats},
               timeout, log)
  ts_res = worker({"op": "ts_limits", "state": name, "mode": mode, "repeats": repeats,
                   "root": os.path.join(base, "raw_tensorstore")}, timeout, log)
  ts_res["repeats"] = repeats

  save_res: dict[str, list] = {lib: [] for lib in libs}
  kept: dict[str, tuple[str, int]] = {}         # lib -> (root, step) used by the restores
  for r in range(runs):
    for lib in (libs if r % 2 == 0 else libs[::-1]):
      root = os.path.join(base, lib, f"run{r}")
      args = {"op": "save", "lib": lib, "state": name, "mode": mode, "root": root, "run": r,
              "n_saves": a.n_saves, "fp_file": fp_file}
      if lib == "fnckpt" and a.save_kwargs:
        args["save_kwargs"] = a.save_kwargs
      res = worker(args, timeout, log)
      save_res[lib].append(res)
      if res.get("ok") and lib not in kept:
        kept[lib] = (root, a.n_saves - 1)
      elif not a.keep:
        shutil.rmtree(root, ignore_errors=True)

  rest_res: dict[str, dict[str, list]] = {lib: {"a": [], "b": []} for lib in libs}
  for r in range(runs):
    for mesh in ("a", "b"):
      for lib in (libs if r % 2 == 0 else libs[::-1]):
        if lib not in kept:
          rest_res[lib][mesh].append({"ok": False, "error": "no checkpoint (every save failed)"})
          continue
        root, step = kept[lib]
        rest_res[lib][mesh].append(worker(
            {"op": "restore", "lib": lib, "state": name, "mode": mode, "root": root, "step": step,
             "mesh": mesh, "run": r, "fp_file": fp_file, "verify": r == 0}, timeout, log))
  if a.profile:                  # extra runs, profiled, not in the figures
    os.makedirs(a.profile_dir, exist_ok=True)
    for lib in libs:
      root = os.path.join(base, lib, "profile")
      worker({"op": "save", "lib": lib, "state": name, "mode": mode, "root": root, "run": "profile",
              "n_saves": a.n_saves, "save_kwargs": a.save_kwargs if lib == "fnckpt" else None,
              "profile": os.path.join(a.profile_dir, f"{name}-{lib}-save.txt")}, timeout, log)
      if lib in kept:
        worker({"op": "restore", "lib": lib, "state": name, "mode": mode, "root": kept[lib][0],
                "step": kept[lib][1], "mesh": "b", "run": "profile", "verify": False,
                "profile": os.path.join(a.profile_dir, f"{name}-{lib}-restore-other-mesh.txt")},
               timeout, log)
  if not a.keep:
    shutil.rmtree(base, ignore_errors=True)

  sb = dev.get("state_bytes") or ts_res.get("state_bytes") or next(
      (r["state_bytes"] for rs in save_res.values() for r in rs if r.get("ok")), None)
  lim = state_limits(dirs["limits"], dev, ts_res, sb)
  per, agg = aggregate(libs, save_res, rest_res, sb)
  return {"limits": lim, "device_limits": dev, "ts_limits": ts_res, "per_run": per,
          "aggregate": agg, "raw": {"save": save_res, "restore": rest_res}}


def parse(argv: list[str]):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="250 MiB state, 2 runs (about 3.5 minutes)")
  p.add_argument("--dir", default=os.path.join(REPO, "tmp", "bench"),
                 help="data directory on the disk to measure (default: <repo>/tmp/bench)")
  p.add_argument("--runs", type=int, help="runs per figure (default: quick 2, full 5)")
  p.add_argument("--n-saves", type=int, default=2, help="saves per save process (default 2)")
  p.add_argument("--libs", default=",".join(LIBS), help="comma-separated: fnckpt,orbax")
  p.add_argument("--states", help=f"comma-separated, of {','.join(STATES)} (default: all; "
                                  f"quick: {','.join(QUICK_STATES)})")
  p.add_argument("--save-kwargs", type=json.loads, default=None,
                 help='extra fnckpt.save arguments as JSON, e.g. \'{"budget_bytes": 268435456}\'')
  p.add_argument("--timeout", type=float, help="seconds per worker (default: quick 180, full 900)")
  p.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
  p.add_argument("--keep", action="store_true", help="keep the checkpoints written")
  p.add_argument("--profile", action="store_true",
                 help="also run one profiled save and restore per library (pyinstrument, main "
                      "thread) into <out>/<date>-profiles/; not counted in the figures")
  p.add_argument("--s3", action="store_true", help="checkpoints on a local S3 server (hook, not wired)")
  a = p.parse_args(argv)
  a.mode = "quick" if a.quick else "full"
  a.runs = a.runs or (2 if a.quick else 5)
  a.timeout = a.timeout or (180 if a.quick else 900)
  a.libs = [l for l in a.libs.split(",") if l]
  a.states = ([s for s in a.states.split(",") if s] if a.states
              else list(QUICK_STATES if a.quick else STATES))
  a.dir = os.path.abspath(a.dir)
  return a


def main(argv: list[str]) -> int:
  a = parse(argv)
  t0 = time.perf_counter()
  date = dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
  command = "python " + " ".join(shlex.quote(x) for x in [os.path.relpath(__file__, os.getcwd()), *argv])
  os.makedirs(a.dir, exist_ok=True)
  mach = limits.machine(a.dir)
  if any(t in mach["disk"] for t in ("tmpfs", "overlay", "ramfs")):
    print(f"warning: {a.dir} is on {mach['disk']}, not a real disk; use --dir", file=sys.stderr)
  log: list = []
  load0 = os.getloadavg()[0]
  if load0 > 0.5:
    print(f"warning: load average {load0:.2f}: other processes will skew the figures", file=sys.stderr)
  a.profile_dir = os.path.join(a.out, f"{date}-profiles")
  with s3_location(a.s3):
    print("machine limits ...", file=sys.stderr, flush=True)
    lim = limits.measure(os.path.join(a.dir, "limits"), (256 if a.quick else 1024) * MiB)
    shutil.rmtree(os.path.join(a.dir, "limits"), ignore_errors=True)
    report: dict[str, Any] = {
        "date": date, "command": command, "machine": mach, "versions": versions(), "dir": a.dir,
        "mode": a.mode, "runs": a.runs, "n_saves": a.n_saves, "libs": a.libs,
        "save_kwargs": a.save_kwargs, "limits": lim, "states": {}}
    for name in a.states:
      report["states"][name] = run_state(name, a, {"limits": lim}, log)
  report["wall_s"] = time.perf_counter() - t0
  report["load"] = (load0, os.getloadavg()[0])
  report["workers"] = log
  md = markdown(report)
  print(md)
  os.makedirs(a.out, exist_ok=True)
  with open(os.path.join(a.out, f"{date}.md"), "w") as f:
    f.write(md)
  with open(os.path.join(a.out, f"{date}.json"), "w") as f:
    json.dump(report, f, indent=1, default=str)
  print(f"wrote {a.out}/{date}.md and .json ({report['wall_s']:.0f} s)", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
