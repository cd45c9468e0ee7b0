"""``gs://`` and ``s3://`` locations -> TensorStore kvstore specs (the ``gcs`` and ``s3`` drivers).

:func:`kvstore_spec` turns ``bucket/some/path`` plus the user's ``storage_options`` and the
environment into the JSON spec of that *directory* (its ``path`` ends in ``/``). Nothing here does
I/O; TensorStore does the requests when the spec is opened.

Settings; a ``storage_options`` entry wins over the environment, and among environment
variables the first one set wins::

  option              environment variables                     TensorStore spec member
  ------------------  ----------------------------------------  ------------------------------
  both schemes:
  concurrency         FNCKPT_REQUEST_CONCURRENCY                {s3,gcs}_request_concurrency
  max_retries         FNCKPT_REQUEST_RETRIES                    {s3,gcs}_request_retries
  initial_delay       FNCKPT_REQUEST_INITIAL_DELAY              {s3,gcs}_request_retries
  max_delay           FNCKPT_REQUEST_MAX_DELAY                  {s3,gcs}_request_retries
  s3:// only:
  endpoint            FNCKPT_S3_ENDPOINT, AWS_ENDPOINT_URL_S3,  endpoint
                      AWS_ENDPOINT_URL
  region              AWS_REGION, AWS_DEFAULT_REGION            aws_region
  host_header         -                                         host_header
  credentials         FNCKPT_S3_CREDENTIALS                     aws_credentials
  profile             (AWS_PROFILE, read by TensorStore)        aws_credentials.profile
  requester_pays      -                                         requester_pays
  conditional_write   (TENSORSTORE_S3_USE_CONDITIONAL_WRITE,    use_conditional_write
                      read by TensorStore)
  gs:// only:
  user_project        -                                         gcs_user_project

- ``concurrency``: the most requests in flight (an integer >= 1). Unset: TensorStore's shared
  default (``TENSORSTORE_S3_REQUEST_CONCURRENCY`` / ``TENSORSTORE_GCS_REQUEST_CONCURRENCY``, 32).
- ``max_retries``: retries of a request that failed transiently (an integer >= 0; TensorStore's
  default is 32). ``initial_delay`` / ``max_delay``: the exponential backoff, as seconds (a number)
  or a duration string such as ``"250ms"`` or ``"2s"`` (defaults 1s and 32s).
- ``endpoint``: an ``http(s)://host[:port]`` URL of an S3-compatible server (MinIO, SeaweedFS, R2,
  ...). Unset: AWS, with the bucket's region looked up unless ``region`` is set.
  ``AWS_ENDPOINT_URL*`` are ignored when ``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=true``, as in the
  AWS SDKs.
- ``credentials``: one of ``"default"`` (environment, ``~/.aws`` files, web identity, ECS, EC2
  instance metadata, then anonymous), ``"environment"`` (``AWS_ACCESS_KEY_ID``,
  ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``), ``"profile"``, ``"anonymous"``, ``"imds"``,
  ``"ecs"``, or a TensorStore ``aws_credentials`` object such as
  ``{"type": "profile", "profile": "p", "credentials_file": "/path"}``. Unset: ``"environment"``
  when ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY`` are both set (the chain would pick them
  first anyway), else TensorStore's default chain (which reads ``~/.aws``, logging an error for
  each missing file, and may ask the EC2 metadata server unless ``AWS_EC2_METADATA_DISABLED=true``;
  for public buckets pass ``"anonymous"``). Secrets are never accepted as options (they would end
  up in specs and logs): keep them in the environment or in a credentials file.
- ``conditional_write``: use ``If-Match`` / ``If-None-Match`` writes (atomic create-if-absent).
  TensorStore turns them on for AWS and for servers it does not know to lack them; set ``False``
  for a server that rejects them (TensorStore then checks with a HEAD first: not atomic).
- ``gs://`` credentials come from TensorStore's Google chain: ``GOOGLE_APPLICATION_CREDENTIALS``,
  the gcloud application-default file, then the GCE metadata server. A GCS emulator is selected
  with ``TENSORSTORE_GCS_HTTP_URL`` (process-wide; there is no per-call endpoint). The first
  ``gs://`` request of a process fixes the credentials for the rest of it.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from typing import Any

from .._errors import CheckpointError

__all__ = [
  "kvstore_spec",
  "split_context_resources",
  "S3_OPTIONS",
  "GCS_OPTIONS",
  "AWS_CREDENTIAL_TYPES",
]

_COMMON_OPTIONS = ("concurrency", "max_retries", "initial_delay", "max_delay")
S3_OPTIONS: tuple[str, ...] = _COMMON_OPTIONS + (
  "endpoint",
  "region",
  "host_header",
  "credentials",
  "profile",
  "requester_pays",
  "conditional_write",
)
GCS_OPTIONS: tuple[str, ...] = _COMMON_OPTIONS + ("user_project",)
AWS_CREDENTIAL_TYPES: tuple[str, ...] = (
  "default",
  "environment",
  "profile",
  "anonymous",
  "imds",
  "ecs",
)

# Why an option of the other scheme, or a common spelling, is not accepted.
_HINTS = {
  ("gs", "endpoint"): "gs:// has no per-call endpoint: set TENSORSTORE_GCS_HTTP_URL "
  "(process-wide) to use a GCS emulator",
  ("gs", "credentials"): "gs:// credentials come from GOOGLE_APPLICATION_CREDENTIALS, the gcloud "
  "application-default file or the GCE metadata server",
  ("gs", "region"): "GCS buckets need no region",
  ("gs", "requester_pays"): "for requester-pays GCS buckets pass 'user_project'",
  ("s3", "user_project"): "for requester-pays S3 buckets pass requester_pays=True",
}
_SECRET_WORDS = ("key", "secret", "token", "password")

_DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|ms|s|m|h))+$")
_GCS_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]*[a-z0-9]$")
_S3_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*[A-Za-z0-9]$")
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def kvstore_spec(
  scheme: str,
  rest: str,
  options: Mapping[str, Any] | None = None,
  *,
  environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
  """The TensorStore kvstore spec of the directory ``<scheme>://<rest>``.

  ``scheme`` is ``"s3"`` or ``"gs"``; ``rest`` is ``bucket/some/path`` (no scheme). ``options``
  are the user's ``storage_options`` (not modified); ``environ`` defaults to ``os.environ``.
  Raises :class:`~fnckpt.CheckpointError` naming the URL for a malformed location, an unknown
  option or a bad value (never echoing anything that could be a secret).

  >>> kvstore_spec("s3", "my-bucket/runs/7", environ={})
  {'driver': 's3', 'bucket': 'my-bucket', 'path': 'runs/7/'}
  >>> kvstore_spec("s3", "my-bucket/runs/7",
  ...              {"endpoint": "http://127.0.0.1:9000/", "credentials": "environment",
  ...               "max_retries": 2, "initial_delay": 0.01}, environ={"AWS_REGION": "eu-west-1"})
  ... # doctest: +NORMALIZE_WHITESPACE
  {'driver': 's3', 'bucket': 'my-bucket', 'path': 'runs/7/', 'endpoint': 'http://127.0.0.1:9000',
   'aws_region': 'eu-west-1', 'aws_credentials': {'type': 'environment'},
   's3_request_retries': {'max_retries': 2, 'initial_delay': '10ms'}}
  >>> kvstore_spec("gs", "my-bucket", {"concurrency": 64},
  ...              environ={"FNCKPT_REQUEST_CONCURRENCY": "8"})
  {'driver': 'gcs', 'bucket': 'my-bucket', 'path': '', 'gcs_request_concurrency': {'limit': 64}}
  >>> kvstore_spec("gs", "my-bucket/x", {"endpoint_url": "http://x"}, environ={})
  Traceback (most recent call last):
  ...
  fnckpt._errors.CheckpointError: Unknown storage option 'endpoint_url' for 'gs://my-bucket/x' \
