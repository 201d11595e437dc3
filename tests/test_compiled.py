"""The on-disk cache of compiled kernels, shared by processes that compile at once."""

import itertools
import threading

import numba
import pytest
from numba.core import caching

from jaxcache._src import compiled, dram_tier, kernels, replay, row_log

KEYS = {"a": (("int64",), "magic"), "b": (("float32",), "magic")}
STEPS = ("_load_index", "_save_index", "_save_data")  # the file operations of a save


def _race(files_class, schedule, directory):
    """Two processes' cache files save versions ``a`` and ``b`` of one kernel,
    their file operations interleaved in the order ``schedule`` names them
    (``"aab..."``); returns what a third process then loads for each key."""
    turn = threading.Condition()
    order = list(schedule)

    def in_turn(name, method):
        def step(*args):
            with turn:
                turn.wait_for(lambda: order and order[0] == name)
            try:
                return method(*args)
            finally:
                with turn:
                    order.pop(0)
                    turn.notify_all()

        return step

    def save(name):
        files = files_class(str(directory), "kernel-1.py311", source_stamp=1)
        for step in STEPS:
            setattr(files, step, in_turn(name, getattr(files, step)))
        files.save(KEYS[name], f"code for {name}")
        with turn:  # steps a save skipped (an index entry already there)
            order[:] = [n for n in order if n != name]
            turn.notify_all()

    threads = [threading.Thread(target=save, args=(name,)) for name in KEYS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert not any(t.is_alive() for t in threads), f"schedule {schedule} did not finish"
    loader = files_class(str(directory), "kernel-1.py311", source_stamp=1)
    return {name: loader.load(key) for name, key in KEYS.items()}


@pytest.mark.parametrize(
    "schedule",
    sorted({"".join(p) for p in itertools.permutations("aaabbb")}),
)
def test_saves_racing_in_any_order_never_pair_a_key_with_other_code(tmp_path, schedule):
    loaded = _race(compiled.KeyedCacheFile, schedule, tmp_path)
    for name, code in loaded.items():
        assert code in (None, f"code for {name}"), (schedule, loaded)
    # The one saved last keeps its index entry.
    assert loaded[schedule[-1]] == f"code for {schedule[-1]}"


def test_numbas_own_cache_files_are_not_trusted(tmp_path):
    key = KEYS["a"]
    theirs = caching.IndexDataCacheFile(str(tmp_path), "kernel-1.py311", source_stamp=1)
    theirs.save(key, "code for a")
    ours = compiled.KeyedCacheFile(str(tmp_path), "kernel-1.py311", source_stamp=1)
    assert ours.load(key) is None  # written under a counter: compiled again
    ours.save(key, "code for a")
    assert ours.load(key) == "code for a"


def test_every_kernel_uses_the_keyed_cache():
    dispatchers = [
        value
        for module in (kernels, dram_tier, row_log, replay)
        for value in vars(module).values()
        if isinstance(value, numba.core.registry.CPUDispatcher)
    ]
    assert len(dispatchers) >= 40
    for dispatcher in dispatchers:
        assert isinstance(dispatcher._cache._cache_file, compiled.KeyedCacheFile), dispatcher
