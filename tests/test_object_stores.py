"""gs:// and s3:// plumbing: URL + storage_options + environment -> TensorStore kvstore spec, and
the resulting kvstores against real local servers (SeaweedFS for S3, fake-gcs-server for GCS)."""

from __future__ import annotations

import doctest
import os
import subprocess
import sys
import textwrap
import time

import pytest
import tensorstore as ts

from fnckpt._io import object_stores as _object_stores, paths as _paths
from fnckpt._errors import CheckpointError

import servers

# The server fixtures live in tests/servers.py and tests/conftest.py imports them; import them
# here only while conftest does not, so that one server of each kind serves the whole session.
if not hasattr(sys.modules.get("conftest"), "s3_env"):
  from servers import gcs, gcs_env, s3, s3_env  # noqa: F401

# Every variable kvstore_spec reads, cleared for the pure tests so the host's settings (or a
# server fixture's) cannot leak in.
_ENV_VARS = (
    "FNCKPT_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "AWS_REGION", "AWS_DEFAULT_REGION",
    "FNCKPT_S3_CREDENTIALS", "FNCKPT_REQUEST_CONCURRENCY", "FNCKPT_REQUEST_RETRIES",
    "FNCKPT_REQUEST_INITIAL_DELAY", "FNCKPT_REQUEST_MAX_DELAY", "TENSORSTORE_GCS_HTTP_URL",
    "STORAGE_EMULATOR_HOST", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")

NO_VALUE = b"\x02"  # StorageGeneration::NoValue: "write only if absent"
FAST = {"max_retries": 1, "initial_delay": "10ms", "max_delay": "50ms"}
BOUND_S = 15.0  # an error must surface within this many seconds


@pytest.fixture
def clean_env(monkeypatch):
  for name in _ENV_VARS:
    monkeypatch.delenv(name, raising=False)
  return monkeypatch


# ---------------------------------------------------------------------------------------------
# pure: specs


def test_doctests():
  result = doctest.testmod(_object_stores, optionflags=doctest.ELLIPSIS)
  assert result.attempted >= 4 and result.failed == 0


def test_defaults(clean_env):
  assert _paths.kvstore_spec("s3://bucket/run/10") == {
      "driver": "s3", "bucket": "bucket", "path": "run/10/"}
  assert _paths.kvstore_spec("gs://bucket/run/10/") == {
      "driver": "gcs", "bucket": "bucket", "path": "run/10/"}
  assert _paths.kvstore_spec("gs://bucket") == {"driver": "gcs", "bucket": "bucket", "path": ""}
  assert _paths.kvstore_spec("s3://bucket/") == {"driver": "s3", "bucket": "bucket", "path": ""}


def test_s3_all_options(clean_env):
  options = {"endpoint": "https://minio.local:9000/", "region": "eu-west-1",
             "host_header": "bucket.minio.local", "credentials": "anonymous",
             "requester_pays": True, "conditional_write": False, "concurrency": 16,
             "max_retries": 0, "initial_delay": 0.25, "max_delay": "2s"}
  before = dict(options)
  spec = _paths.kvstore_spec("s3://bucket/a/b", options)
  assert options == before  # the caller's dict is not consumed
  assert spec == {
      "driver": "s3", "bucket": "bucket", "path": "a/b/", "endpoint": "https://minio.local:9000",
      "aws_region": "eu-west-1", "host_header": "bucket.minio.local", "requester_pays": True,
      "use_conditional_write": False, "aws_credentials": {"type": "anonymous"},
      "s3_request_concurrency": {"limit": 16},
      "s3_request_retries": {"max_retries": 0, "initial_delay": "250ms", "max_delay": "2s"}}
  # TensorStore accepts it, inline resources included (parsing only, no I/O).
  assert ts.KvStore.Spec(spec).to_json()["bucket"] == "bucket"


def test_gs_all_options(clean_env):
  spec = _paths.kvstore_spec("gs://bucket/x", {"user_project": "proj", "concurrency": "4",
                                               "max_retries": 3, "max_delay": "1m"})
  assert spec == {"driver": "gcs", "bucket": "bucket", "path": "x/",
                  "gcs_user_project": {"project_id": "proj"},
                  "gcs_request_concurrency": {"limit": 4},
                  "gcs_request_retries": {"max_retries": 3, "max_delay": "60s"}}
  assert ts.KvStore.Spec(spec).to_json()["driver"] == "gcs"


def test_environment_and_precedence(clean_env):
  clean_env.setenv("AWS_ENDPOINT_URL", "http://generic:1")
  assert _paths.kvstore_spec("s3://bucket/x")["endpoint"] == "http://generic:1"
  clean_env.setenv("AWS_ENDPOINT_URL_S3", "http://s3-specific:2")
  assert _paths.kvstore_spec("s3://bucket/x")["endpoint"] == "http://s3-specific:2"
  clean_env.setenv("FNCKPT_S3_ENDPOINT", "http://ours:3")
  assert _paths.kvstore_spec("s3://bucket/x")["endpoint"] == "http://ours:3"
  assert _paths.kvstore_spec("s3://bucket/x", {"endpoint": "http://call:4"})["endpoint"] == \
      "http://call:4"
  clean_env.delenv("FNCKPT_S3_ENDPOINT")
  clean_env.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")
  assert "endpoint" not in _paths.kvstore_spec("s3://bucket/x")

  clean_env.setenv("AWS_DEFAULT_REGION", "us-west-2")
  assert _paths.kvstore_spec("s3://bucket/x")["aws_region"] == "us-west-2"
  clean_env.setenv("AWS_REGION", "eu-central-1")
  assert _paths.kvstore_spec("s3://bucket/x")["aws_region"] == "eu-central-1"
  assert _paths.kvstore_spec("s3://bucket/x", {"region": "ap-south-1"})["aws_region"] == \
      "ap-south-1"

  clean_env.setenv("FNCKPT_S3_CREDENTIALS", "environment")
  clean_env.setenv("FNCKPT_REQUEST_CONCURRENCY", "12")
  clean_env.setenv("FNCKPT_REQUEST_RETRIES", "5")
  clean_env.setenv("FNCKPT_REQUEST_INITIAL_DELAY", "0.5")
  clean_env.setenv("FNCKPT_REQUEST_MAX_DELAY", "10s")
  spec = _paths.kvstore_spec("s3://bucket/x")
  assert spec["aws_credentials"] == {"type": "environment"}
  assert spec["s3_request_concurrency"] == {"limit": 12}
  assert spec["s3_request_retries"] == {"max_retries": 5, "initial_delay": "500ms",
                                        "max_delay": "10s"}
  gspec = _paths.kvstore_spec("gs://bucket/x", {"max_retries": 1})
  assert gspec["gcs_request_concurrency"] == {"limit": 12}
  assert gspec["gcs_request_retries"] == {"max_retries": 1, "initial_delay": "500ms",
                                          "max_delay": "10s"}
  assert "aws_region" not in gspec and "aws_credentials" not in gspec
  spec = _paths.kvstore_spec("s3://bucket/x", {"credentials": "default", "concurrency": 2})
  assert spec["aws_credentials"] == {"type": "default"}
  assert spec["s3_request_concurrency"] == {"limit": 2}


def test_split_context_resources_share_one_limit(clean_env):
  spec = _paths.kvstore_spec("s3://bucket/x", {"endpoint": "http://127.0.0.1:9",
                                               "region": "us-east-1", "concurrency": 3,
                                               "max_retries": 1, "credentials": "anonymous"})
  bare, resources = _object_stores.split_context_resources(spec)
  assert resources == {"aws_credentials": {"type": "anonymous"},
                       "s3_request_concurrency": {"limit": 3},
                       "s3_request_retries": {"max_retries": 1}}
  assert set(bare) == {"driver", "bucket", "path", "endpoint", "aws_region"}
  ctx = ts.Context(resources)
  for key in ("a/", "b/"):  # no I/O: region and endpoint are given
    kv = ts.KvStore.open({**bare, "path": bare["path"] + key}, context=ctx).result()
    assert "s3_request_concurrency" not in kv.spec().to_json()


def test_credentials_forms(clean_env):
  def creds(options):
    return _paths.kvstore_spec("s3://bucket/x", options).get("aws_credentials")

  assert creds({}) is None  # TensorStore's default chain
  assert creds({"profile": "dev"}) == {"type": "profile", "profile": "dev"}
  assert creds({"credentials": "default", "profile": "dev"}) == {"type": "default",
                                                                 "profile": "dev"}
  given = {"type": "profile", "credentials_file": "/x/credentials"}
  assert creds({"credentials": given}) == given
  for kind in _object_stores.AWS_CREDENTIAL_TYPES:
    assert creds({"credentials": kind}) == {"type": kind}
  # Keys in the environment: name the provider the default chain would pick anyway.
  clean_env.setenv("AWS_ACCESS_KEY_ID", "id")
  assert creds({}) is None  # the secret is missing
  clean_env.setenv("AWS_SECRET_ACCESS_KEY", "secret")
  assert creds({}) == {"type": "environment"}
  assert creds({"profile": "dev"}) == {"type": "profile", "profile": "dev"}
  assert creds({"credentials": "default"}) == {"type": "default"}


@pytest.mark.parametrize("url, options, env, match", [
    ("s3://", None, {}, r"'s3://' names no bucket"),
    ("gs:///x", None, {}, r"'gs:///x' names no bucket"),
    ("s3://ab/x", None, {}, r"'ab' in 's3://ab/x' is not a valid bucket name"),
    ("gs://Bad_Bucket/x", None, {}, r"'Bad_Bucket' in 'gs://Bad_Bucket/x' is not a valid"),
    ("s3://bucket//x", None, {}, r"'s3://bucket//x' has an empty, '\.' or '\.\.' path"),
    ("gs://bucket/a/../b", None, {}, r"'\.\.' path component"),
    ("s3://bucket/x", {"endpoint_url": "http://h:1"}, {},
     r"Unknown storage option 'endpoint_url' for 's3://bucket/x' \(did you mean 'endpoint'\?\)"),
    ("gs://bucket/x", {"endpoint": "http://h:1"}, {},
     r"Unknown storage option 'endpoint' for 'gs://bucket/x' .*TENSORSTORE_GCS_HTTP_URL"),
    ("gs://bucket/x", {"credentials": "anonymous"}, {},
     r"Unknown storage option 'credentials' for 'gs://bucket/x'.*GOOGLE_APPLICATION_CREDENTIALS"),
    ("s3://bucket/x", {"user_project": "p"}, {}, r"'user_project' for 's3://bucket/x'.*requester"),
    ("s3://bucket/x", {"endpoint": "localhost:9000"}, {},
     r"S3 endpoint 'localhost:9000' \(storage option 'endpoint'\) for 's3://bucket/x' is not"),
    ("s3://bucket/x", None, {"FNCKPT_S3_ENDPOINT": "ftp://h"},
     r"\(environment variable FNCKPT_S3_ENDPOINT\) for 's3://bucket/x' is not an http"),
    ("s3://bucket/x", {"host_header": "h"}, {}, r"'host_header' for 's3://bucket/x' needs an"),
    ("s3://bucket/x", {"concurrency": 0}, {}, r"'concurrency' for 's3://bucket/x' must be an "
                                              r"integer >= 1, got 0"),
    ("s3://bucket/x", None, {"FNCKPT_REQUEST_CONCURRENCY": "many"},
     r"environment variable FNCKPT_REQUEST_CONCURRENCY for 's3://bucket/x' must be an integer"),
    ("gs://bucket/x", {"max_retries": -1}, {}, r"'max_retries' for 'gs://bucket/x' must be an "
                                               r"integer >= 0"),
    ("s3://bucket/x", {"max_retries": True}, {}, r"'max_retries' .* must be an integer"),
    ("s3://bucket/x", {"initial_delay": "soon"}, {}, r"'initial_delay' .* duration such as"),
    ("s3://bucket/x", None, {"FNCKPT_REQUEST_MAX_DELAY": "-1"},
     r"environment variable FNCKPT_REQUEST_MAX_DELAY .* must be a number of seconds"),
    ("s3://bucket/x", {"initial_delay": 5, "max_delay": 1}, {},
     r"max_delay \(1s\) is shorter than initial_delay \(5s\) for 's3://bucket/x'"),
    ("s3://bucket/x", {"requester_pays": "yes"}, {}, r"'requester_pays' .* True or False"),
    ("s3://bucket/x", {"credentials": "session"}, {}, r"'credentials' for 's3://bucket/x' must "
                                                      r"be one of default, environment"),
    ("s3://bucket/x", None, {"FNCKPT_S3_CREDENTIALS": "magic"},
     r"environment variable FNCKPT_S3_CREDENTIALS for 's3://bucket/x' must be one of"),
    ("s3://bucket/x", {"credentials": {"profile": "p"}}, {}, r"must have a 'type' among"),
    ("s3://bucket/x", {"credentials": "anonymous", "profile": "p"}, {},
     r"'profile' for 's3://bucket/x' conflicts with credentials of type 'anonymous'"),
    ("gs://bucket/x", None, {"STORAGE_EMULATOR_HOST": "http://127.0.0.1:1"},
     r"STORAGE_EMULATOR_HOST is set but TensorStore does not read it.*TENSORSTORE_GCS_HTTP_URL"),
    ("memory://x", {"concurrency": 1}, {}, r"storage_options \['concurrency'\] are not used by"),
])
def test_errors(clean_env, url, options, env, match):
  for name, value in env.items():
    clean_env.setenv(name, value)
  with pytest.raises(CheckpointError, match=match):
    _paths.kvstore_spec(url, options)


@pytest.mark.parametrize("options", [
    {"aws_secret_access_key": "s3cr3t-VALUE"},
    {"secret": "s3cr3t-VALUE"},
    {"credentials": "s3cr3t-VALUE"},
    {"credentials": {"type": "s3cr3t-VALUE"}},
    {"endpoint": "http://AKIA:s3cr3t-VALUE@127.0.0.1:9000"},
])
def test_errors_never_echo_secrets(clean_env, options):
  with pytest.raises(CheckpointError) as info:
    _paths.kvstore_spec("s3://bucket/x", options)
  assert "s3cr3t-VALUE" not in str(info.value)
  assert "s3://bucket/x" in str(info.value)


# ---------------------------------------------------------------------------------------------
# against real servers


@pytest.fixture(params=["s3", "gcs"])
def server(request) -> servers.ObjectStoreServer:
  """Each server in turn, with its environment applied for the test."""
  return request.getfixturevalue(f"{request.param}_env")


def _list(kv: ts.KvStore, *args) -> list[bytes]:
  return sorted(kv.list(*args).result())


@pytest.mark.parametrize("extra", [{}, {"concurrency": 4, **FAST}], ids=["defaults", "tuned"])
def test_write_read_list_delete(server, extra):
  url = server.unique_url()
  kv = _paths.open_kvstore(url, {**server.storage_options, **extra})
  assert kv.spec().to_json()["path"].endswith("/")
  kv.write("manifest.msgpack", b"m").result()
  kv.write("leaf/zarr.json", b"{}").result()
  kv.write("leaf/c/0", b"\x00" * 1000).result()
  kv.write("other/c/0", b"x").result()
  assert kv.read("leaf/c/0").result().value == b"\x00" * 1000
  assert _list(kv) == [b"leaf/c/0", b"leaf/zarr.json", b"manifest.msgpack", b"other/c/0"]
  assert _list(kv, ts.KvStore.KeyRange("leaf/", "leaf0")) == [b"leaf/c/0", b"leaf/zarr.json"]
  kv.delete_range(ts.KvStore.KeyRange("leaf/", "leaf0")).result()
  assert _list(kv) == [b"manifest.msgpack", b"other/c/0"]
  missing = kv.read("leaf/zarr.json").result()
  assert missing.state == "missing"
  # The directory is a prefix: a sibling directory sees none of it.
  assert _list(_paths.open_kvstore(url + "-sibling", server.storage_options)) == []
  kv.delete_range(ts.KvStore.KeyRange()).result()
  assert _list(kv) == []


def test_conditional_writes(s3_env):
  """SeaweedFS honours If-None-Match / If-Match (fnckpt itself does not rely on them)."""
  server = s3_env
  assert server.conditional_writes
  kv = _paths.open_kvstore(server.unique_url(), server.storage_options)
  first = kv.write("COMMIT", b"1", if_equal=NO_VALUE).result()
  assert first.generation  # written
  assert not kv.write("COMMIT", b"2", if_equal=NO_VALUE).result().generation  # refused
  assert not kv.write("COMMIT", b"3", if_equal=b"\x00\"stale\"").result().generation
  assert kv.write("COMMIT", b"4", if_equal=first.generation).result().generation
  assert kv.read("COMMIT").result().value == b"4"
  # Racing create-if-absent writes: exactly one wins.
  futures = [kv.write("race", str(i).encode(), if_equal=NO_VALUE) for i in range(8)]
  assert sum(bool(f.result().generation) for f in futures) == 1


def test_gcs_conditional_writes_as_the_fixture_reports(gcs_env):
  """fake-gcs-server (before fsouza/fake-gcs-server#2308) ignores ifGenerationMatch on simple
  uploads; the fixture probes this. Hold TensorStore's view to the fixture's report, so a
  server that starts honouring preconditions flips ``conditional_writes`` and this test with
  it (the full semantics are then those of test_conditional_writes)."""
  kv = _paths.open_kvstore(gcs_env.unique_url(), gcs_env.storage_options)
  assert kv.write("COMMIT", b"1", if_equal=NO_VALUE).result().generation
  refused = not kv.write("COMMIT", b"2", if_equal=NO_VALUE).result().generation
  assert refused == gcs_env.conditional_writes
  assert kv.read("COMMIT").result().value == (b"1" if refused else b"2")


def test_s3_settings_from_environment_only(s3_env):
  """What a subprocess gets: FNCKPT_S3_ENDPOINT / FNCKPT_S3_CREDENTIALS, no storage options."""
  kv = _paths.open_kvstore(s3_env.unique_url())
  assert kv.spec().to_json()["endpoint"] == s3_env.endpoint
  kv.write("k", b"v").result()
  assert kv.read("k").result().value == b"v"


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_subprocess_with_server_env(request, kind):
  server = request.getfixturevalue(kind)  # env NOT applied in this process
  url = server.unique_url()
  code = textwrap.dedent(f"""
      from fnckpt._io import paths as _paths
      kv = _paths.open_kvstore({url!r})
      kv.write("from-child", b"hello").result()
      print(sorted(kv.list().result()))
  """)
  env = {k: v for k, v in os.environ.items() if k not in _ENV_VARS}
  env.update(server.env)
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
  assert out.returncode == 0, out.stderr[-3000:]
  assert "[b'from-child']" in out.stdout
  # ... and this process (with the env applied) sees the child's object.
  for name, value in server.env.items():
    request.getfixturevalue("monkeypatch").setenv(name, value)
  kv = _paths.open_kvstore(url, server.storage_options)
  assert kv.read("from-child").result().value == b"hello"


def _assert_fails_fast(fn, match):
  start = time.monotonic()
  with pytest.raises(ValueError, match=match):
    fn()
  assert time.monotonic() - start < BOUND_S


def test_missing_bucket_fails_fast(server):
  url = f"{server.url.split('://')[0]}://fnckpt-no-such-bucket/x"
  kv = _paths.open_kvstore(url, {**server.storage_options, **FAST})
  _assert_fails_fast(lambda: kv.write("k", b"v").result(), "NOT_FOUND")
  if server.kind == "s3":
    _assert_fails_fast(lambda: kv.list().result(), "NOT_FOUND.*NoSuchBucket")
  # Quirks (both servers, and real S3/GCS too): a read in a missing bucket is a missing key, not
  # an error; fake-gcs-server also lists a missing bucket as empty.
  assert kv.read("k").result().state == "missing"


def test_s3_wrong_credentials_fail_fast(s3_env, monkeypatch):
  monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
  kv = _paths.open_kvstore(s3_env.unique_url(), {**s3_env.storage_options, **FAST})
  for op in (lambda: kv.write("k", b"v").result(), lambda: kv.list().result(),
             lambda: kv.read("k").result()):
    _assert_fails_fast(op, "PERMISSION_DENIED.*SignatureDoesNotMatch")
  anonymous = _paths.open_kvstore(s3_env.unique_url(),
                                  {**s3_env.storage_options, **FAST, "credentials": "anonymous"})
  _assert_fails_fast(lambda: anonymous.write("k", b"v").result(), "PERMISSION_DENIED.*Access")


def test_s3_unreachable_endpoint_fails_fast(s3_env):
  (port,) = servers._free_ports(1)  # nothing listens there
  kv = _paths.open_kvstore(s3_env.unique_url(), {**s3_env.storage_options, **FAST,
                                                 "endpoint": f"http://127.0.0.1:{port}"})
  _assert_fails_fast(lambda: kv.write("k", b"v").result(), "retry attempts failed")


def test_s3_credentials_file_profile(s3, monkeypatch, clean_env):
  """Credentials from a file named in the spec: no AWS_* variables needed at all."""
  for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE",
               "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
  creds = {"type": "profile", "profile": s3.env["AWS_PROFILE"],
           "credentials_file": s3.env["AWS_SHARED_CREDENTIALS_FILE"],
           "config_file": s3.env["AWS_CONFIG_FILE"]}
  kv = _paths.open_kvstore(s3.unique_url(), {"endpoint": s3.endpoint, "credentials": creds})
  kv.write("k", b"v").result()
  assert _list(kv) == [b"k"]


def test_servers_report_their_setup(s3, gcs):
  assert s3.url == "s3://fnckpt-test/" and gcs.url == "gs://fnckpt-test/"
  for server in (s3, gcs):
    assert server.endpoint.startswith("http://127.0.0.1:")
    assert server.startup_s < servers.READY_TIMEOUT_S
  assert s3.conditional_writes  # SeaweedFS honours If-None-Match / If-Match
  assert s3.env["AWS_EC2_METADATA_DISABLED"] == "true"
  assert "GOOGLE_AUTH_TOKEN_FOR_TESTING" in gcs.env
