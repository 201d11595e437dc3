"""The host threads: results in order, every call run, errors raised after."""

from __future__ import annotations

import threading

import pytest

from jaxcache._src.threads import HostThreads


@pytest.mark.parametrize("count", [1, 2, 4])
def test_map_keeps_order_and_runs_every_call_before_raising(count):
    ran = []
    lock = threading.Lock()

    def piece(k: int) -> int:
        with lock:
            ran.append(k)
        if k in (3, 5):
            raise ValueError(f"piece {k}")
        return k * k

    threads = HostThreads(count)
    assert threads.map(lambda k: k + 1, range(10)) == list(range(1, 11))
    with pytest.raises(ValueError, match="piece 3"):  # the first in order
        threads.map(piece, range(8))
    assert sorted(ran) == list(range(8))
    results = threads.gather(piece, list(range(8)))
    assert [r for k, r in enumerate(results) if k not in (3, 5)] == [0, 1, 4, 16, 36, 49]
    assert str(results[5].error) == "piece 5"


def test_maps_from_several_threads_at_once_and_inside_a_map():
    threads = HostThreads(2)

    def nested(k: int) -> list[int]:  # a map inside a map's piece
        return threads.map(lambda j: 10 * k + j, range(3))

    outputs: dict[int, list] = {}

    def caller(c: int) -> None:
        outputs[c] = [threads.map(nested, range(5)) for _ in range(20)]

    callers = [threading.Thread(target=caller, args=(c,)) for c in range(3)]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join()
    expected = [[10 * k + j for j in range(3)] for k in range(5)]
    assert all(outputs[c] == [expected] * 20 for c in range(3))
