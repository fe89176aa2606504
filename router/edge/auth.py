"""Who may call what: API keys (Bearer) for `/v1/*`, the admin token for `/admin/*` and `/debug/*`.

Pure checks over request headers; the app turns a refusal into a 401 (bad or missing credential) or a
403 (admin API disabled because no admin token is configured). Comparisons are constant-time. With
no API keys configured, `/v1/*` is open; with no admin token, the admin and debug APIs are closed.
"""

from __future__ import annotations

import hmac
from typing import Final

from starlette.datastructures import Headers

from router.core.errors import RouterError, Unauthorized
from router.settings.secrets import Secrets

__all__ = ["AdminDisabled", "Guard", "bearer_token"]


class AdminDisabled(RouterError):
    """No admin token is configured, so the admin and debug endpoints refuse every caller."""

    status, error_type, code = 403, "permission_error", "admin_disabled"


def bearer_token(headers: Headers) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (scheme case-insensitive), else None.

    `Unauthorized` when the header is given more than once: which one a check reads and which one an
    engine or another proxy reads may differ, so a valid first key must not carry a second one."""
    values = headers.getlist("authorization")
    if not values:
        return None
    if len(values) > 1:
        raise Unauthorized("more than one Authorization header")
    value = values[0]
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _matches(token: str, accepted: frozenset[str]) -> bool:
    # Compare against every key (no early exit) so timing does not tell which prefix matched.
    found = False
    for key in accepted:
        found |= hmac.compare_digest(token.encode(), key.encode())
    return found


class Guard:
    """Checks credentials against the loaded secrets; raises a `RouterError` to refuse."""

    def __init__(self, secrets: Secrets) -> None:
        self._secrets = secrets
        self.api_keys_required: Final = bool(secrets.api_keys)
        """Whether `/v1/*` needs an API key (read per request: an attribute, not a property's call)."""

    @property
    def secrets(self) -> Secrets:
        """The secrets checked against, fixed at construction."""
        return self._secrets

    def check_api(self, headers: Headers) -> None:
        """Admit a `/v1/*` request, or raise `Unauthorized` (401) for a missing or unknown key."""
        if not self.secrets.api_keys:
            return
        token = bearer_token(headers)
        if token is None:
            raise Unauthorized("missing API key: send `Authorization: Bearer <key>`")
        if not _matches(token, self.secrets.api_keys):
            raise Unauthorized("invalid API key")

    def check_admin(self, headers: Headers) -> None:
        """Admit an admin or debug request, or raise `AdminDisabled` (403) / `Unauthorized` (401)."""
        admin = self.secrets.admin_token
        if admin is None:
            raise AdminDisabled(
                "the admin and debug API is disabled: set the admin token (KVROUTER_ADMIN_TOKEN)"
            )
        token = bearer_token(headers)
        if token is None or not _matches(token, frozenset({admin})):
            raise Unauthorized("admin endpoints need `Authorization: Bearer <admin token>`")
