"""Restore targets' shardings made placeable, or refused with the key path and the fix.

Today's JAX hands restore targets whose shardings cannot be placed as they stand:
``jax.eval_shape`` of a state on a mesh from ``jax.make_mesh`` (Explicit axes by default) and
``nnx.eval_shape`` give ``NamedSharding``s over an ``AbstractMesh`` (axis names, sizes and
types, no devices), and a ``ShapeDtypeStruct`` made with a bare ``PartitionSpec`` takes the mesh
in context. The rule (docs/concepts/saving.md "Restore targets"):

- An abstract mesh becomes the mesh in context (``jax.set_mesh(mesh)``) when one is set, which
  must have the same axis names and sizes; else the devices of this job laid out as
  ``jax.make_mesh(sizes, names)`` lays them out (the same devices in the same order as the
  mesh the state was made on, when that came from ``jax.make_mesh``). Either way the axis
  types are the abstract mesh's, so a restored array's ``.sharding`` and ``jax.typeof(x)``
  are what a jitted step on an Explicit mesh expects.
- A concrete sharding is used as given once checked: its devices belong to this job and it
  can hold an array of the saved shape.
- A memory kind other than the devices' default (``pinned_host``, ...) and a ``Format`` with a
  layout are honoured: the array is read onto device memory, then moved (one
  ``jax.device_put``).
- Anything else is a :class:`CheckpointError` naming the key path, what was given and the fix.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax.experimental.layout import Format

from .._errors import CheckpointError

AbstractMesh = jax.sharding.AbstractMesh
FIX = (
  "restore inside `with jax.set_mesh(mesh):` with the mesh the target was made for, or "
  "give this key path a concrete sharding (jax.sharding.NamedSharding(mesh, spec) of a "
  "jax.sharding.Mesh)"
)


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where one target array goes: ``sharding`` to read and place onto (device memory), and
  ``final`` (a sharding of another memory kind, or a ``Format``) to move it to after, if any."""

  sharding: jax.sharding.Sharding | None
  final: Any = None


class Resolver:
  """Target shardings resolved for one restore: each abstract mesh made concrete once."""

  def __init__(self) -> None:
    self._meshes: dict[AbstractMesh, jax.sharding.Mesh] = {}
    self._devices: frozenset | None = None
    self._placed: dict[tuple[Any, Any], Placement] = {}  # by (sharding, shape): checked once

  def leaf(self, where: str, leaf: Any, shape: tuple[int, ...] | None) -> Placement:
    """The placement for a target leaf (a ``jax.Array``, ``ShapeDtypeStruct`` or
    ``Sharding``) that will hold an array of ``shape``."""
    try:  # a ShapeDtypeStruct made with a bare PartitionSpec raises here without a mesh
      given = leaf if isinstance(leaf, jax.sharding.Sharding) else leaf.sharding
    except Exception as e:
      raise CheckpointError(
        f"{where}: the target's sharding cannot be resolved ({e}); {FIX}."
      ) from None
    if given is None:
      return Placement(None)
    fmt = getattr(leaf, "format", None) if isinstance(leaf, jax.ShapeDtypeStruct) else None
    layout = getattr(fmt, "layout", None)
    if not isinstance(given, jax.sharding.Sharding):
      raise CheckpointError(
        f"{where}: the target's sharding is {type(given).__name__} "
        f"{given!r}, not a jax.sharding.Sharding; {FIX}."
      )
    placed = self._placed.get((given, shape))
    if placed is None:
      placed = self._placed[(given, shape)] = _device_memory(self._resolve(where, given, shape))
    if layout is not None:
      placed = Placement(placed.sharding, Format(layout, placed.final or placed.sharding))
    return placed

  def _resolve(
    self, where: str, given: jax.sharding.Sharding, shape: tuple[int, ...] | None
  ) -> jax.sharding.Sharding:
    """``given`` as a sharding of this job's devices that can hold ``shape``."""
    if isinstance(given, jax.sharding.NamedSharding) and isinstance(given.mesh, AbstractMesh):
      given = jax.sharding.NamedSharding(
        self._mesh(where, given.mesh), given.spec, memory_kind=given.memory_kind
      )
    self._check_devices(where, given)
    if shape is not None:
      _check_fits(where, given, shape)
    return given

  def _mesh(self, where: str, abstract: AbstractMesh) -> jax.sharding.Mesh:
    if abstract not in self._meshes:
      self._meshes[abstract] = _concrete(where, abstract)
    return self._meshes[abstract]

  def _check_devices(self, where: str, sharding: jax.sharding.Sharding) -> None:
    if self._devices is None:
      self._devices = frozenset(jax.devices())
    try:
      devices = sharding.device_set
    except Exception as e:
      raise CheckpointError(
        f"{where}: the target's sharding {sharding} cannot be placed onto "
        f"({type(e).__name__}: {e}); {FIX}."
      ) from None
    foreign = [d for d in devices if d not in self._devices]
    if foreign:
      raise CheckpointError(
        f"{where}: the target's sharding {sharding} uses devices that are not in this job "
        f"({', '.join(map(str, foreign[:4]))}; the job has {len(self._devices)}: "
        f"jax.devices()); give it a sharding of this job's devices."
      )


