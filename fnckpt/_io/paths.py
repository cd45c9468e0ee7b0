"""Checkpoint locations -> TensorStore kvstore specs; listing and deletion.

A path is a string: a local path, ``file://...``, ``memory://...``, ``gs://bucket/...`` or
``s3://bucket/...``. A :class:`Location` is a path with the storage options that apply to it,
made once where a public function is called and passed down as one value. Every function here
works on the kvstore of the *directory* (a spec whose path ends in ``/``), so the same code
lists, reads, writes and deletes on every backend.

The only shared state is the TensorStore context holding the ``memory://`` store (kept in
``fnckpt._state.storage``): by design its contents live as long as the process (that is what an
in-memory checkpoint is).
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
from collections.abc import Mapping
from typing import Any, NamedTuple

import tensorstore as ts

from .. import _state
from .._errors import CheckpointError

__all__ = [
  "Location",
  "Opened",
  "kvstore_spec",
  "join",
  "display",
  "resolve",
  "open_kvstore",
  "context",
  "list_keys",
  "delete_prefix",
  "clear",
  "io_error",
  "io_hint",
  "location_of",
  "redact",
  "error_text",
  "status_code",
  "read_failure",
]

_SCHEMES = ("file://", "memory://", "gs://", "s3://")


def _root() -> ts.Context:
  """The parent context: holds only the process-wide ``memory://`` key-value store."""
  storage = _state.storage
  with storage.lock:
    if storage.root is None:
      storage.root = ts.Context({"memory_key_value_store": {}})
    return storage.root


def context(
  *, concurrency: int | None = None, resources: dict[str, Any] | None = None
) -> ts.Context:
  """A fresh TensorStore context for one save or restore: no cache, bounded concurrency.

  Fresh per operation so that nothing grows across saves; the ``memory://`` store is inherited
  from the process-wide parent so in-memory checkpoints outlive one operation. ``resources``
  (request limits, retries, credentials of an object store) are shared by every store opened
  in the context, so a limit holds for the whole operation, not per leaf.
  """
  spec: dict[str, Any] = {"cache_pool": {"total_bytes_limit": 0}, **(resources or {})}
  if concurrency is not None:
    spec["data_copy_concurrency"] = {"limit": concurrency}
    spec["file_io_concurrency"] = {"limit": max(concurrency, 8)}
  return ts.Context(spec, parent=_root())


def _split_scheme(path: str) -> tuple[str, str]:
  path = os.fspath(path)
  for scheme in _SCHEMES:
    if path.startswith(scheme):
      return scheme[:-3], path[len(scheme) :]
  if "://" in path:
    raise CheckpointError(
      f"Unsupported storage location {path!r}: the scheme is not one of "
      f"{', '.join(s for s in _SCHEMES)}. Use a local path or one of these URLs."
    )
  return "file", path


def display(path: str) -> str:
  """The location as users wrote it, normalised (used in every error message)."""
  scheme, rest = _split_scheme(path)
  if scheme == "file":
    return os.path.abspath(os.path.expanduser(rest))
  return f"{scheme}://{rest.rstrip('/')}"


def join(path: str, *names: str) -> str:
  """``path/name/...`` for any scheme."""
  out = os.fspath(path).rstrip("/")
  for name in names:
    out = f"{out}/{name.strip('/')}"
  return out


