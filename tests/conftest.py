"""Test-session set-up: eight simulated CPU devices, before JAX starts, and
one scratch directory for every temporary file.

Single-device code uses the first device; sharded tests build meshes of 1, 2,
4 and 8 of them.
"""

import os
import shutil
import tempfile

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)


def pytest_configure(config: pytest.Config) -> None:
    # Doctests, examples and the libraries below them (TFDS, orbax) make
    # directories with `tempfile` and leave them; so do the programs the
    # tests start. Put them all in one directory, removed when the run ends
    # (with xdist, each worker's inside the controller's). pytest's own
    # tmp_path directories stay where they were, kept for the last runs.
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    scratch = tempfile.mkdtemp(prefix="jaxcache-tests-")
    os.environ["TMPDIR"] = tempfile.tempdir = scratch
    config.add_cleanup(lambda: shutil.rmtree(scratch, ignore_errors=True))
