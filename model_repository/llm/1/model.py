"""Triton Python backend model `llm` (decoupled): a thin adapter between Triton and the inflight engine.

execute() only parses, validates and queues; it never waits for the model. The engine runs in a
process of its own (serving/engine_process.py; or on a thread of this one, with `engine_process`
false); a responder thread sends each request's new text as it comes, the last response of a
request carrying the FINAL flag, and aborts requests whose clients cancelled. Every admitted request
gets exactly one FINAL response: its end, its error, or (should the engine stop for good) an
UNAVAILABLE error, after which the model unloads itself so that it reports not-ready.
"""

import json
import os
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path


def _project_root() -> str:
    # The stub embeds Python in isolated mode (PYTHONPATH is ignored): the launcher names the venv's
    # site-packages and the project root in INFLIGHT_SITE_PACKAGES and INFLIGHT_ROOT.
    # INFLIGHT_SITE_PACKAGES may list several folders, the first taking precedence.
    root = os.environ.get("INFLIGHT_ROOT") or str(Path(__file__).resolve().parents[3])
    paths = [*os.environ.get("INFLIGHT_SITE_PACKAGES", "").split(os.pathsep), os.path.join(root, "backend")]
    sys.path[:0] = [p for p in paths if p and p not in sys.path]
    return root


# Packages that transformers imports whenever they are installed (scikit-learn, for assisted generation's
# roc_curve, and scipy with it), by module and distribution name.
OPTIONAL_FOR_TRANSFORMERS = {"sklearn": "scikit-learn", "scipy": "scipy"}


def _hide_packages_needing_newer_numpy() -> None:
    """The bundled stub reads arrays with the numpy 1 ABI, so numpy 1.26 comes first on its path
    (scripts/serve.py), whatever numpy the environment has. Where the environment's scikit-learn or scipy
    needs a newer numpy (the lent H200's image: scipy needs numpy 2), transformers' import of them failed
    and the model with it ("Could not import module 'AutoTokenizer'"). Nothing here uses them: they are
    hidden from this process (a module mapped to None in sys.modules is not found, and its import fails
    at once). The engine process has the environment's own numpy and keeps them."""
    from importlib import metadata

    import numpy
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    def parsed(texts: list[str]) -> list[Requirement]:
        requirements = []
        for text in texts:
            try:
                requirements.append(Requirement(text))
            except InvalidRequirement:  # (a package's malformed metadata must not stop the model's load)
                pass
        return requirements

    def needs_newer_numpy(distribution: str, seen: set) -> bool:
        if distribution in seen:
            return False
        seen.add(distribution)
        try:
            requirements = parsed(metadata.requires(distribution) or [])
        except metadata.PackageNotFoundError:
            return False
        for requirement in requirements:
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            name = canonicalize_name(requirement.name)
            if name == "numpy":
                if not requirement.specifier.contains(numpy.__version__, prereleases=True):
                    return True
            elif needs_newer_numpy(name, seen):
                return True
        return False

    hidden = [module for module, distribution in OPTIONAL_FOR_TRANSFORMERS.items()
              if needs_newer_numpy(distribution, set())]
    for module in hidden:
        sys.modules[module] = None
    if hidden:
        print(f"inflight: {', '.join(hidden)} hidden from the Triton stub: they need a newer numpy than its "
              f"{numpy.__version__}", file=sys.stderr)


def _utf8_text_files() -> None:
    """The stub's embedded Python leaves the process in the C locale, so files open as ASCII unless a
    reader names the encoding; torch.compile (fused layers, torch_compile), when the engine runs on a
    thread here, reads its own UTF-8 code templates without naming it."""
    import locale

    if locale.getpreferredencoding(False).lower().replace("-", "") == "utf8":
        return
    for name in ("C.UTF-8", "C.utf8", "en_US.UTF-8"):
        try:
            locale.setlocale(locale.LC_CTYPE, name)
            return
        except locale.Error:
            continue