def _concrete(where: str, abstract: AbstractMesh) -> jax.sharding.Mesh:
  """The concrete mesh for ``abstract``: the mesh in context, else this job's devices."""
  names, sizes = tuple(abstract.axis_names), tuple(abstract.axis_sizes)
  given = f"an abstract mesh {_shape_text(names, sizes)}"
  context = jax.sharding.get_mesh()
  if not context.empty:
    have = (tuple(context.axis_names), tuple(context.axis_sizes))
    if have != (names, sizes):
      raise CheckpointError(
        f"{where}: the target's sharding is on {given}, the mesh in context is "
        f"{_shape_text(*have)}; {FIX}."
      )
    if tuple(context.axis_types) == tuple(abstract.axis_types):
      return context
    return jax.sharding.Mesh(context.devices, names, axis_types=tuple(abstract.axis_types))
  if math.prod(sizes) != jax.device_count():
    raise CheckpointError(
      f"{where}: the target's sharding is on {given} of {math.prod(sizes)} devices, and no "
      f"mesh is in context to place it on (this job has {jax.device_count()} devices); "
      f"{FIX}."
    )
  try:
    return jax.make_mesh(sizes, names, axis_types=tuple(abstract.axis_types))
  except Exception as e:
    raise CheckpointError(
      f"{where}: the target's sharding is on {given}, which "
      f"jax.make_mesh cannot lay out on this job's devices ({e}); "
      f"{FIX}."
    ) from None


def _check_fits(where: str, sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> None:
  """A CheckpointError unless ``sharding`` can hold an array of ``shape``."""
  try:
    if isinstance(sharding, jax.sharding.NamedSharding) and len(sharding.spec) > len(shape):
      raise ValueError(
        f"its PartitionSpec {sharding.spec} has more entries than the array "
        f"has dimensions ({len(shape)})"
      )
    sharding.shard_shape(shape)
    sharding.addressable_devices_indices_map(shape)
  except Exception as e:
    raise CheckpointError(
      f"{where}: the sharding {sharding} cannot hold an array of shape "
      f"{shape} ({e}); give this key path a sharding that fits."
    ) from None


def _device_memory(sharding: jax.sharding.Sharding) -> Placement:
  """Read onto the devices' default memory; moved to ``sharding`` after when it is another
  memory kind (``pinned_host``, ...)."""
  kind = getattr(sharding, "memory_kind", None)
  try:
    default = next(iter(sharding.device_set)).default_memory().kind  # type: ignore[attr-defined]
  except Exception:  # a backend without memories: one kind
    return Placement(sharding)
  if kind is None or kind == default:
    return Placement(sharding)
  return Placement(sharding.with_memory_kind(default), sharding)


def _shape_text(names: tuple[str, ...], sizes: tuple[int, ...]) -> str:
  return "(" + ", ".join(f"{n!r}: {s}" for n, s in zip(names, sizes)) + ")"
