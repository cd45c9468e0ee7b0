"""Restore targets of today's JAX (docs/concepts/saving.md): shardings over abstract meshes
(what ``jax.eval_shape`` gives on ``jax.make_mesh``'s Explicit axes), the mesh in context,
bare PartitionSpecs, memory kinds and layouts; and whatever else a target holds gives either
the right values or a CheckpointError naming the key path, never another exception."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st
from jax.experimental.layout import Format, Layout
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P

import fnckpt

EXPLICIT, AUTO = (AxisType.Explicit,) * 2, (AxisType.Auto,) * 2
W = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
U = np.arange(6 * 10, dtype=np.int32).reshape(6, 10)
# one leaf of each storage kind besides w (inline): packed, a zarr array, pieces
STORED = {"packed": ((128, 128), P()), "zarr": ((1024, 2048), P()),
          "pieces": ((2048, 1024), P("data", "model"))}


def value_of(name):
  return W if name == "w" else np.arange(np.prod(STORED[name][0]), dtype=np.float32).reshape(
      STORED[name][0])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  mesh = jax.make_mesh((2, 4), ("data", "model"))  # Explicit axes (JAX's default)
  assert mesh.axis_types == EXPLICIT
  state = {"w": jax.device_put(W, NamedSharding(mesh, P("data", "model"))),
           "u": jax.device_put(U, NamedSharding(mesh, P())),
           "step": 7, "key": jax.random.key(3),
           **{k: jax.device_put(value_of(k), NamedSharding(mesh, spec))
              for k, (_, spec) in STORED.items()}}
  path = str(tmp_path_factory.mktemp("targets") / "c")
  fnckpt.save(state, path).wait()
  stored = {k: m.stored for k, m in fnckpt.metadata(path).tree.items() if k in STORED}
  assert stored["packed"].startswith("pack ") and stored["pieces"] == "pieces", stored
  assert stored["zarr"] not in ("inline", "pieces") and not stored["zarr"].startswith("pack ")
  return path, state, mesh


def same_values(restored, state):
  assert restored["step"] == 7
  assert np.array_equal(np.asarray(restored["w"]), W)
  assert np.array_equal(np.asarray(restored["u"]), U)
  assert np.array_equal(jax.random.key_data(restored["key"]), jax.random.key_data(state["key"]))


def test_eval_shape_on_an_explicit_mesh_restores_with_its_axis_types(saved):
  path, state, mesh = saved
  target = jax.eval_shape(lambda: state)
  assert isinstance(target["w"].sharding.mesh, AbstractMesh)  # what users pass today
  restored = fnckpt.restore(path, target)
  same_values(restored, state)
  w = restored["w"]
  assert w.sharding == NamedSharding(mesh, P("data", "model"))  # the axis types included
  assert jax.typeof(w).sharding.spec == P("data", "model")
  assert w.sharding.mesh.axis_types == EXPLICIT
  step = jax.jit(lambda w, u: (w * 2, u + 1))  # a jitted step on the Explicit mesh takes them
  out = step(w, restored["u"])
  assert jax.typeof(out[0]) == jax.typeof(w)
  assert np.array_equal(np.asarray(out[0]), W * 2)


def test_the_mesh_in_context_is_used(saved):
  path, state, mesh = saved
  reversed_mesh = Mesh(mesh.devices[::-1, ::-1], ("data", "model"), axis_types=EXPLICIT)
  target = jax.eval_shape(lambda: state)
  with jax.set_mesh(reversed_mesh):
    restored = fnckpt.restore(path, target)
  same_values(restored, state)
  assert restored["w"].sharding.mesh == reversed_mesh  # its devices, in its order
  for shard in restored["w"].addressable_shards:
    assert np.array_equal(np.asarray(shard.data), W[shard.index])


def test_axis_types_are_the_targets_on_a_context_mesh_of_other_types(saved):
  path, state, _ = saved
  auto = jax.make_mesh((2, 4), ("data", "model"), axis_types=AUTO)
  with jax.set_mesh(auto):
    restored = fnckpt.restore(path, jax.eval_shape(lambda: state))
  assert restored["w"].sharding.mesh.axis_types == EXPLICIT
  assert list(restored["w"].sharding.mesh.devices.flat) == list(auto.devices.flat)
  same_values(restored, state)


def test_partition_spec_target_resolves_against_the_mesh_in_context(saved):
  path, state, mesh = saved
  with jax.set_mesh(mesh):
    target = {**jax.eval_shape(lambda: state),
              "w": jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=P("model"))}
    restored = fnckpt.restore(path, target)
  assert restored["w"].sharding == NamedSharding(mesh, P("model"))
  same_values(restored, state)


def test_partition_spec_without_a_mesh_names_the_key_path_and_the_fix(saved):
  path, state, _ = saved
  target = {**jax.eval_shape(lambda: state),
            "w": jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=P("model"))}
  with pytest.raises(fnckpt.TreeMismatchError) as e:
    fnckpt.restore(path, target)
  text = str(e.value)
  assert "['w']: the target's sharding cannot be resolved (" in text
  assert "restore inside `with jax.set_mesh(mesh):` with the mesh the target was made for, " \
         "or give this key path a concrete sharding" in text


@pytest.mark.parametrize("abstract, context, message", [
    ((4, 4), None, "['w']: the target's sharding is on an abstract mesh ('data': 4, 'model': 4) "
                   "of 16 devices, and no mesh is in context to place it on (this job has 8 "
                   "devices)"),
    ((4, 2), (2, 4), "['w']: the target's sharding is on an abstract mesh ('data': 4, "
                     "'model': 2), the mesh in context is ('data': 2, 'model': 4)"),
], ids=["too-large-for-the-job", "other-than-context"])
def test_abstract_mesh_of_another_shape_is_refused(saved, abstract, context, message):
  path, state, _ = saved
  sharding = NamedSharding(AbstractMesh(abstract, ("data", "model"), axis_types=EXPLICIT),
                           P("data"))
  target = {**jax.eval_shape(lambda: state),
            "w": jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=sharding)}
  with pytest.raises(fnckpt.TreeMismatchError) as e:
    if context is None:
      fnckpt.restore(path, target)
    else:
      with jax.set_mesh(jax.make_mesh(context, ("data", "model"))):
        fnckpt.restore(path, target)
  assert message in str(e.value)
  assert "jax.set_mesh(mesh)" in str(e.value)


def test_abstract_mesh_of_the_jobs_size_is_laid_out_as_make_mesh_would(saved):
  path, state, _ = saved
  abstract = AbstractMesh((4, 2), ("data", "model"), axis_types=EXPLICIT)
  target = {**jax.eval_shape(lambda: state),
            "w": jax.ShapeDtypeStruct((8, 16), jnp.float32,
                                      sharding=NamedSharding(abstract, P("model", "data")))}
  restored = fnckpt.restore(path, target)
  want = jax.make_mesh((4, 2), ("data", "model"), axis_types=EXPLICIT)
  assert restored["w"].sharding == NamedSharding(want, P("model", "data"))
  same_values(restored, state)


def test_prefix_sharding_over_an_abstract_mesh(saved):
  path, state, mesh = saved
  sharding = jax.eval_shape(lambda: state)["u"].sharding  # P() over the abstract mesh
  restored = fnckpt.restore(path, {"w": sharding, "u": sharding}, partial=True)
  assert restored["w"].sharding == NamedSharding(mesh, sharding.spec)
  assert np.array_equal(np.asarray(restored["w"]), W)


@pytest.mark.parametrize("kind", ["pinned_host", "unpinned_host"])
def test_a_memory_kind_of_the_target_is_honoured(saved, kind):
  path, state, mesh = saved
  sharding = NamedSharding(mesh, P("data"), memory_kind=kind)
  target = {**jax.eval_shape(lambda: state),
            "w": jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=sharding)}
  restored = fnckpt.restore(path, target)
  assert restored["w"].sharding == sharding
  same_values(restored, state)


def test_a_layout_of_the_target_is_honoured(saved):
  path, state, mesh = saved
  fmt = Format(Layout(major_to_minor=(1, 0)), NamedSharding(mesh, P("data")))
  target = {**jax.eval_shape(lambda: state),
            "w": jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=fmt)}
  restored = fnckpt.restore(path, target)
  assert restored["w"].format.layout.major_to_minor == (1, 0)
  same_values(restored, state)


def test_restore_or_init_with_its_default_target_on_an_explicit_mesh(tmp_path):
  mesh = jax.make_mesh((2, 4), ("data", "model"))

  def init():  # jax.eval_shape(init) has shardings over an abstract mesh
    return {"w": jax.device_put(jnp.arange(128.0).reshape(8, 16),
                                NamedSharding(mesh, P("data", "model"))),
            "b": jax.device_put(jnp.ones(16), NamedSharding(mesh, P("model")))}

  assert isinstance(jax.eval_shape(init)["w"].sharding.mesh, AbstractMesh)
  with fnckpt.CheckpointManager(tmp_path / "run") as manager:
    state, step = manager.restore_or_init(init)
    assert step is None
    manager.save(5, jax.tree.map(lambda x: x + 1, state), force=True)
  with fnckpt.CheckpointManager(tmp_path / "run") as manager:  # a restart
    restored, step = manager.restore_or_init(init)
  assert step == 5
  assert restored["w"].sharding == NamedSharding(mesh, P("data", "model"))
  assert np.array_equal(np.asarray(restored["w"]), np.arange(128.0).reshape(8, 16) + 1)
  assert np.array_equal(np.asarray(restored["b"]), np.full(16, 2.0))


# --- whatever the target holds: the right values, or a CheckpointError naming the key path ----

MESHES = {
    "2x4": lambda: jax.make_mesh((2, 4), ("data", "model")),
    "4x2-auto": lambda: jax.make_mesh((4, 2), ("data", "model"), axis_types=AUTO),
    "8x1": lambda: jax.make_mesh((8, 1), ("data", "model")),
    "reversed": lambda: Mesh(np.array(jax.devices()[::-1]).reshape(2, 4), ("data", "model"),
                             axis_types=EXPLICIT),
    "half": lambda: Mesh(np.array(jax.devices()[4:]).reshape(2, 2), ("data", "model")),
    "other-names": lambda: jax.make_mesh((2, 4), ("x", "y")),
}
SPEC_ENTRIES = st.sampled_from([None, "data", "model", ("data", "model"), ("model", "data"),
                                "x"])


@st.composite
def targets(draw):
  """(description, target leaf for 'w' or 'u', the mesh to hold in context or None)."""
  mesh = MESHES[draw(st.sampled_from(sorted(MESHES)))]()
  spec = P(*draw(st.lists(SPEC_ENTRIES, max_size=3)))
  context = draw(st.sampled_from([None, "same", "2x4", "4x2-auto"]))
  context = mesh if context == "same" else (MESHES[context]() if context else None)
  how = draw(st.sampled_from(["concrete", "abstract", "spec", "single", "memory", "format",
                              "sharding-leaf", "none", "object"]))
  try:
    sharding = NamedSharding(mesh, spec)
  except Exception:  # a spec naming an axis this mesh does not have: JAX refuses it itself
    sharding = NamedSharding(mesh, P())
  if how == "abstract":
    sharding = NamedSharding(mesh.abstract_mesh, sharding.spec)
  elif how == "single":
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[draw(st.integers(0, 7))])
  elif how == "memory":
    sharding = sharding.with_memory_kind(draw(st.sampled_from(["pinned_host", "device",
                                                                "unpinned_host"])))
  elif how == "format":
    sharding = Format(Layout(major_to_minor=draw(st.sampled_from([(0, 1), (1, 0)]))), sharding)
  leaf = {"spec": spec, "none": None, "object": draw(st.sampled_from(
      [mesh, spec, Layout(major_to_minor=(0, 1)), "data"]))}.get(how, sharding)
  name = draw(st.sampled_from(["w", "u"]))
  value = W if name == "w" else U
  if how in ("sharding-leaf", "object"):
    target = leaf
  else:
    try:
      target = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=leaf)
    except Exception:  # e.g. a spec longer than the array's rank: JAX refuses it itself
      target = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=NamedSharding(mesh, P()))
  return f"{how} {name} {leaf!r} context={context}", name, target, context


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=targets())
def test_any_target_gives_the_values_or_an_error_naming_the_key_path(saved, case):
  path, _, _ = saved
  what, name, target, context = case
  value = W if name == "w" else U
  with jax.set_mesh(context) if context is not None else contextlib.nullcontext():
    try:
      restored = fnckpt.restore(path, {name: target}, partial=True)
    except fnckpt.CheckpointError as e:
      assert f"['{name}']" in str(e), what
      event(f"refused: {what.split()[0]}")
      return
    event(f"restored: {what.split()[0]}")
    sharding = target if not isinstance(target, jax.ShapeDtypeStruct) else target.sharding
  got = restored[name]
  if isinstance(target, jax.ShapeDtypeStruct) and sharding is None:
    assert isinstance(got, jax.Array), what
  elif isinstance(target, (jax.ShapeDtypeStruct, jax.sharding.Sharding)):
    assert got.sharding.shard_shape(value.shape) == sharding.shard_shape(value.shape), what
    assert got.sharding.memory_kind == (getattr(sharding, "memory_kind", None) or "device")
    for shard in got.addressable_shards:
      assert np.array_equal(np.asarray(shard.data), value[shard.index]), what
  else:  # a target leaf of another type: only a non-array saved leaf could fill it
    pytest.fail(f"{what}: restored {got!r} into a target of {type(target).__name__}")
  assert np.array_equal(np.asarray(got), value), what


@pytest.mark.slow
def test_targets_across_processes(saved):
  """2 processes x 4 devices: an abstract mesh of the whole job restores; a sharding of
  another process's devices restores (this process holds no shard of it); a mesh larger than
  the job is a CheckpointError naming the key path."""
  import json
  import sys

  import helpers_proc as hp
  path = saved[0]
  worker = str(hp.HERE) + "/targets_worker.py"
  port = hp.free_port()
  procs = [hp.start([sys.executable, worker, json.dumps({
      "mode": "targets", "path": path, "port": port, "num_processes": 2, "process_id": i})])
      for i in range(2)]
  results = hp.finish(procs, 180)
  for r in results:
    assert r.returncode == 0 and not r.timed_out and r.result, r.describe()
  for r in results:
    for name in ("w", *STORED):
      outcomes = r.result["outcomes"][name]
      assert outcomes["abstract-job"] == {"shards": 4}, name
      assert outcomes["other-process-device"] == {"shards": 0}, name
      assert outcomes["other-process-mesh"] == {"shards": 0}, name
      assert f"['{name}']: the target's sharding is on an abstract mesh ('data': 4, 'model': " \
             "4) of 16 devices" in outcomes["abstract-too-large"]["error"], name