def kvstore_spec(path: str, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """The TensorStore kvstore JSON spec for the *directory* ``path`` (its path ends in ``/``).

  ``options`` are per-backend settings (see :func:`fnckpt.save`'s ``storage_options``).

  >>> kvstore_spec("/tmp/run/10")
  {'driver': 'file', 'path': '/tmp/run/10/'}
  >>> kvstore_spec("memory://run/10")
  {'driver': 'memory', 'path': 'run/10/'}
  """
  options = dict(options or {})
  scheme, rest = _split_scheme(path)
  if scheme == "file":
    spec: dict[str, Any] = {
      "driver": "file",
      "path": os.path.abspath(os.path.expanduser(rest)).rstrip("/") + "/",
    }
  elif scheme == "memory":
    spec = {"driver": "memory", "path": rest.strip("/") + "/"}
  else:
    from . import object_stores as _object_stores  # gs:// and s3:// settings live there

    spec = _object_stores.kvstore_spec(scheme, rest, options)
    options = {}
  if options:
    raise CheckpointError(
      f"storage_options {sorted(options)} are not used by {display(path)!r}; "
      "they apply to gs:// and s3:// locations only."
    )
  return spec


def _frozen(options: Mapping[str, Any] | None) -> Mapping[str, Any]:
  """A read-only copy of the user's ``storage_options`` (a mapping or None)."""
  if options is not None and not isinstance(options, Mapping):
    raise CheckpointError(
      f"storage_options must be a dict of storage settings or None, found "
      f"{type(options).__name__} {options!r:.60}; e.g. storage_options={{'endpoint': "
      "'http://127.0.0.1:8333'}."
    )
  return types.MappingProxyType(dict(options or {}))


@dataclasses.dataclass(frozen=True)
class Location:
  """Where a checkpoint (or a manager's directory) is: the path as given and the storage
  options that apply to it (the public functions' ``storage_options``), as one value. Made
  once, where a public function is called (:meth:`of`), and passed down instead of a (path,
  options) pair. Compares by value and hashes by its path (the options are a read-only copy).
  The kvstore spec is derived when asked (:meth:`spec`: it reads the environment, as each
  operation did), and every operation opens it in a fresh TensorStore context
  (:func:`resolve`), so neither is held here.

  >>> loc = Location.of("memory://doc/loc", None)
  >>> loc.join("3").display, loc.join("3") == Location.of("memory://doc/loc/3")
  ('memory://doc/loc/3', True)
  >>> loc.join("3").spec()
  {'driver': 'memory', 'path': 'doc/loc/3/'}
  """

  path: str
  options: Mapping[str, Any] = dataclasses.field(default_factory=lambda: _frozen(None), hash=False)

  @classmethod
  def of(
    cls, path: str | os.PathLike[str] | Location, options: Mapping[str, Any] | None = None
  ) -> Location:
    """``path`` (with ``options``, the user's storage options) as a location; a location
    is returned as it is."""
    if isinstance(path, Location):
      return path
    return cls(os.fspath(path), _frozen(options))

  @property
  def display(self) -> str:
    """The location as users wrote it, normalised (:func:`display`)."""
    return display(self.path)

  def join(self, *names: str) -> Location:
    """``path/name/...`` with the same options."""
    return Location(join(self.path, *names), self.options)

  def spec(self) -> dict[str, Any]:
    """The kvstore spec of the directory (:func:`kvstore_spec`; it validates the options)."""
    return kvstore_spec(self.path, self.options)

  def __reduce__(self) -> tuple[Any, ...]:
    # (copy and deepcopy: the read-only options view itself cannot be copied)
    return (Location.of, (self.path, dict(self.options)))


# Local file system errors, by the OS's words (TensorStore reports them as PERMISSION_DENIED /
# RESOURCE_EXHAUSTED, which must not get the object stores' credential hints).
_LOCAL_HINTS = (
  ("No space left on device", " The disk is full: free some space or save elsewhere."),
  ("Disk quota exceeded", " The disk quota is used up: free some space or save elsewhere."),
  ("File too large", " A file went over the process's file size limit (ulimit -f)."),
  ("Read-only file system", " The destination is on a read-only file system: save elsewhere."),
  ("Permission denied", " This process may not access it: check the owner and permissions."),
)


def io_hint(e: BaseException) -> str:
  """What a TensorStore I/O error most likely means, as a sentence to append ('' if unsure).

  >>> io_hint(ValueError("NOT_FOUND: NoSuchBucket: The specified bucket does not exist"))
  ' The bucket does not exist: check its name (and the endpoint or account it lives in).'
  """
  text = str(e)
  local = next((hint for cause, hint in _LOCAL_HINTS if cause in text), None)
  if local is not None:
    return local
  if "os_error_code" in text:  # a local file system error: no bucket, credentials or endpoint
    return ""
  # (GCS answers a write into a missing bucket with a bare 404)
  if "NoSuchBucket" in text or ("NOT_FOUND" in text and "Error writing gs://" in text):
    return " The bucket does not exist: check its name (and the endpoint or account it lives in)."
  if any(
    w in text
    for w in (
      "PERMISSION_DENIED",
      "UNAUTHENTICATED",
      "SignatureDoesNotMatch",
      "InvalidAccessKeyId",
      "AccessDenied",
      "http_response_code='403'",
      "http_response_code='401'",
    )
  ):
    return (
      " Access was denied: check the credentials (AWS_ACCESS_KEY_ID / "
      "AWS_SECRET_ACCESS_KEY, the AWS profile or storage option 'credentials'; "
      "GOOGLE_APPLICATION_CREDENTIALS for gs://) and the bucket's permissions."
    )
  if any(
    w in text
    for w in (
      "CURL error",
      "Could not connect",
      "Could not resolve",
      "Timeout was reached",
      "retry attempts failed",
      "UNAVAILABLE",
    )
  ):
    return (
      " The storage server could not be reached: check the endpoint (storage option "
      "'endpoint' or FNCKPT_S3_ENDPOINT for s3://, TENSORSTORE_GCS_HTTP_URL for a GCS "
      "emulator) and the network. Storage options 'max_retries' / 'max_delay' "
      "(FNCKPT_REQUEST_RETRIES / FNCKPT_REQUEST_MAX_DELAY) bound how long it keeps trying."
    )
  return ""


def redact(text: str) -> str:
  """``text`` with the values of secret environment variables blanked out (belt and braces:
  TensorStore's messages are not known to contain them)."""
  for var in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "GOOGLE_AUTH_TOKEN_FOR_TESTING"):
    value = os.environ.get(var, "")
    if len(value) >= 4:
      text = text.replace(value, "<redacted>")
  return text


