"""The engine in a process of its own: the Triton model's process parses, encodes and sends; the engine
process schedules, runs the model, samples and detokenizes (vLLM's EngineCore split, our code).

Why: every response is built and sent from Python, and in one process those sends and the engine's
host work share one interpreter lock. At GPU rates (a decode step of 128 sequences every few
milliseconds, each step 128 responses) the two together need more than one core's worth of Python.

`EngineProcess` is an EngineThread (same callbacks, same responder, same coalescing) whose stepping
thread receives the engine process's steps instead of running them. Messages are pickled tuples on a
pipe:
  to the engine:   ("wait_for_sends", bool) once; then ("add", request_id, token_ids, params, priority,
                   lora_name, final_only, lora_task, max_prompt_tokens),
                   ("abort", request_id), ("sent",) (a step's responses are out: when told to, the
                   engine waits for it before the next step, see engine_thread.py), ("stop",)
  from the engine: ("ready", device_type, max_model_len) or ("failed", reason) once; then ("step", deltas, stats)
                   (the deltas compacted: outputs.compact_deltas),
                   ("refused", delta), ("stats", stats) when it falls idle, ("dead", reason), ("stopped",)
A request the engine refuses comes back as a final delta with `error_kind` "invalid" or "unavailable".
When the engine process dies (killed, out of memory), its pipe closes: every request still held ends
with an error through `on_dead`, as when the engine stops for good; nothing waits for it. When it hangs
(a step that never ends: a hung GPU, a kernel that never returns), `step_timeout_s` stops it so.
"""

import logging
import multiprocessing.connection
import queue
import signal
import subprocess
import sys
import threading
import time

from transformers import AutoTokenizer

from ..encoders import Encoders, copy_or_load
from ..engine import EngineDeadError
from ..outputs import RequestDelta, compact_deltas, expand_deltas
from ..launch import start_engine_process
from .engine_thread import EngineThread
from .heap import freeze_startup_heap
from .profile import ServingProfile

logger = logging.getLogger(__name__)
STOP_TIMEOUT_S = 30.0
WATCH_TICK_S = 1.0  # how often a wait for the engine's next message checks its step time-out


def _encoders(settings: dict) -> Encoders:
    """One encoder ready, more copied from a tokenizer that never encodes (copying one that encodes on
    another thread is not safe)."""
    trust = bool(settings.get("trust_remote_code", False))
    load = lambda: AutoTokenizer.from_pretrained(settings["model"], trust_remote_code=trust)  # noqa: E731
    template = load()
    return Encoders(lambda: copy_or_load(template, load), made=[copy_or_load(template, load)])


class RemoteEngine:
    """What the Triton model asks of the engine, answered in this process: encoding (its own
    tokenizers), the engine's last reported statistics, aborts (sent on)."""

    def __init__(self, process: "EngineProcess", encoders: Encoders, device_type: str, max_model_len: int):
        self._process = process
        self._encoders = encoders
        self.device_type = device_type
        self.max_model_len = max_model_len
        self.last_stats: dict | None = None
        self.submitted_since_stats = 0  # requests sent since those statistics: counted as waiting

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None,
               limit_name: str = "max_tokens") -> list[int]:
        return self._encoders.encode(text, add_special_tokens, max_tokens, limit_name)

    def stats(self) -> dict:
        stats = dict(self.last_stats or {"num_waiting": 0})
        stats["num_waiting"] += self.submitted_since_stats
        return stats

    def abort(self, request_id: str) -> None:
        self._process.abort(request_id)

    def close(self) -> None:
        self._process.stop()


