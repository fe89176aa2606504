"""Asking an engine which model it serves (`GET /v1/models`): Kubernetes discovery's question to an
engine whose model no label names (router.links.kube_discovery's `EngineTable`).

I/O at the edge, through a `router.edge.upstream_transport.Transport`: the gateway's one HTTP client
(router.edge.http1), in a pool of its own (one connection per engine), or in tests any other
transport. Bounded as the engine scraper is (router.edge.engine_scraper, whose answer check it
shares): `discovery.kubernetes.model_timeout_s` for all of it (connect, head, body), at most
`MAX_BYTES` read (a Content-Length over it is refused before reading, a body growing past it is
abandoned and its connection closed), nothing decompressed (`Accept-Encoding: identity`), no
redirect followed, no cookie kept (the client neither follows nor keeps any). The answer is the
first model listed that is not an adapter (its `parent` unset). A probe that fails answers None; it
is counted by reason (`MODEL_PROBE_ERRORS`, `kvrouter_discovery_model_probe_errors_total`) and
logged, the transport's failures classified by the upstream leg's one mapping
(`router.edge.upstream.upstream_error`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final

import msgspec

from router.edge.engine_scraper import check_answer, transport_reason
from router.edge.headers import host_of
from router.edge.http1 import ClientSettings, Http1Client
from router.edge.upstream import UPSTREAM_FAILURES
from router.edge.upstream_transport import Transport
from router.links.engine_metrics import ScrapeRejected
from router.settings.config import EngineConfig

__all__ = ["MAX_BYTES", "MODEL_PROBE_ERRORS", "ModelProbe"]

log = logging.getLogger(__name__)

MAX_BYTES: Final = 1 << 20
"""The longest `/v1/models` answer read."""

MODEL_PROBE_ERRORS: Final = (
    "connection",  # no connection, or it broke mid-answer
    "timeout",  # model_timeout_s passed
    "status",  # an answer other than 2xx or 3xx
    "redirect",  # a 3xx: not followed
    "too_large",  # a body over MAX_BYTES
    "malformed",  # not an OpenAI model list
    "no_model",  # a list of adapters only, or empty
    "internal",  # anything else (a bug): logged with its traceback
)
"""The `reason` label values of `kvrouter_discovery_model_probe_errors_total`."""


class _Model(msgspec.Struct, frozen=True):
    id: str
    parent: str | None = None


class _Models(msgspec.Struct, frozen=True):
    data: list[_Model]


_MODELS: Final = msgspec.json.Decoder(_Models)


class ModelProbe:
    """`await probe(engine)`: the model `engine` serves, or None when it cannot say (counted in `errors`
    by reason, logged); `close()` lets go of its connections."""

    def __init__(self, timeout_s: float, transport: Transport | None = None) -> None:
        """`transport` carries the probes (None: an `Http1Client` of the probe's own, bounded by
        `timeout_s`, made at the first probe)."""
        self.timeout_s = timeout_s
        self.errors: dict[str, int] = dict.fromkeys(MODEL_PROBE_ERRORS, 0)
        """Failed probes so far, by reason (`MODEL_PROBE_ERRORS`)."""
        self._client = transport

    async def __call__(self, engine: EngineConfig) -> str | None:
        """The engine's served model; None on any failure (counted and logged here, never raised)."""
        try:
            async with asyncio.timeout(self.timeout_s):
                body = await self._read(engine)
            models = _MODELS.decode(body).data
            return next(m.id for m in models if m.parent is None)
        except ScrapeRejected as exc:
            reason, error = exc.reason, str(exc)
        except UPSTREAM_FAILURES as exc:  # the transport's, and the probe's own timeout
            reason, error = transport_reason(engine, "model probe", exc)
        except msgspec.MsgspecError as exc:
            reason, error = "malformed", str(exc)
        except StopIteration:
            reason, error = "no_model", "every model listed is an adapter"
        except Exception as exc:
            log.exception("engine model unknown", extra={"engine": engine.name, "reason": "internal"})
            reason, error = "internal", repr(exc)
        self.errors[reason] += 1
        if reason != "internal":
            log.warning(
                "engine model unknown", extra={"engine": engine.name, "reason": reason, "error": error[:200]}
            )
        return None

    def close(self) -> None:
        """Close the transport's idle connections (a probe after this makes a new client)."""
        if self._client is not None:
            self._client.close()
        self._client = None

    async def _read(self, engine: EngineConfig) -> bytes:
        """The answer's body, at most `MAX_BYTES` of it (`ScrapeRejected` past them)."""
        if self._client is None:
            t = self.timeout_s  # the probe's own bound covers the rest: none is looser
            self._client = Http1Client(
                ClientSettings(
                    connect_s=t, first_byte_s=t, read_s=t, total_s=t, pool_per_host=1, pool_wait_s=t
                )
            )
        headers = [("Host", host_of(engine.url)), ("Accept-Encoding", "identity")]
        answer = await self._client.request("GET", engine.url, "/v1/models", headers, b"")
        try:  # any end but the body's last bytes drops the connection: what is left is not read
            check_answer(answer.status, answer.raw_headers, MAX_BYTES)
            body = bytearray()
            while chunk := await answer.next_chunk():
                body += chunk
                if len(body) > MAX_BYTES:
                    raise ScrapeRejected("too_large", f"the body passed {MAX_BYTES} bytes")
        finally:
            answer.close()
        return bytes(body)
