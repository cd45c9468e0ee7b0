"""The ``fnckpt`` command: look at (and export) checkpoints without devices or user code.

    fnckpt ls DIR            steps under a CheckpointManager directory (or one checkpoint)
    fnckpt inspect PATH      the saved tree: key path, kind, dtype, shape, sharding, bytes
    fnckpt verify PATH       read every chunk, check every checksum (PATH may be a run DIR)
    fnckpt diff A B          key paths added / removed / changed; --values compares the data
    fnckpt export CKPT OUT   the arrays as safetensors (OUT.safetensors, or a directory of shards)
                             or, with --format orbax, the tree as an Orbax checkpoint
    fnckpt --version         fnckpt's version, and JAX's, TensorStore's and Python's

Exit status: 0 all is well; 1 damage found (verify), differences found (diff) or nothing to
list (ls); 2 a usage error or a location that cannot be read.

Only the manifest, the commit marker, the zarr3 chunks and the ``pp/<process>`` files of
``fnckpt.PerProcess`` values are read (through TensorStore), so any location fnckpt writes
works: local paths, ``memory://`` (same process only), ``gs://``, ``s3://``. No JAX backend
is started. ``export`` writes local files only (``fnckpt._export``).
``--storage-option KEY=VALUE`` (repeatable, before or after the command) sets the
``storage_options`` of fnckpt.save/restore for every location the command reads; a checkpoint
is opened as restore opens it (``fnckpt._sources.source.open_source``) and its arrays read
through the reader restore uses (``fnckpt._sources.read``: its read window and context).

One module per command (``ls``, ``inspect``, ``verify``, ``diff``, ``export``), each with
``run(args)``; ``text`` writes sizes, tables and causes; here: the parser and :func:`main`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Sequence

from .._errors import CheckpointError
from .._io import paths as _paths
from .._version import __version__
from . import diff as _diff
from . import export as _export
from . import inspect as _inspect
from . import ls as _ls
from . import verify as _verify

__all__ = ["main"]


def _storage_options(pairs: Sequence[str] | None) -> dict[str, Any] | None:
  """``--storage-option KEY=VALUE`` pairs as a ``storage_options`` dict (a VALUE that parses
  as JSON is taken as JSON, else as a string; a later KEY wins). None when none were given.

  >>> _storage_options(["endpoint=http://127.0.0.1:8333", "max_retries=2"])
  {'endpoint': 'http://127.0.0.1:8333', 'max_retries': 2}
  """
  if not pairs:
    return None
  options: dict[str, Any] = {}
  for pair in pairs:
    key, eq, text = pair.partition("=")
    if not eq or not key.strip():
      raise CheckpointError(
        f"--storage-option {pair!r}: expected KEY=VALUE, found "
        f"{'no KEY before' if eq else 'no'} '='. Write e.g. --storage-option "
        "endpoint=http://127.0.0.1:8333 or --storage-option max_retries=2."
      )
    try:
      value = json.loads(text)
    except ValueError:
      value = text
    options[key.strip()] = value
  return options


def _check_storage_options(locations: Sequence[str], options: dict[str, Any] | None) -> None:
  """Each location the command was given, checked with ``options`` by the code that save and
  restore use (``_paths.kvstore_spec``; no I/O), before anything is read. An error that the
  options cause (an unknown key, a bad value, options for a local path) names
  ``--storage-option``; one of the location itself (a bad URL) does not."""
  for path in locations:
    try:
      _paths.kvstore_spec(path, options)
    except CheckpointError as e:
      if not options:
        raise
      try:
        _paths.kvstore_spec(path)
      except CheckpointError:
        raise e from None
      raise CheckpointError(f"--storage-option: {e}") from None


_STORAGE_OPTION_HELP = (
  "a storage option for every location the command reads (the storage_options of "
  "fnckpt.save/restore: endpoint, region, credentials, max_retries, ...); VALUE is JSON if "
  "it parses, else a string; repeat it for several, e.g. --storage-option "
  "endpoint=http://127.0.0.1:8333 --storage-option max_retries=2"
)


def _add_storage_option(p: argparse.ArgumentParser, dest: str) -> None:
  p.add_argument(
    "--storage-option", action="append", dest=dest, metavar="KEY=VALUE", help=_STORAGE_OPTION_HELP
  )


def _version_text() -> str:
  """``fnckpt --version``: this fnckpt, and what it runs on (for bug reports).

  >>> _version_text()  # doctest: +ELLIPSIS
  'fnckpt ... (jax ..., jaxlib ..., tensorstore ..., Python ...)'
  """
  import importlib.metadata
  import platform

  def version(name: str) -> str:
    try:
      return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      return "?"

  deps = ", ".join(f"{n} {version(n)}" for n in ("jax", "jaxlib", "tensorstore"))
  return f"fnckpt {__version__} ({deps}, Python {platform.python_version()})"


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    prog="fnckpt",
    description="Inspect, check and export fnckpt checkpoints (no devices needed).",
    epilog="Exit status: 0 ok; 1 damage (verify), differences (diff) or nothing to list "
    "(ls); 2 usage error or unreadable location.",
  )
  p.add_argument(
    "--version",
    action="version",
    version=_version_text(),
    help="print fnckpt's version (and JAX's, TensorStore's, Python's) and exit",
  )
  # Accepted before and after the command; two dests, since a subparser's value would replace
  # the main parser's.
  _add_storage_option(p, "storage_option_pairs")
  common = argparse.ArgumentParser(add_help=False)
  _add_storage_option(common, "storage_option_pairs_after")
  sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
  ls = sub.add_parser(
    "ls",
    parents=[common],
    help="list the steps of a run directory",
    description="Committed steps (uncommitted leftovers, steps marked "
    "damaged) of a CheckpointManager directory: data size, leaves, files, "
    "commit time, metrics; with --local, of both tiers.",
  )
  ls.add_argument("dir")
  ls.add_argument(
    "--local",
    metavar="FAST",
    default=None,
    help="also list the manager's local tier (local_directory); "
    "--storage-option settings apply to DIR only",
  )
  ls.set_defaults(run=_ls.run, locations=("dir",))
  ins = sub.add_parser(
    "inspect",
    parents=[common],
    help="show the saved tree of one checkpoint",
    description="Key path, kind, dtype, shape, saved sharding, bytes and "
    "inline values of every leaf.",
  )
  ins.add_argument("path")
  ins.set_defaults(run=_inspect.run, locations=("path",))
  ver = sub.add_parser(
    "verify",
    parents=[common],
    help="read every chunk and check its checksum",
    description="Read every chunk of a checkpoint (or of every committed "
    "step of a run directory), checking crc32c checksums; exit 1 naming "
    "each damaged leaf.",
  )
  ver.add_argument("path")
  ver.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
  ver.set_defaults(run=_verify.run, locations=("path",))
  dif = sub.add_parser(
    "diff",
    parents=[common],
    help="compare two checkpoints",
    description="Key paths only in A (-), only in B (+), changed in kind, "
    "dtype or shape (~); with --values, leaves whose values differ (!). "
    "Exit 1 when they differ.",
  )
  dif.add_argument("a")
  dif.add_argument("b")
  dif.add_argument("--values", action="store_true", help="also compare the data, bitwise")
  dif.set_defaults(run=_diff.run, locations=("a", "b"))
  _add_export(sub, common)
  return p


def _add_export(sub: Any, common: argparse.ArgumentParser) -> None:
  exp = sub.add_parser(
    "export",
    parents=[common],
    help="write the arrays as safetensors (or the tree as an Orbax checkpoint)",
    description="Write a checkpoint's arrays as safetensors, streamed in "
    "a bounded window: OUT ending in .safetensors is one file, anything "
    "else a directory of model-0000i-of-0000N.safetensors shards with "
    "model.safetensors.index.json. Names are key paths joined with '.'. "
    "With --format orbax: the whole tree as an Orbax PyTree checkpoint in the "
    "directory OUT (what orbax-checkpoint's StandardCheckpointer restores).",
  )
  exp.add_argument("checkpoint")
  exp.add_argument("out")
  exp.add_argument(
    "--format",
    choices=("safetensors", "orbax"),
    default="safetensors",
    help="safetensors (default) or orbax",
  )
  exp.add_argument(
    "--select",
    help="export this subtree only (e.g. params, params.dense); names are relative to it",
  )
  exp.add_argument("--dtype", help="convert floating-point arrays (e.g. bfloat16)")
  exp.add_argument("--prefix", help="prepend to every name (e.g. model)")
  exp.add_argument(
    "--rename",
    action="append",
    metavar="OLD=NEW",
    help="replace the key prefix OLD of names by NEW (repeatable)",
  )
  exp.add_argument(
    "--max-shard-size",
    default=None,
    metavar="SIZE",
    help="largest shard of a directory OUT (default 5GB; e.g. 500MB, 2GiB)",
  )
  exp.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
  exp.set_defaults(run=_export.run, locations=("checkpoint",))


def main(argv: Sequence[str] | None = None) -> int:
  """Run the ``fnckpt`` command line; return its exit status.

  >>> import numpy as np, fnckpt, fnckpt.cli, tempfile
  >>> d = tempfile.mkdtemp()
  >>> _ = fnckpt.save({"w": np.arange(4.0)}, f"{d}/c").wait()
  >>> fnckpt.cli.main(["verify", "--quiet", f"{d}/c"])  # doctest: +ELLIPSIS
  OK .../c
  0
  """
  args = _parser().parse_args(argv)
  try:
    args.storage_options = _storage_options(
      (args.storage_option_pairs or []) + (args.storage_option_pairs_after or [])
    )
    _check_storage_options([getattr(args, n) for n in args.locations], args.storage_options)
    code = args.run(args)
    sys.stdout.flush()
    return code
  except BrokenPipeError:  # `fnckpt inspect X | head -1`: the reader has gone; so do we
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
    return 0
  except (CheckpointError, OSError, ValueError) as e:  # TensorStore I/O errors are ValueErrors
    text = " | ".join(line.strip() for line in str(e).splitlines() if line.strip())
    print(f"fnckpt {args.command}: error: {text}", file=sys.stderr)
    return 2
