"""The engine's Prometheus metrics, through the Python backend's custom-metrics API (`pb_utils`),
served on Triton's metrics port beside Triton's own.

Every update of a metric is a message to the server and its reply, so updates are batched: the
responder only records latencies, and `update` (called by the thread that steps the engine, or
receives its steps, at most every `report_interval_s` and when the engine falls idle) sends what
changed since the last one."""

import bisect
import itertools
import math
from collections import Counter, deque

from ..engine import STEP_SECONDS_BUCKETS, STEP_TOKEN_BUCKETS
from ..outputs import RequestMetrics
from .profile import PARTS

LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0]
# A whole request's times, from a few milliseconds (a queue that is empty, a short prompt's prefill on a
# GPU) to the longest generations.
REQUEST_TIME_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0]
# Tokens of a request, 1-2-5 steps up to any model's context (vLLM's buckets stop at the model's own).
TOKEN_COUNT_BUCKETS = [m * 10 ** e for e in range(7) for m in (1, 2, 5) if m * 10 ** e <= 1_000_000]
# vllm_backend's and vLLM's histograms of whole requests, observed when a request ends with "stop" or
# "length": key -> (name, description, buckets).
REQUEST_HISTOGRAMS = {
    "e2e": ("inflight_e2e_request_latency_seconds", "Time from request arrival to its last response",
            REQUEST_TIME_BUCKETS),
    "queue": ("inflight_request_queue_time_seconds", "Time from request arrival to its first step",
              REQUEST_TIME_BUCKETS),
    "prefill": ("inflight_request_prefill_time_seconds", "Time from a request's first step to its first token",
                REQUEST_TIME_BUCKETS),
    "decode": ("inflight_request_decode_time_seconds", "Time from a request's first token to its last",
               REQUEST_TIME_BUCKETS),
    "inference": ("inflight_request_inference_time_seconds", "Time from a request's first step to its last token",
                  REQUEST_TIME_BUCKETS),
    "prompt_tokens": ("inflight_request_prompt_tokens", "Prompt tokens of a finished request",
                      TOKEN_COUNT_BUCKETS),
    "generation_tokens": ("inflight_request_generation_tokens",
                          "Tokens a finished request generated, all its completions together", TOKEN_COUNT_BUCKETS),
    "n": ("inflight_request_params_n", "Completions a finished request asked for (n)", [1, 2, 5, 10, 20]),
}
# How requests ended, for inflight_request_success_total{finished_reason} (vLLM's request_success_total;
# a request that failed is counted by inflight_requests_failed_total).
FINISH_REASONS = ("stop", "length", "abort")

