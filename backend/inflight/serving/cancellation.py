"""Which requests their clients cancelled, asked of the server a few at a time.

Triton tells a Python model of a cancellation only when asked, a message to the server per request
(about 65 µs here), on the thread that sends responses. Asking about every request at once each
interval blocks that thread for all of it (8-13 ms for 128 requests on two cores; at 256 streams and
a 50 ms interval, a third of its time in 17 ms blocks), and no token goes out meanwhile. So each call
asks about the share of the requests that came due since the last call, those asked longest ago
first: every request is still asked about once an interval, and the asking is spread over the calls.
"""

import time
from collections import deque
from collections.abc import Callable

POLL_TICK_S = 0.01  # how often the responder polls: each time, the requests due since the last


class CancellationPoller:
    def __init__(self, interval_s: float):
        self._interval_s = interval_s
        self._queue: deque[str] = deque()  # request ids, longest unasked first
        self._due = 0.0  # requests due, with the fraction of one carried to the next call
        self._last: float | None = None

    def add(self, request_id: str) -> None:
        """Start asking about a request (any thread)."""
        self._queue.append(request_id)

    def poll(self, is_cancelled: Callable[[str], bool | None], now: float | None = None) -> list[str]:
        """The requests found cancelled among those due. `is_cancelled(id)`: True (cancelled: reported
        and no longer asked about), False (ask again next interval) or None (ended: no longer asked)."""
        now = time.monotonic() if now is None else now
        waiting = len(self._queue)
        if self._interval_s <= 0 or self._last is None:
            self._due = waiting
        else:
            self._due = min(waiting, self._due + waiting * (now - self._last) / self._interval_s)
        self._last = now
        asked, cancelled = int(self._due + 1e-9), []  # the epsilon: rounding in the sums of fractions
        self._due = max(0.0, self._due - asked)
        for _ in range(asked):
            request_id = self._queue.popleft()
            state = is_cancelled(request_id)
            if state:
                cancelled.append(request_id)
            elif state is False:
                self._queue.append(request_id)
        return cancelled
