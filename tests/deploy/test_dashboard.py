"""deploy/grafana/kvrouter.json: every PromQL expression parses, and every metric it names is one a live
gateway exports on /metrics (`vllm:` ones: one the engine stub, vLLM's stand-in, exports), with the
labels its matchers use."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import httpx
import promql_parser as promql
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway_helpers import (
    all_fresh,
    engine_of,
    gateway_config,
    running_gateway,
    running_stubs,
    wait_for,
)

DASHBOARD: Final = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvrouter.json"
# Grafana's interval variables stand where PromQL wants a duration; $model and $engine sit in strings.
_INTERVALS: Final = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
_SUFFIXES: Final = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created")}
# The list: what an operator must see on it.
REQUIRED: Final = {
    "kvrouter_requests_total", "kvrouter_rejected_requests_total", "kvrouter_router_overhead_seconds_bucket",
    "kvrouter_predicted_cached_tokens_total", "kvrouter_actual_cached_tokens_total",
    "kvrouter_engine_mirror_trust", "kvrouter_engine_event_lag_seconds", "kvrouter_engine_gaps_total",
    "kvrouter_engine_resets_total", "kvrouter_engine_in_flight_requests", "kvrouter_engine_breaker_state",
    "kvrouter_request_ttft_seconds_bucket", "kvrouter_request_duration_seconds_bucket",
}  # fmt: skip


def panels(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in node.get("panels", []):
        yield panel
        yield from panels(panel)


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every query of the dashboard: panel targets, and the metric selectors of label_values() variables."""
    exprs = [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found = re.fullmatch(r"label_values\((.+), *\w+\)", variable["query"]["query"])
            assert found, variable["query"]
            exprs.append(found.group(1))
    return exprs


def selectors(node: Any) -> Iterator[promql.VectorSelector]:
    """Every vector selector in a parsed expression."""
    if isinstance(node, promql.VectorSelector):
        yield node
    elif isinstance(node, promql.MatrixSelector):
        yield node.vector_selector
    elif isinstance(node, promql.BinaryExpr):
        yield from selectors(node.lhs)
        yield from selectors(node.rhs)
    elif isinstance(node, promql.Call):
        for arg in node.args:
            yield from selectors(arg)
    elif isinstance(node, promql.AggregateExpr):
        yield from selectors(node.expr)
        if node.param is not None:
            yield from selectors(node.param)
    elif isinstance(node, promql.ParenExpr | promql.UnaryExpr | promql.SubqueryExpr):
        yield from selectors(node.expr)


def parse(expr: str) -> promql.Expr:
    for variable, value in _INTERVALS.items():
        expr = expr.replace(variable, value)
    return promql.parse(expr)


def exported(text: str) -> dict[str, set[str]]:
    """Each series name the exposition defines (a counter's `_total`, a histogram's `_bucket`, ...) and
    the labels its samples carry."""
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for suffix in _SUFFIXES.get(family.type, ("",)):
            names.setdefault(family.name + suffix, set())
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def test_every_expression_parses_and_the_dashboard_covers_the_list() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    used = {s.name for e in expressions(dashboard) for s in selectors(parse(e))}
    assert REQUIRED <= used, REQUIRED - used
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        if panel.get("targets"):
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


async def test_every_metric_the_dashboard_names_is_exported() -> None:
    async with running_stubs(2) as stubs:
        config = gateway_config([engine_of(f"e{i}", s) for i, s in enumerate(stubs)])
        async with running_gateway(config) as gw:
            c = gw.client

            async def ready() -> bool:
                return await all_fresh(c)

            await wait_for(ready)
            body = {"model": "kvrouter-stub", "prompt": "the quick brown fox " * 8, "max_tokens": 3}
            stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
            for b in (body, stream):  # so the labelled series exist and show their labels
                assert (await c.post("/v1/completions", json=b)).status_code == 200
            gateway = exported((await c.get("/metrics")).text)
            assert stubs[0].info is not None
            async with httpx.AsyncClient() as client:
                engine = exported((await client.get(stubs[0].info.url + "/metrics")).text)
    for expr in expressions(json.loads(DASHBOARD.read_text())):
        for selector in selectors(parse(expr)):
            name = selector.name
            assert name is not None, expr
            series = engine if name.startswith("vllm:") else gateway
            assert name in series, f"{name} (in {expr}) is not exported"
            labels = {m.name for m in selector.matchers.matchers} - {"__name__"}
            if series[name]:  # the labels of a series with samples (a labelled one with none shows none)
                assert labels <= series[name], f"{name}: no labels {labels - series[name]} (in {expr})"
