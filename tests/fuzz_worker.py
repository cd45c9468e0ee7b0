"""Manifest fuzzing: the mutator, the checkpoint it works on, and the worker process.

Used by ``tests/test_fuzz.py``. Three parts:

* :func:`build_tree` makes a training-state-like pytree holding every leaf kind fnckpt saves
  (the fuzzed checkpoint) and, with ``canary=True``, the same structure with distinctive values
  (a sibling checkpoint that no read of the fuzzed one may ever touch).
* :func:`make_case` is the mutator: a pure, deterministic function of (original manifest,
  canary manifest, seed, case number) -> mutated manifest bytes and a description. It knows
  nothing of the manifest's schema: it walks whatever msgpack structure it finds (so it keeps
  working when the format changes) and draws replacement strings from the manifest's own
  vocabulary plus generic hostile values (paths, dtype names, attribute names).
* ``python fuzz_worker.py CONFIG_JSON`` is a long-lived worker: it limits its own address
  space, copies the checkpoints once, then for each case number read from stdin rewrites
  manifest.msgpack and COMMIT (COMMIT names the mutated manifest's SHA-256, so the manifest is
  "trusted") and calls ``fnckpt.metadata``, ``fnckpt.restore`` (no target; for some cases an
  abstract target too) and the CLI's ``inspect`` and ``verify``. It reports on a private pipe
  (its fd 1 at start; fd 1 itself is pointed at stderr so nothing else can write into the
  protocol) one line per operation started (``OP <case> <op>``, so a crash or a hang is
  attributed) and one ``RESULT <json>`` per case. Besides case numbers it takes ``baseline``
  (the unmutated manifest, plus self-tests of the canary detectors) and ``stats`` (memory and
  CPU time). Per call it checks: only CheckpointError escapes (CLI: exit 0/1/2, on 2 one line
  ``fnckpt CMD: error: ...``, never a traceback), ``np.random.get_state()`` unchanged, no
  file of the canary opened (inotify), no canary value (MARK) in a restored array.

This module imports only the standard library and msgpack at import time (the test imports it
to regenerate reproducers); JAX, numpy and fnckpt are imported by the worker only.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import sys
from typing import Any, NamedTuple

import msgpack

MANIFEST = "manifest.msgpack"
COMMIT = "COMMIT"
CKPT = "ckpt"     # the fuzzed checkpoint, <workdir>/ckpt
CANARY = "other"  # its sibling, <workdir>/other: nothing of it may ever be read
MARK = 12345      # what the canary's arrays (and PRNG key data) hold

OPS = ("metadata", "restore", "restore(target)", "cli inspect", "cli verify")


# --- the checkpoint ---------------------------------------------------------------------------

class Pair(NamedTuple):
  first: Any
  second: Any


def build_tree(canary: bool = False) -> Any:
  """Every leaf kind: jax arrays sharded over a 2x4 mesh of the 8 CPU devices (float32, bf16,
  int4, bool, complex64; big ones stored as zarr arrays, small ones inline), a single-device
  0-d array, numpy arrays (one empty) and numpy scalars, Python scalars (64-bit extremes, big
  ints, str, bytes, None), empty dict/list/tuple, typed PRNG keys (one, and 8 sharded), a raw
  uint32 key, a numpy Generator, nested dicts/lists/namedtuples.

  The original's values never contain ``MARK``; the canary's arrays hold nothing else (where
  their dtype can hold it; -7/-77/True for int4/int8/bool)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

  mesh = jax.make_mesh((2, 4), ("a", "b"))

  def sh(*spec):
    return NamedSharding(mesh, P(*spec))

  def vals(shape, dtype):
    dt = np.dtype(jnp.dtype(dtype))
    if canary:
      if dt == np.bool_:
        return np.ones(shape, dt)
      if dt.name == "int4":
        return np.full(shape, -7, dt)
      if dt.itemsize == 1:
        return np.full(shape, -77, dt)
      return np.full(shape, MARK, dt)
    base = np.arange(math.prod(shape)).reshape(shape)
    if dt == np.bool_:
      return base % 3 == 0
    if dt.kind == "c":
      return (base % 5 + 1j * (base % 3)).astype(dt)
    return (base % 5 + 1).astype(dt)

  def jarr(shape, dtype, sharding):
    return jax.device_put(vals(shape, dtype), sharding)

  seed = MARK if canary else 0
  gen = np.random.default_rng(seed + 7)
  gen.random(3)
  return {
      "params": {
          "dense": {"kernel": jarr((64, 128), "float32", sh("a", "b")),   # medium
                    "bias": jarr((8,), "float32", sh("b"))},             # inline
          # > 4 MiB: its own zarr array even where medium arrays are packed (format 2)
          "big": jarr((1024, 1040), "float32", sh("a", "b")),
          "emb": jarr((64, 256), "bfloat16", sh(None, "b")),
          "small_bf16": jarr((4, 4), "bfloat16", sh()),
          "q": jarr((64, 512), "int4", sh("a")),
          "q_small": jarr((8,), "int4", sh("b")),
          "mask": jarr((64, 512), "bool", sh("b", None)),
          "mask_small": jarr((8,), "bool", sh()),
          "c": jarr((32, 128), "complex64", sh(None, "a")),
          "c_small": jarr((2, 4), "complex64", sh("a", "b")),
          "scalar0": jax.device_put(vals((), "float32"), SingleDeviceSharding(jax.devices()[3])),
      },
      "opt": [Pair(jarr((16, 8), "float32", sh("a")), vals((16, 8), "float32")),
              Pair(np.int16(-3), 7)],
      "np": {"f64": vals((64, 64), "float64"), "i16": vals((3, 5), "int16"),
             "empty": np.zeros((0, 4), np.float32), "u32": vals((4,), "uint32")},
      "npscalars": [np.float32(1.5), np.int8(-3), np.bool_(True), np.uint64(1 << 63)],
      "py": {"int": 7, "neg": -(1 << 63), "u64": (1 << 64) - 1, "big": 1 << 100,
             "negbig": -(1 << 80), "float": 0.25, "inf": float("inf"), "bool": True,
             "complex": 1 - 2j, "str": "héllo", "bytes": b"\x00\xff", "none": None},
      "empty": {"dict": {}, "list": [], "tuple": ()},
      "rng": {"key": jax.random.key(seed),
              "keys": jax.device_put(jax.random.split(jax.random.key(seed + 1), 8), sh("b")),
              "raw": jax.random.PRNGKey(seed + 3), "gen": gen},
      "layers": [{"w": jarr((8, 8), "float32", sh("a", "b")), "name": "l0"},
                 {"w": jarr((8, 8), "float32", sh("a", "b")), "name": "l1"}],
  }


