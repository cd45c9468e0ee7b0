"""Test setup: 8 virtual CPU devices, configured before JAX starts any backend."""

import os

os.environ.setdefault("XLA_FLAGS", "")
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from servers import gcs, gcs_env, s3, s3_env  # noqa: E402,F401  (object-store test servers)
