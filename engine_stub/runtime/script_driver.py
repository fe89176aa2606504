"""Runs a manager-trace script (`tests/data/vllm-0.33.0/manager-traces/*.script.json`) on the stub.

The traces were recorded with a stand-in scheduler (trace README, semantics doc §7, §11): `admit`
steps the engine until every named request has sampled its first token, `decode` runs n one-token
steps of one request, `finish` frees requests, `reset` resets the prefix cache; requests an op does
not name sit idle and every request gets the whole token budget. Each op yields records in the
trace file's shape so tests can compare them field by field. Pure.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import msgspec

from engine_stub.core.engine_config import (
    CacheConfig,
    EngineCoreConfig,
    GroupKind,
    GroupSpec,
    SchedulerConfig,
)
from engine_stub.core.request import Request, RequestId, SubmitParams
from engine_stub.core.scheduler import Scheduler, StepOutput, pseudo_token
from events.wire import KVEvent
from tokenization.request_tokens import ReportMode

__all__ = ["ScriptDriver", "config_from_script"]

FREE_QUEUE_HEAD = 16
UNBOUNDED_TOKENS = 1 << 30


def config_from_script(config: dict[str, Any]) -> EngineCoreConfig:
    """The engine a trace script's `config` describes (model full | fa_swa | fa_mamba)."""
    bs = config["block_size"]
    second = {
        "full": None,
        "fa_swa": GroupSpec(GroupKind.SLIDING_WINDOW, bs, sliding_window=config.get("sliding_window", 8)),
        "fa_mamba": GroupSpec(
            GroupKind.MAMBA, bs, mamba_prefill_checkpoint=config.get("mamba_prefill_checkpoint", False)
        ),
    }[config["model"]]
    groups = (GroupSpec(GroupKind.FULL_ATTENTION, bs),) + ((second,) if second else ())
    cache = CacheConfig(
        num_gpu_blocks=config["num_blocks"],
        groups=groups,
        prefix_cache_retention_interval=config.get("retention_interval", 0),
    )
    sched = SchedulerConfig(
        max_num_batched_tokens=config.get("max_num_batched_tokens", 8192),
        long_prefill_token_threshold=config.get("long_prefill_token_threshold", 0),
        budget_per_request=True,
    )
    return EngineCoreConfig(cache=cache, scheduler=sched)


class ScriptDriver:
    """Maps script ops onto `Scheduler` calls and renders each step as a trace record."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.engine = Scheduler(config_from_script(config), sampler=self._sample)
        self._forced: dict[RequestId, deque[int]] = {}

    def _sample(self, req: Request) -> int:
        forced = self._forced.get(req.request_id)
        return forced.popleft() if forced else pseudo_token(req)

    def run(self, ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Every record the script produces, in order."""
        return [record for op in ops for record in self.apply(op)]

    def apply(self, op: dict[str, Any]) -> list[dict[str, Any]]:
        """Run one op; returns its records (one per engine step, or one for finish/reset)."""
        match op["op"]:
            case "admit":
                return self._admit(op.get("requests") or [op])
            case "decode":
                return self._decode(RequestId(op["req"]), op["n"], op.get("tokens"))
            case "finish":
                for name in op.get("reqs") or [op["req"]]:
                    assert self.engine.abort(RequestId(name)), f"unknown request {name}"
                return [self._pool_record(self.engine.take_events())]
            case "reset":
                ok = self.engine.reset_prefix_cache()
                return [{"reset_ok": ok} | self._pool_record(self.engine.take_events())]
            case other:
                raise ValueError(f"unknown script op {other!r}")

    def _admit(self, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        names = []
        for spec in specs:
            mode = ReportMode(spec.get("report", "incremental"))
            params = SubmitParams(max_tokens=UNBOUNDED_TOKENS, report_mode=mode)
            names.append(self.engine.submit(spec["tokens"], params, request_id=spec["req"]))
        records = []
        while pending := [n for n in names if self.engine.requests[n].num_output_tokens == 0]:
            records.append(self._step_record(self.engine.step(only=set(pending))))
        return records

    def _decode(self, rid: RequestId, n: int, tokens: list[int] | None) -> list[dict[str, Any]]:
        if tokens:
            self._forced[rid] = deque(tokens)
        return [self._step_record(self.engine.step(only={rid})) for _ in range(n)]

    def _step_record(self, out: StepOutput) -> dict[str, Any]:
        reqs = self.engine.requests
        lookups = {
            rid: {
                "hit_tokens": a.hit_tokens,
                "shared_prefix_boundary": a.shared_prefix_boundary,
                "num_uncached": a.num_uncached,
                "hit_blocks": a.hit_blocks,
                "admitted": a.admitted,
            }
            for rid, a in out.admissions.items()
        }
        record = {
            "lookups": lookups or None,
            "scheduled_tokens": dict(out.scheduled),
            "sampled_token": dict(out.new_tokens) or None,
            "num_computed_tokens": {rid: reqs[rid].num_computed_tokens for rid in out.scheduled},
            "block_tables": {rid: self.engine.block_ids(rid) for rid in out.scheduled},
            "resident": self._resident(),
        }
        return record | self._pool_record(out.events)

    def _pool_record(self, events: list[KVEvent]) -> dict[str, Any]:
        pool = self.engine.kv.pool
        head = []
        for block in list(pool.free_queue)[:FREE_QUEUE_HEAD]:
            key = block.key
            head.append(
                [int(block.block_id), None if key is None else key[1], None if key is None else _wire(key[0])]
            )
        record: dict[str, Any] = {"free_queue_head": head, "num_free_blocks": pool.num_free_blocks}
        record["events"] = _events(events)
        return record

    def _resident(self) -> dict[str, dict[str, int]]:
        resident = self.engine.kv.pool.resident()
        return {str(g): {str(h): n for h, n in sorted(per.items())} for g, per in sorted(resident.items())}


def _wire(digest: bytes) -> int:
    return int.from_bytes(digest[-8:], "big")


def _events(events: list[KVEvent]) -> list[Any]:
    return msgspec.json.decode(msgspec.json.encode(events))  # type: ignore[no-any-return]