_TS_SPEC = re.compile(r"\s*\[tensorstore_spec='.*'\]", re.S)
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')  # a quoted path or URL (may hold any word)


def error_text(e: BaseException) -> str:
  """An error's message without TensorStore's appended spec (and never a secret)."""
  return redact(_TS_SPEC.sub("", str(e)).strip())


def status_code(e: BaseException) -> str:
  """The status code of a failed TensorStore operation (its ``ValueError``'s first word:
  ``"OUT_OF_RANGE"``, ``"NOT_FOUND"``, ...), or ``""``. The one place TensorStore's status is
  read (it has no field for it).

  >>> status_code(ValueError("OUT_OF_RANGE: Requested byte range [10, 11) is not valid"))
  'OUT_OF_RANGE'
  >>> status_code(OSError("OUT_OF_RANGE: not TensorStore's"))
  ''
  """
  code = str(e).partition(":")[0] if isinstance(e, ValueError) else ""
  return code if re.fullmatch(r"[A-Z][A-Z_]+", code) else ""


def read_failure(e: BaseException) -> str:
  """What a failed TensorStore open or read means: ``"checksum"`` (crc32c mismatch),
  ``"missing"``, ``"corrupt"`` (cannot be decoded), ``"metadata"`` (zarr.json differs from
  the manifest) or ``""``. Decided from the status code and TensorStore's own words, never
  from a path or the spec (either may contain "crc", "missing", ...).

  >>> read_failure(ValueError('NOT_FOUND: "gs://crc-bucket/c" ...'))
  'missing'
  """
  code = status_code(e)
  words = _QUOTED.sub('""', error_text(e)).lower()
  if "digest mismatch" in words:  # the crc32c codec's check
    return "checksum"
  if "invalid bool value" in words:  # a bool byte other than 0/1 (checksums cannot tell)
    return "corrupt"
  return {"NOT_FOUND": "missing", "DATA_LOSS": "corrupt", "FAILED_PRECONDITION": "metadata"}.get(
    code, ""
  )


def io_error(e: BaseException, path: str, doing: str) -> CheckpointError:
  """A :class:`CheckpointError` for a failed storage operation on ``path``: names the
  location, what was being done, the likely cause, and TensorStore's message (never a
  secret). A ``CheckpointError`` passes through unchanged.

  >>> str(io_error(ValueError("ABORTED: All 1 retry attempts failed: CURL error"),
  ...              "s3://b/run", "listing"))[:60]
  "Cannot access 's3://b/run' (listing): the storage server cou"
  """
  if isinstance(e, CheckpointError):
    return e
  hint = io_hint(e)
  text = redact(str(e))
  if len(text) > 600:
    text = text[:600] + " ..."
  if not hint:
    return CheckpointError(f"Cannot access {display(path)!r} ({doing}): {type(e).__name__}: {text}")
  return CheckpointError(
    f"Cannot access {display(path)!r} ({doing}): {hint[1].lower()}"
    f"{hint[2:-1]}. [{type(e).__name__}: {text}]"
  )


