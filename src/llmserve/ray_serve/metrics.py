"""/metrics of a Ray deployment: the ingress's HTTP counters and every replica's engine.

Each replica renders its own ServerMetrics (the same families a single server has) into
its routing-stats report; the ingress serves them all at once, each sample labelled with
``replica``, merged family by family with its own HTTP-level families. A dashboard sums
over ``replica`` (``sum without (replica) (...)``) to read the deployment as one server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from llmserve.server.metrics import ServerMetrics

# What the ingress itself measures; the rest is the replicas' (their engines').
INGRESS_FAMILIES = frozenset({"llmserve:http_responses", "llmserve:request_rejected"})


class ClusterMetrics(ServerMetrics):
    def __init__(self, model_name: str,
                 reports: Callable[[], dict[str, dict]]) -> None:
        super().__init__(model_name)
        self._reports = reports

    def render(self) -> bytes:
        families: dict[str, Metric] = {}
        # Through the text format, as the replicas' come: counters' _created samples then
        # form the same families on both sides.
        for family in text_string_to_metric_families(generate_latest(self.registry).decode()):
            if family.name.removesuffix("_created") in INGRESS_FAMILIES:
                _merge(families, family, None)
        for replica, report in sorted(self._reports().items()):
            text = report.get("metrics")
            if text:
                for family in text_string_to_metric_families(text):
                    _merge(families, family, replica)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(families.values()))
        return generate_latest(registry)


def _merge(into: dict[str, Metric], family: Metric, replica: str | None) -> None:
    merged = into.get(family.name)
    if merged is None:
        merged = into[family.name] = Metric(family.name, family.documentation, family.type,
                                            family.unit)
    for s in family.samples:
        labels = s.labels if replica is None else {**s.labels, "replica": replica}
        merged.samples.append(Sample(s.name, labels, s.value, s.timestamp, s.exemplar))


class _Families:
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families
