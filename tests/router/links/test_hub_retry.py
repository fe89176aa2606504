"""The background retry's pure parts (router.links.hub_retry): its waits, and a fetch that loads each
variant's tokenizer or says why not, offline from a hub cache built in the test's directory (the
gateway's retries themselves: tests/e2e/test_hub_tokenizer.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from huggingface_hub import constants

from router.core.variant import Variant
from router.links.hub_retry import MAX_DELAY_S, fetch_and_load, retry_delays
from router.prepare.engine_variants import resolve_variant
from router.settings.config import ModelConfig
from tests.hub_helpers import DEEPSEEK_JSON, cache_revision
from tokenization.hub import HubUnavailable

REPO = "deepseek-ai/DeepSeek-V4"


def test_the_waits_double_from_the_first_up_to_the_cap() -> None:
    assert retry_delays(30.0, 6) == [30.0, 60.0, 120.0, 240.0, 480.0, MAX_DELAY_S]
    assert retry_delays(0.5, 0) == []


def _variant(repo: str) -> Variant:
    return resolve_variant(ModelConfig(name="m", tokenizer=repo))


def test_a_fetch_loads_what_arrived_and_says_why_for_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "hub"
    cache_revision(cache, REPO, "a" * 40, {"tokenizer.json": DEEPSEEK_JSON})
    cache_revision(cache, "org/broken", "b" * 40, {"tokenizer.json": "not json"})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    good, broken, missing = _variant(REPO), _variant("org/broken"), _variant("org/absent")
    found = fetch_and_load(
        {(REPO, None): [good], ("org/broken", None): [broken], ("org/absent", None): [missing]}, 30.0
    )
    loaded = found[(REPO, None)]
    assert not isinstance(loaded, HubUnavailable)
    path, encoders = loaded
    assert path.parent.name == "snapshots" and list(encoders) == [good.tokenizer_source]
    assert encoders[good.tokenizer_source].tokenizer.encode("hello", add_special_tokens=False)
    reasons = {ref: r.reason for ref, r in found.items() if isinstance(r, HubUnavailable)}
    assert reasons == {("org/broken", None): "unreadable", ("org/absent", None): "offline"}
