"""The engine's Prometheus metrics, through the Python backend's custom-metrics API (`pb_utils`),
served on Triton's metrics port beside Triton's own."""

LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0]

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


class TritonMetrics:
    def __init__(self, pb_utils, labels: dict[str, str]):
        self._pb_utils = pb_utils
        self._labels = labels
        self._families = []  # a family must outlive its metrics, or setting them fails
        kinds = pb_utils.MetricFamily
        self._gauges = {key: self._metric(name, desc, kinds.GAUGE) for key, (name, desc) in GAUGES.items()}
        self._counters = {key: self._metric(name, desc, kinds.COUNTER) for key, (name, desc) in COUNTERS.items()}
        self._counted = {key: 0 for key in COUNTERS}
        self._hit_rate = self._metric("inflight_prefix_cache_hit_rate",
                                      "Share of looked-up prompt tokens found in the prefix cache", kinds.GAUGE)
        self._latency = {
            "ttft": self._histogram("inflight_time_to_first_token_seconds",
                                    "Time from request arrival to its first token"),
            "itl": self._histogram("inflight_inter_token_latency_seconds", "Time between two tokens of one request"),
        }
        self._last = None

    def _metric(self, name: str, description: str, kind, **options):
        family = self._pb_utils.MetricFamily(name=name, description=description, kind=kind)
        self._families.append(family)
        return family.Metric(labels=self._labels, **options)

    def _histogram(self, name: str, description: str):
        """A histogram where this server version has them, else a _sum and a _count counter."""
        kinds = self._pb_utils.MetricFamily
        if hasattr(kinds, "HISTOGRAM"):
            return self._metric(name, description, kinds.HISTOGRAM, buckets=LATENCY_BUCKETS).observe
        total = self._metric(f"{name}_sum", description, kinds.COUNTER)
        count = self._metric(f"{name}_count", description, kinds.COUNTER)

        def observe(value: float) -> None:
            total.increment(value)
            count.increment(1)

        return observe

    def update(self, stats: dict) -> None:
        snapshot = tuple(stats[k] for k in (*GAUGES, *COUNTERS))
        if snapshot == self._last:
            return  # each call is a message to the server: skip when nothing changed
        self._last = snapshot
        for key, metric in self._gauges.items():
            metric.set(stats[key])
        for key, metric in self._counters.items():
            if stats[key] > self._counted[key]:
                metric.increment(stats[key] - self._counted[key])
                self._counted[key] = stats[key]
        queried = stats["prefix_cache_queried_tokens"]
        self._hit_rate.set(stats["prefix_cache_hit_tokens"] / queried if queried else 0.0)

    def observe_time_to_first_token(self, seconds: float) -> None:
        self._latency["ttft"](seconds)

    def observe_inter_token_latency(self, seconds: float) -> None:
        self._latency["itl"](seconds)
