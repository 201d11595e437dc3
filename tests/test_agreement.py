"""The padded sizes processes agree on, against an in-memory coordination service.

``tests/test_multiprocess.py`` runs the agreement between real processes
under ``jax.distributed``; here threads stand in for processes, so that
skewed arrivals, many processes and a failing barrier are cheap to try.
"""

from __future__ import annotations

import collections
import re
import threading

import numpy as np
import pytest

from jaxcache._src import agreement as agreement_module
from jaxcache._src.agreement import _KeyValueAgreement


class _Service:
    """The key-value store and barriers of a coordination service (one lock)."""

    def __init__(self, processes: int) -> None:
        self.store: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.barriers: dict[str, threading.Barrier] = {}
        self.processes = processes
        self.requests: collections.Counter[str] = collections.Counter()

    def client(self) -> _Client:
        return _Client(self)


class _Client:
    def __init__(self, service: _Service) -> None:
        self.service = service

    def key_value_set_bytes(self, key: str, value: bytes) -> None:
        with self.service.lock:
            self.service.requests["set"] += 1
            self.service.store[key] = value
            self.service.changed.notify_all()

    def blocking_key_value_get_bytes(self, key: str, timeout_ms: int) -> bytes:
        with self.service.lock:
            self.service.requests["get"] += 1
            store = self.service.store
            if not self.service.changed.wait_for(lambda: key in store, timeout_ms / 1000):
                raise TimeoutError(f"{key} not set")
            return store[key]

    def wait_at_barrier(self, barrier: str, timeout_ms: int, process_ids=None) -> None:
        with self.service.lock:
            self.service.requests["barrier"] += 1
            parties = len(process_ids) if process_ids is not None else self.service.processes
            waiter = self.service.barriers.setdefault(barrier, threading.Barrier(parties))
        waiter.wait(timeout=timeout_ms / 1000)

    def key_value_dir_get_bytes(self, directory: str) -> list[tuple[str, bytes]]:
        with self.service.lock:
            self.service.requests["dir"] += 1
            store = self.service.store
            return [(k, v) for k, v in sorted(store.items()) if k.startswith(directory)]

    def key_value_delete(self, key: str) -> None:  # the key, and the keys under it
        with self.service.lock:
            self.service.requests["delete"] += 1
            store = self.service.store
            for gone in [k for k in store if k == key or k.startswith(key + "/")]:
                del store[gone]


def _in_threads(run, processes: int) -> None:
    """Runs ``run(process)`` in one thread per process; raises the first error."""
    errors: list[BaseException] = []

    def guarded(process: int) -> None:
        try:
            run(process)
        except BaseException as error:  # raised again below
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(p,)) for p in range(processes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _agree(processes: int, steps: int, seed: int = 0):
    """Each of ``processes`` threads agrees on ``steps`` batches' needs;
    returns what each got, the needs drawn, and the service."""
    service = _Service(processes)
    rng = np.random.default_rng(seed)
    needs = rng.integers(0, 1000, size=(steps, processes, 4))
    delays = rng.random((steps, processes)) < 0.3  # skewed arrivals
    got = np.zeros_like(needs)

    def run(process: int) -> None:
        agreement = _KeyValueAgreement(
            service.client(), "jaxcache/t", list(range(10, 10 + processes)), process
        )
        for index in range(steps):
            if delays[index, process]:
                threading.Event().wait(0.001)
            got[index, process] = agreement.max(index, needs[index, process])

    _in_threads(run, processes)
    return got, needs, service


@pytest.mark.parametrize("processes", [2, 3, 4, 7])
def test_every_process_gets_the_elementwise_maximum_of_every_batch(processes):
    got, needs, service = _agree(processes, steps=30)
    expected = needs.max(axis=1, keepdims=True)
    np.testing.assert_array_equal(got, np.broadcast_to(expected, got.shape))
    # Old batches' keys are deleted: the store holds the last few plans only.
    assert len(service.store) == processes * agreement_module._KEEP


@pytest.mark.parametrize("processes", [2, 3, 4, 8])
def test_requests_per_process_and_batch_stay_few_however_many_processes(processes):
    steps = 20
    _, _, service = _agree(processes, steps)
    requests = service.requests
    # One process deletes each batch's directory once it is out of the window.
    assert requests.pop("delete") == steps - agreement_module._KEEP
    assert requests.pop("set") == processes * steps
    if processes <= agreement_module._READ_EACH:  # a read of each other process's key
        assert requests == {"get": (processes - 1) * processes * steps}
    else:  # a barrier and a read of the batch's directory
        assert requests == {"barrier": processes * steps, "dir": processes * steps}


def test_a_process_that_never_arrives_is_named_in_the_error(monkeypatch):
    monkeypatch.setattr(agreement_module, "_TIMEOUT_MS", 50)
    for processes in (2, 5):  # a read per process, and the barrier
        members = list(range(processes))
        agreement = _KeyValueAgreement(_Service(processes).client(), "jaxcache/t", members, 0)
        with pytest.raises(
            RuntimeError, match=re.escape(f"processes {members} did not all publish") + ".* 7 "
        ):
            agreement.max(7, np.array([1, 2]))


def test_keys_of_another_program_in_the_directory_are_an_error():
    service = _Service(4)
    service.store["jaxcache/t/0/9"] = np.array([3, 5], np.int64).tobytes()  # exchange 0
    members = [4, 5, 6, 7]
    agreements = [_KeyValueAgreement(service.client(), "jaxcache/t", members, p) for p in range(4)]
    errors: list[BaseException] = []

    def run(agreement):
        try:
            agreement.max(3, np.array([1]))
        except RuntimeError as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(a,)) for a in agreements]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(errors) == 4 and all("sizes from 5 processes" in str(e) for e in errors)


