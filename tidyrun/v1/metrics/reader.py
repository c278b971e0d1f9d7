"""``from tidyrun.v1.metrics.reader import Counter, Gauge, Histogram, Vector``: the classes of ``LLM.get_metrics()``'s
objects where vLLM's users import them from (tidyrun.metrics_reader defines them)."""

from ...metrics_reader import Counter, Gauge, Histogram, Metric, Vector

__all__ = ("Metric", "Counter", "Gauge", "Histogram", "Vector")