class EngineProcess(EngineThread):
    ENGINE_IN_THIS_PROCESS = False

    def __init__(self, settings: dict, faults: str | None = None, started: tuple | None = None,
                 step_timeout_s: float | None = None, **thread_options):
        """`settings`: the engine's (LLM(**settings)); `faults`: a fault-injection spec (faults.py);
        `started`: launch.start_engine_process()'s (process, pipe), a process started earlier that is still
        waiting for its settings; `step_timeout_s`: how long the engine may take to report its next step
        while requests are in it before it is taken for hung and stopped (None: forever); the rest as
        EngineThread's, but make_engine."""
        super().__init__(make_engine=None, **thread_options)
        self._settings = dict(settings)
        self._faults = faults
        self._started = started
        self._step_timeout_s = step_timeout_s
        self._in_engine: set[str] = set()  # requests sent to the engine and not finished (the watch's)
        self._busy_since = 0.0  # when the engine last went from no request to some
        self._process: subprocess.Popen | None = None
        self._conn: multiprocessing.connection.Connection | None = None
        self._send_lock = threading.Lock()
        self._stopped = False
        self.engine_frozen_objects = 0  # the engine process's start-up heap, frozen (heap.py): its last report

    # -- called by the Triton model ----------------------------------------------------------------
    def submit(self, request_id: str, prompt, params, priority: int = 0, lora_name: str | None = None,
               final_only: bool = False, lora_task=None, max_prompt_tokens: int | None = None) -> None:
        """Send a request on; the engine's refusal comes back as its final delta."""
        if not self._in_engine:
            self._busy_since = time.monotonic()
        self._in_engine.add(request_id)
        self._send(("add", request_id, prompt, params, priority, lora_name, final_only, lora_task, max_prompt_tokens))
        self.engine.submitted_since_stats += 1

    def abort(self, request_id: str) -> None:
        try:
            self._send(("abort", request_id))
        except EngineDeadError:
            pass  # its request ends with the engine's death

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            self._send(("stop",))
        except EngineDeadError:
            pass
        super().stop(timeout)  # the receiving thread ends with the engine process's "stopped" or its exit
        if self._process is not None:
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as e:  # the pipe is closed: the engine process is gone
            raise EngineDeadError(f"the engine process is gone ({type(e).__name__})") from None

    # -- the receiving thread (EngineThread's stepping thread) -------------------------------------
    def _step_loop(self) -> None:
        try:
            self._process, self._conn = self._started or start_engine_process()
            self._started = None
            self._conn.send((self._settings, self._faults))
            try:
                encoders = _encoders(self._settings)  # loaded while the engine process starts
            except Exception as e:  # the engine process, loading the same files, says why first
                encoders = e
            kind, *detail = self._receive()
            if kind != "ready":
                raise RuntimeError(f"the engine process did not start: {detail[0]}")
            if isinstance(encoders, Exception):
                raise encoders
            device_type, max_model_len = detail
            self.engine = RemoteEngine(self, encoders, device_type, max_model_len)
            self._configure_for(device_type)
            self._conn.send(("wait_for_sends", not self._overlap_sending))
        except BaseException as e:
            self._start_error = e
            if self._process is not None:
                self._process.kill()
                self._process.wait()
            return
        finally:
            self._ready.set()
        while True:
            kind, *rest = self._receive()
            if kind == "step":
                deltas, stats = expand_deltas(rest[0]), rest[1]
                self._in_engine.difference_update([delta.request_id for delta in deltas if delta.finished])
                self._take_stats(stats)
                self._put(deltas)  # on a CPU: returns once they are handed on
                if deltas and not self._overlap_sending:
                    self._acknowledge()
                self._report_step()
            elif kind == "refused":
                self._in_engine.discard(rest[0].request_id)
                self._put([rest[0]])
            elif kind == "stats":  # the engine fell idle: reported once its last responses are out, so
                self._take_stats(rest[0])  # that the metrics count them before the next request comes
                self._outbox.join()
                self._report_step(idle=True)
            elif kind == "dead":
                self._report_step(idle=True)
                self._outbox.put(rest[0])
                return
            elif kind == "stopped":
                return

    def _take_stats(self, stats: dict) -> None:
        self.profile.remote = stats.pop("engine_profile")  # the engine process's parts of the profile
        self.engine_frozen_objects = stats.pop("engine_frozen_objects")
        self.engine.last_stats = stats
        self.engine.submitted_since_stats = 0

    def _receive(self) -> tuple:
        try:
            if self._step_timeout_s is not None:
                waiting_since = time.monotonic()  # (not before: the engine may be waiting for our sends)
                while not self._conn.poll(WATCH_TICK_S):
                    if self._in_engine and time.monotonic() - max(waiting_since, self._busy_since) \
                            > self._step_timeout_s:
                        return self._stop_hung()
            return self._conn.recv()
        except (EOFError, OSError):
            code = self._process.wait()
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            return ("dead", f"the engine process {how}")
        except Exception as e:  # a message that cannot be read: the two sides no longer agree, so it ends
            self._process.kill()
            self._process.wait()
            return ("dead", f"a message from the engine process could not be read: {type(e).__name__}: {e}")

    def _stop_hung(self) -> tuple:
        self._process.kill()
        self._process.wait()
        return ("dead", f"no engine step ended within step_timeout_s ({self._step_timeout_s:g} s) while "
                        f"{len(self._in_engine)} request(s) waited on it (a hung GPU or kernel?): the engine "
                        "process was stopped")

    def _acknowledge(self) -> None:
        try:
            self._send(("sent",))
        except EngineDeadError:
            pass  # the next receive reports it


