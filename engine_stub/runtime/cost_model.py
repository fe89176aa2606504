"""How long a simulated engine step takes: a roofline-style cost model, pure.

Defaults approximate Llama-3.1-8B (BF16) on one H100 SXM, from first principles rather than a
benchmark (so the derivation is checkable):
- prefill is compute-bound: ~2 x 8e9 = 16 GFLOP per token; at ~50% of the H100's 989 dense BF16
  TFLOP/s that is ~32 us per uncached prompt token (~31k tokens/s);
- decode is memory-bound: every step streams the 16 GB of weights at ~3.35 TB/s, ~4.8 ms, plus
  scheduling and sampling overhead, so ~6 ms per step at small batch, growing slowly with batch size
  (KV reads: ~128 KiB per token of context for this model, ~38 ns per cached token of context read).
These are estimates, not measurements; a deployment that knows its engines sets its own numbers.

The KV pool of that engine (`H100_8B`, the load test's default pool): Llama-3-8B has 32 layers, 8 KV
heads of dimension 128, in BF16, so one token's K and V take 2 x 32 x 8 x 128 x 2 B = 131,072 B
(128 KiB, `KV_BYTES_PER_TOKEN`). vLLM gives the KV cache what `gpu_memory_utilization` (0.9) of the
80 GiB leaves after the weights (8.03e9 parameters x 2 B, ~16 GiB with activations rounded in):
0.9 x 80 - 16 = 56 GiB, i.e. 458,752 tokens, or 28,672 blocks of 16 tokens (vLLM's
`num_gpu_blocks` counts the null block among them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

import msgspec

if TYPE_CHECKING:
    from engine_stub.core.request import Request, RequestId
    from engine_stub.core.scheduler import StepOutput

__all__ = ["H100_8B", "KV_BYTES_PER_TOKEN", "CostModel", "GpuMemory", "StepWork", "step_work"]

GIB: Final = 1 << 30
KV_BYTES_PER_TOKEN: Final = 2 * 32 * 8 * 128 * 2
"""K and V x 32 layers x 8 KV heads x head dim 128 x 2 bytes (BF16): Llama-3-8B's 128 KiB per token."""


class GpuMemory(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What sizes an engine's KV pool: GPU memory, vLLM's utilisation cap, weights, KV bytes per token."""

    total_bytes: int = 80 * GIB
    utilization: float = 0.9
    weight_bytes: int = 16 * GIB
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN

    def kv_tokens(self) -> int:
        """Tokens of KV the pool holds: what the utilisation cap leaves after the weights."""
        free = int(self.total_bytes * self.utilization) - self.weight_bytes
        return max(0, free // self.kv_bytes_per_token)

    def num_gpu_blocks(self, block_size: int) -> int:
        """vLLM's `num_gpu_blocks` for `block_size`-token blocks (the null block among them)."""
        return self.kv_tokens() // block_size


H100_8B: Final = GpuMemory()
"""An H100 80 GB serving Llama-3-8B in BF16: 458,752 tokens of KV, 28,672 blocks of 16."""


class CostModel(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Seconds per unit of work; `speed_factor` > 1 makes simulated time run faster than real time."""

    prefill_s_per_token: float = 32e-6
    decode_step_s: float = 6e-3
    decode_s_per_seq: float = 40e-6
    context_read_s_per_token: float = 38e-9
    step_overhead_s: float = 0.5e-3
    speed_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.speed_factor <= 0:
            raise ValueError("speed_factor must be > 0")
        fields = (self.prefill_s_per_token, self.decode_step_s, self.decode_s_per_seq)
        if min(*fields, self.context_read_s_per_token, self.step_overhead_s) < 0:
            raise ValueError("cost model times must be >= 0")

    def step_seconds(self, work: StepWork) -> float:
        """Wall-clock seconds one engine step with `work` takes, after the speed factor."""
        if work.prefill_tokens == 0 and work.decode_seqs == 0:
            return 0.0
        seconds = self.step_overhead_s + work.prefill_tokens * self.prefill_s_per_token
        if work.decode_seqs:
            seconds += self.decode_step_s + work.decode_seqs * self.decode_s_per_seq
        seconds += work.context_tokens * self.context_read_s_per_token
        return seconds / self.speed_factor


class StepWork(msgspec.Struct, frozen=True):
    """What one step computes: uncached prompt tokens, decoding sequences, context tokens read."""

    prefill_tokens: int = 0
    decode_seqs: int = 0
    context_tokens: int = 0


def step_work(out: StepOutput, requests: Mapping[RequestId, Request]) -> StepWork:
    """What one scheduler step computed, for `CostModel.step_seconds`: its prefill tokens, decoding
    sequences and the context read, i.e. the computed tokens, after the step, of every scheduled
    request the scheduler still holds (`requests`; a request that finished in the step reads as 0).

    The one pricing rule of a step: the stub's step loop, the load test's busy-time model and the
    routing simulator all call it."""
    context = sum(req.num_computed_tokens for rid in out.scheduled if (req := requests.get(rid)) is not None)
    return StepWork(out.num_prefill_tokens, out.num_decode_tokens, context)
