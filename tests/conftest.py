"""Test setup: 8 virtual CPU devices, configured before JAX starts any backend."""

import os

os.environ.setdefault("XLA_FLAGS", "")
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from servers import gcs, gcs_env, s3, s3_env  # noqa: E402,F401  (object-store test servers)

import pytest  # noqa: E402

# Modules whose tests start several jax.distributed processes with barrier deadlines and
# assert where each process learned of a failure: under pytest-xdist (`--dist loadgroup`)
# they run one at a time on one worker, beside the other workers' single-process tests.
PROCESS_MODULES = {"test_broadcast_mp", "test_collective_mp", "test_manager_mp",
                   "test_multiprocess", "test_peers_mp", "test_faults", "test_perprocess"}


def pytest_collection_modifyitems(config, items):
  for item in items:
    if item.module is not None and item.module.__name__ in PROCESS_MODULES:
      item.add_marker(pytest.mark.xdist_group("processes"))
