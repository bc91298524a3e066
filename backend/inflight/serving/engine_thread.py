"""Run an engine in the background: one thread steps it while there is work and sleeps when idle;
a second thread hands each step's deltas to the caller.

On an accelerator the responder sends a step's responses while the next step runs. On CPU the engine
waits for them instead: there every send wakes threads of the server and of clients that take a core
from the model's torch threads, and a parallel region stalls until its preempted thread is back.
Measured on 2 cores, 64 streams: overlapped, 69 to 94 tok/s, 13% below offline (medians); a step's
sends, then the next step: 85 to 95 tok/s, as offline in the same runs.

The engine is built on its stepping thread, so that every torch operation runs on that one thread:
once two threads have both run CPU kernels, each keeps an OpenMP team, and the idle team slows the
busy one (small matmuls about 1.5x slower, measured here).

A failed step is the engine's own business (it ends the requests it must, with an error delta). When
the engine stops for good, or the stepping loop itself breaks, `on_dead(reason)` runs on the responder
thread after every delta before it has been handed on, so the caller can end whatever is left.
"""

import logging
import queue
import threading
import time
from typing import Callable

from ..engine import LLMEngine
from ..outputs import RequestDelta, coalesce

logger = logging.getLogger(__name__)


class EngineThread:
    def __init__(self, make_engine: Callable[[], LLMEngine],
                 on_delta: Callable[[RequestDelta], None],
                 poll_cancelled: Callable[[], list[str]] = lambda: [],
                 on_step: Callable[[dict], None] = lambda stats: None,
                 on_dead: Callable[[str], None] = lambda reason: None,
                 poll_interval_s: float = 0.0, overlap_sending: bool | None = None):
        """on_delta(delta) runs on the responder thread for every delta (`delta.error` says why the
        engine ended a request that failed). poll_cancelled() runs on the responder thread and names
        requests to abort. on_step(engine.stats()) runs after every step and when idle. on_dead(reason)
        runs once, on the responder thread, when the engine has stopped for good. Polling can cost a
        message to the server per request, so it runs at most every `poll_interval_s`.
        `overlap_sending`: send a step's responses while the next step runs; None: only when the engine
        is not on CPU."""
        self._make_engine = make_engine
        self.engine: LLMEngine | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._on_delta = on_delta
        self._poll_cancelled = poll_cancelled
        self._poll_interval_s = poll_interval_s
        self._overlap_sending = overlap_sending
        self._last_poll = 0.0
        self._on_step = on_step
        self._on_dead = on_dead
        self._wake = threading.Condition()
        self._stopping = False
        # A step's deltas; a str: the engine died for that reason; None: stop.
        self._outbox: queue.Queue[list[RequestDelta] | str | None] = queue.Queue()
        self._stepper = threading.Thread(target=self._step_loop, name="inflight-engine", daemon=True)
        self._responder = threading.Thread(target=self._respond_loop, name="inflight-responder", daemon=True)

    def start(self) -> LLMEngine:
        """Build the engine on the stepping thread and start serving; returns the engine."""
        self._stepper.start()
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error
        self._responder.start()
        return self.engine

    def submit(self, request_id: str, prompt, params, priority: int = 0) -> None:
        """Queue a request; raises ValueError (from the engine's validation) without queueing it."""
        self.engine.add_request(request_id, prompt, params, priority)
        with self._wake:
            self._wake.notify()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        with self._wake:
            self._wake.notify()

    def stop(self, timeout: float = 30.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._stepper.join(timeout)
        self._outbox.put(None)
        if self._responder.is_alive():
            self._responder.join(timeout)

    def _step_loop(self) -> None:
        try:
            self.engine = self._make_engine()
        except BaseException as e:
            self._start_error = e
            return
        finally:
            self._ready.set()
        if self._overlap_sending is None:
            self._overlap_sending = self.engine.config.device_type != "cpu"
        while True:
            with self._wake:
                while not self._stopping and not self.engine.has_unfinished():
                    self._report_step()
                    self._wake.wait(timeout=0.5)
                if self._stopping:
                    return
            try:
                self._put(self.engine.step())  # a failed step ends its own requests with error deltas
            except BaseException as e:  # the loop itself is broken: end everything, stop stepping
                logger.exception("the engine loop failed")
                self._end_dead_engine(f"the engine loop failed: {type(e).__name__}: {e}")
                return
            if self.engine.dead_reason is not None:
                self._end_dead_engine(self.engine.dead_reason)
                return
            self._report_step()

    def _end_dead_engine(self, reason: str) -> None:
        try:
            self._put(self.engine.shut_down(reason))  # also requests that slipped in as it died
        except BaseException:
            logger.exception("could not end the requests of the stopped engine")
        self._report_step()
        self._outbox.put(self.engine.dead_reason or reason)

    def _put(self, deltas: list[RequestDelta]) -> None:
        if deltas:
            self._outbox.put(deltas)
            if not self._overlap_sending:
                self._outbox.join()  # until the responder has handed every delta on

    def _report_step(self) -> None:
        try:
            self._on_step(self.engine.stats())
        except Exception:  # metrics must never stop the engine
            logger.exception("on_step failed")

    def _respond_loop(self) -> None:
        # Polling for cancellations runs here, on the thread that sends responses: a request is never
        # asked about once its last response is out (its Triton request may be gone by then).
        while True:
            try:
                steps = [self._outbox.get(timeout=max(self._poll_interval_s, 0.01))]
            except queue.Empty:
                steps = []
            steps += self._drain_outbox()
            stopping = None in steps
            # When sending falls behind the engine (fast steps, many requests), the steps waiting here
            # go out as one response per request: fewer messages, and every client catches up at once.
            for delta in coalesce([deltas for deltas in steps if isinstance(deltas, list)]):
                try:
                    self._on_delta(delta)
                except Exception:
                    logger.exception("sending the response of %s failed", delta.request_id)
            for reason in (item for item in steps if isinstance(item, str)):
                try:
                    self._on_dead(reason)
                except Exception:
                    logger.exception("on_dead failed")
            if not stopping and time.monotonic() - self._last_poll >= self._poll_interval_s:
                self._last_poll = time.monotonic()
                self._poll()
            for _ in steps:
                self._outbox.task_done()  # a waiting engine steps again
            if stopping:
                return

    def _drain_outbox(self) -> list:
        steps = []
        while True:
            try:
                steps.append(self._outbox.get_nowait())
            except queue.Empty:
                return steps

    def _poll(self) -> None:
        try:
            cancelled = self._poll_cancelled()
        except Exception:
            logger.exception("polling for cancelled requests failed")
            return
        for request_id in cancelled:
            self.abort(request_id)
