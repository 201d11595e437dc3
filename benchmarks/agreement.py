"""The per-step agreement on padded sizes between processes, against their count.

A cache whose devices span several processes agrees on each batch's padded
sizes through ``jax.distributed``'s coordination service (``agreement.py``):
each process writes its needs, then (beyond three processes) waits at a
barrier of the cache's processes and reads the batch's directory back, or
(up to three) reads each other's key. This launches 2, 4 and 8 local
processes under ``jax.distributed.initialize`` (CPU, no devices used) and
times, per step and process, that agreement against one blocking read of
each other process's key in turn (the way it was done before), the two
taking turns in blocks of ``BLOCK`` steps.

Medians over the timed steps of process 0. On a machine with fewer cores
than processes the processes take turns on the cores, and every figure
includes that wait; the ratios ``NAME_8_over_2`` say how each way grows
with the processes.

    python benchmarks/agreement.py            # about 20 s on 2 cores
    python benchmarks/agreement.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

BLOCK = 20  # steps one way runs before the other takes its turn
COUNTS = (2, 4, 8)
_TIMEOUT_MS = 120_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_get_per_peer(client, prefix: str, process: int, processes: int, index, needs):
    """The reference: write this process's key, read each other's in turn,
    delete this process's key of 64 batches before."""
    import numpy as np

    client.key_value_set_bytes(f"{prefix}/{index}/{process}", needs.tobytes())
    out = needs.copy()
    for other in range(processes):
        if other != process:
            raw = client.blocking_key_value_get_bytes(f"{prefix}/{index}/{other}", _TIMEOUT_MS)
            np.maximum(out, np.frombuffer(raw, np.int64), out=out)
    if index >= 64:
        client.key_value_delete(f"{prefix}/{index - 64}/{process}")
    return out


def worker(processes: int, process: int, coordinator: str, steps: int) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import numpy as np

    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=processes, process_id=process
    )
    from jax._src import distributed

    from jaxcache._src.agreement import agreement

    client = distributed.global_state.client
    ours = agreement("bench", list(range(processes)), process)
    seconds: dict[str, list[float]] = {"jaxcache": [], "one_get_per_peer": []}
    rng = np.random.default_rng(process)
    for start in range(0, 2 * steps, BLOCK):
        way = "jaxcache" if (start // BLOCK) % 2 == 0 else "one_get_per_peer"
        for index in range(start, start + BLOCK):
            needs = rng.integers(0, 1 << 20, 4).astype(np.int64)
            begin = time.perf_counter()
            if way == "jaxcache":
                ours.max(index, needs)
            else:
                _one_get_per_peer(client, "reference", process, processes, index, needs)
            seconds[way].append(time.perf_counter() - begin)
    print(json.dumps({way: float(np.median(s[BLOCK:])) for way, s in seconds.items()}))
    jax.distributed.shutdown()


def launch(processes: int, steps: int) -> dict[str, float]:
    coordinator = f"127.0.0.1:{_free_port()}"
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(processes), str(i), coordinator, str(steps)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(processes)
    ]
    outputs = [child.communicate(timeout=600)[0] for child in children]
    if any(child.returncode for child in children):
        raise RuntimeError(f"a worker of {processes} processes failed: {outputs}")
    return json.loads(outputs[0].strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        processes, process, coordinator, steps = sys.argv[2:6]
        worker(int(processes), int(process), coordinator, int(steps))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    args = parser.parse_args()
    steps = 60 if args.quick else 200  # per way

    import _harness

    print(f"{_harness.machine()}; {steps} steps per way, turns of {BLOCK}; process 0's medians")
    print(f"{'processes':>9} {'jaxcache us':>12} {'one get per peer us':>20} {'ratio':>6}")
    figures = {}
    for processes in COUNTS:
        result = launch(processes, steps)
        figures[processes] = result
        ours, reference = 1e6 * result["jaxcache"], 1e6 * result["one_get_per_peer"]
        print(f"{processes:>9} {ours:>12.0f} {reference:>20.0f} {ours / reference:>6.2f}")
    first, last = COUNTS[0], COUNTS[-1]
    _harness.print_results(
        {
            f"agreement_{last}_over_{first}": figures[last]["jaxcache"]
            / figures[first]["jaxcache"],
            f"one_get_per_peer_{last}_over_{first}": figures[last]["one_get_per_peer"]
            / figures[first]["one_get_per_peer"],
            f"agreement_over_one_get_per_peer_at_{last}": figures[last]["jaxcache"]
            / figures[last]["one_get_per_peer"],
        }
    )


if __name__ == "__main__":
    main()
