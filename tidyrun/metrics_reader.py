"""``LLM.get_metrics()``: the engine's counters and gauges as vLLM's metric objects (vllm.v1.metrics.reader).

Users who learned vLLM read prefix-cache hit rates and queue sizes from
``llm.get_metrics()`` by their ``vllm:`` names; the same names are served
here from ``LLM.stats()`` (host-side numbers, read when called).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Counter(Metric):
    value: int = 0


@dataclass(frozen=True)
class Gauge(Metric):
    value: float = 0.0


# vLLM's other two kinds. tidyrun reports none of them yet (its figures are counts and gauges), but code written
# for vLLM dispatches on all four (``isinstance(metric, Histogram)``, vLLM's offline metrics example).
@dataclass(frozen=True)
class Vector(Metric):
    values: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Histogram(Metric):
    count: int = 0
    sum: float = 0.0
    buckets: dict[str, int] = field(default_factory=dict)


# (vLLM's name, kind, the key of LLM.stats() it reads)
_METRICS = (
    ("vllm:num_requests_running", Gauge, "running"),
    ("vllm:num_requests_waiting", Gauge, "waiting"),
    ("vllm:num_preemptions", Counter, "preemptions"),
    ("vllm:prefix_cache_queries", Counter, "prefill_tokens"),  # prompt tokens looked up in the cache
    ("vllm:prefix_cache_hits", Counter, "prefix_cached_tokens"),  # of which served from it
    ("vllm:spec_decode_num_draft_tokens", Counter, "spec_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", Counter, "spec_accepted_tokens"),
)


def metrics_from_stats(stats: dict, model_name: str) -> list[Metric]:
    """vLLM-named metrics of one engine's ``stats()``, labelled with the model like vLLM's."""
    labels = {"model_name": model_name, "engine": "0"}
    out: list[Metric] = [kind(name, dict(labels), stats[key]) for name, kind, key in _METRICS]
    total = stats["kv_blocks_total"] or 1
    out.append(Gauge("vllm:kv_cache_usage_perc", dict(labels), stats["kv_blocks_used"] / total))
    return out
