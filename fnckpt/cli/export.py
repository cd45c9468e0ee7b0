"""``fnckpt export CKPT OUT``: a checkpoint's arrays as safetensors (``fnckpt._export``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from .._errors import CheckpointError
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


def run(args: argparse.Namespace) -> int:
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
