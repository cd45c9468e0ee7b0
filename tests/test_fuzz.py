"""Hostile manifests: a seeded mutator over the manifest of a real checkpoint holding every leaf
kind; every mutated manifest is made "trusted" (COMMIT names its SHA-256) and read by
``fnckpt.metadata``, ``fnckpt.restore`` (no target; every third case an abstract target too)
and the CLI's ``inspect`` and ``verify``.

Pass, per call: it succeeds or raises ``fnckpt.CheckpointError``; the CLI exits 0, 1 or 2, and
on 2 prints one line ``fnckpt CMD: error: ...`` and no traceback. Anything else fails: another
exception type (MemoryError included), a crash or abort, a hang, a change of ``np.random``'s
global state, a read of the sibling "canary" checkpoint (seen by inotify, and by its values
showing up in a restored array).

The calls run in long-lived worker subprocesses (``fuzz_worker.py``; one per core, at most 2)
under an address-space limit (``RLIMIT_AS``, 4 GiB by default; JAX's CPU client and
TensorStore work under it, and a 2**45-byte allocation fails at once), so a memory bomb or an
abort kills a worker, not the machine; the worker is restarted and the case that killed it
recorded. The CLI runs in-process in the worker, through its entry point ``fnckpt.cli.main``
(stdout/stderr captured), which is what the ``fnckpt`` command runs.

Environment:
  FNCKPT_FUZZ_CASES    mutated manifests (default 10000)
  FNCKPT_FUZZ_SEED     the seed (default 0; "random" picks one and prints it)
  FNCKPT_FUZZ_ONLY     comma-separated case numbers: run only these, print their manifests
  FNCKPT_FUZZ_WORKERS  worker processes (default: min(2, CPUs))
  FNCKPT_FUZZ_TIMEOUT  seconds per case before it counts as a hang (default 20)
  FNCKPT_FUZZ_AS_GB    each worker's address-space limit in GiB (default 4; 0: none)
  FNCKPT_FUZZ_MAX_S    stop starting cases after this many seconds (default 480)
  FNCKPT_FUZZ_REPORT   also write the report to this file

Failures are grouped by (operation, exception type or failure kind, message with numbers and
quoted values blanked, code location) and reported with one reproducer each: the mutation,
the mutated manifest (long lists elided to the mutated items) and the command that re-runs
that one case.
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

import fnckpt
import fuzz_worker as fw

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "fuzz_worker.py")


def _env(name: str, default: str) -> str:
  value = os.environ.get(name, "").strip()
  return value or default


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  """<src>/ckpt: the checkpoint to fuzz; <src>/other: the canary, same structure, values
  fw.MARK, so a store path pointed at '../other/...' finds real, matching arrays."""
  src = tmp_path_factory.mktemp("fuzz") / "src"
  fnckpt.save(fw.build_tree(), str(src / fw.CKPT)).wait()
  fnckpt.save(fw.build_tree(canary=True), str(src / fw.CANARY)).wait()
  return src


# --- one worker process -------------------------------------------------------------------

_CRASH_PATTERNS = re.compile(
    r"terminate called|what\(\):|Fatal Python error|Segmentation fault|Aborted|bad_alloc|"
    r"MemoryError|Check failed|^F\d{4} |RecursionError|out of memory", re.M)


def _innermost(dump: str) -> str:
  """' [at file:line function]': the innermost fnckpt frame of the worker's main thread in a
  faulthandler dump (the thread whose stack holds worker_main), or ''."""
  blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump)
  main = [b for b in blocks if "worker_main" in b] or blocks
  frames = re.findall(r'File "[^"]*?fnckpt/([^"/]+)", line (\d+) in (\S+)', main[-1])
  return f" [at {frames[0][0]}:{frames[0][1]} {frames[0][2]}]" if frames else ""


class _Worker:
  def __init__(self, n: int, source, base: str, scratch: str, config: dict):
    self.n, self.source = n, str(source)
    self.log_path = os.path.join(base, f"worker{n}.log")
    self.config = {**config, "source": self.source, "workdir": os.path.join(scratch, f"w{n}")}
    self.proc: subprocess.Popen | None = None
    self.buf = b""
    self.inotify = "?"
    self.starts = 0

  def start(self) -> None:
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2", PYTHONFAULTHANDLER="1",
               PYTHONPATH=ROOT + os.pathsep + HERE + os.pathsep + env.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    self.log = open(self.log_path, "ab")
    self.proc = subprocess.Popen(
        [sys.executable, WORKER, json.dumps(self.config)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=self.log, cwd=ROOT, env=env, start_new_session=True)
    self.buf = b""
    self.starts += 1
    kind, line = self._line(time.monotonic() + 180)
    if kind != "line" or not line.startswith("READY"):
      self.kill()
      raise RuntimeError(f"fuzz worker {self.n} did not start ({kind}: {line!r}); its log:\n"
                         f"{self._log_tail(0)}")
    fields = dict(f.split("=", 1) for f in line.split()[1:])
    self.inotify = fields.get("inotify", "?")
    limit = int(self.config["address_space_bytes"])
    if limit > 0 and int(fields.get("as_limit", -1)) != limit:
      self.kill()
      raise RuntimeError(f"fuzz worker {self.n}: address-space limit not set: {line!r}")

  def kill(self) -> None:
    if self.proc is not None:
      try:
        os.killpg(self.proc.pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass
      try:
        self.proc.wait(10)
      except subprocess.TimeoutExpired:
        pass
      for f in (self.proc.stdin, self.proc.stdout):
        try:
          f.close()
        except Exception:
          pass
      self.proc = None
      self.log.close()

  def _line(self, deadline: float) -> tuple[str, str]:
    """("line", text) | ("eof", "") | ("timeout", "")."""
    fd = self.proc.stdout.fileno()
    while b"\n" not in self.buf:
      left = deadline - time.monotonic()
      if left <= 0:
        return "timeout", ""
      ready, _, _ = select.select([fd], [], [], left)
      if not ready:
        continue
      chunk = os.read(fd, 1 << 16)
      if not chunk:
        return "eof", ""
      self.buf += chunk
    line, _, self.buf = self.buf.partition(b"\n")
    return "line", line.decode(errors="replace")

  def _log_tail(self, offset: int, chars: int = 6000) -> str:
    try:
      with open(self.log_path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")[-chars:]
    except OSError:
      return ""

  def run(self, command: str, timeout: float) -> dict:
    """Send one case; its RESULT, or a failure record for the crash or hang it caused."""
    if self.proc is None:
      self.start()
    offset = os.path.getsize(self.log_path)
    op = "(before any operation)"
    try:
      self.proc.stdin.write(command.encode() + b"\n")
      self.proc.stdin.flush()
    except (BrokenPipeError, OSError):
      pass
    deadline = time.monotonic() + timeout
    while True:
      kind, line = self._line(deadline)
      if kind == "line" and line.startswith("OP "):
        op = line.split(" ", 2)[2]
        continue
      if kind == "line" and line.startswith("RESULT "):
        return json.loads(line[len("RESULT "):])
      if kind == "line":
        continue
      if kind == "timeout":
        try:  # where is it stuck? (faulthandler dumps every thread's stack on SIGUSR1)
          os.kill(self.proc.pid, signal.SIGUSR1)
          time.sleep(1.0)
        except ProcessLookupError:
          pass
        self.kill()
        what = f"hang (no result in {timeout:g}s)"
        detail = "killed" + _innermost(self._log_tail(offset, 60000))
      else:
        try:
          rc = self.proc.wait(10)
        except subprocess.TimeoutExpired:
          rc = None
        self.kill()
        time.sleep(0.05)
        tail = self._log_tail(offset, 60000)
        what = (f"crash: killed by {signal.Signals(-rc).name}" if rc is not None and rc < 0
                else f"crash: exit status {rc}")
        hits = [l.strip() for l in tail.splitlines() if _CRASH_PATTERNS.search(l.strip())]
        detail = (hits[0] if hits else fw._first_line(tail.strip().splitlines()[-1]
                                                       if tail.strip() else ""))[:300]
        detail += _innermost(tail)
      return {"case": int(command) if command.lstrip("-").isdigit() else -1,
              "failures": [{"op": op, "kind": what, "msg": detail}], "outcomes": {op: "FAIL"},
              "died": True}


# --- grouping and reporting ---------------------------------------------------------------

def _normalize(msg: str, base: str) -> str:
  msg = msg.replace(base, "<dir>")
  msg = re.sub(r"\[at [^\]]*\]", "", msg)
  msg = re.sub(r"(?<![A-Za-z])'[^']{0,200}'|\"[^\"]{0,200}\"", "'…'", msg)
  msg = re.sub(r"0x[0-9a-fA-F]+|\d+(\.\d+)?(e[+-]?\d+)?", "N", msg)
  return msg.strip()[:160]


def _location(msg: str) -> str:
  m = re.search(r"\[at ([^\]]*)\]", msg)
  return re.sub(r":\d+ ", " ", m.group(1)) if m else ""


def _report(groups: dict, cases: dict, seed, base: str) -> str:
  out = []
  ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
  by_place: dict = collections.defaultdict(collections.Counter)
  for (op, kind, norm, loc), hits in ordered:
    by_place[loc or "(no library frame)"][f"{kind} in {op}"] += len(hits)
  out.append(f"where (innermost fnckpt frame) -> what, in which operation (cases):")
  for loc, what in sorted(by_place.items(), key=lambda kv: -sum(kv[1].values())):
    out.append(f"  {loc}: " + "; ".join(f"{k} x{v}" for k, v in what.most_common()))
  out.append("")
  out.append(f"{len(ordered)} kind(s) of failure:")
  for n, ((op, kind, norm, loc), hits) in enumerate(ordered, 1):
    out.append(f"  {n:3d}. {len(hits):5d}x  {op}: {kind}: {norm}" + (f"  [{loc}]" if loc else ""))
  printed: dict = {}
  for n, ((op, kind, norm, loc), hits) in enumerate(ordered, 1):
    def size(h):
      c = cases[h[0]]
      return (len(c.steps), sum(len(s) for s in c.steps), h[0])
    index, msg = min(hits[:50], key=size)
    case = cases[index]
    out.append("")
    out.append(f"=== {n}. {op}: {kind} ({len(hits)} case(s)); example: case {index}")
    out.append(f"message: {msg.replace(base, '<dir>')}")
    if index in printed:
      out.append(f"mutation and manifest: as in {printed[index]} above")
      continue
    printed[index] = f"=== {n}."
    out.append("mutation:")
    out.extend(f"  - {s}" for s in case.steps)
    if case.obj is not None:
      out.append("mutated manifest (long lists show only the mutated items):")
      out.append(fw.render(case.obj, case.touched))
    else:
      out.append(f"mutated manifest bytes ({len(case.data)} B), from byte 0: "
                 f"{case.data[:64].hex()}...")
    out.append(f"re-run: FNCKPT_FUZZ_SEED={seed} FNCKPT_FUZZ_ONLY={index} python -m pytest -q "
               "tests/test_fuzz.py -p no:cacheprovider")
  return "\n".join(out)


@pytest.mark.slow
def test_fuzzed_manifests_raise_only_checkpoint_errors(source, tmp_path):
  seed_text = _env("FNCKPT_FUZZ_SEED", "0")
  seed = random.randrange(1 << 31) if seed_text == "random" else seed_text
  only = [int(x) for x in _env("FNCKPT_FUZZ_ONLY", "").replace(",", " ").split()]
  n_cases = len(only) if only else int(_env("FNCKPT_FUZZ_CASES", "10000"))
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  n_workers = max(1, min(int(_env("FNCKPT_FUZZ_WORKERS", str(min(2, cores or 1)))), n_cases))
  timeout = float(_env("FNCKPT_FUZZ_TIMEOUT", "20"))
  max_s = float(_env("FNCKPT_FUZZ_MAX_S", "480"))
  as_gb = float(_env("FNCKPT_FUZZ_AS_GB", "4"))
  base = str(tmp_path)
  config = {"seed": seed, "address_space_bytes": int(as_gb * (1 << 30)), "target_every": 3}
  with open(source / fw.CKPT / fw.MANIFEST, "rb") as f:
    original = f.read()
  with open(source / fw.CANARY / fw.MANIFEST, "rb") as f:
    canary = f.read()

  # Worker copies of the checkpoints live in memory where possible: each case rewrites two
  # files, which costs milliseconds on a disk mounted with 'discard'.
  scratch = base
  if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
    for old in os.listdir("/dev/shm"):  # left by runs that were killed (pytest's timeout)
      m = re.fullmatch(r"fnckpt-fuzz-(\d+)-.*", old)
      if m and not os.path.exists(f"/proc/{m.group(1)}"):
        shutil.rmtree(os.path.join("/dev/shm", old), ignore_errors=True)
    scratch = tempfile.mkdtemp(prefix=f"fnckpt-fuzz-{os.getpid()}-", dir="/dev/shm")
  workers = [_Worker(i, source, base, scratch, config) for i in range(n_workers)]
  try:
    # The harness itself: the unmutated checkpoint must pass every operation, values intact.
    workers[0].start()
    baseline = workers[0].run("baseline", 120)
    selftest = baseline.get("selftest", {})
    assert not baseline["failures"] and not baseline.get("baseline_value_problems") and set(
        baseline["outcomes"].values()) <= {"ok", "exit 0"} and selftest.get(
        "canary arrays recognised", 0) >= 5 and selftest.get("canary reads seen") != 0, (
        f"the UNMUTATED checkpoint fails the fuzz harness (a harness or library bug, not a "
        f"fuzz finding): {baseline}\n{workers[0]._log_tail(0)}")

    todo = iter(only or range(n_cases))
    lock = threading.Lock()
    results: list[dict] = []
    start = time.monotonic()
    stopped_early = []
    errors = []

    def loop(w: _Worker) -> None:
      try:
        while True:
          with lock:
            if time.monotonic() - start > max_s:
              stopped_early.append(True)
              return
            index = next(todo, None)
          if index is None:
            return
          res = w.run(str(index), timeout)
          with lock:
            results.append(res)
      except BaseException as e:  # a worker that cannot start: the harness is broken
        errors.append(e)

    threads = [threading.Thread(target=loop, args=(w,), daemon=True) for w in workers]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    elapsed = time.monotonic() - start
    memory, cpu = [], []
    for w in workers:
      if w.proc is not None:
        res = w.run("stats", 30)
        memory.append(res.get("memory", "?"))
        if res.get("cases"):
          cpu.append(res["cpu_s"] / res["cases"])
  finally:
    for w in workers:
      w.kill()
    if scratch != base:
      shutil.rmtree(scratch, ignore_errors=True)
  if errors:
    raise errors[0]

  # --- tally
  outcomes = collections.defaultdict(collections.Counter)
  op_time = collections.Counter()
  groups: dict = collections.defaultdict(list)
  for res in results:
    for op, outcome in res["outcomes"].items():
      outcomes[op][outcome] += 1
    for op, t in res.get("times", {}).items():
      op_time[op] += t
    for f in res["failures"]:
      key = (f["op"], f["kind"], _normalize(f["msg"], scratch), _location(f["msg"]))
      groups[key].append((res["case"], f["msg"]))
  notes: dict = collections.defaultdict(list)
  for res in results:
    for f in res.get("notes", []):
      key = (f["op"], f["kind"], _normalize(f["msg"], scratch), _location(f["msg"]))
      notes[key].append((res["case"], f["msg"]))
  failed_cases = sum(1 for r in results if r["failures"])
  deaths = sum(1 for r in results if r.get("died"))
  in_worker = sum(r.get("case_s", 0) for r in results)
  summary = [f"fuzz: seed {seed}, {len(results)} mutated manifests in {elapsed:.1f}s with "
             f"{n_workers} worker(s) ({elapsed / max(1, len(results)) * 1000:.1f}s per 1000 "
             f"cases; in a worker {in_worker / max(1, len(results)) * 1000:.1f} ms per case, "
             f"excluding hangs and restarts; CPU per case {sum(cpu) / max(1, len(cpu)) * 1000:.1f} "
             f"ms); {failed_cases} case(s) failed; {deaths} worker(s) "
             f"crashed or hung; inotify: {'/'.join(w.inotify for w in workers)}; worker memory at "
             f"the end: {'; '.join(memory)} (limit {as_gb:g} GiB of address space)"]
  for op in fw.OPS:
    c = outcomes.get(op, collections.Counter())
    counts = "  ".join(f"{k} {v}" for k, v in sorted(c.items()))
    summary.append(f"  {op:16s} mean {op_time[op] / max(1, sum(c.values())) * 1000:6.1f} ms  "
                   f"{counts}")
  problems = []
  if stopped_early and len(results) < n_cases:
    problems.append(f"only {len(results)} of {n_cases} cases ran within FNCKPT_FUZZ_MAX_S="
                    f"{max_s:g}s")
  report = ""
  if notes:  # not failures: CheckpointErrors that a catch-all made out of raw Python errors
    lines = [f"note: {sum(len(h) for h in notes.values())} CheckpointError(s) wrap a raw Python "
             "error (a catch-all turned it into CheckpointError: validation gaps, not failures):"]
    for (op, kind, norm, loc), hits in sorted(notes.items(), key=lambda kv: -len(kv[1])):
      try:
        examples = [fw.make_case(original, canary, seed, i) for i, _ in hits[:20]]
        example = min(examples, key=lambda c: (len(c.steps), sum(map(len, c.steps))))
        index, steps = example.index, "; ".join(example.steps)
      except Exception as e:
        index, steps = hits[0][0], f"make_case raised {e!r}"
      lines.append(f"  {len(hits):5d}x  {op}: {kind}: {norm}" + (f"  [{loc}]" if loc else "")
                   + f"\n         e.g. case {index}: {steps[:300]}")
    summary += lines
  print("\n".join(summary))  # (shown with -s, or with the failure)
  if groups or only:
    wanted = {i for hits in groups.values() for i, _ in hits[:50]} | set(only)
    cases = {}
    for i in wanted:
      try:
        cases[i] = fw.make_case(original, canary, seed, i)
      except Exception as e:  # reported by the worker as a HARNESS BUG group
        cases[i] = fw.Case(i, [f"make_case raised {type(e).__name__}: {e}"], b"", None, [])
    report = _report(groups, cases, seed, scratch)
    if only:
      for i in only:
        c = cases[i]
        report += (f"\n\n--- case {i}: " + "; ".join(c.steps) + "\n" +
                   (fw.render(c.obj, [p for p, _ in fw._sites(c.obj)], width=10 ** 9)
                    if c.obj is not None else c.data.hex()))
  path = os.environ.get("FNCKPT_FUZZ_REPORT")
  if path:
    with open(path, "w") as f:
      f.write("\n".join(summary + problems) + "\n\n" + report + "\n")
  if only:
    print(report)
  if groups or problems:
    pytest.fail("\n".join(summary + problems) + "\n\n" + report, pytrace=False)


def test_mutator_is_deterministic_and_always_mutates(source):
  """A case is a pure function of (manifests, seed, number): the test regenerates reproducers
  from the number alone, so this must hold (and the cached original must never change)."""
  with open(source / fw.CKPT / fw.MANIFEST, "rb") as f:
    original = f.read()
  with open(source / fw.CANARY / fw.MANIFEST, "rb") as f:
    canary = f.read()
  first = [fw.make_case(original, canary, 7, i) for i in range(1000)]
  again = [fw.make_case(original, canary, 7, i) for i in range(1000)]
  assert [c.data for c in first] == [c.data for c in again]
  assert [c.steps for c in first] == [c.steps for c in again]
  assert all(c.data != original and c.steps for c in first)
  assert len({c.data for c in first}) > 900
