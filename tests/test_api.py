"""The public namespace is the contract: ``fnckpt.__all__`` is exactly the public names, each
documented; every module's docstring examples run; importing fnckpt has no side effects."""

import doctest
import importlib
import inspect
import os
import pkgutil
import subprocess
import sys
import tempfile
import types

import pytest

import fnckpt

# every module and subpackage, by its name under fnckpt (e.g. "_save.save", "cli")
MODULES = sorted(m.name[len("fnckpt."):] for m in pkgutil.walk_packages(fnckpt.__path__, "fnckpt.")
                 if m.name != "fnckpt.__main__")  # __main__ runs the CLI when imported


@pytest.mark.parametrize("name", ["fnckpt", *(f"fnckpt.{m}" for m in MODULES)])
def test_doctests(name, tmp_path, monkeypatch):
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # examples use tempfile.mkdtemp()
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                           verbose=False, report=True)
  assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_the_core_modules_have_examples():
  for name in ("_format.tree", "_format.manifest", "_layout.chunks", "_format.leaves",
               "_io.paths", "_save.save", "_restore.restore"):
    module = importlib.import_module(f"fnckpt.{name}")
    examples = sum(len(t.examples) for t in doctest.DocTestFinder().find(module))
    assert examples > 0, name


def _public_names(module):
  return {n for n, v in vars(module).items()
          if not n.startswith("_") and not isinstance(v, types.ModuleType)}


def test_all_is_exactly_the_public_names():
  assert len(fnckpt.__all__) == len(set(fnckpt.__all__)), "duplicates in fnckpt.__all__"
  assert set(fnckpt.__all__) == _public_names(fnckpt)
  for core in ("save", "restore", "metadata", "wait", "SaveHandle", "SaveStats",
               "CheckpointMetadata", "ArrayMetadata", "SavedSharding", "CheckpointError",
               "TreeMismatchError", "NotCommittedError", "BarrierTimeoutError"):
    assert core in fnckpt.__all__
  assert len(fnckpt.__all__) <= 19, "keep the public namespace near a dozen names"


@pytest.mark.parametrize("name", fnckpt.__all__)
def test_every_public_name_is_documented(name):
  obj = getattr(fnckpt, name)
  doc = inspect.getdoc(obj)
  assert doc and len(doc.split()) >= 3, f"fnckpt.{name} has no real docstring"
  if inspect.isclass(obj):
    for attr, member in vars(obj).items():
      if not attr.startswith("_") and (inspect.isfunction(member) or isinstance(member, property)):
        assert inspect.getdoc(member), f"fnckpt.{name}.{attr} has no docstring"


def test_errors_form_one_hierarchy():
  for name in ("TreeMismatchError", "NotCommittedError", "BarrierTimeoutError"):
    assert issubclass(getattr(fnckpt, name), fnckpt.CheckpointError)
  assert issubclass(fnckpt.TreeMismatchError, ValueError)
  assert issubclass(fnckpt.BarrierTimeoutError, TimeoutError)


@pytest.mark.parametrize("name", MODULES)
def test_module_all_names_exist(name):
  module = importlib.import_module(f"fnckpt.{name}")
  for n in getattr(module, "__all__", ()):
    assert hasattr(module, n), f"fnckpt.{name}.__all__ names {n!r}, which does not exist"


def test_import_has_no_side_effects():
  code = (
      "import threading, sys\n"
      "before = threading.active_count()\n"
      "import fnckpt\n"
      "from fnckpt import _state\n"
      "assert threading.active_count() == before, 'threads started at import'\n"
      "assert _state.storage.root is None, 'a TensorStore context was created at import'\n"
      "assert _state.saves.budget is None and not _state.saves.pending\n"
      "assert not _state.saves.exit_registered, 'an exit handler was registered at import'\n"
      "print('ok')\n")
  here = os.path.dirname(os.path.dirname(fnckpt.__file__))  # the fnckpt under test
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": here},
                       timeout=120)
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_no_pickle_and_no_private_jax_imports_in_the_package():
  import pathlib
  root = pathlib.Path(fnckpt.__file__).parent
  for path in root.rglob("*.py"):
    text = path.read_text()
    name = path.relative_to(root).as_posix()
    assert "import pickle" not in text and "cloudpickle" not in text, name
    if "jax._src" in text:
      # the one allowed: the coordination client has no public accessor
      assert name == "_io/commit.py", f"{name} imports jax._src"


def test_fnckpt_checkpoints_named_like_foreign_files_still_open(tmp_path):
  """A fnckpt checkpoint directory named ``model.safetensors`` or ``run.json`` is fnckpt's
  (its reader is tried first, whatever the name)."""
  import numpy as np
  for name in ("model.safetensors", "run.json"):
    path = str(tmp_path / name)
    fnckpt.save({"w": np.arange(4.0)}, path).wait()
    assert fnckpt.metadata(path).format == "fnckpt"
    assert fnckpt.restore(path)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_an_interrupted_save_is_never_read_as_a_stray_foreign_file(tmp_path):
  """An uncommitted fnckpt save holding a *.safetensors file (or a model index, or Orbax's
  _METADATA) stays an interrupted save: NotCommittedError, never that file's contents; and a
  committed one whose manifest is gone stays a damaged fnckpt checkpoint."""
  import json
  import os
  import struct
  import numpy as np
  path = str(tmp_path / "c")
  fnckpt.save({"w": np.arange(4096.0)}, path).wait()
  header = json.dumps({"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}).encode()
  with open(os.path.join(path, "extra.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(header)) + header + b"q")
  os.rename(os.path.join(path, "manifest.msgpack"), str(tmp_path / "manifest.msgpack"))
  with pytest.raises(fnckpt.CheckpointError, match=r"does not match its commit marker"):
    fnckpt.restore(path)
  os.rename(str(tmp_path / "manifest.msgpack"), os.path.join(path, "manifest.msgpack"))
  os.remove(os.path.join(path, "COMMIT"))
  for extra in ("", "_METADATA"):
    if extra:
      with open(os.path.join(path, extra), "w") as f:
        f.write("{}")
    for call in (fnckpt.restore, fnckpt.metadata):
      with pytest.raises(fnckpt.NotCommittedError, match=r"c' holds an interrupted save"):
        call(path)
