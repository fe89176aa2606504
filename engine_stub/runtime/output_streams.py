"""Per-request output streams between the engine runtime and the HTTP layer.

The runtime puts an `Emitted` on a request's sink queue for every sampled token; several engine
requests (a multi-prompt completion) may share one sink, told apart by `index`. A server that stops
ends each open request with one `aborted` item.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from engine_stub.core.request import RequestId, SubmitParams

__all__ = ["Emitted", "RequestStream"]


@dataclass(frozen=True, slots=True)
class Emitted:
    """One output token of the request at `index`; `finished` on its last one."""

    index: int
    token: int
    output_index: int
    finished: bool
    stream: RequestStream
    aborted: bool = False
    """The request was ended by the server (it is stopping); `token` is then -1, not an output token."""


@dataclass(slots=True, eq=False)
class RequestStream:
    """One engine request's identity, sink and the facts usage reports need."""

    rid: RequestId
    index: int
    sink: asyncio.Queue[Emitted]
    num_prompt_tokens: int
    params: SubmitParams
    arrival: float
    cached_tokens: int | None = None
    """The prefix-cache hit at the first admission (re-admissions after preemption are not reported)."""
    preempted: bool = False
    num_output_tokens: int = 0

    def emit(self, token: int, finished: bool) -> None:
        """Hand the next output token to the reader."""
        emitted = Emitted(
            index=self.index, token=token, output_index=self.num_output_tokens, finished=finished, stream=self
        )
        self.sink.put_nowait(emitted)
        self.num_output_tokens += 1

    def end_aborted(self) -> None:
        """Tell the reader the request ended without another token (vLLM's finish reason "abort")."""
        emitted = Emitted(
            index=self.index,
            token=-1,
            output_index=self.num_output_tokens,
            finished=True,
            stream=self,
            aborted=True,
        )
        self.sink.put_nowait(emitted)
