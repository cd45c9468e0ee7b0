"""The release artifact and the versions it claims: the wheel (typed, installable on its own),
``fnckpt --version``, and the dependency floors that ``import fnckpt`` enforces."""

import os
import pathlib
import re
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile

import pytest

import fnckpt
from fnckpt import _version

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _floors() -> dict[str, str]:
  """``name -> floor`` of pyproject.toml's ``dependencies`` (each written ``name>=floor``)."""
  deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
  floors = {}
  for dep in deps:
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)", dep.strip())
    assert m, f"pyproject.toml dependency {dep!r}: expected 'name>=floor'"
    floors[m.group(1)] = m.group(2)
  return floors


def test_pyproject_floors_are_the_ones_import_checks():
  assert _floors() == _version.MINIMUM


def test_the_version_has_one_source():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())
  assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
  assert project["tool"]["setuptools"]["dynamic"]["version"] == {
      "attr": "fnckpt._version.__version__"}
  assert re.fullmatch(r"\d+\.\d+\.\d+", fnckpt.__version__)


def test_the_changelog_records_this_version_and_every_format():
  text = (ROOT / "CHANGELOG.md").read_text()
  assert f"## [{fnckpt.__version__}]" in text
  for version in (1, 2, 3):
    assert re.search(rf"format {version}\b", text, re.IGNORECASE), version


def _run(args, **kw):
  return subprocess.run(args, capture_output=True, text=True, timeout=300, **kw)


def test_an_older_jax_is_refused_at_import_with_both_versions_and_the_fix():
  code = "import jax; jax.__version__ = '0.5.0'; import fnckpt"
  r = _run([sys.executable, "-c", code], env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 1
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("ImportError: fnckpt ") and fnckpt.__version__ in last
  assert "jax 0.5.0 (needs >= 0.9.0)" in last and 'pip install -U "jax>=0.9.0"' in last


def test_versions_below_the_floor_are_named_and_others_are_not():
  assert _version.too_old({"jax": "0.8.1", "numpy": "1.26.4", "tensorstore": "0.1.86",
                           "jaxlib": "0.12.0.1", "xxhash": None}) == [
      "jax 0.8.1 (needs >= 0.9.0)", "numpy 1.26.4 (needs >= 2.0)"]
  assert _version.too_old({"jax": "0.9.0rc1", "numpy": "2.0.0.dev0+git"}) == []


def test_cli_version_is_the_package_version():
  r = _run([sys.executable, "-m", "fnckpt", "--version"])
  assert r.returncode == 0, r.stderr
  assert r.stdout.startswith(f"fnckpt {fnckpt.__version__} (jax ")


@pytest.mark.slow
def test_the_wheel_is_typed_and_works_installed_on_its_own(tmp_path):
  """``pip wheel .``, then that wheel (not the checkout) in a fresh venv: saves, restores and
  reports the same version. The venv sees this environment's dependencies after its own
  packages, so only the build's setuptools comes from the registry."""
  # The venv's own view: no PYTHONPATH (a source tree there, with its egg-info, would make pip
  # take fnckpt as installed already and skip the wheel).
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"JAX_PLATFORMS": "cpu"}
  env_dir = tmp_path / "venv"  # its own pip (ensurepip): the outer env may have none (uv)
  venv.create(env_dir, with_pip=True)
  py, cli = env_dir / "bin" / "python", env_dir / "bin" / "fnckpt"
  # This environment's packages after the venv's own (a .pth line is a plain sys.path entry:
  # the editable install's hook there is not run, so fnckpt can only come from the wheel).
  site = env_dir / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / \
      "site-packages"
  outer = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
  (site / "outer-env.pth").write_text("".join(f"{p}\n" for p in outer))
  build = _run([str(py), "-m", "pip", "wheel", str(ROOT), "--no-deps",
                "-w", str(tmp_path / "dist")], env=env)
  assert build.returncode == 0, build.stdout + build.stderr
  (wheel,) = (tmp_path / "dist").glob("fnckpt-*.whl")
  assert wheel.name.startswith(f"fnckpt-{fnckpt.__version__}-py3-none-any")
  with zipfile.ZipFile(wheel) as z:
    names = z.namelist()
    meta = z.read(f"fnckpt-{fnckpt.__version__}.dist-info/METADATA").decode()
  assert "fnckpt/py.typed" in names and "fnckpt/_version.py" in names
  assert not [n for n in names if n.startswith(("tests/", "bench/", "examples/"))]
  assert f"Version: {fnckpt.__version__}\n" in meta
  for name, floor in _version.MINIMUM.items():
    assert f"Requires-Dist: {name}>={floor}" in meta, name

  inst = _run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
              env=env)
  assert inst.returncode == 0, inst.stdout + inst.stderr
  script = """
import os, sys, numpy as np, fnckpt
assert fnckpt.__file__.startswith(sys.prefix), fnckpt.__file__  # the wheel, not the checkout
tree = {"w": np.arange(12.0).reshape(3, 4), "step": 3, "big": np.arange(300_000, dtype=np.int32)}
fnckpt.save(tree, os.path.abspath("ckpt")).wait()
back = fnckpt.restore(os.path.abspath("ckpt"), tree)
assert back["step"] == 3 and all(np.array_equal(back[k], tree[k]) for k in ("w", "big"))
print(fnckpt.__version__)
"""
  r = _run([str(py), "-c", script], cwd=tmp_path, env=env)
  assert r.returncode == 0, r.stdout + r.stderr
  assert r.stdout.strip() == fnckpt.__version__
  v = _run([str(cli), "--version"], cwd=tmp_path, env=env)
  assert v.returncode == 0 and v.stdout.startswith(f"fnckpt {fnckpt.__version__} "), v.stderr
  ok = _run([str(cli), "verify", "--quiet", str(tmp_path / "ckpt")], cwd=tmp_path, env=env)
  assert ok.returncode == 0, ok.stdout + ok.stderr
