"""/metrics as a Prometheus scraper reads it: the engine's step count is a counter that never goes down."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tidal.observe.metrics import Metrics
from tidal.wire import EngineStats


def steps_family(metrics: Metrics, step: int):
    text = metrics.render(EngineStats(step=step), num_frontend_requests=0).decode()
    return next(family for family in text_string_to_metric_families(text) if family.name == "tidal:engine_steps")


def test_engine_steps_is_a_counter_named_by_the_prometheus_conventions():
    family = steps_family(Metrics("m"), 38)
    assert family.type == "counter"
    samples = {sample.name: sample.value for sample in family.samples}
    assert samples["tidal:engine_steps_total"] == 38


def test_engine_steps_never_goes_down_when_a_replica_starts_over():
    metrics = Metrics("m")
    totals = []
    for step in (10, 25, 4, 9):  # 4: a replica restarted and reports from 0 again
        family = steps_family(metrics, step)
        totals.append(next(s.value for s in family.samples if s.name == "tidal:engine_steps_total"))
    assert totals == [10, 25, 25, 30]