(did you mean 'endpoint'? gs:// has no per-call endpoint: set TENSORSTORE_GCS_HTTP_URL \
(process-wide) to use a GCS emulator). Options for gs:// are: concurrency, max_retries, \
initial_delay, max_delay, user_project.
  """
  env = os.environ if environ is None else environ
  options = dict(options or {})
  if scheme not in ("s3", "gs"):
    raise CheckpointError(f"Unsupported object-store scheme {scheme!r}: use 's3' or 'gs'.")
  url = f"{scheme}://{rest.rstrip('/')}"
  known = S3_OPTIONS if scheme == "s3" else GCS_OPTIONS
  for name in options:
    if name not in known:
      raise CheckpointError(_unknown_option_message(scheme, name, url, known))

  bucket, path = _split_bucket(scheme, rest, url)
  get = _Lookup(options, env, url)
  if scheme == "s3":
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": path}
    spec.update(_s3_settings(get, url))
    prefix = "s3"
  else:
    spec = {"driver": "gcs", "bucket": bucket, "path": path}
    spec.update(_gcs_settings(get, url))
    prefix = "gcs"
  spec.update(_request_settings(get, prefix, url))
  return spec


def _gcs_settings(get: _Lookup, url: str) -> dict[str, Any]:
  """The ``gs://``-only members: refuses an emulator TensorStore would not see."""
  out: dict[str, Any] = {}
  if "TENSORSTORE_GCS_HTTP_URL" not in get.env and get.env.get("STORAGE_EMULATOR_HOST"):
    raise CheckpointError(
      f"STORAGE_EMULATOR_HOST is set but TensorStore does not read it, so {url!r} would go "
      "to the real Google Cloud Storage. Set TENSORSTORE_GCS_HTTP_URL to the emulator's "
      "URL (e.g. http://127.0.0.1:4443), or unset STORAGE_EMULATOR_HOST."
    )
  user_project = get.string("user_project")
  if user_project is not None:
    out["gcs_user_project"] = {"project_id": user_project}
  return out


