"""Credentials, shared by both transports (constant-time comparisons): the shared bearer
token (register, trigger, cancel) and the per-member credential issued at registration
(every agent call after Register). docs/coordinator.md#security has the trust model."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from refitplane.errors import Unauthenticated

# Bytes of randomness in a member credential (URL-safe base64 on the wire).
MEMBER_CREDENTIAL_BYTES = 32


def new_member_credential() -> tuple[str, str]:
    """A fresh member credential and the digest the coordinator stores in its place."""
    secret = secrets.token_urlsafe(MEMBER_CREDENTIAL_BYTES)
    return secret, credential_digest(secret)


def credential_digest(secret: str) -> str:
    """SHA-256 of the credential: the stored form, so a read of the store (or a backup)
    cannot act as a member. The secret is 256 random bits: no salt or slow hash needed."""
    return hashlib.sha256(secret.encode()).hexdigest()


def credential_matches(secret: str, digest: str) -> bool:
    return bool(digest) and hmac.compare_digest(credential_digest(secret), digest)


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
