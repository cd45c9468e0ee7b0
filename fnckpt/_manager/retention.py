"""PURE: which checkpoint steps to keep. Data in, data out; no files, no clocks.

The kept set is a union of rules, each given as an argument (``None`` switches a rule off):

- ``max_to_keep=k``: the ``k`` newest steps;
- ``keep_every=m``: every step divisible by ``m`` (kept forever, e.g. for evaluation);
- ``best_n=n``: the ``n`` steps with the best value of ``metrics[step]`` (``best_mode``
  ``"min"`` or ``"max"``); steps without a numeric value (or with NaN) are never "best";
  ties go to the newer step;
- always: the newest step and every step in ``protect`` (saves in flight).

With no rule at all, every step is kept.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping

__all__ = ["Policy", "keep", "to_delete"]


@dataclasses.dataclass(frozen=True)
class Policy:
  """A retention policy (see the module docstring); validated on construction.

  >>> Policy(max_to_keep=2, keep_every=10)
  Policy(max_to_keep=2, keep_every=10, best_n=None, best_mode='min')
  """

  max_to_keep: int | None = None
  keep_every: int | None = None
  best_n: int | None = None
  best_mode: str = "min"

  def __post_init__(self):
    for name, low in (("max_to_keep", 0), ("keep_every", 1), ("best_n", 0)):
      v = getattr(self, name)
      if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < low):
        raise ValueError(f"{name} must be None or an int >= {low}, got {v!r}.")
    if self.best_mode not in ("min", "max"):
      raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}.")

  @property
  def keeps_all(self) -> bool:
    return self.max_to_keep is None and self.keep_every is None and self.best_n is None


def _number(value: Any) -> float | None:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return None
  value = float(value)
  return None if math.isnan(value) else value


def keep(
  steps: Iterable[int],
  policy: Policy,
  metrics: Mapping[int, Any] | None = None,
  protect: Iterable[int] = (),
) -> set[int]:
  """The steps of ``steps`` that ``policy`` keeps (plus ``protect``, even if not in ``steps``).

  ``metrics[step]`` is the value the ``best_n`` rule ranks (a number; anything else, or a
  missing entry, is not ranked).

  >>> sorted(keep(range(10), Policy(max_to_keep=2, keep_every=4)))
  [0, 4, 8, 9]
  >>> sorted(keep([1, 2, 3, 4], Policy(best_n=1), {1: 0.5, 2: 0.1, 3: 0.9}))
  [2, 4]
  >>> sorted(keep([1, 2, 3], Policy(max_to_keep=0), protect=[7]))
  [3, 7]
  """
  steps = sorted(set(int(s) for s in steps))
  kept = set(int(s) for s in protect)
  if not steps:
    return kept
  if policy.keeps_all:
    return kept | set(steps)
  kept.add(steps[-1])
  if policy.max_to_keep:
    kept.update(steps[-policy.max_to_keep :])
  if policy.keep_every:
    kept.update(s for s in steps if s % policy.keep_every == 0)
  if policy.best_n:
    metrics = metrics or {}
    ranked = [(v, s) for s in steps if (v := _number(metrics.get(s))) is not None]
    sign = 1.0 if policy.best_mode == "min" else -1.0
    ranked.sort(key=lambda vs: (sign * vs[0], -vs[1]))  # best first; ties: newer first
    kept.update(s for _, s in ranked[: policy.best_n])
  return kept


def to_delete(
  steps: Iterable[int],
  policy: Policy,
  metrics: Mapping[int, Any] | None = None,
  protect: Iterable[int] = (),
) -> list[int]:
  """The steps of ``steps`` that ``policy`` does not keep, oldest first.

  >>> to_delete([10, 20, 30, 40], Policy(max_to_keep=2))
  [10, 20]
  >>> to_delete([10, 20, 30, 40], Policy(max_to_keep=1, best_n=1, best_mode="max"),
  ...           {10: 3.0, 20: 1.0, 30: 2.0, 40: 0.0})
  [20, 30]
  """
  steps = sorted(set(int(s) for s in steps))
  kept = keep(steps, policy, metrics, protect)
  return [s for s in steps if s not in kept]