def abstract_target(tree: Any) -> Any:
  """The tree with every jax.Array replaced by its ShapeDtypeStruct (shape, dtype, sharding);
  numpy arrays, scalars and Generators stay (fnckpt takes them as they are)."""
  import jax
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                      if isinstance(x, jax.Array) else x, tree)


# --- the mutator ------------------------------------------------------------------------------

def _unpack(data: bytes) -> Any:
  return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _pack(obj: Any) -> bytes:
  return msgpack.packb(obj, use_bin_type=True)


NASTY_PATHS = ["", ".", "..", "/", "../other/d/0", "../other", "../" + CANARY, "/etc",
               "/etc/passwd", "a/../../x", "d/../../other/d/0", "./d/0", "d//0", "d/0/", "~",
               "\\..\\other", "%2e%2e/other", "file:///etc", "memory://x", "gs://b/x",
               "s3://b/x", "d/0\x00/../../other", "COMMIT", "manifest.msgpack"]
NASTY_DTYPES = ["float128", "object", "O", "<U3", "U", "S5", "V8", "V", "|b1", ">f4", "<f8",
                "complex256", "datetime64[s]", "timedelta64", "int4", "uint2", "int2",
                "float4_e2m1fn", "float8_e4m3", "bfloat16", "float32", "int64", "bool",
                "void", "str", "bytes", "[('a', 'i4')]", "i4,i4", "(2,)i4", "key<fry>"]
NASTY_NAMES = ["seed", "__import__", "os.system", "__class__", "__reduce__", "__init__",
               "eval", "exec", "builtins.open", "subprocess.Popen", "numpy.random.seed",
               "MT19937", "PCG64", "PCG64DXSM", "Philox", "SFC64", "RandomState", "Generator",
               "BitGenerator", "__ndarray__", "__int__", "threefry2x32", "rbg", "unsafe_rbg",
               "no_such_impl", "collections.OrderedDict", "jax.numpy.ones", "NamedSharding",
               "GSPMDSharding", "PositionalSharding"]
NASTY_MISC = ["A" * 10000, "é" * 300, "\u202e", "\x00", " ", "None", "nan", "-1", "0",
              "2e7", "99999999999999999999", "1" * 5000, "-0", "0x10", "inf"]
NASTY_INTS = [0, -1, 1, 2, 3, 7, 8, 255, 256, 1 << 20, 20_000_000, (1 << 31) - 1, 1 << 31,
              -(1 << 31), 1 << 32, 1 << 45, (1 << 53) + 1, 1 << 62, (1 << 63) - 1, -(1 << 63),
              1 << 63, (1 << 64) - 1]
NASTY_FLOATS = [float("nan"), float("inf"), float("-inf"), -0.0, 0.5, 1e308, 3.0, -1.0,
                2.0 ** 45, 1e-320]
OTHER_VALUES = [None, True, False, 0, -1, 1 << 45, (1 << 63) - 1, 2.5, float("nan"), "", "x",
                b"", b"\x00" * 7, b"x" * 100, [], [None], [0], [-1], [1 << 45], [[]], ["x"],
                {}, {"": None}, {0: 1}, {"x": []}]
UNKNOWN_KEYS = ["zz_unknown", "", "__import__", "seed", "os.system", "__class__", 0, -1,
                1 << 40, None, b"k", True]


def _int_clamp(v: int) -> int:
  return max(-(1 << 63), min((1 << 64) - 1, v))


def _sites(obj: Any) -> list[tuple[tuple, Any]]:
  """Every node (root included) as (path, value), depth first; path entries are map keys or
  list indices (a map key is ('k', key), a list index ('i', n))."""
  out, stack = [], [((), obj)]
  while stack:
    path, v = stack.pop()
    out.append((path, v))
    if isinstance(v, dict):
      stack.extend((path + (("k", k),), x) for k, x in reversed(list(v.items())))
    elif isinstance(v, list):
      stack.extend((path + (("i", i),), x) for i, x in reversed(list(enumerate(v))))
  return out


def _get(obj: Any, path: tuple) -> Any:
  for _, k in path:
    obj = obj[k]
  return obj


