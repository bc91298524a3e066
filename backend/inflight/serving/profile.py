"""Where the serving process spends its time, by part: wall seconds, the thread's CPU seconds (their
difference is time spent waiting: for the GPU, for the server's reply to a message, or for the
interpreter lock while another thread runs) and how often each part ran. Exported as Triton metrics
(metrics.py) and read by the serving benchmark as differences over a run.

Parts: `engine_step` (the engine's step: scheduling, the model, sampling, detokenizing),
`engine_waits_for_sends` (the engine waits for a step's responses: CPU engines), `report_metrics` (the
engine's gauges and counters to the server), `build_response` (a delta into output tensors),
`send_response` (handing a response to the server: a message and its reply), `observe_latency`
(time-to-first-token and inter-token samples), `poll_cancelled` (asking the server which requests
their clients cancelled), `collect_garbage` (the cyclic garbage collector's pauses, whichever thread
they stop: heap.py). Each thread keeps its own totals; a snapshot sums them."""

import gc
import threading
import time
from contextlib import contextmanager, nullcontext

_UNTIMED = nullcontext()
PARTS = ("engine_step", "engine_waits_for_sends", "report_metrics", "build_response", "send_response",
         "observe_latency", "poll_cancelled", "collect_garbage")

# The collector's pauses in this process, timed by one callback however many profiles it has.
_collections = {part: [0.0, 0.0, 0] for part in PARTS}
_collection_began = [0.0, 0.0]


def _time_collection(phase: str, info: dict) -> None:
    if phase == "start":
        _collection_began[:] = time.perf_counter(), time.thread_time()
        return
    totals = _collections["collect_garbage"]
    totals[0] += time.perf_counter() - _collection_began[0]
    totals[1] += time.thread_time() - _collection_began[1]
    totals[2] += 1


class ServingProfile:
    def __init__(self, enabled: bool = True):
        """Disabled, `timing` costs nothing (timed, a part costs about 2 µs: two thread-CPU clock reads)."""
        self.enabled = enabled
        self._local = threading.local()
        self._threads: list[dict[str, list]] = []  # each thread's totals: part -> [wall, cpu, count]
        self.remote: dict | None = None  # another process's snapshot, added to this one's (engine_process.py)
        if enabled and _time_collection not in gc.callbacks:
            gc.callbacks.append(_time_collection)

    def _totals(self) -> dict[str, list]:
        totals = getattr(self._local, "totals", None)
        if totals is None:  # the first part this thread times
            totals = self._local.totals = {part: [0.0, 0.0, 0] for part in PARTS}
            self._threads.append(totals)
        return totals

    def timing(self, part: str):
        return self._timed(part) if self.enabled else _UNTIMED

    @contextmanager
    def _timed(self, part: str):
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            totals = self._totals()[part]
            totals[0] += time.perf_counter() - wall
            totals[1] += time.thread_time() - cpu
            totals[2] += 1

    def snapshot(self) -> dict[str, tuple[float, float, int]]:
        """part -> (wall seconds, CPU seconds, times run) so far, summed over threads (and `remote`); the
        collector's pauses are the process's since its first profile."""
        threads = [{part: tuple(values) for part, values in t.items()} for t in (*self._threads, _collections)]
        if self.remote is not None:
            threads.append(self.remote)
        return {part: tuple(sum(t[part][i] for t in threads) for i in range(3)) for part in PARTS}


def profile_table(before: dict, after: dict, seconds: float) -> str:
    """A markdown table of what changed between two snapshots (or metric readings in the same shape)
    over `seconds` of wall time: each part's share of it, wall and CPU."""
    rows = ["| part | times | wall s | share of the run | CPU s | waiting s | per time (µs) |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for part in PARTS:
        wall, cpu, count = (a - b for a, b in zip(after.get(part, (0, 0, 0)), before.get(part, (0, 0, 0))))
        if not count:
            continue
        rows.append(f"| {part} | {count:.0f} | {wall:.2f} | {wall / seconds:.0%} | {cpu:.2f} | {wall - cpu:.2f} | "
                    f"{1e6 * wall / count:.0f} |")
    return "\n".join(rows)
