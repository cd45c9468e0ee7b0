"""The package's version (``fnckpt.__version__``, written into every manifest) and the lowest
versions of its dependencies that it runs on.

``pyproject.toml`` reads ``__version__`` from here, and its ``dependencies`` floors equal
:data:`MINIMUM` (``tests/test_release.py`` holds them together). ``import fnckpt`` calls
:func:`check` first, so an environment older than the floor fails at once, with one message
naming what is installed and what is needed, instead of an ``ImportError`` deep inside.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Callable, Mapping

__version__ = "0.3.0"

# The floors CI tests (.ci/run's floor run); below each, the suite fails. jax/jaxlib 0.9.0:
# jax.make_mesh's axes are Explicit by default (0.8.x: Auto, and a DeprecationWarning from every
# make_mesh; 0.8.0 also lacks jax.sharding.get_mesh, < 0.6.2 jax.experimental.layout.Format,
# which fnckpt imports). numpy 2.0: jax's own floor. tensorstore 0.1.86: S3 accepts
# max_retries=0 (0.1.85 refuses it; < 0.1.81 KvStore.read takes no byte_range).
MINIMUM: dict[str, str] = {
  "jax": "0.9.0",
  "jaxlib": "0.9.0",
  "numpy": "2.0",
  "tensorstore": "0.1.86",
  "msgpack": "1.0",
  "xxhash": "3.0",
  "crc32c": "2.3",
}


def parse(version: str) -> tuple[int, ...]:
  """The leading release numbers of a version string (pre-release and local parts dropped).

  >>> parse("0.12.0.1"), parse("0.8.1.dev20251010+cuda12"), parse("2.0.0rc1")
  ((0, 12, 0, 1), (0, 8, 1), (2, 0, 0))
  """
  match = re.match(r"\d+(\.\d+)*", version.strip())
  return tuple(int(n) for n in match.group(0).split(".")) if match else ()


def too_old(installed: Mapping[str, str | None], minimum: Mapping[str, str] = MINIMUM) -> list[str]:
  """``"name installed (needs >= floor)"`` for each installed package below its floor (a
  package whose version is unknown, None, is not judged).

  >>> too_old({"jax": "0.5.0", "jaxlib": "0.5.0", "numpy": "2.1.0", "xxhash": None})
  ['jax 0.5.0 (needs >= 0.9.0)', 'jaxlib 0.5.0 (needs >= 0.9.0)']
  """
  return [
    f"{name} {have} (needs >= {minimum[name]})"
    for name, have in installed.items()
    if have is not None and name in minimum and parse(have) < parse(minimum[name])
  ]


def _installed(name: str) -> str | None:
  if name == "jax":  # what is imported, even where the metadata lies (a source checkout)
    import jax

    return jax.__version__
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def check(installed: Callable[[str], str | None] = _installed) -> None:
  """Raise an ``ImportError`` naming every dependency older than :data:`MINIMUM` and the fix.

  >>> check()  # this environment meets the floors
  >>> check(lambda name: "0.5.0" if name.startswith("jax") else None)
  Traceback (most recent call last):
  ...
  ImportError: fnckpt 0.3.0 needs newer versions of: jax 0.5.0 (needs >= 0.9.0), jaxlib 0.5.0 \
(needs >= 0.9.0). Upgrade them: pip install -U "jax>=0.9.0" "jaxlib>=0.9.0"
  """
  old = too_old({name: installed(name) for name in MINIMUM})
  if old:
    names = [entry.split(" ", 1)[0] for entry in old]
    fix = " ".join(f'"{name}>={MINIMUM[name]}"' for name in names)
    raise ImportError(
      f"fnckpt {__version__} needs newer versions of: {', '.join(old)}. "
      f"Upgrade them: pip install -U {fix}"
    )
