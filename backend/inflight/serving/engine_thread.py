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

The engine's statistics go to `on_step` at most every `report_interval_s` while it steps (each metric
update is a message to the server) and whenever it falls idle. `profile` times each part of the work
(profile.py).

A failed step is the engine's own business (it ends the requests it must, with an error delta). When
the engine stops for good, or the stepping loop itself breaks, `on_dead(reason)` runs on the responder
thread after every delta before it has been handed on, so the caller can end whatever is left.
"""

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Callable

from ..engine import LLMEngine
from ..outputs import RequestDelta, coalesce
from .profile import ServingProfile

logger = logging.getLogger(__name__)
GPU_SENDERS = 4  # sender threads for an engine on a GPU, when not set


class EngineThread:
    # The model runs in this process, on the cores its sends would use (EngineProcess: in its own).
    ENGINE_IN_THIS_PROCESS = True

    def __init__(self, make_engine: Callable[[], LLMEngine],
                 on_delta: Callable[[RequestDelta], None],
                 poll_cancelled: Callable[[], list[str]] = lambda: [],
                 on_step: Callable[[dict], None] = lambda stats: None,
                 on_dead: Callable[[str], None] = lambda reason: None,
                 poll_interval_s: float = 0.0, overlap_sending: bool | None = None,
                 report_interval_s: float = 0.0, senders: int | None = 1, profiling: bool = True):
        """on_delta(delta) runs on the responder thread for every delta (`delta.error` says why the
        engine ended a request that failed). poll_cancelled() runs on the responder thread and names
        requests to abort. on_step(engine.stats()) runs after every step and when idle. on_dead(reason)
        runs once, on the responder thread, when the engine has stopped for good. Polling can cost a
        message to the server per request, so it runs at most every `poll_interval_s`.
        `overlap_sending`: send a step's responses while the next step runs; None: unless the engine
        runs on CPU in this process. `report_interval_s`: on_step's least interval while the engine
        steps. `senders`: threads calling on_delta at once for different requests (worth it when
        on_delta waits, as a Triton response sender does for the server's reply, without holding the
        interpreter lock); None: GPU_SENDERS when the engine is not on CPU, else 1. `profiling`: time
        the parts of the work in `profile` (profile.py)."""
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
        self._report_interval_s = report_interval_s
        self._last_report = float("-inf")
        self.profile = ServingProfile(profiling)
        if senders is not None and (not isinstance(senders, int) or isinstance(senders, bool) or senders < 1):
            raise ValueError(f"senders must be a positive integer, got {senders!r}")
        self._num_senders = senders
        self._senders: ThreadPoolExecutor | None = None  # made when the engine is built
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

    def submit(self, request_id: str, prompt, params, priority: int = 0, lora_name: str | None = None,
               final_only: bool = False, lora_task=None, max_prompt_tokens: int | None = None) -> None:
        """Queue a request (`final_only`, `max_prompt_tokens`: add_request's); raises ValueError (from the
        engine's validation) without queueing it."""
        self.engine.add_request(request_id, prompt, params, priority, lora_name, final_only=final_only,
                                lora_task=lora_task, max_prompt_tokens=max_prompt_tokens)
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
        if self._senders is not None:
            self._senders.shutdown(wait=False)

    def _step_loop(self) -> None:
        try:
            self.engine = self._make_engine()
            self._configure_for(self.engine.config.device_type)
        except BaseException as e:
            self._start_error = e
            return
        finally:
            self._ready.set()
        while True:
            with self._wake:
                while not self._stopping and not self.engine.has_unfinished():
                    self._report_step(idle=True)
                    self._wake.wait(timeout=0.5)
                if self._stopping:
                    return
            try:
                with self.profile.timing("engine_step"):
                    deltas = self.engine.step()  # a failed step ends its own requests with error deltas
                self._put(deltas)
            except BaseException as e:  # the loop itself is broken: end everything, stop stepping
                logger.exception("the engine loop failed")
                self._end_dead_engine(f"the engine loop failed: {type(e).__name__}: {e}")
                return
            if self.engine.dead_reason is not None:
                self._end_dead_engine(self.engine.dead_reason)
                return
            self._report_step()

    def _configure_for(self, device_type: str) -> None:
        """Settings left to the engine's device: sender threads off a CPU; overlapped sending, except
        for a CPU engine in this process, whose torch threads the sends would preempt."""
        on_cpu = device_type == "cpu"
        if self._overlap_sending is None:
            self._overlap_sending = not (on_cpu and self.ENGINE_IN_THIS_PROCESS)
        if self._num_senders is None:
            self._num_senders = 1 if on_cpu else GPU_SENDERS
        if self._num_senders > 1:
            self._senders = ThreadPoolExecutor(self._num_senders, thread_name_prefix="inflight-sender")

    def _end_dead_engine(self, reason: str) -> None:
        try:
            self._put(self.engine.shut_down(reason))  # also requests that slipped in as it died
        except BaseException:
            logger.exception("could not end the requests of the stopped engine")
        self._report_step(idle=True)
        self._outbox.put(self.engine.dead_reason or reason)

    def _put(self, deltas: list[RequestDelta]) -> None:
        if deltas:
            self._outbox.put(deltas)
            if not self._overlap_sending:
                with self.profile.timing("engine_waits_for_sends"):
                    self._outbox.join()  # until the responder has handed every delta on

    def _report_step(self, idle: bool = False) -> None:
        now = time.monotonic()
        if not idle and now - self._last_report < self._report_interval_s:
            return
        self._last_report = now
        try:  # an idle engine's reports are not timed: they would change the profile they report
            with nullcontext() if idle else self.profile.timing("report_metrics"):
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
            self._hand_on(coalesce([deltas for deltas in steps if isinstance(deltas, list)]))
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

    def _hand_on(self, deltas: list[RequestDelta]) -> None:
        """on_delta for each delta; with several senders, their shares at once (a request's deltas all in
        one share, in order), returning when every one is handed on."""
        if self._senders is None or len(deltas) < 2:
            self._hand_on_share(deltas)
            return
        shares = [[] for _ in range(self._num_senders)]
        for delta in deltas:
            shares[hash(delta.request_id) % self._num_senders].append(delta)
        for future in [self._senders.submit(self._hand_on_share, share) for share in shares if share]:
            future.result()

    def _hand_on_share(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            try:
                self._on_delta(delta)
            except Exception:
                logger.exception("sending the response of %s failed", delta.request_id)

    def _drain_outbox(self) -> list:
        steps = []
        while True:
            try:
                steps.append(self._outbox.get_nowait())
            except queue.Empty:
                return steps

    def _poll(self) -> None:
        try:
            with self.profile.timing("poll_cancelled"):
                cancelled = self._poll_cancelled()
        except Exception:
            logger.exception("polling for cancelled requests failed")
            return
        for request_id in cancelled:
            self.abort(request_id)
