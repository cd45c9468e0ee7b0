"""target_from_metadata: a restore target built from what a checkpoint says about itself.

The usual target comes from the model's code: ``jax.eval_shape(init)`` with shardings added.
A job that has no such code for the whole state (an evaluator that never builds the optimizer,
a conversion script, a job on another mesh inspecting a run) builds the same kind of target
from :func:`fnckpt.metadata`: a ``jax.ShapeDtypeStruct`` with a sharding per saved array.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from .restore import ArrayMetadata, CheckpointMetadata, metadata

__all__ = ["target_from_metadata", "ShardingRule"]

# (key path as jax.tree_util.keystr prints it for meta.tree, the array) -> where it goes
ShardingRule = Callable[[str, ArrayMetadata], Sharding | PartitionSpec]


def target_from_metadata(
  meta: CheckpointMetadata | str,
  sharding: Sharding | Mesh | ShardingRule,
  *,
  mesh: Mesh | None = None,
  storage_options: dict[str, Any] | None = None,
) -> Any:
  """A restore target for a checkpoint: ``meta.tree`` with each array replaced by a
  ``jax.ShapeDtypeStruct`` carrying the sharding it should be restored with.

  Args:
    meta: the checkpoint's :class:`fnckpt.CheckpointMetadata`, or its location (then read with
      :func:`fnckpt.metadata`).
    sharding: where each array goes. A ``jax.sharding.Sharding``: every array gets it. A
      ``jax.sharding.Mesh``: every array keeps the ``PartitionSpec`` it was saved with, on this
      mesh (arrays saved unsharded, on one device or from numpy are replicated); the mesh must
      have the saved axis names, of any sizes that divide the array. A callable
      ``rule(keypath, array_metadata)`` returning a ``Sharding``, or a ``PartitionSpec`` to
      place on ``mesh``; ``keypath`` is ``jax.tree_util.keystr`` of the leaf's path in
      ``meta.tree`` (e.g. ``"['params']['w']"``).
    mesh: the mesh for the PartitionSpecs a rule returns (only with a rule).
    storage_options: for reading ``meta`` from ``gs://``/``s3://`` (see :func:`fnckpt.metadata`).

  Returns:
    ``meta.tree`` (plain dicts and lists) with every array a ``ShapeDtypeStruct`` of its saved
    shape and dtype; a typed PRNG key array one of its key dtype and shape
    (``ArrayMetadata.key_shape``; a rule's spec or sharding is for that shape). Other leaves
    (ints, strings, numpy Generators, None, empty containers) are the saved values, which
    :func:`fnckpt.restore` fills in as saved. Restore it whole, or a part of it with
    ``partial=True``. Every sharding is checked against its array's shape here, so an axis
    that does not divide a dimension is an error naming the key path. (As for any
    ``jax.device_put``, 64-bit dtypes stay 64-bit on devices only with ``jax_enable_x64``.)

  >>> import jax, jax.numpy as jnp, numpy as np, fnckpt, tempfile
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> n = len(jax.devices())
  >>> saved_on = jax.make_mesh((n,), ("data",))
  >>> state = {"w": jax.device_put(jnp.arange(8.0 * n).reshape(n, 8),
  ...                              NamedSharding(saved_on, P("data"))),
  ...          "key": jax.random.key(0), "step": 7}
  >>> path = tempfile.mkdtemp() + "/7"
  >>> _ = fnckpt.save(state, path).wait()
  >>> meta = fnckpt.metadata(path)
  >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])  # another mesh
  >>> target = fnckpt.target_from_metadata(meta, mesh)  # the saved PartitionSpecs on it
  >>> target["w"].shape == (n, 8), target["w"].sharding.spec == P("data"), target["step"]
  (True, True, 7)
  >>> target["key"]
  ShapeDtypeStruct(shape=(), dtype=key<fry>, ...)
  >>> restored = fnckpt.restore(path, target)
  >>> dict(restored["w"].sharding.mesh.shape), restored["step"]
  ({'data': 1}, 7)
  >>> np.array_equal(restored["w"], state["w"])
  True
  >>> rule = lambda keypath, array: P() if keypath == "['key']" else P(None, "data")
  >>> fnckpt.target_from_metadata(meta, rule, mesh=mesh)["w"].sharding.spec == P(None, "data")
  True
  """
  if isinstance(meta, str):
    meta = metadata(meta, storage_options=storage_options)
  sharding_of = _sharding_function(sharding, mesh)
  key_dtypes: dict[str, Any] = {}

  def leaf(path: Any, value: Any) -> Any:
    if not isinstance(value, ArrayMetadata):
      return value
    keypath = jax.tree_util.keystr(path)
    if value.impl is None:
      shape, dtype = value.shape, value.dtype
    else:
      if value.impl not in key_dtypes:
        key_dtypes[value.impl] = _key_dtype(value.impl)
      shape, dtype = value.key_shape, key_dtypes[value.impl]
    placed = sharding_of(keypath, value)
    _check_fits(keypath, shape, placed)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=placed)

  return jax.tree_util.tree_map_with_path(leaf, meta.tree)


def _sharding_function(
  sharding: Any, mesh: Mesh | None
) -> Callable[[str, ArrayMetadata], Sharding]:
  """The three accepted forms of ``sharding`` as one function ``(keypath, array) -> Sharding``."""
  if isinstance(sharding, Sharding):
    if mesh is not None:
      raise TypeError(
        "target_from_metadata: mesh= goes with a rule returning PartitionSpecs, "
        f"not with a Sharding ({sharding})."
      )
    return lambda keypath, array: sharding
  if isinstance(sharding, Mesh):
    if mesh is not None:
      raise TypeError(
        "target_from_metadata: pass the mesh once (as `sharding`, to keep the "
        "saved PartitionSpecs), not also as mesh=."
      )
    return lambda keypath, array: _saved_spec_on(sharding, keypath, array)
  if callable(sharding):
    return lambda keypath, array: _from_rule(sharding, mesh, keypath, array)
  raise TypeError(
    "target_from_metadata: `sharding` must be a jax.sharding.Sharding, a "
    "jax.sharding.Mesh or a callable (keypath, ArrayMetadata) -> Sharding | "
    f"PartitionSpec; got {type(sharding).__name__}."
  )


def _from_rule(
  rule: ShardingRule, mesh: Mesh | None, keypath: str, array: ArrayMetadata
) -> Sharding:
  placed = rule(keypath, array)
  if isinstance(placed, Sharding):
    return placed
  if isinstance(placed, PartitionSpec):
    if mesh is None:
      raise TypeError(
        f"target_from_metadata: the rule returned {placed} for {keypath}; a "
        "PartitionSpec needs a mesh: pass mesh=."
      )
    return NamedSharding(mesh, placed)
  raise TypeError(
    f"target_from_metadata: the rule returned {placed!r} for {keypath}; it must "
    "return a jax.sharding.Sharding or a PartitionSpec."
  )


def _saved_spec_on(mesh: Mesh, keypath: str, array: ArrayMetadata) -> NamedSharding:
  """The PartitionSpec ``array`` was saved with, on ``mesh`` (replicated if it had none)."""
  saved = array.sharding
  if saved is None or saved.type != "named" or saved.spec is None:
    return NamedSharding(mesh, PartitionSpec())
  rank = len(array.key_shape)
  spec = tuple(saved.spec)
  if any(entry is not None for entry in spec[rank:]):  # a key's data dims are never sharded
    raise ValueError(
      f"target_from_metadata: {keypath} was saved as {saved.spec}, which shards "
      f"more than its {rank} dimension(s); pass a rule for it."
    )
  spec = spec[:rank]
  used = {
    a
    for entry in spec
    if entry is not None
    for a in (entry if isinstance(entry, tuple) else (entry,))
  }
  unknown = sorted(used - set(mesh.axis_names))
  if unknown:
    raise ValueError(
      f"target_from_metadata: {keypath} was saved as {saved.spec} over mesh axes "
      f"{saved.axes}; this mesh has axes {tuple(mesh.axis_names)}, not {unknown}. Pass a "
      "rule: target_from_metadata(meta, lambda keypath, array: PartitionSpec(...), mesh=mesh)."
    )
  return NamedSharding(mesh, PartitionSpec(*spec))


def _check_fits(keypath: str, shape: tuple[int, ...], sharding: Sharding) -> None:
  """Fail here, naming the leaf, rather than deep inside the restore."""
  try:
    sharding.shard_shape(shape)
  except ValueError as e:
    raise ValueError(
      f"target_from_metadata: {keypath} of shape {shape} cannot be placed with {sharding}: {e}"
    ) from None


def _key_dtype(impl: str) -> Any:
  """The dtype of typed PRNG keys of ``impl`` (abstractly: no device work)."""
  return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype
