"""docs/grafana-tidal.json: valid JSON, and every PromQL expression in it names only metrics tidal exports
(a renamed metric would otherwise leave a silent, empty panel)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tidal.observe.metrics import Metrics
from tidal.wire import EngineStats

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana-tidal.json"


def exported_series() -> set[str]:
    text = Metrics("m", num_replicas=2).render(EngineStats(num_total_blocks=8), 0,
                                                [(0, True, EngineStats(), 0), (1, True, EngineStats(), 0)]).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def expressions(node) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for value in node.values() for e in expressions(value)]
    if isinstance(node, list):
        return [e for value in node for e in expressions(value)]
    return []


def test_every_expression_names_a_metric_tidal_exports():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = expressions(dashboard["panels"])
    assert len(exprs) >= 10
    series = exported_series()
    for expr in exprs + [dashboard["templating"]["list"][1]["query"]]:
        names = re.findall(r"tidal:[a-z_:]+", expr)
        assert names, expr
        for name in names:
            assert name in series, f"{name} (in {expr!r}) is not a series tidal exports"


def test_the_hop_panels_read_the_hop_histogram():
    exprs = expressions(json.loads(DASHBOARD.read_text())["panels"])
    assert any("tidal:request_hop_seconds_bucket" in e and "hop" in e for e in exprs)
    assert any("tidal:time_to_first_token_seconds_bucket" in e for e in exprs)