# How long (in iterations) an OpenMP thread that waits at the end of a parallel region spins before it
# sleeps, unless the environment says (GOMP_SPINCOUNT, OMP_WAIT_POLICY). On a CPU host the engine's
# torch threads share the cores with tritonserver, this process and the clients; while one of them is
# preempted, the others spin at the region's end and keep the cores from it. With libgomp's default
# (300,000) a decode step of the default model took 730-790 ms (median) beside one busy process, 55-74
# ms alone; with 10,000, 166 ms beside it and 72 ms alone (2 cores, README "Benchmarks").
OPENMP_SPIN_COUNT = 10_000


def _short_openmp_spin() -> None:
    """Set before torch loads OpenMP (here, in the engine process and in tensor-parallel workers,
    which inherit this environment)."""
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = str(OPENMP_SPIN_COUNT)


def _settings_path(model_dir: str) -> str:
    return os.environ.get("INFLIGHT_MODEL_JSON") or os.path.join(model_dir, "model.json")


def _start_engine_process_early():
    """The engine process (unless model.json says otherwise), started before this process imports torch
    and transformers: both import at once (on a 2-core CI host each takes ~8 s). Only this light module
    of the package loads here; its process waits for its settings from initialize(). Not in the stub
    that only completes the configuration, which never initializes a model."""
    from inflight.launch import start_engine_process, started_to_complete_config

    model_dir = os.path.dirname(os.path.abspath(__file__))
    if started_to_complete_config(os.path.basename(os.path.dirname(model_dir))):
        return None
    try:
        with open(_settings_path(model_dir)) as f:
            if json.load(f).get("engine_process", True) is not True:
                return None
    except (OSError, ValueError):
        return None  # initialize() says what is wrong
    return start_engine_process()


def _leave_with_tritonserver() -> None:
    """This process (the stub) ends once its tritonserver is gone, reaped or not: the stub's own watch
    misses a dead tritonserver that nothing has reaped yet (launch.leave_with_parent)."""
    from inflight.launch import leave_with_parent

    tritonserver = os.getppid()
    leave_with_parent(tritonserver, f"inflight: tritonserver (pid {tritonserver}) is gone: its Python model's "
                                    "process leaves (and its engine process with it)")


ROOT = _project_root()
_leave_with_tritonserver()
_hide_packages_needing_newer_numpy()
_utf8_text_files()
_short_openmp_spin()
_early_engine_process = _start_engine_process_early()


def _take_early_engine_process():
    global _early_engine_process
    started, _early_engine_process = _early_engine_process, None
    return started

import triton_python_backend_utils as pb_utils  # noqa: E402

from inflight import LLM, faults  # noqa: E402
from inflight.engine import EngineDeadError  # noqa: E402
from inflight.serving.cancellation import POLL_TICK_S, CancellationPoller  # noqa: E402
from inflight.serving.engine_process import EngineProcess  # noqa: E402
from inflight.serving.engine_thread import EngineThread  # noqa: E402
from inflight.serving.heap import freeze_startup_heap  # noqa: E402
from inflight.serving.metrics import TritonMetrics  # noqa: E402
from inflight.serving.request import ParsedRequest, for_outputs, parse_request, with_word_bias  # noqa: E402
from inflight.serving.response import RequestResponses  # noqa: E402
from inflight.serving.settings import (place_instance, resolve_draft_model, resolve_lora_modules,  # noqa: E402
                                       split_settings)


def _error(message: str, code_name: str = "INVALID_ARG"):
    code = getattr(pb_utils.TritonError, code_name, None)
    error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(error=error)


FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# Prompts longer than this are tokenized on a thread of their own, not on Triton's execute thread.
INLINE_TOKENIZE_CHARS = 1 << 16


