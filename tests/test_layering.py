"""The package's layers, read from the source (``ast``: every import, at module level or inside a
function or an ``if`` block, relative or absolute):

1. a module imports only its own package or packages below it (the table below; each package's
   ``__init__`` says what it owns and what it may import);
2. no import cycle between modules, however long;
3. no internal module imports the public package ``fnckpt`` itself (``import fnckpt``,
   ``from fnckpt import save``, ``from .. import __version__``): only ``fnckpt/__init__.py`` and
   ``fnckpt/__main__.py`` put the public names together.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

import fnckpt

TOP = "fnckpt"
ROOT = pathlib.Path(fnckpt.__file__).parent

# Package (or top-level module) -> layer, bottom to top.
LAYERS = {
    "_errors": 0, "_version": 0,
    "_state": 0,       # everything kept per process (imports nothing of fnckpt but _errors)
    "_layout": 1,      # pure layout rules
    "_format": 2,      # the checkpoint format: records, manifest, leaves, key paths
    "_io": 3,          # storage, TensorStore, commit marker, processes
    "_sources": 4,     # reading stored checkpoints (any format)
    "_restore": 5,
    "_save": 6,
    "_export": 7,
    "_manager": 8,
    "cli": 9,
}
ENTRY = {TOP, f"{TOP}.__main__"}   # may import anything (they assemble the public package)


@dataclasses.dataclass(frozen=True)
class Import:
  module: str        # the importing module, e.g. "fnckpt._save.save"
  path: str          # its file, relative to the package's parent
  line: int
  target: str        # the fnckpt module (or package) imported, e.g. "fnckpt._io.paths"
  binds_top: bool    # whether it hands the module the public package itself


def modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
  """Every module under ``root`` by dotted name (a package by its own name)."""
  out = {}
  for p in sorted(root.rglob("*.py")):
    parts = (TOP,) + p.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = p
  return out


def imports(name: str, source: str, path: str, known: set[str]) -> list[Import]:
  """The fnckpt modules ``name``'s source imports, each with its line."""
  is_pkg = path.endswith("__init__.py")
  here = name.split(".") if is_pkg else name.split(".")[:-1]
  out = []
  for node in ast.walk(ast.parse(source, path)):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name == TOP or a.name.startswith(TOP + "."):
          # ``import fnckpt.x`` binds the name ``fnckpt`` (the public package) too
          out.append(Import(name, path, node.lineno, _known(a.name, known),
                            a.name == TOP or a.asname is None))
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = here[:len(here) - node.level + 1]
        mod = ".".join(base + ([node.module] if node.module else []))
      else:
        mod = node.module or ""
      if mod != TOP and not mod.startswith(TOP + "."):
        continue
      for a in node.names:
        sub = f"{mod}.{a.name}"
        if sub in known:          # a module: from fnckpt._io import paths
          out.append(Import(name, path, node.lineno, sub, False))
        else:                     # a name in a module: from .paths import join
          out.append(Import(name, path, node.lineno, _known(mod, known), mod == TOP))
  return list(dict.fromkeys(out))  # (one per module and line)


def _known(mod: str, known: set[str]) -> str:
  """The module that holds ``mod`` (``fnckpt._io.paths.join`` -> ``fnckpt._io.paths``)."""
  while mod not in known and "." in mod:
    mod = mod.rsplit(".", 1)[0]
  return mod


def package(mod: str) -> str:
  """``fnckpt._io.paths`` -> ``_io``; ``fnckpt._errors`` -> ``_errors``."""
  return mod.split(".")[1] if mod != TOP else TOP


def layer_problems(found: list[Import]) -> list[str]:
  out = []
  for i in found:
    if i.module in ENTRY or i.target == TOP:
      continue  # (importing the public package is rule 3's)
    mine, theirs = package(i.module), package(i.target)
    if mine not in LAYERS or theirs not in LAYERS:
      out.append(f"{i.path}:{i.line}: {i.module} imports {i.target}, and "
                 f"{mine if mine not in LAYERS else theirs!r} has no layer: add it to LAYERS "
                 "in tests/test_layering.py (and say in its __init__ what it may import)")
    elif LAYERS[theirs] > LAYERS[mine]:
      out.append(f"{i.path}:{i.line}: {i.module} (layer {LAYERS[mine]}, {mine}) imports "
                 f"{i.target} (layer {LAYERS[theirs]}, {theirs}): a module may import only its "
                 "own package or packages below it; move what it needs down")
  return out


def cycles(found: list[Import]) -> list[tuple[list[str], list[Import]]]:
  """Each group of modules that import each other, directly or through others (Tarjan's
  strongly connected components), with one import cycle in it (as the imports that make it)."""
  edges: dict[str, dict[str, Import]] = {}
  for i in found:
    if i.target != i.module and i.target != TOP:
      edges.setdefault(i.module, {}).setdefault(i.target, i)
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on: set[str] = set()
  groups: list[set[str]] = []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in edges.get(v, {}):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      group = set()
      while True:
        w = stack.pop()
        on.discard(w)
        group.add(w)
        if w == v:
          break
      if len(group) > 1:
        groups.append(group)

  for v in sorted(edges):
    if v not in index:
      visit(v)
  return [(sorted(g), _cycle_in(sorted(g)[0], g, edges)) for g in groups]


