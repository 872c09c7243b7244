"""Bearer-token checks, shared by both transports (constant-time comparison)."""

from __future__ import annotations

import hmac

from refitplane.errors import Unauthenticated


class TokenCheck:
    def __init__(self, token: str | None) -> None:
        self._token = token.encode() if token else None

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def check(self, authorization: str | None) -> None:
        """Raise Unauthenticated unless `authorization` is `Bearer <token>` (or auth is off).
        Messages never echo what was sent."""
        if self._token is None:
            return
        if not authorization:
            raise Unauthenticated("missing bearer token", field="authorization")
        scheme, _, presented = authorization.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            presented.strip().encode(), self._token
        ):
            raise Unauthenticated("invalid bearer token", field="authorization")