@pytest.mark.parametrize("processes", [2, 5])
def test_every_process_gathers_every_processes_values_beside_the_maximum(processes):
    # Each batch, each process publishes its needs and, on a sibling's keys,
    # a [3, Q] array of a length of its own (the sampled ids a plan lists).
    service = _Service(processes)
    rng = np.random.default_rng(1)
    steps = 12
    values = [
        [rng.integers(-(1 << 40), 1 << 40, (3, int(rng.integers(0, 5)))) for _ in range(processes)]
        for _ in range(steps)
    ]
    got: dict[int, list] = {}

    def run(process: int) -> None:
        agreement = _KeyValueAgreement(
            service.client(), "jaxcache/t", list(range(processes)), process
        )
        sibling = agreement.sibling("learner")
        got[process] = [
            (agreement.max(i, np.array([process])), sibling.gather(i, values[i][process]))
            for i in range(steps)
        ]

    _in_threads(run, processes)
    for process in range(processes):
        for i, (most, parts) in enumerate(got[process]):
            assert most.tolist() == [processes - 1]
            assert len(parts) == processes
            for part, sent in zip(parts, values[i], strict=True):
                np.testing.assert_array_equal(part, sent)
    # Both exchanges delete their old batches.
    assert len(service.store) == 2 * processes * agreement_module._KEEP


@pytest.mark.parametrize("processes", [2, 5])
def test_a_plan_exchanged_again_after_a_restore_agrees_anew(processes):
    # A restore in place plans indices the processes exchanged already (as
    # does a plan refused for room): keys named by plan index were written
    # twice, which the coordination service refuses.
    service = _Service(processes)
    got: dict[int, list[int]] = {}

    def run(process: int) -> None:
        agreement = _KeyValueAgreement(
            service.client(), "jaxcache/t", list(range(processes)), process
        )
        plans = [0, 1, 2, 3, 2, 3, 4, 4]  # back to 2; 4 refused, then again
        got[process] = [
            int(agreement.max(i, np.array([10 * k + process]))[0]) for k, i in enumerate(plans)
        ]

    _in_threads(run, processes)
    expected = [10 * k + processes - 1 for k in range(8)]
    assert all(got[p] == expected for p in range(processes))


@pytest.mark.parametrize("processes", [2, 5])
def test_processes_out_of_step_are_an_error(processes):
    service = _Service(processes)
    errors: list[str] = []

    def run(process: int) -> None:
        agreement = _KeyValueAgreement(
            service.client(), "jaxcache/t", list(range(processes)), process
        )
        try:
            agreement.max(1 if process == 0 else 0, np.array([1]))
        except RuntimeError as error:
            errors.append(str(error))

    _in_threads(run, processes)
    assert len(errors) == processes and all("out of step" in e for e in errors)
