"""fnckpt._manifest: manifest and commit marker <-> msgpack bytes, versioning, validation. Pure:
no files, no devices (leaf records come from fnckpt._leaves.encode_leaf)."""

import hashlib
import math

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fnckpt import CheckpointError
from fnckpt import _leaves, _manifest

LOC = "/ckpt/7"


def _manifest_dict(leaves=(), **extra):
  return {"format": _manifest.FORMAT_NAME, "version": _manifest.FORMAT_VERSION,
          "leaves": list(leaves), **extra}


# --- round trips -------------------------------------------------------------------------

_ints = st.integers(-(1 << 63), (1 << 64) - 1)
_scalars = st.one_of(st.none(), st.booleans(), _ints, st.floats(allow_nan=False),
                     st.text(max_size=8), st.binary(max_size=8))
_data = st.recursive(
    _scalars,
    lambda c: st.one_of(st.lists(c, max_size=4),
                        st.dictionaries(st.one_of(st.text(max_size=4), _ints), c, max_size=4)),
    max_leaves=12)
_paths = st.lists(st.one_of(st.tuples(st.sampled_from(["dict", "attr"]), st.text(max_size=4)),
                            st.tuples(st.sampled_from(["seq", "flat", "dict"]),
                                      st.integers(0, 99))).map(list), max_size=4)
_records = st.fixed_dictionaries(
    {"path": _paths, "kind": st.sampled_from(_manifest.LEAF_KINDS)},
    optional={"value": _data, "dtype": st.sampled_from(["float32", "bfloat16", "int4"]),
              "shape": st.lists(st.integers(0, 9), max_size=3), "inline": st.binary(max_size=16)})


@settings(max_examples=200, deadline=None)
@given(st.lists(_records, max_size=6), _data)
def test_property_encode_decode_round_trip(records, user_metadata):
  manifest = _manifest_dict(records, metadata=user_metadata, created=1.5)
  _manifest.check_msgpackable(manifest, "manifest")
  data = _manifest.encode(manifest)
  assert isinstance(data, bytes)
  assert _manifest.decode(data, LOC) == manifest


@settings(max_examples=200, deadline=None)
@given(st.one_of(
    _scalars.filter(lambda v: v is not None),
    st.integers().filter(lambda v: not -(1 << 63) <= v < (1 << 64)),  # bigint kind
    st.complex_numbers(allow_nan=False),
    st.sampled_from([np.float32(1.5), np.int8(-3), np.uint64(2**64 - 1), np.bool_(True),
                     np.float16(-0.0), np.complex64(1 - 2j)])))
def test_property_leaf_values_survive_the_manifest(value):
  rec, data = _leaves.encode_leaf((("dict", "v"),), value)
  assert data is None  # values go inline, no array data
  back = _manifest.decode(_manifest.encode(_manifest_dict([rec])), LOC)["leaves"][0]
  restored = _leaves.decode_value(back)
  assert type(restored) is type(value)
  if isinstance(value, float) and math.isnan(value):
    assert math.isnan(restored)
  else:
    assert restored == value


def test_manifest_bytes_are_plain_msgpack():
  manifest = _manifest_dict([{"path": [["dict", "a"]], "kind": "scalar", "type": "int",
                              "value": 1}])
  assert msgpack.unpackb(_manifest.encode(manifest), raw=False) == manifest


def test_constants_name_the_files():
  assert (_manifest.MANIFEST, _manifest.COMMIT, _manifest.DATA_DIR) == (
      "manifest.msgpack", "COMMIT", "d")
  assert isinstance(_manifest.FORMAT_VERSION, int) and _manifest.FORMAT_VERSION >= 1


# --- decode: bad bytes -------------------------------------------------------------------

@pytest.mark.parametrize("data, match", [
    (b"", r"The manifest of '/ckpt/7' is corrupt \(.*\)\. The checkpoint cannot be read; "
          r"restore an earlier one\."),
    (b"\xc1", r"manifest of '/ckpt/7' is corrupt"),
    (_manifest.encode(_manifest_dict()) + b"x", r"manifest of '/ckpt/7' is corrupt \(ExtraData"),
    (msgpack.packb([1, 2]), r"manifest of '/ckpt/7' is corrupt or not an fnckpt manifest "
                            r"\(no 'format': 'fnckpt' header\)"),
    (msgpack.packb({"format": "orbax", "version": 1, "leaves": []}),
     r"not an fnckpt manifest"),
    (msgpack.packb({"format": "fnckpt", "leaves": []}),
     r"manifest of '/ckpt/7' is corrupt: no format version"),
    (msgpack.packb({"format": "fnckpt", "version": "1", "leaves": []}), r"no format version"),
    (msgpack.packb({"format": "fnckpt", "version": 1}),
     r"manifest of '/ckpt/7' is corrupt: its leaf records are malformed\. Restore an earlier"),
    (msgpack.packb({"format": "fnckpt", "version": 1, "leaves": [{"path": [], "kind": "x"}]}),
     r"leaf records are malformed"),
    (msgpack.packb({"format": "fnckpt", "version": 1, "leaves": [{"kind": "array"}]}),
     r"leaf records are malformed"),
    (msgpack.packb({"format": "fnckpt", "version": 1, "leaves": [3]}),
     r"leaf records are malformed"),
], ids=["empty", "reserved-byte", "trailing", "list", "foreign", "no-version", "str-version",
        "no-leaves", "bad-kind", "no-path", "not-a-record"])
