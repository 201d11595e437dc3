"""Test-session set-up: eight simulated CPU devices, before JAX starts, one
scratch directory for every temporary file, and one compilation cache for
the run.

Single-device code uses the first device; sharded tests build meshes of 1, 2,
4 and 8 of them.
"""

import os
import shutil
import tempfile

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)
# The tests compile many small programs and run each a few times, so
# compile time is most of their time. LLVM's lowest optimization level
# halves the time of a test that compiles the device planner's programs (39
# against 24 s for one sharded training test), and XLA:CPU's older loop
# emitters compile the device planner's plan in half the time of its fusion
# emitters. Neither changes a result a test compares: XLA's own
# passes still run, and a test's cache and its reference compile alike. The
# programs the tests start inherit them; benchmarks run without them.
_TEST_FLAGS = {
    "xla_backend_optimization_level": "0",
    "xla_cpu_use_fusion_emitters": "false",
}
for _flag, _value in _TEST_FLAGS.items():
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --{_flag}={_value}").strip()


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
    # Many tests compile the same programs: the exactness matrix builds one
    # step per optimizer whatever the policy, and the reference, examples and
    # docs pages build theirs again. XLA's compilation cache on disk, in the
    # controller's scratch directory, lets the xdist workers and the programs
    # the tests start (examples, processes: they inherit the variables)
    # compile each program once per run; it took three test files from 354
    # to 156 s on 2 cores. A hit still counts as a compilation in
    # ``jaxcache.testing.compilations`` (JAX reports it as one). An entry
    # read while another process writes it fails to load and is compiled
    # again, with a warning (the docs build, where a warning is an error,
    # keeps a cache of its own); results never depend on the cache.
    directory = os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(scratch, "xla"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update(
        "jax_persistent_cache_min_compile_time_secs",
        float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
    )


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    # Each XLA:CPU executable keeps a few memory mappings of its code until
    # JAX drops it (about 3 for a small program). Workers that kept every
    # program of the run died inside XLA late in it (an abort or a
    # segmentation fault while compiling or loading a program), likely at
    # the kernel's limit of 65,530 mappings. Programs are dropped after each
    # module (the disk cache above makes compiling them again cheap).
    yield
    jax.clear_caches()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Modules that use the ``planner`` fixture run each test with both planners.
    if "planner" in metafunc.fixturenames:
        metafunc.parametrize("planner", ["host", "device"], indirect=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # ... but for tests (or cases) of the host planner's own machinery,
    # marked ``host_planner``: partitions per device, host threads, fixed
    # route sizes, the host-callback form; and for tests that build no
    # planner at all (``no_planner``: a table, a read of device arrays).
    keep, drop = [], []
    for item in items:
        params = getattr(item, "callspec", None)
        device = params is not None and params.params.get("planner") == "device"
        once = item.get_closest_marker("host_planner") or item.get_closest_marker("no_planner")
        (drop if device and once else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    # Modules with a test of a minute or more run first, whole (their module
    # fixtures are set up once): the workers then share the short tests,
    # rather than one of them waiting at the end on the other's long one.
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


@pytest.fixture
def planner(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The planner every cache of the test uses (``JAXCACHE_PLANNER``, which
    processes the test starts inherit)."""
    monkeypatch.setenv("JAXCACHE_PLANNER", request.param)
    return request.param
