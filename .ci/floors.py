"""Print pyproject.toml's dependency floors as pins (``name==floor``), one a line: the
constraints of CI's floor run (.ci/run). tests/test_release.py keeps these floors equal to what
``import fnckpt`` checks (fnckpt/_version.py MINIMUM)."""

import pathlib
import re
import tomllib

root = pathlib.Path(__file__).resolve().parent.parent
for dep in tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]:
  m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)", dep.strip())
  if not m:
    raise SystemExit(f"pyproject.toml dependency {dep!r}: expected 'name>=floor'")
  print(f"{m.group(1)}=={m.group(2)}")
