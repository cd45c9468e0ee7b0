"""``fnckpt export CKPT OUT``: a checkpoint's arrays as safetensors, or (``--format orbax``)
its tree as an Orbax PyTree checkpoint (``fnckpt._export``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from .._errors import CheckpointError
from .._export.to_orbax import export_orbax
from .._export.to_safetensors import export_safetensors
from .text import compact, human

__all__ = ["run", "renames"]


def renames(pairs: Sequence[str] | None) -> dict[str, str]:
  """``--rename OLD=NEW`` pairs as export_safetensors' ``rename``.

  >>> renames(["params=model", "head.out=lm_head"])
  {'params': 'model', 'head.out': 'lm_head'}
  """
  out = {}
  for pair in pairs or ():
    old, eq, new = pair.partition("=")
    if not eq or not old.strip("."):
      raise CheckpointError(
        f"--rename {pair!r}: expected OLD=NEW, e.g. --rename "
        "params=model (NEW may be empty to drop OLD)."
      )
    out[old] = new
  return out


_SAFETENSORS_ONLY = ("select", "dtype", "prefix", "rename", "max_shard_size")


def run(args: argparse.Namespace) -> int:
  if args.format == "orbax":
    return _run_orbax(args)
  r = export_safetensors(
    args.checkpoint,
    args.out,
    select=args.select,
    dtype=args.dtype,
    prefix=args.prefix,
    rename=renames(args.rename),
    max_shard_size=args.max_shard_size,
    overwrite=args.overwrite,
    storage_options=args.storage_options,
  )
  for line in r.skipped:
    print(f"note: skipped {line}", file=sys.stderr)
  rate = r.bytes / r.seconds / 1e6 if r.seconds > 0 else 0.0
  extra = {k: v for k, v in r.metadata.items() if k != "format"}
  print(
    f"wrote {r.tensors} tensor(s), {human(r.bytes)}, to {r.out} in {r.seconds:.2f} s "
    f"({rate:.0f} MB/s)"
    + (
      f"; {len(r.files) - 1} shard(s) and model.safetensors.index.json" if len(r.files) > 1 else ""
    )
  )
  if extra:
    print(f"__metadata__: {compact(json.dumps(extra), -200)}")
  return 0


def _run_orbax(args: argparse.Namespace) -> int:
  given = [n for n in _SAFETENSORS_ONLY if getattr(args, n, None)]
  if given:
    flag = "--" + given[0].replace("_", "-")
    raise CheckpointError(
      f"{flag} applies to --format safetensors; --format orbax exports the whole tree as "
      "it is. Drop it, or export to safetensors."
    )
  r = export_orbax(
    args.checkpoint, args.out, overwrite=args.overwrite, storage_options=args.storage_options
  )
  rate = r.bytes / r.seconds / 1e6 if r.seconds > 0 else 0.0
  print(
    f"wrote an Orbax checkpoint of {r.arrays} array(s), {human(r.bytes)}, to {r.out} in "
    f"{r.seconds:.2f} s ({rate:.0f} MB/s)"
  )
  return 0