# -- the engine process ------------------------------------------------------------------------------
class _Serve:
    """The engine process's loop: a thread applies the commands as they come (the engine's add_request
    and abort are thread-safe); the main thread steps while there is work and reports each step. Requests
    with images are added on a thread of their own: the vision tower runs when a request is added (seconds
    an image on a CPU), and the commands thread must go on reading the other requests, the aborts (one that
    overtakes its request waits for it in the engine) and the acknowledged sends each step waits for."""

    def __init__(self, engine, conn: multiprocessing.connection.Connection, frozen_objects: int = 0):
        self.engine = engine
        self.conn = conn
        self.frozen_objects = frozen_objects  # the start-up heap, out of the collector's full passes (heap.py)
        self.wait_for_sends = False  # after each step, until its responses are out (set by the other side)
        self.wake = threading.Condition()
        self.stopping = False
        self.sends_done = threading.Semaphore(0)
        self.send_lock = threading.Lock()
        self.profile = ServingProfile()
        self.image_adds: queue.SimpleQueue = queue.SimpleQueue()  # add commands with images; None: stop

    def stats(self) -> dict:
        return {**self.engine.stats(), "engine_profile": self.profile.snapshot(),
                "engine_frozen_objects": self.frozen_objects}

    def send(self, message: tuple) -> None:
        with self.send_lock:
            self.conn.send(message)

    def read_commands(self) -> None:
        while True:
            try:
                command = self.conn.recv()
            except (EOFError, OSError):  # the Triton model's process is gone
                command = ("stop",)
            kind = command[0]
            if kind == "add" and isinstance(command[2], dict) and "multi_modal_data" in command[2]:
                self.image_adds.put(command[1:])
            elif kind == "add":
                self.add(*command[1:])
            elif kind == "abort":
                self.engine.abort(command[1])
            elif kind == "sent":
                self.sends_done.release()
            elif kind == "wait_for_sends":
                self.wait_for_sends = command[1]
            with self.wake:
                self.stopping = self.stopping or kind == "stop"
                self.wake.notify()
            if kind == "stop":
                self.sends_done.release()  # a step waiting for its sends must not hold up the stop
                self.image_adds.put(None)
                return

    def add_with_images(self) -> None:
        while (command := self.image_adds.get()) is not None:
            self.add(*command)
            with self.wake:
                self.wake.notify()

    def add(self, request_id: str, prompt: list[int], params, priority: int, lora_name: str | None,
            final_only: bool, lora_task, max_prompt_tokens: int | None) -> None:
        try:
            self.engine.add_request(request_id, prompt, params, priority, lora_name, final_only=final_only,
                                    lora_task=lora_task, max_prompt_tokens=max_prompt_tokens)
        except EngineDeadError as e:
            self.refuse(request_id, str(e), "unavailable")
        except ValueError as e:
            self.refuse(request_id, str(e), "invalid")
        except Exception as e:
            logger.exception("adding request %s failed", request_id)
            self.refuse(request_id, f"internal error: {type(e).__name__}: {e}", None)

    def refuse(self, request_id: str, message: str, kind: str | None) -> None:
        self.send(("refused", RequestDelta(request_id, [], "", True, "error", 0, 0, error=message, error_kind=kind)))

    def run(self) -> None:
        threading.Thread(target=self.read_commands, name="inflight-commands", daemon=True).start()
        threading.Thread(target=self.add_with_images, name="inflight-images", daemon=True).start()
        reported_idle = False
        while True:
            with self.wake:
                while not self.stopping and not self.engine.has_unfinished():
                    if not reported_idle:  # the final state of a burst, for the metrics
                        self.send(("stats", self.stats()))
                        reported_idle = True
                    self.wake.wait()
                if self.stopping:
                    return
            reported_idle = False
            try:
                with self.profile.timing("engine_step"):
                    deltas = self.engine.step()  # a failed step ends its own requests with error deltas
            except BaseException as e:  # the loop itself is broken: end everything
                logger.exception("the engine loop failed")
                deltas = self.engine.shut_down(f"the engine loop failed: {type(e).__name__}: {e}")
            if self.engine.dead_reason is not None:
                self.send(("step", compact_deltas(deltas + self.engine.shut_down(self.engine.dead_reason)),
                           self.stats()))
                self.send(("dead", self.engine.dead_reason))
                return
            self.send(("step", compact_deltas(deltas), self.stats()))
            if deltas and self.wait_for_sends:  # (timed where the sends are: EngineThread._put)
                self.sends_done.acquire()


def engine_main() -> None:
    """The engine process (started by EngineProcess through launch.run_child, with one end of a pipe)."""
    from .. import LLM, faults

    conn = multiprocessing.connection.Connection(int(sys.argv[1]))
    logging.basicConfig(level=logging.WARNING, format="inflight engine: %(levelname)s %(message)s")
    try:
        settings, fault_spec = conn.recv()
    except EOFError:  # started early by a Triton model process that is gone (or never needed it)
        return
    try:
        engine = faults.inject(LLM(**settings), fault_spec)
    except BaseException as e:
        logger.exception("the engine could not start")
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    frozen = freeze_startup_heap()
    conn.send(("ready", engine.config.device_type, engine.max_model_len))
    try:
        _Serve(engine, conn, frozen).run()
    finally:
        engine.close()
        try:
            conn.send(("stopped",))
        except OSError:
            pass