def test_decode_rejects_bad_manifests_with_a_clear_error(data, match):
  with pytest.raises(CheckpointError, match=match):
    _manifest.decode(data, LOC)


def test_decode_rejects_a_newer_format_version_and_says_to_upgrade():
  data = _manifest.encode({**_manifest_dict(), "version": _manifest.FORMAT_VERSION + 1})
  with pytest.raises(CheckpointError, match=(
      rf"'/ckpt/7' was written in fnckpt format version {_manifest.FORMAT_VERSION + 1}, newer "
      rf"than this fnckpt reads \(up to {_manifest.FORMAT_VERSION}\)\. Upgrade fnckpt: "
      r"pip install -U fnckpt\.")):
    _manifest.decode(data, LOC)


def test_decode_reads_older_format_versions():
  manifest = {**_manifest_dict(), "version": 0}
  assert _manifest.decode(_manifest.encode(manifest), LOC)["version"] == 0


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=64), _data.map(lambda d: msgpack.packb(d))))
def test_property_decode_of_any_bytes_is_a_manifest_or_a_checkpoint_error(data):
  try:
    manifest = _manifest.decode(data, LOC)
  except CheckpointError as e:
    assert LOC in str(e)
  else:
    assert manifest["format"] == _manifest.FORMAT_NAME
    assert isinstance(manifest["leaves"], list)


# --- the commit marker -------------------------------------------------------------------

def test_commit_marker_names_the_manifest_by_sha256():
  manifest_bytes = _manifest.encode(_manifest_dict())
  commit = _manifest.decode_commit(_manifest.encode_commit(manifest_bytes, 12.5), LOC)
  assert commit["manifest_sha256"] == hashlib.sha256(manifest_bytes).hexdigest()
  assert commit["manifest_sha256"] == _manifest.digest(manifest_bytes)
  assert commit["committed"] == 12.5
  assert commit["format"] == _manifest.FORMAT_NAME
  assert commit["version"] == _manifest.FORMAT_VERSION


@pytest.mark.parametrize("data, match", [
    (b"\xc1", r"The commit marker of '/ckpt/7' is corrupt"),
    (msgpack.packb({"format": "fnckpt", "version": 1}),
     r"commit marker of '/ckpt/7' is corrupt: no manifest hash"),
    (msgpack.packb({"format": "fnckpt", "version": 1, "manifest_sha256": 5}),
     r"no manifest hash"),
    (msgpack.packb({"version": 1, "manifest_sha256": "ab"}),
     r"commit marker of '/ckpt/7' is corrupt or not an fnckpt commit marker"),
    (msgpack.packb({"format": "fnckpt", "version": 99, "manifest_sha256": "ab"}),
     r"format version 99, newer than this fnckpt reads"),
])
def test_decode_commit_rejects_bad_markers(data, match):
  with pytest.raises(CheckpointError, match=match):
    _manifest.decode_commit(data, LOC)


# --- check_msgpackable -------------------------------------------------------------------

@pytest.mark.parametrize("value", [
    None, True, 0, -(1 << 63), (1 << 64) - 1, 1.5, "s", b"b", [1, [2]], (1, 2),
    {"a": {1: [None]}},
])
def test_check_msgpackable_accepts_plain_data(value):
  _manifest.check_msgpackable(value, "meta")


@pytest.mark.parametrize("value, match", [
    (1 << 64, r"meta: integer 18446744073709551616 does not fit in 64 bits; store it as a str"),
    (-(1 << 63) - 1, r"meta: integer .* does not fit in 64 bits"),
    ({"a": [1, object()]}, r"meta\['a'\]\[1\]: value of type object cannot be stored as "
                           r"metadata; use None, bool, int, float, str, bytes"),
    ({(1, 2): 1}, r"meta: key \(1, 2\) must be str or int"),
    (np.int64(3), r"meta: value of type int64 cannot be stored"),
    ({1, 2}, r"meta: value of type set cannot be stored"),
])
def test_check_msgpackable_names_where_and_what(value, match):
  with pytest.raises(CheckpointError, match=match):
    _manifest.check_msgpackable(value, "meta")