def _cycle_in(start: str, group: set[str], edges: dict[str, dict[str, Import]]) -> list[Import]:
  """The shortest cycle through ``start`` inside ``group`` (breadth first)."""
  paths = {start: []}
  todo = [start]
  while todo:
    v = todo.pop(0)
    for w, imp in sorted(edges.get(v, {}).items()):
      if w == start:
        return paths[v] + [imp]
      if w in group and w not in paths:
        paths[w] = paths[v] + [imp]
        todo.append(w)
  raise AssertionError("a strongly connected group without a cycle")


def describe(group: list[str], cycle: list[Import]) -> str:
  chain = " -> ".join([cycle[0].module] + [i.target for i in cycle])
  lines = "; ".join(f"{i.path}:{i.line} ({i.module} imports {i.target})" for i in cycle)
  return (f"import cycle {chain} [{lines}] (modules that import each other: "
          f"{', '.join(group)}): no module may import another that imports it, even through "
          "others (function-local imports too); move the shared part into a lower module both "
          "import")


def public_problems(found: list[Import]) -> list[str]:
  return [f"{i.path}:{i.line}: {i.module} imports the public package fnckpt itself: internal "
          "modules import the module that defines what they need (e.g. "
          "from .._restore.restore import restore; __version__ from fnckpt._version)"
          for i in found if i.binds_top and i.module not in ENTRY]


def scan(root: pathlib.Path = ROOT) -> list[Import]:
  mods = modules(root)
  found = []
  for name, p in mods.items():
    rel = p.relative_to(root.parent).as_posix()
    found += imports(name, p.read_text(), rel, set(mods))
  return found


def test_the_scan_sees_every_module_and_import():
  mods = modules()
  assert f"{TOP}._save.save" in mods and f"{TOP}.cli" in mods
  unknown = [m for m in mods if m not in ENTRY and package(m) not in LAYERS]
  assert not unknown, f"{unknown}: put each module in a package of LAYERS (tests/test_layering.py)"
  found = scan()
  targets = {(i.module, i.target) for i in found}
  assert (f"{TOP}._save.save", f"{TOP}._io.arrays") in targets
  assert len(found) > 150


def test_no_module_imports_a_higher_layer():
  problems = layer_problems(scan())
  assert not problems, "\n" + "\n".join(problems)


def test_no_import_cycles():
  found = cycles(scan())
  assert not found, "\n" + "\n".join(describe(g, c) for g, c in found)


def test_internal_modules_never_import_the_public_package():
  problems = public_problems(scan())
  assert not problems, "\n" + "\n".join(problems)


def test_every_package_says_what_it_owns_and_may_import():
  for name, p in modules().items():
    if p.name == "__init__.py" and name != TOP and package(name) != "cli":
      doc = ast.get_docstring(ast.parse(p.read_text())) or ""
      assert "May import" in doc, f"{p}: its docstring must say what the package owns and " \
          "which packages it may import"
      assert f"Layer {LAYERS[package(name)]}," in doc, f"{p}: its docstring names another layer"


# --- the checks catch what they are for ----------------------------------------------------

def _fake(sources: dict[str, str]) -> list[Import]:
  known = set(sources) | {TOP}
  return [i for name, src in sources.items()
          for i in imports(name, src, name.replace(".", "/") + ".py", known)]


@pytest.mark.parametrize("source", [
    "from .._save import save\n",                          # a module of a higher package
    "def f():\n  from .._save.save import start\n",        # inside a function
    "if True:\n  import fnckpt._save.save as s\n",         # absolute, inside an if block
])
def test_an_upward_import_is_named_with_its_line(source):
  found = _fake({f"{TOP}._io.paths": source, f"{TOP}._save.save": ""})
  (problem,) = layer_problems(found)
  assert problem.startswith(f"{TOP}/_io/paths.py:{source.count(chr(10))}: ")
  assert "(layer 3, _io) imports fnckpt._save.save (layer 6, _save)" in problem


def test_a_cycle_through_a_function_local_import_is_named():
  found = _fake({f"{TOP}._format.a": "from . import b\n",
                 f"{TOP}._format.b": "def f():\n  from .c import x\n",
                 f"{TOP}._format.c": "from .a import y\n"})
  ((group, cycle),) = cycles(found)
  text = describe(group, cycle)
  assert "fnckpt._format.a -> fnckpt._format.b -> fnckpt._format.c -> fnckpt._format.a" in text
  assert "fnckpt/_format/b.py:2" in text


@pytest.mark.parametrize("source", ["import fnckpt\n", "from fnckpt import restore\n",
                                    "from .. import __version__\n",
                                    "def f():\n  import fnckpt._io.paths\n"])
def test_importing_the_public_package_is_named(source):
  found = _fake({f"{TOP}._manager.steps": source, f"{TOP}._io.paths": ""})
  (problem,) = public_problems(found)
  assert problem.startswith(f"{TOP}/_manager/steps.py:")
  assert "imports the public package fnckpt itself" in problem
  assert not public_problems(_fake({f"{TOP}._manager.steps": "from .. import _errors\n",
                                    f"{TOP}._errors": ""}))
