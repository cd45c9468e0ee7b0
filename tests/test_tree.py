"""fnckpt._format.tree: pytrees <-> key paths, rebuilding from key paths, structure diffs. Pure: no
files, no devices."""

import collections
import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fnckpt import CheckpointError, TreeMismatchError
from fnckpt._format import tree as _tree

Pair = collections.namedtuple("Pair", ["first", "second"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
  kernel: object
  bias: object


class Opaque:
  """A pytree node registered without keys: its children get FlattenedIndexKeys."""

  def __init__(self, *children):
    self.children = children

  def __eq__(self, other):
    return type(other) is Opaque and other.children == self.children


jax.tree_util.register_pytree_node(
    Opaque, lambda o: (o.children, None), lambda _, c: Opaque(*c))


# --- keystr / match_key ------------------------------------------------------------------

@pytest.mark.parametrize("path, text", [
    ([], "<root>"),
    ([("dict", "a")], "['a']"),
    ([("dict", 3)], "[3]"),
    ([("seq", 0), ("attr", "mu"), ("dict", "w")], "[0].mu['w']"),
    ([("flat", 2)], "[2]"),
])
def test_keystr(path, text):
  assert _tree.keystr(path) == text


def test_keystr_matches_jax_for_dicts_sequences_and_attributes():
  tree = {"a": [Pair(1, {"b": 2}), 3]}
  ours = [_tree.keystr(p) for p, _ in _tree.flatten(tree)[0]]
  theirs = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  assert ours == theirs


def test_match_key_ignores_how_a_key_is_reached():
  as_attr = [("attr", "params"), ("attr", "kernel")]
  as_dict = [("dict", "params"), ("dict", "kernel")]
  assert _tree.match_key(as_attr) == _tree.match_key(as_dict) == ("params", "kernel")
  assert _tree.match_key([("seq", 0)]) != _tree.match_key([("dict", "0")])


# --- flatten -----------------------------------------------------------------------------

@pytest.mark.parametrize("tree, expected", [
    ({"a": 1, "b": [], "c": None}, [((("dict", "a"),), 1), ((("dict", "b"),), []),
                                    ((("dict", "c"),), None)]),
    (Pair(1, ()), [((("attr", "first"),), 1), ((("attr", "second"),), ())]),
    (Params(kernel=1, bias={}), [((("attr", "kernel"),), 1), ((("attr", "bias"),), {})]),
    ([[], [None]], [((("seq", 0),), []), ((("seq", 1), ("seq", 0)), None)]),
    ({1: "x", 2: "y"}, [((("dict", 1),), "x"), ((("dict", 2),), "y")]),
    (Opaque("p", "q"), [((("flat", 0),), "p"), ((("flat", 1),), "q")]),
    (None, [((), None)]),
    ({}, [((), {})]),
    (7, [((), 7)]),
], ids=["dict", "namedtuple", "dataclass", "nested-empty", "int-keys", "no-keys", "none",
        "empty-root", "scalar-root"])
def test_flatten_keeps_empty_containers_and_none_as_leaves(tree, expected):
  leaves, treedef = _tree.flatten(tree)
  assert leaves == expected
  # the treedef rebuilds the original tree from those leaves
  assert jax.tree_util.tree_unflatten(treedef, [v for _, v in leaves]) == tree


def test_flatten_paths_are_plain_data():
  leaves, _ = _tree.flatten({"a": Pair(np.zeros(2), [1])})
  for path, _ in leaves:
    for kind, key in path:
      assert kind in ("dict", "seq", "attr", "flat")
      assert type(key) in (str, int)


@pytest.mark.parametrize("key", [1.5, True, (1, 2), None], ids=repr)
def test_flatten_rejects_unstorable_dict_keys_naming_the_path(key):
  with pytest.raises(CheckpointError, match=r"Unsupported dict key .* at \['outer'\]\[.*\]: "
                                            r"checkpoint keys must be str or int\. Convert"):
    _tree.flatten({"outer": {key: 1}})


def test_flatten_rejects_unsortable_dict_keys_with_a_fnckpt_error():
  with pytest.raises(CheckpointError, match="keys of one type"):
    _tree.flatten({1: "a", "b": 2})


# --- unflatten_from_paths ----------------------------------------------------------------

def _normalise(tree):
  """What a round trip through key paths can give back: tuples and namedtuples become lists,
  attribute containers become dicts. Empty containers are leaves: they come back as they were."""
  if _tree.is_empty_node(tree):
    return tree
  if isinstance(tree, dict):
    return {k: _normalise(v) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
      return {f: _normalise(getattr(tree, f)) for f in tree._fields}
    return [_normalise(v) for v in tree]
  return tree


@pytest.mark.parametrize("tree", [
    {"a": [1, 2], "b": {"c": None, "d": []}},
    [[], [1]],
    [None, [1, {}]],
    {"x": {"y": ()}},
    {1: "a", 2: ["b"]},
    [Pair(1, 2), Pair((), None)],
    [[[[1]]]],
])
def test_unflatten_from_paths_rebuilds_plain_containers(tree):
  leaves, _ = _tree.flatten(tree)
  rebuilt = _tree.unflatten_from_paths([p for p, _ in leaves], [v for _, v in leaves])
  assert rebuilt == _normalise(tree)


def test_unflatten_from_paths_with_paths_out_of_order():
  paths = [[("seq", 1), ("dict", "x")], [("seq", 0)], [("seq", 2), ("seq", 0)]]
  assert _tree.unflatten_from_paths(paths, ["b", None, 3]) == [None, {"x": "b"}, [3]]


def test_unflatten_from_paths_maps_attrs_to_dicts_and_flat_keys_to_lists():
  paths = [[("attr", "mu"), ("flat", 0)], [("attr", "mu"), ("flat", 1)], [("attr", "count")]]
  assert _tree.unflatten_from_paths(paths, [1, 2, 3]) == {"mu": [1, 2], "count": 3}


def test_unflatten_from_paths_root_leaf_and_nothing():
  assert _tree.unflatten_from_paths([[]], [5]) == 5
  assert _tree.unflatten_from_paths([], []) == {}


_keys = st.one_of(st.text(max_size=4), st.integers(-3, 1000))
_leaves = st.one_of(st.none(), st.integers(), st.text(max_size=3), st.floats(allow_nan=False),
                    st.just([]), st.just({}), st.just(()))


def _trees():
  return st.recursive(
      _leaves,
      lambda children: st.one_of(
          st.lists(children, min_size=1, max_size=4),
          st.tuples(children, children),
          # dict keys of one type: JAX sorts them
          st.dictionaries(st.text(max_size=4), children, min_size=1, max_size=4),
          st.dictionaries(st.integers(-3, 50), children, min_size=1, max_size=4)),
      max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(_trees())
def test_property_flatten_then_unflatten_from_paths_is_identity_up_to_container_types(tree):
  leaves, treedef = _tree.flatten(tree)
  paths = [p for p, _ in leaves]
  values = [v for _, v in leaves]
  assert len(set(paths)) == len(paths)  # key paths name leaves uniquely
  assert _tree.unflatten_from_paths(paths, values) == _normalise(tree)
  assert jax.tree_util.tree_unflatten(treedef, values) == tree
  # and key paths survive a list-of-lists round trip (what the manifest stores)
  stored = [[list(e) for e in p] for p in paths]
  assert _tree.unflatten_from_paths(stored, values) == _normalise(tree)


@settings(max_examples=100, deadline=None)
@given(_trees(), st.randoms(use_true_random=False))
def test_property_unflatten_from_paths_ignores_path_order(tree, rnd):
  leaves, _ = _tree.flatten(tree)
  rnd.shuffle(leaves)
  rebuilt = _tree.unflatten_from_paths([p for p, _ in leaves], [v for _, v in leaves])
  expected = _normalise(tree)
  # dict insertion order may differ, lists may not
  assert rebuilt == expected


# --- diff and the mismatch error ---------------------------------------------------------

def test_diff_lists_missing_and_unexpected_by_keys():
  saved = [[("dict", "a")], [("attr", "b"), ("seq", 0)], [("dict", "c")]]
  wanted = [[("attr", "a")], [("dict", "b"), ("seq", 0)], [("dict", "d")]]
  missing, unexpected = _tree.diff(saved, wanted)
  assert missing == ["['d']"]
  assert unexpected == ["['c']"]


def test_diff_of_equal_trees_is_empty():
  paths = [p for p, _ in _tree.flatten({"a": [1, {"b": 2}]})[0]]
  assert _tree.diff(paths, paths) == ([], [])


def test_mismatch_error_lists_every_problem_in_one_message():
  err = _tree.mismatch_error("/ckpt", missing=["['a']"], unexpected=["['b']", "['c']"],
                             mismatched=["['d']: shape (2,) saved, (3,) in the target"],
                             hint="Pass partial=True.")
  assert isinstance(err, TreeMismatchError) and isinstance(err, ValueError)
  assert str(err) == (
      "The restore target does not match the checkpoint at '/ckpt':\n"
      "  1 key path(s) missing from the checkpoint (in the target only):\n"
      "    ['a']\n"
      "  2 key path(s) in the checkpoint but not in the target:\n"
      "    ['b']\n"
      "    ['c']\n"
      "  1 key path(s) shape or dtype differs:\n"
      "    ['d']: shape (2,) saved, (3,) in the target\n"
      "Pass partial=True.")


def test_mismatch_error_truncates_long_lists_but_counts_them():
  text = str(_tree.mismatch_error("/ckpt", missing=[f"['k{i}']" for i in range(25)]))
  assert "25 key path(s) missing" in text
  assert "['k19']" in text and "['k20']" not in text
  assert "... and 5 more" in text


@pytest.mark.parametrize("x, empty", [
    (None, True), ({}, True), ([], True), ((), True), (Pair(1, 2), False), ([0], False),
    (0, False), ("", False), (np.zeros(0), False),
])
def test_is_empty_node(x, empty):
  assert _tree.is_empty_node(x) is empty