def location_of(kv: ts.KvStore) -> str:
  """The location (as :func:`display` writes it) of an opened directory kvstore.

  >>> location_of(open_kvstore("memory://doc/location_of/"))
  'memory://doc/location_of'
  """
  spec = kv.spec().to_json()
  path = spec.get("path", "").rstrip("/")
  scheme = {"s3": "s3", "gcs": "gs", "memory": "memory"}.get(spec.get("driver"))
  if scheme is None:
    return path
  bucket = f"{spec['bucket']}/" if "bucket" in spec else ""
  return f"{scheme}://{bucket}{path}".rstrip("/")


class Opened(NamedTuple):
  """A location opened for one operation (:func:`resolve`)."""

  spec: dict[str, Any]  # the directory's kvstore spec, without context resources
  context: ts.Context  # fresh, holding them
  kv: ts.KvStore  # the opened directory


def resolve(where: Location | str, options: Mapping[str, Any] | None = None) -> Opened:
  """For one save or restore: the directory's kvstore spec (without context resources), a
  fresh context holding them, and the opened directory kvstore. ``where``: a location, or a
  path (with its storage ``options``; here and below, ``options`` are only for a path)."""
  where = Location.of(where, options)
  spec = where.spec()
  resources: dict[str, Any] = {}
  if spec["driver"] in ("s3", "gcs"):
    from . import object_stores as _object_stores

    spec, resources = _object_stores.split_context_resources(spec)
  ctx = context(resources=resources)
  try:  # no I/O, except an S3 bucket's region lookup when no region is given
    return Opened(spec, ctx, ts.KvStore.open(spec, context=ctx).result())
  except Exception as e:
    raise io_error(e, where.path, "opening the location") from e


def open_kvstore(where: Location | str, options: Mapping[str, Any] | None = None) -> ts.KvStore:
  """Open the directory ``where`` as a :class:`tensorstore.KvStore` (no I/O on local files)."""
  return resolve(where, options)[2]


def list_keys(where: Location | str, options: Mapping[str, Any] | None = None) -> list[str]:
  """Every key under the directory ``where``, relative to it, sorted (one kvstore list; a
  location that does not exist has no keys).

  >>> kv = open_kvstore("memory://doc/list_keys")
  >>> _ = kv.write("3/COMMIT", b"x").result()
  >>> list_keys("memory://doc/list_keys")
  ['3/COMMIT']
  """
  where = Location.of(where, options)
  kv = resolve(where)[2]
  try:
    keys = kv.list().result()
  except Exception as e:
    raise io_error(e, where.path, "listing") from e
  return sorted(k.decode("utf-8", "surrogateescape") for k in keys)


def clear(kv: ts.KvStore, first: tuple[str, ...] = ()) -> None:
  """Delete every key of the opened directory ``kv``: the keys in ``first`` (a commit marker)
  before the rest, so a reader never sees them beside a partly deleted directory."""
  for key in first:
    kv.delete_range(ts.KvStore.KeyRange(key, key + "\0")).result()
  kv.delete_range(ts.KvStore.KeyRange()).result()


def delete_prefix(
  where: Location | str, options: Mapping[str, Any] | None = None, first: tuple[str, ...] = ()
) -> None:
  """Delete the directory ``where`` and everything under it, on any backend. The keys in
  ``first`` (e.g. a commit marker) are deleted before the rest, so a reader never sees them
  beside a partly deleted directory. On local files the emptied directory is removed too
  (TensorStore removes the files and subdirectories, not the directory it was opened on).

  >>> kv = open_kvstore("memory://doc/delete_prefix")
  >>> _ = kv.write("a/b", b"x").result()
  >>> delete_prefix("memory://doc/delete_prefix")
  >>> list_keys("memory://doc/delete_prefix")
  []
  """
  where = Location.of(where, options)
  _, _, kv = resolve(where)
  try:
    clear(kv, first)
  except Exception as e:
    raise io_error(e, where.path, "deleting") from e
  scheme, rest = _split_scheme(where.path)
  if scheme == "file":
    try:
      os.rmdir(os.path.abspath(os.path.expanduser(rest)))
    except OSError:  # not empty (a concurrent writer) or already gone: leave it
      pass