def _request_settings(get: _Lookup, prefix: str, url: str) -> dict[str, Any]:
  """``<prefix>_request_concurrency`` and ``<prefix>_request_retries``, the members both schemes
  share (``prefix`` is ``"s3"`` or ``"gcs"``); absent settings give no member."""
  out: dict[str, Any] = {}
  concurrency = get.integer("concurrency", "FNCKPT_REQUEST_CONCURRENCY", minimum=1)
  if concurrency is not None:
    out[f"{prefix}_request_concurrency"] = {"limit": concurrency}
  retries: dict[str, Any] = {}
  max_retries = get.integer("max_retries", "FNCKPT_REQUEST_RETRIES", minimum=0)
  if max_retries is not None:
    retries["max_retries"] = max_retries
  delays = {}
  for name, var in (
    ("initial_delay", "FNCKPT_REQUEST_INITIAL_DELAY"),
    ("max_delay", "FNCKPT_REQUEST_MAX_DELAY"),
  ):
    value = get.duration(name, var)
    if value is not None:
      delays[name] = value
      retries[name] = _format_duration(value)
  if len(delays) == 2 and delays["max_delay"] < delays["initial_delay"]:
    raise CheckpointError(
      f"max_delay ({retries['max_delay']}) is shorter than initial_delay "
      f"({retries['initial_delay']}) for {url!r}."
    )
  if retries:
    out[f"{prefix}_request_retries"] = retries
  return out


_RESOURCE_KEYS = (
  "aws_credentials",
  "s3_request_concurrency",
  "s3_request_retries",
  "gcs_request_concurrency",
  "gcs_request_retries",
  "gcs_user_project",
)


