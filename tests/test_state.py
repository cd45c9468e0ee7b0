"""Process-wide state lives in one place, ``fnckpt/_state.py`` (read from the source, ``ast``):
no other module has a ``global`` statement, binds a module-level name to a mutable value (a
container, a lock, a counter, an instance of its own class), memoises with
``functools.lru_cache`` / ``functools.cache`` (``_state.memo`` registers the cache instead) or
registers an exit handler at import. ``_state`` itself imports nothing of fnckpt but
``_errors``."""

from __future__ import annotations

import ast
import pathlib

import pytest

import fnckpt
from fnckpt import _state

ROOT = pathlib.Path(fnckpt.__file__).parent
STATE = "_state.py"

# Calls whose result is immutable (or a constant by convention): allowed at module level.
IMMUTABLE = {"re.compile", "frozenset", "tuple", "object", "TypeVar", "typing.TypeVar",
             "collections.namedtuple", "typing.NamedTuple", "dataclasses.field"}
# Calls that make mutable state whatever the name (even an ALL_CAPS "constant").
MUTABLE = {"set", "dict", "list", "bytearray"}
MUTABLE_MODULES = {"threading", "collections", "queue", "weakref", "itertools"}


def _dotted(node: ast.AST) -> str | None:
  if isinstance(node, ast.Call):
    return _dotted(node.func)
  if isinstance(node, ast.Name):
    return node.id
  if isinstance(node, ast.Attribute):
    base = _dotted(node.value)
    return f"{base}.{node.attr}" if base else None
  return None


def _module_level(body: list[ast.stmt]):
  """Statements run at import: the module's, and those inside its ``if``/``try``/``with``."""
  for node in body:
    yield node
    for field in ("body", "orelse", "finalbody"):
      if isinstance(node, (ast.If, ast.Try, ast.With)):
        yield from _module_level(getattr(node, field, []))
    if isinstance(node, ast.Try):
      for handler in node.handlers:
        yield from _module_level(handler.body)


def _constant_name(name: str) -> bool:
  return name.strip("_").replace("_", "").isupper()


def _binding_problem(name: str, value: ast.expr) -> str | None:
  """Why binding ``name`` to ``value`` at module level is mutable state (None: it is not)."""
  if name.startswith("__"):
    return None
  call = _dotted(value) if isinstance(value, ast.Call) else None
  if call is not None and call not in IMMUTABLE and (
      call in MUTABLE or call.split(".")[0] in MUTABLE_MODULES):
    return f"{name} = {call}(...)"
  if isinstance(value, (ast.List, ast.Dict, ast.Set)) and not (
      value.keys if isinstance(value, ast.Dict) else value.elts):
    return f"{name} = an empty {type(value).__name__.lower()}"
  if _constant_name(name):
    return None  # a constant: a non-empty literal table, or a call made once (e.g. a regex)
  if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
    return f"{name} = a {type(value).__name__.lower()} (mutable)"
  if call is not None and call not in IMMUTABLE:
    return f"{name} = {call}(...) (an object made at import)"
  return None


def problems_in(source: str, path: str) -> list[str]:
  """Every piece of process-wide state ``source`` keeps outside ``_state``, with its line."""
  tree = ast.parse(source, path)
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Global):
      out.append(f"{path}:{node.lineno}: global {', '.join(node.names)}")
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      for d in node.decorator_list:
        name = _dotted(d) or ""
        if name.rsplit(".", 1)[-1] in ("lru_cache", "cache"):
          out.append(f"{path}:{d.lineno}: @{name} on {node.name}: use @_state.memo(maxsize)")
        if name == "atexit.register":
          out.append(f"{path}:{d.lineno}: @atexit.register at import: register on first use")
  for node in _module_level(tree.body):
    if isinstance(node, ast.Assign):
      targets, value = node.targets, node.value
    elif isinstance(node, ast.AnnAssign) and node.value is not None:
      targets, value = [node.target], node.value
    elif isinstance(node, ast.Expr) and _dotted(node.value) == "atexit.register":
      out.append(f"{path}:{node.lineno}: atexit.register at import: register on first use")
      continue
    else:
      continue
    for t in targets:
      problem = _binding_problem(t.id, value) if isinstance(t, ast.Name) else None
      if problem:
        out.append(f"{path}:{node.lineno}: {problem}")
  return out


def test_no_module_but_state_keeps_process_wide_state():
  found = []
  for p in sorted(ROOT.rglob("*.py")):
    if p.relative_to(ROOT).as_posix() != STATE:
      found += problems_in(p.read_text(), p.relative_to(ROOT.parent).as_posix())
  assert not found, ("\n" + "\n".join(found) + "\nkeep what fnckpt holds between calls in "
                     "fnckpt/_state.py (and say there what it is), memoise with _state.memo")


def test_state_imports_nothing_of_fnckpt_but_errors():
  tree = ast.parse((ROOT / STATE).read_text())
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.level or
                                             (node.module or "").startswith("fnckpt")):
      assert node.level == 1 and node.module == "_errors", ast.unparse(node)
    if isinstance(node, ast.Import):
      assert not any(a.name.startswith("fnckpt") for a in node.names), ast.unparse(node)


def test_every_cache_is_listed_and_bounded_or_closed():
  memos = _state.memos()
  for name in ("fnckpt._layout.chunks._named_info", "fnckpt._save.plan._processes",
               "fnckpt._save.piece_writes.mesh_processes", "fnckpt._restore.restore._key_data_ndim"):
    assert name in memos, sorted(memos)
  unbounded = [n for n, info in memos.items() if info.maxsize is None]
  assert unbounded == ["fnckpt._restore.restore._key_data_ndim"]  # (PRNG implementations)


# --- the check catches what it is for ------------------------------------------------------

@pytest.mark.parametrize("source, says", [
    ("_cache = {}\n", "_cache = an empty dict"),
    ("_seen: set = set()\n", "_seen = set(...)"),
    ("_LOCK = threading.Lock()\n", "_LOCK = threading.Lock(...)"),
    ("_order = itertools.count()\n", "_order = itertools.count(...)"),
    ("stats = Stats()\n", "stats = Stats(...) (an object made at import)"),
    ("_last = [None]\n", "_last = a list (mutable)"),
    ("try:\n  _x = collections.OrderedDict()\nexcept ImportError:\n  pass\n",
     "_x = collections.OrderedDict(...)"),
    ("def f():\n  global _root\n", "global _root"),
    ("@functools.lru_cache(maxsize=8)\ndef f(x):\n  return x\n", "use @_state.memo(maxsize)"),
    ("@atexit.register\ndef bye():\n  pass\n", "register on first use"),
    ("atexit.register(print)\n", "register on first use"),
])
def test_the_check_names_mutable_state_with_its_line(source, says):
  (problem,) = problems_in(source, "fnckpt/_x.py")
  assert problem.startswith("fnckpt/_x.py:") and says in problem, problem


@pytest.mark.parametrize("source", [
    "_HELD = {'host': 'numpy'}\n", "_PATTERN = re.compile('x')\n", "_END = object()\n",
    "__all__ = ['a']\n", "LIMIT = 4096\n", "T = TypeVar('T')\n", "log = None\n",
    "def f():\n  cache = {}\n  return cache\n",
])
def test_constants_and_locals_are_not_state(source):
  assert problems_in(source, "fnckpt/_x.py") == []
