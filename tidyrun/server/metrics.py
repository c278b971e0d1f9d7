"""Prometheus metrics of one server: request and token counters, engine gauges read at scrape time.

Uses a registry owned by the app (not prometheus_client's process-wide
default), so two servers in one process do not share or clash.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST


class _EngineCollector:
    """Reads the loop's latest stats snapshot (written by the engine thread after every step)."""

    def __init__(self, loop) -> None:
        self._loop = loop

    def collect(self):
        stats = self._loop.stats.values
        yield GaugeMetricFamily("tidyrun_requests_waiting", "requests queued, not yet scheduled",
                                value=stats.get("waiting", 0))
        yield GaugeMetricFamily("tidyrun_requests_running", "sequences in the running batch",
                                value=stats.get("running", 0))
        total = stats.get("kv_blocks_total", 0) or 1
        yield GaugeMetricFamily("tidyrun_kv_cache_usage_ratio", "fraction of KV blocks in use",
                                value=stats.get("kv_blocks_used", 0) / total)
        yield GaugeMetricFamily("tidyrun_preemptions", "sequences preempted since start",
                                value=stats.get("preemptions", 0))
        yield GaugeMetricFamily("tidyrun_prefix_cache_hit_tokens", "prompt tokens served from the prefix cache",
                                value=stats.get("prefix_cached_tokens", 0))
        yield GaugeMetricFamily("tidyrun_prefill_tokens", "prompt tokens of admitted sequences",
                                value=stats.get("prefill_tokens", 0))
        yield GaugeMetricFamily("tidyrun_spec_draft_tokens", "speculative draft tokens proposed",
                                value=stats.get("spec_draft_tokens", 0))
        yield GaugeMetricFamily("tidyrun_spec_accepted_tokens", "speculative draft tokens accepted",
                                value=stats.get("spec_accepted_tokens", 0))
        yield GaugeMetricFamily("tidyrun_sleeping", "1 while the engine sleeps", value=int(stats.get("sleeping", 0)))
        memory = GaugeMetricFamily("tidyrun_device_memory_bytes", "device bytes held, by ledger owner",
                                   labels=["owner"])
        for owner, nbytes in stats.get("device_memory_bytes", {}).items():
            memory.add_metric([owner], nbytes)
        yield memory


class ServerMetrics:
    def __init__(self, loop) -> None:
        self.registry = CollectorRegistry()
        self._requests = Counter("tidyrun_http_requests", "HTTP requests by route and status",
                                 ["route", "status"], registry=self.registry)
        self._prompt_tokens = Counter("tidyrun_prompt_tokens", "prompt tokens of finished requests",
                                      registry=self.registry)
        self._generation_tokens = Counter("tidyrun_generation_tokens", "generated tokens of finished requests",
                                          registry=self.registry)
        self.registry.register(_EngineCollector(loop))

    def count(self, route: str, status: int) -> None:
        self._requests.labels(route, str(status)).inc()

    def tokens(self, prompt: int, generated: int) -> None:
        self._prompt_tokens.inc(prompt)
        self._generation_tokens.inc(generated)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