def _send_final_error(sender, message: str, code_name: str) -> None:
    try:
        sender.send(_error(message, code_name), flags=FINAL)
    except Exception as e:  # the client is gone, or the stream was closed already
        pb_utils.Logger.log_warn(f"inflight: could not send an error response: {e}")


class AdmissionRefused(Exception):
    """The server is full: the client may retry later (UNAVAILABLE)."""


@dataclass
class ActiveRequest:
    request: object
    sender: object
    parsed: ParsedRequest
    arrival: float
    requested_outputs: frozenset[str] = frozenset()  # the outputs the client named; none: every output
    last_token_time: float | None = None
    arrival_ns: int = field(default_factory=time.time_ns)  # (the engine's token times' clock)
    first_completion_tokens: int = 0  # not streamed: its first completion's length, once it ended
    generated_tokens: int = 0  # the tokens of its completions that ended
    responses: RequestResponses = field(init=False)  # turns each delta into what is sent
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.responses = RequestResponses(self.parsed, self.requested_outputs)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("model `llm` must use the decoupled transaction policy")
        settings_path = _settings_path(os.path.join(args["model_repository"], args["model_version"]))
        with open(settings_path) as f:
            settings = json.load(f)
        settings["model"] = os.environ.get("INFLIGHT_MODEL") or settings.get("model")
        if not os.path.isabs(settings["model"]):
            settings["model"] = os.path.join(ROOT, settings["model"])
        engine_settings, self.serving = split_settings(settings)
        engine_settings["lora_modules"] = resolve_lora_modules(engine_settings.get("lora_modules"),
                                                               self.serving.enable_lora,
                                                               os.path.dirname(settings_path), ROOT)
        engine_settings["speculative_config"] = resolve_draft_model(engine_settings.get("speculative_config"), ROOT)
        instances = sum(group.get("count", 1) for group in config.get("instance_group", [])) or 1
        engine_settings = place_instance(engine_settings, args.get("model_instance_kind", "MODEL"),
                                         int(args.get("model_instance_device_id", 0)), instances)
        self.model_name = args["model_name"]
        self.active: dict[str, ActiveRequest] = {}
        self.dead_reason: str | None = None
        self.metrics = TritonMetrics(pb_utils, {"model": args["model_name"], "version": args["model_version"]})
        self.cancellations = CancellationPoller(self.serving.cancel_poll_interval_s)
        options = dict(on_delta=self._respond, poll_cancelled=self._poll_cancelled, on_step=self._report,
                       on_dead=self._engine_died, poll_interval_s=min(POLL_TICK_S, self.serving.cancel_poll_interval_s),
                       overlap_sending=self.serving.overlap_sending, report_interval_s=self.serving.metrics_interval_s,
                       senders=self.serving.sender_threads, profiling=self.serving.serving_profile)
        # INFLIGHT_FAULTS makes engine stages raise at chosen steps: a test-only hook (inflight/faults.py).
        fault_spec = os.environ.get("INFLIGHT_FAULTS")
        if self.serving.engine_process:
            self.thread = EngineProcess(engine_settings, fault_spec, started=_take_early_engine_process(),
                                        step_timeout_s=self.serving.step_timeout_s, **options)
        else:
            self.thread = EngineThread(lambda: faults.inject(LLM(**engine_settings), fault_spec), **options)
        self.profile = self.thread.profile
        self.engine = self.thread.start()
        self.long_prompts = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inflight-tokenize")
        freeze_startup_heap()  # (this process serves for its life: serving/heap.py)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            self._refusing_on_error(sender, self._admit, request, sender)
        return None

    @staticmethod
    def _refusing_on_error(sender, admit, *args) -> None:
        """Run an admission step; any error becomes the request's one FINAL response."""
        try:
            admit(*args)
        except ValueError as e:
            sender.send(_error(str(e)), flags=FINAL)
        except (AdmissionRefused, EngineDeadError) as e:
            sender.send(_error(str(e), "UNAVAILABLE"), flags=FINAL)
        except Exception as e:  # never leave a client waiting for a FINAL that will not come
            pb_utils.Logger.log_error(f"inflight: request failed: {type(e).__name__}: {e}")
            sender.send(_error(f"internal error: {type(e).__name__}: {e}", "INTERNAL"), flags=FINAL)

    def _admit(self, request, sender) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"the model is unavailable: {self.dead_reason}")
        inputs = {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}
        parameters = json.loads(request.parameters() or "{}")
        parsed = parse_request(inputs, parameters=parameters, settings=self.serving)
        if self.engine.stats()["num_waiting"] >= self.serving.max_queued_requests:
            raise AdmissionRefused(f"the server is at its limit of {self.serving.max_queued_requests} "
                                   "queued requests; retry later")
        if (isinstance(parsed.prompt, list) or len(parsed.prompt) <= INLINE_TOKENIZE_CHARS) and not parsed.images:
            self._enqueue(request, sender, parsed)
        else:  # a long prompt (up to a second to tokenize), or images (the vision tower runs when the request
            # is added), must not hold up the requests behind it
            self.long_prompts.submit(self._refusing_on_error, sender, self._enqueue, request, sender, parsed)

    def _enqueue(self, request, sender, parsed: ParsedRequest) -> None:
        cap = self.serving.max_prompt_tokens
        if isinstance(parsed.prompt, list):
            token_ids = parsed.prompt
        elif parsed.params.truncate_prompt_tokens:  # encoded whole (max_input_bytes bounds it), then cut
            token_ids = self.engine.encode(parsed.prompt)
        elif cap is not None and cap < self.engine.max_model_len:
            token_ids = self.engine.encode(parsed.prompt, max_tokens=cap, limit_name="max_prompt_tokens")
        else:
            token_ids = self.engine.encode(parsed.prompt, max_tokens=self.engine.max_model_len,
                                           limit_name="max_model_len")
        token_ids = parsed.params.truncated(token_ids, self.engine.max_model_len)
        table = parsed.prompt_embedding_table
        length = len(token_ids) or (len(table) if table is not None else 0)
        if cap is not None and length > cap:
            raise ValueError(f"the prompt has {length} tokens; this server accepts at most {cap}")
        requested_outputs = frozenset(request.requested_output_names())
        params = for_outputs(with_word_bias(parsed.params, parsed.bias_words,
                                            lambda word: self.engine.encode(word, add_special_tokens=False)),
                             requested_outputs)
        request_id = uuid.uuid4().hex
        self.active[request_id] = ActiveRequest(request, sender, parsed, time.monotonic(), requested_outputs)
        try:
            # Not streamed, each completion is sent whole: the engine hands it over once, when it ends
            # (no delta a token to build, pass on and gather here).
            self.thread.submit(request_id, parsed.engine_prompt(token_ids), params, parsed.priority,
                               parsed.lora_name, final_only=not parsed.stream, lora_task=parsed.lora_task,
                               max_prompt_tokens=cap)  # (the engine counts an image's tokens)
        except Exception:
            del self.active[request_id]
            raise
        # Asked about only once the engine took it: a refusal's FINAL may be sent from another thread,
        # and asking Triton about a request while its FINAL goes out crashes tritonserver (a segfault
        # in TRITONBACKEND_ResponseFactoryIsCancelled, seen here).
        self.cancellations.add(request_id)

    def _report(self, stats: dict) -> None:
        self.metrics.update(stats, self.profile.snapshot() if self.profile.enabled else None)

    def _poll_cancelled(self) -> list[str]:
        return self.cancellations.poll(self._is_cancelled)

    def _is_cancelled(self, request_id: str) -> bool | None:
        active = self.active.get(request_id)
        if active is None or active.cancelled:
            return None  # ended (its last response is out: never ask about it again), or already aborted
        active.cancelled = active.request.is_cancelled()
        return active.cancelled

    def _respond(self, delta) -> None:
        active = self.active.pop(delta.request_id, None) if delta.finished else self.active.get(delta.request_id)
        if active is None:
            return
        try:
            self._send(active, delta)
        except Exception as e:  # a response that cannot be built must still end its request
            pb_utils.Logger.log_error(f"inflight: responding failed: {type(e).__name__}: {e}")
            if not delta.finished:
                self.active.pop(delta.request_id, None)
                self.engine.abort(delta.request_id)
            _send_final_error(active.sender, f"internal error: {type(e).__name__}: {e}", "INTERNAL")

    def _send(self, active: ActiveRequest, delta) -> None:
        if delta.error is not None:  # the engine ends every completion of the request: one error is enough
            self.active.pop(delta.request_id, None)
            code = {"invalid": "INVALID_ARG", "unavailable": "UNAVAILABLE"}.get(delta.error_kind, "INTERNAL")
            active.sender.send(_error(delta.error, code), flags=FINAL)
            return
        if delta.finish_reason == "abort":
            if delta.finished:  # the client cancelled: close the stream (once all completions ended)
                active.sender.send(flags=FINAL)
                self.metrics.count_end("abort")
            return
        with self.profile.timing("observe_latency"):
            self._observe_latency(active, delta)
            if delta.finish_reason is not None:
                active.generated_tokens += delta.num_output_tokens
            if delta.finished:
                self.metrics.observe_finished(delta.finish_reason, time.monotonic() - active.arrival,
                                              active.arrival_ns, delta.metrics, delta.num_prompt_tokens,
                                              active.generated_tokens, active.parsed.params.n)
        with self.profile.timing("build_response"):
            outputs = active.responses.add(delta)
            if outputs is None:
                return
            response = pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(name, array) for name, array in outputs.items()])
        with self.profile.timing("send_response"):
            active.sender.send(response, flags=FINAL if delta.finished else 0)

    def _observe_latency(self, active: ActiveRequest, delta) -> None:
        if not active.parsed.stream:  # its tokens come at its end: the engine's times of them, once it ends
            if delta.index == 0:
                active.first_completion_tokens = delta.num_output_tokens
            if delta.metrics is not None:
                self.metrics.observe_from_engine(active.arrival_ns, delta.metrics, active.first_completion_tokens)
            return
        num_new_tokens = len(delta.new_token_ids)
        if not num_new_tokens:
            return
        now = time.monotonic()
        if active.last_token_time is None:
            self.metrics.observe_time_to_first_token(now - active.arrival)
        else:
            self.metrics.observe_inter_token_latency((now - active.last_token_time) / num_new_tokens)
        active.last_token_time = now

    def _engine_died(self, reason: str) -> None:
        """The engine stopped for good: end what is left, then unload, so that the model reports
        not-ready (possible when tritonserver runs with --model-control-mode=explicit, as serve.py does)."""
        self.dead_reason = reason
        pb_utils.Logger.log_error(f"inflight: the engine stopped: {reason}")
        for request_id in list(self.active):
            active = self.active.pop(request_id, None)
            if active is not None:
                _send_final_error(active.sender, f"the model is unavailable: {reason}", "UNAVAILABLE")
        try:
            pb_utils.unload_model(self.model_name)  # returns at once; finalize() runs later
        except Exception as e:
            pb_utils.Logger.log_error(f"inflight: could not unload the model to report not-ready ({e}); "
                                      "every request is refused instead")

    def finalize(self):
        self.long_prompts.shutdown(wait=True)  # what it admits is ended below like every other request
        self.thread.stop()
        if self.engine is not None:
            self.engine.close()  # its tensor-parallel workers leave with it
        for active in self.active.values():
            active.sender.send(_error("the model is being unloaded; the request was not finished", "UNAVAILABLE"),
                               flags=FINAL)
        self.active.clear()
