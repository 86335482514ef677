"""A call's namespace (tenant): whose voiceprints it may see.

With `serve --auth-tokens`, the tenant is derived from the caller's bearer token: a
SHA-256 of it, so the token itself is never stored, and two tokens never share voiceprints.
A rotated token is a new tenant (docs/voiceprints.md: re-enroll, or keep the old token
in the file while moving). Without --auth-tokens every caller is in DEFAULT_TENANT: a
server without authentication has one namespace, whatever token a caller sends.
"""

from __future__ import annotations

import hashlib

from speakerd.serving.access.auth import bearer_token

DEFAULT_TENANT = "default"
#: Hex digits of the token's SHA-256 kept: 128 bits, no collision between real tokens.
TENANT_HEX = 32


def tenant_of(metadata: tuple[tuple[str, str | bytes], ...] | None, authenticated: bool) -> str:
    """The tenant of a call with this metadata (the interceptor has accepted its token)."""
    if not authenticated:
        return DEFAULT_TENANT
    token = bearer_token(metadata)
    if token is None:  # the interceptor refuses such calls first; never a shared namespace
        raise PermissionError("no bearer token")
    return "token-" + hashlib.sha256(token.encode()).hexdigest()[:TENANT_HEX]