def _lookup(obj: Any, path: tuple) -> Any:
  """The node at ``path`` in ``obj`` or None if there is none (same-position lookups in the
  canary's manifest)."""
  try:
    for kind, k in path:
      if kind == "k" and isinstance(obj, dict) and k in obj:
        obj = obj[k]
      elif kind == "i" and isinstance(obj, list) and 0 <= k < len(obj):
        obj = obj[k]
      else:
        return None
    return obj
  except Exception:
    return None


def fmt_path(path: tuple) -> str:
  out = []
  for kind, k in path:
    if kind == "k" and isinstance(k, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
      out.append(f".{k}")
    else:
      out.append(f"[{short(k, 40)}]")
  text = "".join(out) or "<root>"
  return text if len(text) <= 120 else text[:60] + f"...({len(path)} deep)..." + text[-40:]


def short(v: Any, limit: int = 60) -> str:
  """A short repr for descriptions (long strings and bytes cut, their length said)."""
  if isinstance(v, (str, bytes)) and len(v) > 24:
    return f"{v[:20]!r}...({len(v)} {'chars' if isinstance(v, str) else 'bytes'})"
  text = repr(v)
  return text if len(text) <= limit else text[:limit - 3] + "..."


class Case(NamedTuple):
  index: int
  steps: list            # human-readable descriptions of each mutation, in order
  data: bytes            # the mutated manifest bytes
  obj: Any               # the mutated manifest (None if the bytes were mangled after packing)
  touched: list          # the paths mutated (for reproducers)


class _Mutator:
  def __init__(self, obj: Any, canary_obj: Any, vocab_str: list, vocab_keys: list,
               original_sites: list, rng: random.Random):
    self.obj, self.canary, self.rng = obj, canary_obj, rng
    self.original_sites = original_sites
    self.vocab_str, self.vocab_keys = vocab_str, vocab_keys
    self.steps: list[str] = []
    self.touched: list[tuple] = []

  # -- helpers
  def set(self, path: tuple, value: Any, what: str) -> bool:
    """Put ``value`` at ``path`` (False, and nothing done, if it is what is there)."""
    old = _get(self.obj, path)
    if _pack(old) == _pack(value):
      return False
    if not path:
      self.obj = value
    else:
      _get(self.obj, path[:-1])[path[-1][1]] = value
    self.steps.append(f"{fmt_path(path)}: {short(old)} -> {short(value)} ({what})")
    self.touched.append(path)
    return True

  def strings_for(self, path: tuple, old: str) -> list[str]:
    derived = ["../other/" + old, "../" + old, "/" + old, old + "/..", old + "/../..",
               "./" + old, old + "/../../other", old.upper(), old + "x", old[:-1]]
    twin = _lookup(self.canary, path)
    if isinstance(twin, str):
      derived = ["../other/" + twin, "../" + CANARY + "/" + twin.strip("/")] + derived
    return derived

  def random_value(self, avoid_type: type | None = None) -> Any:
    r = self.rng
    for _ in range(20):
      pick = r.random()
      if pick < 0.5:
        v = r.choice(OTHER_VALUES)
      elif pick < 0.65:
        v = r.choice(NASTY_INTS)
      elif pick < 0.75:
        v = r.choice(NASTY_FLOATS)
      elif pick < 0.9:
        v = r.choice(self.vocab_str + NASTY_NAMES + NASTY_PATHS + NASTY_DTYPES)
      else:
        v = r.choice(self.original_sites)[1]  # (a copy of) some node of the original
      if avoid_type is None or type(v) is not avoid_type:
        return _unpack(_pack(v))
    return None

  # -- one mutation of the node at path
  def tweak(self, path: tuple) -> None:
    r = self.rng
    v = _get(self.obj, path)
    if isinstance(v, bool) or v is None:
      self.set(path, self.random_value(type(v)), "another type")
    elif isinstance(v, int):
      choice = r.randrange(9)
      if choice == 0:
        nv, what = v + 1, "+1"
      elif choice == 1:
        nv, what = v - 1, "-1"
      elif choice == 2:
        k = r.randint(1, 50)
        nv, what = v * (1 << k) if v else 1 << k, f"*2**{k}"
      elif choice == 3:
        nv, what = -v, "negated"
      elif choice == 4:
        nv, what = v // 2, "//2"
      elif choice in (5, 6, 7):
        nv, what = r.choice(NASTY_INTS), "int"
      else:
        nv, what = self.random_value(int), "another type"
      self.set(path, _int_clamp(nv) if isinstance(nv, int) and not isinstance(nv, bool)
               else nv, what)
    elif isinstance(v, float):
      if r.random() < 0.7:
        self.set(path, r.choice(NASTY_FLOATS), "float")
      else:
        self.set(path, self.random_value(float), "another type")
    elif isinstance(v, str):
      pick = r.random()
      if pick < 0.25:
        pool, what = self.strings_for(path, v) + NASTY_PATHS, "path-like"
      elif pick < 0.4:
        pool, what = NASTY_DTYPES, "dtype-like"
      elif pick < 0.55:
        pool, what = NASTY_NAMES, "name"
      elif pick < 0.8:
        pool, what = self.vocab_str, "string from elsewhere in the manifest"
      elif pick < 0.9:
        pool, what = NASTY_MISC, "odd string"
      else:
        self.set(path, self.random_value(str), "another type")
        return
      self.set(path, r.choice(pool), what)
    elif isinstance(v, bytes):
      choice = r.randrange(7)
      if choice == 0 and v:
        n = r.randrange(len(v))
        self.set(path, v[:n], f"truncated to {n}")
      elif choice == 1:
        extra = bytes(r.randrange(256) for _ in range(r.choice([1, 2, 3, 4, 8, 64])))
        self.set(path, v + extra, f"extended by {len(extra)}")
      elif choice == 2 and v:
        i = r.randrange(len(v))
        b = bytearray(v)
        b[i] ^= 1 << r.randrange(8)
        self.set(path, bytes(b), f"bit flipped in byte {i}")
      elif choice == 3:
        self.set(path, v * 2 if v else b"\x00" * 1024, "doubled")
      elif choice == 4:
        self.set(path, b"", "emptied")
      else:
        self.set(path, self.random_value(bytes), "another type")
    elif isinstance(v, list):
      choice = r.randrange(11)
      n = len(v)
      if choice == 0 and n:
        k = r.randrange(n)
        self.set(path, v[:k], f"truncated to {k}")
      elif choice == 1 and n:
        k = r.randrange(n)
        self.set(path, v[:k] + v[k + 1:], f"item {k} dropped")
      elif choice == 2 and n:
        k = r.randrange(n)
        self.set(path, v[:k + 1] + [_unpack(_pack(v[k]))] + v[k + 1:], f"item {k} duplicated")
      elif choice == 3:
        self.set(path, v + [self.random_value()], "item appended")
      elif choice == 4 and n >= 2:
        i, j = r.sample(range(n), 2)
        w = list(v)
        w[i], w[j] = w[j], w[i]
        self.set(path, w, f"items {i} and {j} swapped")
      elif choice == 5 and n >= 2:
        self.set(path, v[::-1], "reversed")
      elif choice == 6 and n:
        times = r.choice([2, 8, 64, 1000])
        self.set(path, v + [_unpack(_pack(v[-1])) for _ in range(times)],
                 f"last item repeated {times} more times")
      elif choice == 7:
        self.set(path, [], "emptied")
      elif choice == 8:
        depth = r.choice([30, 200, 450])
        deep: Any = None
        for _ in range(depth):
          deep = [deep]
        self.set(path, v + [deep], f"item nested {depth} deep appended")
      else:
        self.set(path, self.random_value(list), "another type")
    elif isinstance(v, dict):
      choice = r.randrange(6)
      keys = list(v)
      if choice == 0 and keys:
        k = r.choice(keys)
        del v[k]
        self.steps.append(f"{fmt_path(path)}: key {short(k)} deleted")
        self.touched.append(path)
      elif choice == 1:
        k = r.choice(UNKNOWN_KEYS + self.vocab_keys)
        val = self.random_value()
        v[k] = val
        self.steps.append(f"{fmt_path(path)}: key {short(k)} added = {short(val)}")
        self.touched.append(path + (("k", k),))
      elif choice == 2 and keys:
        k = r.choice(keys)
        new = r.choice([x for x in self.vocab_keys + UNKNOWN_KEYS if x != k])
        val = v.pop(k)
        v[new] = val
        self.steps.append(f"{fmt_path(path)}: key {short(k)} renamed {short(new)}")
        self.touched.append(path + (("k", new),))
      elif choice == 3:
        self.set(path, {}, "emptied")
      else:
        self.set(path, self.random_value(dict), "another type")

  def redirect(self) -> None:
    """A consistent crafted manifest: every string naming a location under some prefix (a
    data directory, 'd', 'd/3', ...) now names the same place under ../other/ (the canary's
    name for it where the canary names it differently, e.g. a per-save directory)."""
    r = self.rng
    prefixes = {}
    for path, v in self.original_sites:
      if isinstance(v, str) and 0 < len(v) < 200:
        twin = _lookup(self.canary, path)
        parts = v.split("/")
        for n in range(1, len(parts) + 1 if len(parts) > 1 else 1):
          prefixes.setdefault("/".join(parts[:n]), None)
        if isinstance(twin, str) and twin != v:
          prefixes[v] = twin
    if not prefixes:
      return
    prefix = r.choice(sorted(prefixes, key=str))
    twin = prefixes[prefix] or prefix
    new = r.choice(["../other/", "../" + CANARY + "/./", "/../other/"]) + twin
    count = 0
    for path, v in _sites(self.obj):
      if isinstance(v, str) and (v == prefix or v.startswith(prefix + "/")) and path:
        _get(self.obj, path[:-1])[path[-1][1]] = new + v[len(prefix):]
        self.touched.append(path)
        count += 1
    if count:
      self.steps.append(f"every string {short(prefix)} or under it -> under {short(new)} "
                        f"({count} string(s); redirect)")

  def mutate_random(self) -> None:
    r = self.rng
    if r.random() < 0.05:
      self.redirect()
      return
    sites = _sites(self.obj) if self.steps else self.original_sites  # unmutated yet: the same
    pick = r.random()
    if pick < 0.7:
      self.tweak(r.choice(sites)[0])
    elif pick < 0.85:  # a node becomes a copy of another node (type confusion, realistic)
      (a, _), (b, bv) = r.choice(sites[1:] or sites), r.choice(sites)
      if a[:len(b)] != b:
        self.set(a, _unpack(_pack(bv)), f"copy of {fmt_path(b)}")
    elif pick < 0.95:
      path = r.choice(sites)[0]
      self.set(path, self.random_value(type(_get(self.obj, path))), "another type")
    else:  # two nodes swapped
      a, b = r.choice(sites[1:] or sites)[0], r.choice(sites[1:] or sites)[0]
      if a[:len(b)] != b and b[:len(a)] != a:
        av, bv = _get(self.obj, a), _get(self.obj, b)
        self.set(a, bv, f"swapped with {fmt_path(b)}")
        _get(self.obj, b[:-1])[b[-1][1]] = av
        self.touched.append(b)

  def systematic(self, k: int) -> None:
    """Every node in turn (k-th case: node k mod N), with a value cycling through the
    hostile values for its type (round k // N)."""
    sites = self.original_sites  # this is the only mutation: self.obj is still the original
    path = sites[k % len(sites)][0]
    v = _get(self.obj, path)
    rnd = k // len(sites)
    if isinstance(v, bool) or v is None:
      pool = [x for x in OTHER_VALUES if type(x) is not type(v)]
    elif isinstance(v, int):  # (the first rounds matter most: 10,000 cases make ~6)
      pool = [-1, 1 << 45, 1 << 63, _int_clamp(v + 1), _int_clamp(v << 45), 0, -(1 << 63),
              (1 << 64) - 1, _int_clamp(v - 1), _int_clamp(-v)] + NASTY_INTS
    elif isinstance(v, float):
      pool = NASTY_FLOATS
    elif isinstance(v, str):
      pool = (self.strings_for(path, v)[:1] + ["seed", "__import__", "os.system", "object",
                                               "/etc", "<U3", "a/../../x", "float128", "",
                                               "V8", "."]
              + self.strings_for(path, v)[1:] + NASTY_PATHS + NASTY_NAMES + NASTY_DTYPES
              + NASTY_MISC + self.vocab_str)
    elif isinstance(v, bytes):
      pool = [b"", v[:-1], v + b"\x00", v[: len(v) // 2], v * 2, "", None]
    elif isinstance(v, list):
      pool = [[], v[:-1], v + v[-1:], v[::-1], v + [None], None, {}, "", 0]
    else:
      pool = [None, {}, [], "", 0, v]
    for offset in range(len(pool)):  # the first value of the pool, from this round's, that
      choice = pool[(rnd + offset) % len(pool)]  # differs from what is there
      if choice is v or _pack(choice) != _pack(v):
        break
    if isinstance(v, dict) and choice is v:  # the round that deletes this node instead
      if path and isinstance(_get(self.obj, path[:-1]), dict):
        parent = _get(self.obj, path[:-1])
        del parent[path[-1][1]]
        self.steps.append(f"{fmt_path(path)}: deleted (systematic)")
        self.touched.append(path[:-1])
        return
      choice = None
    if path and rnd % 7 == 6 and isinstance(_get(self.obj, path[:-1]), dict):
      parent = _get(self.obj, path[:-1])
      del parent[path[-1][1]]
      self.steps.append(f"{fmt_path(path)}: deleted (systematic)")
      self.touched.append(path[:-1])
      return
    self.set(path, _unpack(_pack(choice)), "systematic")


def vocabulary(obj: Any) -> tuple[list[str], list[Any]]:
  """The strings (values and map keys) of a manifest, in first-seen order (deterministic)."""
  strs, keys = {}, {}
  for path, v in _sites(obj):
    if isinstance(v, str) and len(v) < 200:
      strs.setdefault(v, None)
    if isinstance(v, dict):
      for k in v:
        keys.setdefault(k, None)
  return list(strs), list(keys)


_CACHE: dict = {}


def make_case(original: bytes, canary: bytes, seed: int | str, index: int) -> Case:
  """Case ``index`` of the run with ``seed``: a deterministic function of its arguments.

  Even cases are systematic (every node of the manifest in turn, each with the hostile values
  for its type in turn: strings first become '../other/<the canary's value here>', 'seed',
  '__import__', 'os.system', ...; ints -1, 2**45, 2**63, ...; every 7th round deletes the
  node), odd ones random (1-4 mutations of random nodes); about one odd case in seven instead
  or also mangles the encoded bytes (truncated, bits flipped, bytes inserted or dropped)."""
  rng = random.Random(f"{seed}:{index}")
  key = (original, canary)
  if key not in _CACHE:
    _CACHE.clear()
    first = _unpack(original)
    _CACHE[key] = (first, _unpack(canary), *vocabulary(first), _sites(first))
  _, canary_obj, vocab_str, vocab_keys, original_sites = _CACHE[key]
  m = _Mutator(_unpack(original), canary_obj, vocab_str, vocab_keys, original_sites, rng)
  raw_only = False
  if index % 2 == 0:
    m.systematic(index // 2)
  else:
    raw_only = rng.random() < 0.05
    if not raw_only:
      for _ in range(rng.choice([1, 1, 1, 1, 2, 2, 3, 4])):
        m.mutate_random()
      for _ in range(20):  # until something changed
        if m.steps:
          break
        m.mutate_random()
  try:
    data = _pack(m.obj)
  except (OverflowError, ValueError, TypeError) as e:  # msgpack cannot encode it (too deep...)
    m.steps.append(f"(not encodable: {e}; the original bytes are mangled instead)")
    m.obj, m.touched, raw_only = None, [], True
    data = original
  obj_out = m.obj
  if raw_only or (index % 2 == 1 and rng.random() < 0.1):
    b = bytearray(data)
    choice = rng.randrange(5)
    if choice == 0:
      n = rng.randrange(len(b))
      del b[n:]
      m.steps.append(f"bytes truncated to {n} of {len(data)}")
    elif choice == 1:
      flips = rng.choice([1, 1, 2, 4, 16])
      at = []
      for _ in range(flips):
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
        at.append(i)
      m.steps.append(f"{flips} bit(s) flipped at bytes {sorted(at)}")
    elif choice == 2:
      i = rng.randrange(len(b) + 1)
      ins = rng.choice([b"\x00", b"\xc1", b"\xc0", b"\xdd\x7f\xff\xff\xff", b"\xc6\x00\x10\x00\x00",
                        b"\x91" * 2000, bytes([rng.randrange(256)])])
      b[i:i] = ins
      m.steps.append(f"{short(ins)} inserted at byte {i}")
    elif choice == 3 and b:
      i = rng.randrange(len(b))
      del b[i]
      m.steps.append(f"byte {i} deleted")
    else:
      b += bytes(rng.randrange(256) for _ in range(rng.choice([1, 8, 100])))
      m.steps.append("trailing garbage appended")
    data = bytes(b)
    obj_out = None
  if not m.steps or data == original:  # nothing changed after all: a raw bit flip
    b = bytearray(data)
    i = rng.randrange(len(b))
    b[i] ^= 1 << rng.randrange(8)
    data = bytes(b)
    m.steps.append(f"1 bit flipped at byte {i}")
    obj_out = None
  return Case(index, m.steps, data, obj_out, m.touched)


def commit_for(commit_template: bytes, original: bytes, mutated: bytes) -> bytes:
  """The COMMIT marker that makes ``mutated`` the trusted manifest: its "manifest_sha256" (and
  any other value naming the original manifest by hash or length) now names ``mutated``."""
  commit = _unpack(commit_template)
  old_hash, new_hash = hashlib.sha256(original).hexdigest(), hashlib.sha256(mutated).hexdigest()
  for k, v in list(commit.items()):
    if v == old_hash:
      commit[k] = new_hash
    elif isinstance(v, int) and not isinstance(v, bool) and v == len(original):
      commit[k] = len(mutated)
  commit["manifest_sha256"] = new_hash
  return _pack(commit)


def render(obj: Any, touched: list, width: int = 100) -> str:
  """A JSON-ish repr of a (mutated) manifest: long lists show only the items on a mutated
  path (others elided), long strings and bytes are cut."""
  on_path = {p[:i] for p in touched for i in range(len(p) + 1)}
  lines: list[str] = []

  def emit(v: Any, path: tuple, indent: int, prefix: str) -> None:
    pad = "  " * indent
    if isinstance(v, dict):
      flat = short(v, 10 ** 9)
      if len(pad + prefix + flat) <= width and not any(len(p) > len(path) and p[:len(path)] == path
                                                        for p in on_path):
        lines.append(pad + prefix + flat)
        return
      lines.append(pad + prefix + "{")
      for k, x in v.items():
        emit(x, path + (("k", k),), indent + 1, f"{short(k)}: ")
      lines.append(pad + "}")
    elif isinstance(v, list):
      flat = "[" + ", ".join(short(x, 10 ** 9) for x in v) + "]"
      if len(pad + prefix + flat) <= width and len(v) <= 8:
        lines.append(pad + prefix + flat)
        return
      lines.append(pad + prefix + "[")
      shown = [i for i in range(len(v)) if path + (("i", i),) in on_path]
      if not shown and len(v) <= 3:
        shown = list(range(len(v)))
      last = -1
      for i in shown:
        if i - last > 1:
          lines.append(pad + f"  ... {i - last - 1} unchanged item(s)")
        emit(v[i], path + (("i", i),), indent + 1, f"[{i}] ")
        last = i
      if len(v) - 1 - last > 0:
        lines.append(pad + f"  ... {len(v) - 1 - last} unchanged item(s)")
      lines.append(pad + "]")
    else:
      lines.append(pad + prefix + short(v, 200))

  emit(obj, (), 0, "")
  return "\n".join(lines)


# --- the worker -------------------------------------------------------------------------------

def _first_line(text: str) -> str:
  for line in str(text).splitlines():
    if line.strip():
      return line.strip()[:300]
  return ""


class _Inotify:
  """Opens and reads under a directory tree, seen through Linux inotify (a read of the canary
  checkpoint by the library, by any code path: Python or TensorStore's C++)."""
  IN_ACCESS, IN_OPEN = 0x001, 0x020

  def __init__(self, root: str):
    import ctypes
    import struct
    self.struct = struct
    self.fd = -1
    self.names: dict[int, str] = {}
    try:
      libc = ctypes.CDLL(None, use_errno=True)
      fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
      if fd < 0:
        return
      for d, _, _ in os.walk(root):
        wd = libc.inotify_add_watch(fd, os.fsencode(d), self.IN_ACCESS | self.IN_OPEN)
        if wd >= 0:
          self.names[wd] = os.path.relpath(d, os.path.dirname(root))
      self.fd = fd
    except Exception:
      self.fd = -1

  def events(self) -> list[str]:
    if self.fd < 0:
      return []
    out = []
    while True:
      try:
        data = os.read(self.fd, 1 << 16)
      except BlockingIOError:
        return out
      i = 0
      while i < len(data):
        wd, mask, _, n = self.struct.unpack_from("iIII", data, i)
        name = data[i + 16:i + 16 + n].rstrip(b"\0").decode(errors="replace")
        i += 16 + n
        where = self.names.get(wd, "?") + ("/" + name if name else "/")
        what = "opened" if mask & self.IN_OPEN else "read"
        entry = f"{what} {where}"
        if entry not in out:
          out.append(entry)


def _marks(x: Any, np: Any, jax: Any, depth: int = 0) -> list[str]:
  """Key-path-ish places in a restored tree whose arrays contain the canary's MARK."""
  found = []
  if depth > 50:
    return found
  if isinstance(x, dict):
    for k, v in x.items():
      found += [f"[{k!r}]{p}" for p in _marks(v, np, jax, depth + 1)]
    return found
  if isinstance(x, (list, tuple)):
    for i, v in enumerate(x):
      found += [f"[{i}]{p}" for p in _marks(v, np, jax, depth + 1)]
    return found
  try:
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
      a = np.asarray(x)
      if a.size and a.dtype.kind in "biufcV":
        mark = np.array(MARK).astype(a.dtype)
        # only where the dtype holds MARK (nearly) exactly: not int8/int4/bool/fp8
        if abs(np.asarray(mark).astype(np.complex128).item() - MARK) < 100:
          if bool(np.any(a == mark)):
            return [""]
  except Exception:  # an odd restored object: nothing to compare
    pass
  return found


def overwrite(path: str, data: bytes) -> None:
  """Replace a file's content in place (no O_TRUNC: on a file system mounted with 'discard'
  truncating open() costs milliseconds)."""
  fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
  try:
    view = memoryview(data)
    while view:
      view = view[os.write(fd, view):]
    os.ftruncate(fd, len(data))
  finally:
    os.close(fd)


def where_in_fnckpt(e: BaseException) -> str:
  """' [at file:line function]' of the innermost fnckpt frame of ``e``'s traceback."""
  import traceback
  tb = traceback.extract_tb(e.__traceback__)
  lib = [fr for fr in tb if f"fnckpt{os.sep}" in fr.filename and "tests" not in fr.filename]
  at = lib[-1] if lib else (tb[-1] if tb else None)
  return f" [at {os.path.basename(at.filename)}:{at.lineno} {at.name}]" if at else ""


def _compare(got: Any, want: Any, np: Any, jax: Any) -> list[str]:
  """Key paths where a restore into the original's abstract tree differs from the original."""
  def host(x):
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return np.asarray(jax.random.key_data(x))
    if isinstance(x, np.random.Generator):
      return repr(x.bit_generator.state)
    return np.asarray(x) if isinstance(x, (jax.Array, np.ndarray, np.generic)) else x
  is_leaf = lambda x: isinstance(x, np.random.Generator)
  got_leaves = jax.tree_util.tree_leaves_with_path(got, is_leaf=is_leaf)
  want_leaves = jax.tree_util.tree_leaves_with_path(want, is_leaf=is_leaf)
  if [k for k, _ in got_leaves] != [k for k, _ in want_leaves]:
    return ["tree structure differs"]
  problems = []
  for (kp, g), (_, w) in zip(got_leaves, want_leaves):
    g, w = host(g), host(w)
    same = (np.array_equal(g, w) and g.dtype == w.dtype) if isinstance(w, np.ndarray) else (
        type(g) is type(w) and (g == w or (g != g and w != w)))
    if not same:
      problems.append(jax.tree_util.keystr(kp))
  return problems


def worker_main(config: dict) -> None:
  import faulthandler
  import resource
  import signal
  faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks, before a kill
  limit = int(config["address_space_bytes"])
  if limit > 0:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  proto = os.fdopen(os.dup(1), "w", buffering=1)
  os.dup2(2, 1)  # nothing but this function writes to the protocol pipe
  sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)

  def send(line: str) -> None:
    proto.write(line + "\n")
    proto.flush()

  import contextlib
  import io
  import shutil
  import threading
  import time
  import warnings

  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  import numpy as np
  import fnckpt
  import fnckpt.cli
  import functools
  if callable(getattr(fnckpt.cli, "_parser", None)):  # argparse setup costs ms per call
    fnckpt.cli._parser = functools.lru_cache(maxsize=1)(fnckpt.cli._parser)

  workdir = config["workdir"]
  shutil.rmtree(workdir, ignore_errors=True)
  shutil.copytree(config["source"], workdir)
  ckpt = os.path.join(workdir, CKPT)
  with open(os.path.join(ckpt, MANIFEST), "rb") as f:
    original = f.read()
  with open(os.path.join(ckpt, COMMIT), "rb") as f:
    commit_template = f.read()
  with open(os.path.join(workdir, CANARY, MANIFEST), "rb") as f:
    canary = f.read()
  target = abstract_target(build_tree())
  watch = _Inotify(os.path.join(workdir, CANARY))
  with open(os.path.join(workdir, CANARY, MANIFEST), "rb") as f:  # the watch sees reads?
    f.read(1)
  if not watch.events():
    watch.fd = -1
  seed = config["seed"]
  target_every = max(1, int(config.get("target_every", 3)))
  usage = resource.getrusage(resource.RUSAGE_SELF)
  cpu_at_ready, cases_done = usage.ru_utime + usage.ru_stime, 0
  send(f"READY inotify={'yes' if watch.fd >= 0 else 'no'} "
       f"as_limit={resource.getrlimit(resource.RLIMIT_AS)[0]}")

  def cli(*args: str) -> tuple[str | None, str]:
    """Run the CLI's entry point in-process; (failure kind or None, detail)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
        warnings.catch_warnings(record=True):  # warnings are not the error message
      try:
        rc = fnckpt.cli.main(list(args))
      except SystemExit as e:  # argparse
        rc = e.code if isinstance(e.code, int) else 2
    text = err.getvalue()
    if "Traceback (most recent call last)" in text + out.getvalue():
      return "CLI printed a traceback", _first_line(text.split("Traceback")[-1])
    if rc not in (0, 1, 2):
      return f"CLI exit {rc}", _first_line(text)
    if rc == 2:
      lines = [l for l in text.splitlines() if l.strip() and not l.startswith("verify ")]
      if len(lines) != 1 or not lines[0].startswith(f"fnckpt {args[0]}: error:"):
        return "CLI exit 2 without a one-line message", (
            f"{len(lines)} line(s): " + " | ".join(l[:150] for l in lines[:3]))
      return None, "exit 2"
    return None, f"exit {rc}"

  def run_case(index: int, data: bytes, ops: tuple) -> dict:
    overwrite(os.path.join(ckpt, MANIFEST), data)
    overwrite(os.path.join(ckpt, COMMIT), commit_for(commit_template, original, data))
    failures, outcomes, times, notes = [], {}, {}, []
    for op in ops:
      send(f"OP {index} {op}")
      watch.events()
      state = np.random.get_state()
      result, failure, t0 = None, None, time.perf_counter()
      try:
        if op == "metadata":
          result = fnckpt.metadata(ckpt)
        elif op == "restore":
          result = fnckpt.restore(ckpt)
        elif op == "restore(target)":
          result = fnckpt.restore(ckpt, target)
        else:
          kind, detail = cli(op.split()[1], ckpt)
          failure = (kind, detail) if kind else None
        outcome = "ok" if not op.startswith("cli") or failure else detail
      except fnckpt.CheckpointError as e:
        outcome = "CheckpointError"
        # Passes; but a CheckpointError raised from a raw Python error by a catch-all is a
        # validation gap worth seeing (reported apart, not a failure).
        cause = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
        if cause is not None and not isinstance(cause, fnckpt.CheckpointError) and (
            type(cause).__module__ == "builtins"):
          notes.append({"op": op, "kind": f"CheckpointError wrapping {type(cause).__name__}",
                        "msg": _first_line(str(cause)) + where_in_fnckpt(cause)})
      except KeyboardInterrupt:
        raise
      except BaseException as e:  # noqa: BLE001 -- everything else is a finding
        outcome = "FAIL"
        failure = (type(e).__name__, _first_line(str(e)) + where_in_fnckpt(e))
      else:
        if failure:
          outcome = "FAIL"
      elapsed = time.perf_counter() - t0
      after = np.random.get_state()
      if not (after[0] == state[0] and np.array_equal(after[1], state[1])
              and after[2:] == state[2:]):
        np.random.set_state(state)
        failures.append({"op": op, "kind": "np.random global state changed",
                         "msg": "np.random.get_state() differs after the call"})
        outcome = "FAIL"
      seen = watch.events()
      if seen:
        failures.append({"op": op, "kind": "read outside the checkpoint",
                         "msg": "; ".join(seen[:4])})
        outcome = "FAIL"
      if result is not None and op.startswith("restore"):
        where = _marks(result, np, jax)
        if where:
          failures.append({"op": op, "kind": "canary data returned",
                           "msg": f"the sibling checkpoint's values at {where[:3]}"})
          outcome = "FAIL"
      del result
      if failure:
        failures.append({"op": op, "kind": failure[0], "msg": failure[1]})
      outcomes[op] = outcome
      times[op] = round(elapsed, 5)
    return {"case": index, "failures": failures, "outcomes": outcomes, "times": times,
            "notes": notes}

  for line in sys.stdin:
    line = line.strip()
    if not line:
      continue
    if line == "baseline":  # the unmutated manifest: everything must work, values equal
      res = run_case(-1, original, OPS)
      res["baseline_value_problems"] = _compare(fnckpt.restore(ckpt, target), build_tree(),
                                                np, jax)
      # the detectors themselves: reading the canary must be seen, and its values recognised
      watch.events()
      marked = _marks(fnckpt.restore(os.path.join(workdir, CANARY)), np, jax)
      res["selftest"] = {"canary arrays recognised": len(marked),
                         "canary reads seen": len(watch.events()) if watch.fd >= 0 else None}
      send("RESULT " + json.dumps(res))
      continue
    if line == "stats":
      with open("/proc/self/status") as f:
        status = dict(l.split(":", 1) for l in f if ":" in l)
      usage = resource.getrusage(resource.RUSAGE_SELF)
      cpu = usage.ru_utime + usage.ru_stime - cpu_at_ready
      send("RESULT " + json.dumps({"case": -2, "failures": [], "outcomes": {}, "memory": (
          f"VmPeak {status.get('VmPeak', '?').strip()}, VmRSS {status.get('VmRSS', '?').strip()}"
          f", {threading.active_count()} Python threads"), "cpu_s": cpu, "cases": cases_done}))
      continue
    index = int(line)
    t0 = time.perf_counter()
    try:
      case = make_case(original, canary, seed, index)
    except Exception as e:  # a bug of this harness, reported as such (not a fuzz finding)
      send("RESULT " + json.dumps({"case": index, "outcomes": {}, "failures": [{
          "op": "make_case", "kind": "HARNESS BUG " + type(e).__name__,
          "msg": _first_line(str(e))}]}))
      continue
    ops = tuple(op for op in OPS if op != "restore(target)" or index % target_every == 0)
    res = run_case(index, case.data, ops)
    res["case_s"] = round(time.perf_counter() - t0, 5)
    cases_done += 1
    send("RESULT " + json.dumps(res))


if __name__ == "__main__":
  worker_main(json.loads(sys.argv[1]))