GAUGES = {
    "kv_blocks_used": ("inflight_kv_blocks_used", "KV cache blocks in use"),
    "kv_blocks_total": ("inflight_kv_blocks_total", "KV cache blocks in the pool"),
    "num_running": ("inflight_num_requests_running", "Requests holding KV blocks"),
    "num_waiting": ("inflight_num_requests_waiting", "Requests waiting to be scheduled"),
}
COUNTERS = {
    "num_preemptions": ("inflight_num_preemptions_total", "Sequences preempted for recompute"),
    "prompt_tokens_total": ("inflight_prompt_tokens_total", "Prompt tokens of admitted requests"),
    "generation_tokens_total": ("inflight_generation_tokens_total", "Tokens generated"),
    "prefix_cache_queried_tokens": ("inflight_prefix_cache_queried_tokens_total",
                                    "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hit_tokens": ("inflight_prefix_cache_hit_tokens_total", "Prompt tokens found in the prefix cache"),
    "requests_aborted_total": ("inflight_requests_aborted_total", "Requests cancelled by their clients"),
    "requests_failed_total": ("inflight_requests_failed_total", "Requests ended by a failure of the engine"),
    "failed_steps_total": ("inflight_failed_steps_total", "Engine steps that raised"),
}
# Under speculative decoding only (vLLM's spec_decode counters).
SPEC_DECODE_COUNTERS = {
    "spec_decode_drafts_total": ("inflight_spec_decode_num_drafts_total", "Sequence steps that judged drafts"),
    "spec_decode_draft_tokens_total": ("inflight_spec_decode_num_draft_tokens_total", "Draft tokens judged"),
    "spec_decode_accepted_tokens_total": ("inflight_spec_decode_num_accepted_tokens_total", "Draft tokens kept"),
}
LORA_TASK_COUNTERS = {  # with lora_task_slots (lora_tasks.py)
    "lora_task_loads": ("inflight_lora_task_loads_total", "LoRA tasks sent with requests (lora_weights) loaded "
                                                          "into a slot"),
}
KV_OFFLOAD_GAUGES = {  # with kv_offload_memory (kv_offload.py)
    "kv_offload_blocks_used": ("inflight_kv_offload_blocks_used", "KV blocks kept in the host tier"),
    "kv_offload_blocks_total": ("inflight_kv_offload_blocks_total", "KV blocks the host tier holds"),
}
KV_OFFLOAD_COUNTERS = {
    "kv_offload_stored_blocks_total": ("inflight_kv_offload_stored_blocks_total",
                                       "Cached KV blocks copied to the host tier as the pool handed them out"),
    "kv_offload_loaded_blocks_total": ("inflight_kv_offload_loaded_blocks_total",
                                       "KV blocks copied back from the host tier for a prompt's prefix"),
}
IMAGE_COUNTERS = {  # a vision-language model's (images.py)
    "images_encoded_total": ("inflight_images_encoded_total", "Images of prompts run through the vision tower"),
    "images_cached_total": ("inflight_images_cached_total", "Images of prompts whose vectors were kept from before"),
}


class _Sent:
    """A metric and the value the server holds for it (0 at first), so that only changes are sent."""

    def __init__(self, metric):
        self.metric = metric
        self.value = 0

    def set(self, value) -> None:  # a gauge
        if value != self.value:
            self.metric.set(value)
            self.value = value

    def advance(self, total) -> None:  # a counter, to a running total
        if total > self.value:
            self.metric.increment(total - self.value)
            self.value = total


class _Histogram:
    """A Prometheus histogram's series, `_bucket` (cumulative, by `le`), `_sum` and `_count`, counted here
    and sent as counter increments: one message a series that changed, however many observations. (The
    Python backend's HISTOGRAM takes a message per observation, with the interpreter lock held: at a
    GPU's rate, tens of thousands a second, more than the model's process can send.)"""

    def __init__(self, bounds: list[float], series: list[_Sent], total: _Sent, count: _Sent):
        self.bounds, self._series, self._total, self._count = bounds, series, total, count
        self._counts = [0] * len(bounds)  # observations in each bucket, not cumulative
        self._sum = 0.0

    def observe_all(self, values: list[float]) -> None:
        for value in values:
            self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self._sum += sum(values)
        self._send()

    def set_totals(self, counts: list[int], total: float) -> None:
        """Observations counted elsewhere: how many in each bucket so far (not cumulative), and their sum."""
        self._counts, self._sum = list(counts), total
        self._send()

    def _send(self) -> None:
        self._count.advance(sum(self._counts))
        # The largest bucket first: a scrape in the middle of a report still sees cumulative buckets.
        for sent, cumulative in reversed(list(zip(self._series, itertools.accumulate(self._counts)))):
            sent.advance(cumulative)
        self._total.advance(self._sum)


class TritonMetrics:
    def __init__(self, pb_utils, labels: dict[str, str]):
        self._pb_utils = pb_utils
        self._labels = labels
        self._families_by_name = {}  # a family must outlive its metrics, or setting them fails
        kinds = pb_utils.MetricFamily
        self._gauges = {key: _Sent(self._metric(name, desc, kinds.GAUGE)) for key, (name, desc) in GAUGES.items()}
        self._counters = {key: _Sent(self._metric(name, desc, kinds.COUNTER))
                          for key, (name, desc) in COUNTERS.items()}
        self._hit_rate = _Sent(self._metric("inflight_prefix_cache_hit_rate",
                                            "Share of looked-up prompt tokens found in the prefix cache", kinds.GAUGE))
        self._kv_usage = _Sent(self._metric("inflight_kv_cache_usage_perc",
                                            "Share of the KV cache's blocks in use (1: all)", kinds.GAUGE))
        self._histograms = {
            "ttft": self._histogram("inflight_time_to_first_token_seconds",
                                    "Time from request arrival to its first token", LATENCY_BUCKETS),
            "itl": self._histogram("inflight_inter_token_latency_seconds", "Time between two tokens of one request",
                                   LATENCY_BUCKETS),
            **{key: self._histogram(*spec) for key, spec in REQUEST_HISTOGRAMS.items()},
        }
        # Observations not yet sent: the responder appends, the engine thread takes (deques: thread-safe).
        self._pending = {key: deque() for key in self._histograms}
        self._finished = {reason: _Sent(self._metric("inflight_request_success_total", "Requests that ended, by how",
                                                     kinds.COUNTER, labels={**labels, "finished_reason": reason}))
                          for reason in FINISH_REASONS}
        self._step_tokens = self._histogram("inflight_iteration_tokens", "Tokens of an engine step: its prompt "
                                            "chunks and decodes", STEP_TOKEN_BUCKETS)
        self._step_seconds = self._histogram("inflight_engine_step_seconds", "Time of an engine step that ran a "
                                             "batch (under async scheduling, with reading the step before)",
                                             STEP_SECONDS_BUCKETS)
        self._pending_finished = deque()  # (how each request ended: the responders append, as above)
        self._finished_counts = Counter()
        self._profile = None  # the serving profile's counters (profile.py), made when first sent
        self._lora: dict[str, tuple[_Sent, _Sent, _Sent]] = {}  # each adapter's, made when first sent
        self._spec_decode: dict[str, _Sent] = {}  # made when first sent: the engine speculates
        self._accepted_by_position: list[_Sent] = []  # ... and a position's when a draft there is first kept
        self._images: dict[str, _Sent] = {}  # made when first sent: the model takes images
        self._task_loads: dict[str, _Sent] = {}  # made when first sent: the engine takes LoRA tasks
        self._offload_gauges: dict[str, _Sent] = {}  # made when first sent: the engine has a host tier
        self._offload_counters: dict[str, _Sent] = {}

    def _metric(self, name: str, description: str, kind, labels: dict | None = None, **options):
        family = self._families_by_name.get(name)
        if family is None:
            family = self._families_by_name[name] = self._pb_utils.MetricFamily(name=name, description=description,
                                                                               kind=kind)
        return family.Metric(labels=labels or self._labels, **options)

    def _histogram(self, name: str, description: str, buckets: list[float]) -> "_Histogram":
        counter = self._pb_utils.MetricFamily.COUNTER
        bounds = [*buckets, math.inf]
        series = [_Sent(self._metric(f"{name}_bucket", description, counter,
                                     labels={**self._labels, "le": "+Inf" if b == math.inf else f"{b:g}"}))
                  for b in bounds]
        total, count = (_Sent(self._metric(f"{name}_{suffix}", description, counter)) for suffix in ("sum", "count"))
        return _Histogram(bounds, series, total, count)

    def update(self, stats: dict, profile: dict | None = None) -> None:
        """Send the engine's `stats`, the latencies recorded since the last call and the serving
        `profile` (ServingProfile.snapshot()), each only where it changed (each change is a message)."""
        self._send_latencies()
        if profile is not None:
            self._send_profile(profile)
        for key, gauge in self._gauges.items():
            gauge.set(stats[key])
        for key, counter in self._counters.items():
            counter.advance(stats[key])
        queried = stats["prefix_cache_queried_tokens"]
        self._hit_rate.set(stats["prefix_cache_hit_tokens"] / queried if queried else 0.0)
        self._step_tokens.set_totals(stats["steps_by_tokens"], stats["computed_tokens_total"])  # (counted by the
        self._step_seconds.set_totals(stats["steps_by_seconds"], stats["step_seconds_total"])  # engine, each step)
        total_blocks = stats["kv_blocks_total"]
        self._kv_usage.set(stats["kv_blocks_used"] / total_blocks if total_blocks else 0.0)
        finished = self._pending_finished
        self._finished_counts.update(finished.popleft() for _ in range(len(finished)))
        for reason, counter in self._finished.items():
            counter.advance(self._finished_counts[reason])
        self._spec_decode = self._advance_counters(stats, SPEC_DECODE_COUNTERS, self._spec_decode)
        for position, kept in enumerate(stats.get("spec_decode_accepted_tokens_per_pos", ())):
            if position == len(self._accepted_by_position):
                self._accepted_by_position.append(_Sent(self._metric(
                    "inflight_spec_decode_num_accepted_tokens_per_pos", "Draft tokens kept, by their position "
                    "after the sequence's last token (0: the first draft)", self._pb_utils.MetricFamily.COUNTER,
                    labels={**self._labels, "position": str(position)})))
            self._accepted_by_position[position].advance(kept)
        self._images = self._advance_counters(stats, IMAGE_COUNTERS, self._images)
        self._task_loads = self._advance_counters(stats, LORA_TASK_COUNTERS, self._task_loads)
        self._offload_gauges = self._advance_counters(stats, KV_OFFLOAD_GAUGES, self._offload_gauges, gauges=True)
        self._offload_counters = self._advance_counters(stats, KV_OFFLOAD_COUNTERS, self._offload_counters)
        for adapter, (running, waiting, total) in stats.get("lora_requests", {}).items():
            sent = self._lora.get(adapter) or self._lora_metrics(adapter)
            sent[0].set(running)
            sent[1].set(waiting)
            sent[2].advance(total)

    def _advance_counters(self, stats: dict, counters: dict, sent: dict, gauges: bool = False) -> dict:
        """Counters (or `gauges`) that only some engines report (made when first reported): advanced (set) to
        the stats'."""
        if next(iter(counters)) not in stats:
            return sent
        if not sent:
            kind = self._pb_utils.MetricFamily.GAUGE if gauges else self._pb_utils.MetricFamily.COUNTER
            sent = {key: _Sent(self._metric(name, desc, kind)) for key, (name, desc) in counters.items()}
        for key, metric in sent.items():
            if gauges:
                metric.set(stats[key])
            else:
                metric.advance(stats[key])
        return sent

    def _lora_metrics(self, adapter: str) -> tuple["_Sent", "_Sent", "_Sent"]:
        kinds, labels = self._pb_utils.MetricFamily, {**self._labels, "adapter": adapter}
        self._lora[adapter] = tuple(_Sent(self._metric(name, desc, kind, labels=labels)) for name, desc, kind in (
            ("inflight_lora_requests_running", "Requests of the LoRA adapter holding KV blocks", kinds.GAUGE),
            ("inflight_lora_requests_waiting", "Requests of the LoRA adapter waiting to be scheduled", kinds.GAUGE),
            ("inflight_lora_requests_total", "Requests admitted for the LoRA adapter", kinds.COUNTER)))
        return self._lora[adapter]

    def _send_profile(self, profile: dict) -> None:
        if self._profile is None:
            counter = self._pb_utils.MetricFamily.COUNTER
            self._profile = {
                what: {part: _Sent(self._metric(name, desc, counter, labels={**self._labels, "part": part}))
                       for part in PARTS}
                for what, name, desc in (
                    ("wall", "inflight_serving_seconds_total", "Wall time of each part of the serving work"),
                    ("cpu", "inflight_serving_cpu_seconds_total", "CPU time of the threads doing each part"),
                    ("count", "inflight_serving_events_total", "Times each part of the serving work ran"))}
        for i, what in enumerate(("wall", "cpu", "count")):
            for part, sent in self._profile[what].items():
                sent.advance(profile[part][i])

    def _send_latencies(self) -> None:
        for key, histogram in self._histograms.items():
            pending = self._pending[key]
            if pending:
                histogram.observe_all([pending.popleft() for _ in range(len(pending))])

    def observe_time_to_first_token(self, seconds: float) -> None:
        self._pending["ttft"].append(seconds)

    def observe_inter_token_latency(self, seconds: float) -> None:
        self._pending["itl"].append(seconds)

    def observe_from_engine(self, arrival_ns: int, times: RequestMetrics, num_tokens: int) -> None:
        """The latencies of a request whose tokens were sent at its end (not streamed), from the engine's
        times of its first completion's `num_tokens` tokens: its time to first token from `arrival_ns`,
        and its mean inter-token latency, once for each interval (as a stream's would count)."""
        if times.first_token_time_ns is None:
            return
        self._pending["ttft"].append(max(0, times.first_token_time_ns - arrival_ns) / 1e9)
        if num_tokens > 1:
            mean = (times.last_token_time_ns - times.first_token_time_ns) / 1e9 / (num_tokens - 1)
            self._pending["itl"].extend(itertools.repeat(mean, num_tokens - 1))

    def count_end(self, reason: str | None) -> None:
        """How a request ended (its last response's finish reason), where it is one of FINISH_REASONS."""
        if reason in FINISH_REASONS:
            self._pending_finished.append(reason)

    def observe_finished(self, reason: str | None, seconds: float, arrival_ns: int, times: RequestMetrics | None,
                         num_prompt_tokens: int, num_generated_tokens: int, n: int = 1) -> None:
        """A request's end, seen in its last response: how it ended, and for one that ended with "stop" or
        "length" its time from arrival to now (`seconds`), its queue, prefill, decode and inference times
        from the engine's `times` (from its arrival at the model, `arrival_ns`), its tokens and its `n`."""
        self.count_end(reason)
        if reason not in ("stop", "length"):
            return
        pending = self._pending
        pending["e2e"].append(seconds)
        pending["prompt_tokens"].append(num_prompt_tokens)
        pending["generation_tokens"].append(num_generated_tokens)
        pending["n"].append(n)
        if times is None or times.first_scheduled_time_ns is None:
            return
        pending["queue"].append(max(0, times.first_scheduled_time_ns - arrival_ns) / 1e9)
        if times.first_token_time_ns is not None:  # (none: it ended before a token, a prompt too long say)
            pending["prefill"].append(max(0, times.first_token_time_ns - times.first_scheduled_time_ns) / 1e9)
            pending["decode"].append((times.last_token_time_ns - times.first_token_time_ns) / 1e9)
            pending["inference"].append(max(0, times.last_token_time_ns - times.first_scheduled_time_ns) / 1e9)