def split_context_resources(spec: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
  """``(spec without its context resources, those resources)``.

  Resources written inline in a kvstore spec belong to the one driver opened from it: every
  ``ts.KvStore.open`` / ``ts.open`` of a separately built spec gets its own request limit (and
  its own credentials provider). Put the resources in the ``ts.Context`` of a whole save or
  restore instead (``ts.Context({**resources, ...})``) and every store opened in it shares one
  limit. (Or open the directory once and derive the leaves' stores with ``kvstore / "leaf/"``.)

  >>> split_context_resources({"driver": "s3", "bucket": "b", "path": "x/",
  ...                          "s3_request_concurrency": {"limit": 8}})
  ({'driver': 's3', 'bucket': 'b', 'path': 'x/'}, {'s3_request_concurrency': {'limit': 8}})
  """
  spec = dict(spec)
  resources = {key: spec.pop(key) for key in _RESOURCE_KEYS if key in spec}
  return spec, resources


def _s3_settings(get: _Lookup, url: str) -> dict[str, Any]:
  out: dict[str, Any] = {}
  env_vars = ["FNCKPT_S3_ENDPOINT"]
  if get.env.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").strip().lower() != "true":
    env_vars += ["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"]
  endpoint = get.string("endpoint", *env_vars)
  if endpoint is not None:
    if "@" in endpoint:  # user info is a credential: never echo it
      raise CheckpointError(
        f"The S3 endpoint ({get.source('endpoint', *env_vars)}) for {url!r} contains user "
        "info ('user:password@'); give credentials through the environment or a credentials "
        "file instead."
      )
    if not re.match(r"^https?://[^/?#\s]+/?$", endpoint):
      raise CheckpointError(
        f"S3 endpoint {endpoint!r} ({get.source('endpoint', *env_vars)}) for {url!r} is not "
        "an http(s)://host[:port] URL."
      )
    out["endpoint"] = endpoint.rstrip("/")
  region = get.string("region", "AWS_REGION", "AWS_DEFAULT_REGION")
  if region is not None:
    out["aws_region"] = region
  host_header = get.string("host_header")
  if host_header is not None:
    if endpoint is None:
      raise CheckpointError(
        f"storage option 'host_header' for {url!r} needs an endpoint (storage option "
        "'endpoint' or FNCKPT_S3_ENDPOINT)."
      )
    out["host_header"] = host_header
  for name, key in (
    ("requester_pays", "requester_pays"),
    ("conditional_write", "use_conditional_write"),
  ):
    flag = get.boolean(name)
    if flag is not None:
      out[key] = flag
  credentials = _aws_credentials(get, url)
  if credentials is not None:
    out["aws_credentials"] = credentials
  return out


def _aws_credentials(get: _Lookup, url: str) -> dict[str, Any] | None:
  raw = get.raw("credentials", "FNCKPT_S3_CREDENTIALS")
  where = get.source("credentials", "FNCKPT_S3_CREDENTIALS")
  creds: dict[str, Any] | None
  if raw is None:
    # Keys in the environment are what the default chain would find first anyway; naming the
    # provider skips the chain's file reads (an error logged per open when ~/.aws is missing)
    # and any instance-metadata lookups.
    have_keys = all(
      get.env.get(var, "").strip() for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    )
    creds = {"type": "environment"} if have_keys and get.raw("profile") is None else None
  elif isinstance(raw, str):
    if raw.strip() not in AWS_CREDENTIAL_TYPES:
      raise CheckpointError(
        f"{where} for {url!r} must be one of {', '.join(AWS_CREDENTIAL_TYPES)} or a TensorStore "
        "aws_credentials object; got a string that is none of these."
      )
    creds = {"type": raw.strip()}
  elif isinstance(raw, Mapping):
    if raw.get("type") not in AWS_CREDENTIAL_TYPES:
      raise CheckpointError(
        f"{where} for {url!r} must have a 'type' among {', '.join(AWS_CREDENTIAL_TYPES)}."
      )
    creds = dict(raw)
  else:
    raise CheckpointError(
      f"{where} for {url!r} must be a string or a mapping, not {type(raw).__name__}."
    )
  profile = get.string("profile")
  if profile is not None:
    if creds is None:
      creds = {"type": "profile", "profile": profile}
    elif creds["type"] in ("default", "profile") and "profile" not in creds:
      creds["profile"] = profile
    else:
      raise CheckpointError(
        f"storage option 'profile' for {url!r} conflicts with credentials of type "
        f"{creds['type']!r}{' that name a profile' if 'profile' in creds else ''}."
      )
  return creds


def _split_bucket(scheme: str, rest: str, url: str) -> tuple[str, str]:
  bucket, _, path = rest.partition("/")
  if not bucket:
    raise CheckpointError(f"{url!r} names no bucket: write {scheme}://BUCKET/path/to/checkpoint.")
  if scheme == "gs":
    valid = (
      3 <= len(bucket) <= 222
      and _GCS_BUCKET.match(bucket) is not None
      and all(len(part) <= 63 for part in bucket.split("."))
    )
    rule = "3-63 characters (222 with dots) of lowercase letters, digits, '-', '_' and '.'"
  else:
    valid = 3 <= len(bucket) <= 255 and _S3_BUCKET.match(bucket) is not None
    rule = "3-63 characters of lowercase letters, digits, '-' and '.'"
  if not valid:
    raise CheckpointError(
      f"{bucket!r} in {url!r} is not a valid bucket name: {rule}, starting and ending with a "
      "letter or digit."
    )
  path = path.rstrip("/")
  if path:
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
      raise CheckpointError(
        f"{url!r} has an empty, '.' or '..' path component; object stores take keys "
        "literally, so write the path without them."
      )
    path += "/"
  return bucket, path


def _unknown_option_message(scheme: str, name: str, url: str, known: tuple[str, ...]) -> str:
  name_text = repr(name) if isinstance(name, str) else f"of type {type(name).__name__}"
  hints = []
  if isinstance(name, str):
    close = difflib.get_close_matches(name, S3_OPTIONS + GCS_OPTIONS, n=1, cutoff=0.6)
    if close and close[0] != name:
      hints.append(f"did you mean {close[0]!r}?")
    hint = _HINTS.get((scheme, close[0] if close else name)) or _HINTS.get((scheme, name))
    if hint:
      hints.append(hint)
    elif scheme == "s3" and any(word in name.lower() for word in _SECRET_WORDS):
      hints.append(
        "secrets are not taken as options: set AWS_ACCESS_KEY_ID / "
        "AWS_SECRET_ACCESS_KEY or use a credentials file (options 'credentials', "
        "'profile')"
      )
  detail = f" ({' '.join(hints)})" if hints else ""
  return (
    f"Unknown storage option {name_text} for {url!r}{detail}. "
    f"Options for {scheme}:// are: {', '.join(known)}."
  )


class _Lookup:
  """Reads one setting: the storage option if given, else the first set environment variable."""

  def __init__(self, options: dict[str, Any], env: Mapping[str, str], url: str):
    self.options, self.env, self.url = options, env, url

  def raw(self, name: str, *env_vars: str) -> Any:
    if name in self.options and self.options[name] is not None:
      return self.options[name]
    for var in env_vars:
      value = self.env.get(var)
      if value is not None and value.strip() != "":
        return value.strip()
    return None

  def source(self, name: str, *env_vars: str) -> str:
    if name in self.options and self.options[name] is not None:
      return f"storage option {name!r}"
    for var in env_vars:
      value = self.env.get(var)
      if value is not None and value.strip() != "":
        return f"environment variable {var}"
    return f"storage option {name!r}"

  def string(self, name: str, *env_vars: str) -> str | None:
    value = self.raw(name, *env_vars)
    if value is None:
      return None
    if not isinstance(value, str) or not value.strip():
      raise CheckpointError(
        f"{self.source(name, *env_vars)} for {self.url!r} must be a non-empty string, not "
        f"{type(value).__name__}."
      )
    return value.strip()

  def integer(self, name: str, *env_vars: str, minimum: int) -> int | None:
    value = self.raw(name, *env_vars)
    if value is None:
      return None
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
      number = value
    elif isinstance(value, str) and re.fullmatch(r"[+-]?\d+", value):
      number = int(value)
    if number is None or number < minimum:
      raise CheckpointError(
        f"{self.source(name, *env_vars)} for {self.url!r} must be an integer >= {minimum}, "
        f"got {value!r}."
      )
    return number

  def boolean(self, name: str) -> bool | None:
    value = self.raw(name)
    if value is None:
      return None
    if not isinstance(value, bool):
      raise CheckpointError(
        f"storage option {name!r} for {self.url!r} must be True or False, got {value!r}."
      )
    return value

  def duration(self, name: str, *env_vars: str) -> float | None:
    """Seconds, from a number of seconds or a duration string like ``"250ms"``."""
    value = self.raw(name, *env_vars)
    if value is None:
      return None
    seconds: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      seconds = float(value)
    elif isinstance(value, str):
      text = value.strip()
      if re.fullmatch(r"\d+(\.\d+)?", text):
        seconds = float(text)
      elif _DURATION.match(text):
        seconds = sum(
          float(num) * _DURATION_UNITS[unit]
          for num, _, unit in re.findall(r"(\d+(\.\d+)?)(ns|us|ms|s|m|h)", text)
        )
    if seconds is None or not seconds >= 0 or seconds == float("inf"):
      raise CheckpointError(
        f"{self.source(name, *env_vars)} for {self.url!r} must be a number of seconds >= 0 "
        f"or a duration such as '250ms' or '2s', got {value!r}."
      )
    return seconds


def _format_duration(seconds: float) -> str:
  """A TensorStore (absl) duration string for ``seconds``, exact to the microsecond.

  >>> [_format_duration(x) for x in (0, 0.01, 1.5, 2, 1e-6)]
  ['0s', '10ms', '1500ms', '2s', '1us']
  """
  micros = round(seconds * 1_000_000)
  if micros % 1_000_000 == 0:
    return f"{micros // 1_000_000}s"
  if micros % 1_000 == 0:
    return f"{micros // 1_000}ms"
  return f"{micros}us"
