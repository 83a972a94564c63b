"""API keys. With RAGCACHE_API_KEYS (JSON {"key": ["namespace", …]}) or RAGCACHE_ADMIN_KEY set, every
/v1 route needs `Authorization: Bearer <key>`: a tenant key reaches its own namespaces only, the
admin key every namespace and the whole-cache routes. Keys are compared in constant time, and
every configured key is compared, so timing tells nothing about which one nearly matched.
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from fastapi import Request

from .errors import ApiError


@dataclass(frozen=True)
class Caller:
    admin: bool
    namespaces: frozenset[str] | None  # None: every namespace
    tenant: str | None = None  # whose fair share its requests count against (its key's digest); None: the namespace

    def allow(self, namespace: str | None) -> None:
        """403 unless this caller may act on `namespace` (None: every namespace, admin only)."""
        if self.namespaces is None:
            return
        if namespace is None:
            raise ApiError(403, "this key must name one of its namespaces", "namespace")
        if namespace not in self.namespaces:
            raise ApiError(403, f"this key has no access to namespace {namespace!r}", "namespace")

    def sees(self, namespace: str | None) -> bool:
        """Whether this caller may know that something of `namespace` exists."""
        return self.namespaces is None or namespace in self.namespaces

    def require_admin(self) -> None:
        if not self.admin:
            raise ApiError(403, "this route needs the admin key (RAGCACHE_ADMIN_KEY)")


OPEN = Caller(admin=True, namespaces=None)


def caller(request: Request) -> Caller:
    """The FastAPI dependency: who is calling."""
    return identify(request.app.state.service.settings, request.headers.get("authorization", ""))


def identify(settings, authorization: str) -> Caller:
    """The caller an Authorization header names (401 for none, or an unknown key); the middleware that
    refuses unknown keys before a body is read asks this too."""
    if not settings.auth:
        return OPEN
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "missing API key: send Authorization: Bearer <key>",
                       headers={"WWW-Authenticate": "Bearer"})
    given = token.strip().encode()
    found: list[str] | None = None
    for key, namespaces in settings.api_keys.items():
        if hmac.compare_digest(key.encode(), given):
            found = namespaces
    admin = settings.admin_key is not None and hmac.compare_digest(settings.admin_key.encode(), given)
    if admin:
        return OPEN
    if found is None:
        raise ApiError(401, "unknown API key", headers={"WWW-Authenticate": "Bearer"})
    return Caller(admin=False, namespaces=frozenset(found), tenant="key-" + hashlib.sha256(given).hexdigest()[:16])
