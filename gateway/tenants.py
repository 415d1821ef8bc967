"""What a tenant is, and who a request is for, as the media budget's fair queueing sees it: `Tenant` (its id, its
class, its class's weight and its own bounds), the default tenant and the class `other`, the defaults of the tenant
bounds every budget keeps (`DEFAULT_WINDOW_S`, `DEFAULT_MAX_TENANTS`), and `Tenants`, which derives a request's
tenant and priority band once per request from `limits.fairness`. The budgets, the fair queue and the Redis scripts
take tenants from here.

The tenant's id comes from `limits.fairness.tenant_from`:

- `api_key`: a 16-hex-digit BLAKE2b digest of the bearer token (`Authorization: Bearer ...`, or `x-api-key` as
  Anthropic clients send it), keyed with `limits.fairness.key_salt` (unkeyed when it is empty). The key itself is
  never kept: the id is what the access log shows and what `limits.fairness.tenants` names.
- `header`: the value of `limits.fairness.tenant_header`.
- `client`: the client's address (after trusted proxies' headers).

Before any of them, a fairness id a trusted proxy set (`limits.fairness.proxy_tenant_headers`: llm-d's
`x-llm-d-inference-fairness-id`, the Gateway API Inference Extension's `x-gateway-inference-fairness-id`) is the
tenant: `serving.forwarded.TrustedProxies` drops those headers from every other peer, so a request that still carries
one got it from a proxy in `server.forwarded_allow_ips`. A request without a tenant is tenant `default`.

A tenant's class (its metric label, and what the fair queue shares the budget between by weight) is its id when
`limits.fairness.tenants` names it, `other` otherwise: the label set is the configured tenants plus `other`. Every
tenant of `other` has the settings of `limits.fairness.default`, whose weight is the class's: identities a client
mints share one class.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from gateway.config import Band, FairnessSettings, TenantFrom, TenantSettings
from serving.asgi import Scope
from serving.headers import get_header

# The tenant of a request that names none, and the class of every tenant `limits.fairness.tenants` does not name.
DEFAULT_ID = "default"
OTHER = "other"
# How long an idle tenant's lead over its class's virtual time is remembered (seconds), and how many tenant states
# a budget keeps, unless told otherwise: the defaults of `limits.fairness.window_s` and `.max_tenants`.
DEFAULT_WINDOW_S: float = FairnessSettings.model_fields["window_s"].default
DEFAULT_MAX_TENANTS: int = FairnessSettings.model_fields["max_tenants"].default
_DIGEST_BYTES = 8
# Unconfigured tenants `Tenants.of` remembers; past it the memory starts over.
_OTHERS_KEPT = 4096


@dataclass(frozen=True, slots=True)
class Tenant:
    """Whom a reservation is for: `id` (one queue each), `label` (its class, and metric label: a configured tenant
    or `other`), its class's weight, its own bounds, and `settings_key`, the config key its refusals name."""

    id: str
    label: str
    weight: float = 1.0
    max_bytes_in_use: int | None = None
    max_waiting: int | None = None
    settings_key: str = "limits.fairness.default"


DEFAULT_TENANT = Tenant(DEFAULT_ID, OTHER)


def api_key_id(key: bytes, salt: str = "") -> str:
    """The id that stands for an API key: what `limits.fairness.tenants` names with `tenant_from: api_key`."""
    return hashlib.blake2b(key, digest_size=_DIGEST_BYTES, key=salt.encode()).hexdigest()


def _bearer(scope: Scope) -> bytes | None:
    headers = scope["headers"]
    value = get_header(headers, b"authorization")
    if value is not None:
        scheme, _, token = value.strip().partition(b" ")
        if scheme.lower() == b"bearer" and token.strip():
            return token.strip()
        return None
    value = get_header(headers, b"x-api-key")
    return value.strip() or None if value is not None else None


class Tenants:
    """Resolves a request's tenant and band from its scope; with fair queueing off every request is `default`."""

    def __init__(self, settings: FairnessSettings) -> None:
        self.settings = settings
        self.enabled = settings.enabled
        self._header = settings.tenant_header.encode()
        self._priority_header = settings.priority_header.encode()
        self._proxy_headers = tuple(name.encode() for name in settings.proxy_tenant_headers)
        self._salt = settings.key_salt
        self._configured = {
            name: self._tenant(name, name, tenant, f"limits.fairness.tenants.{name}")
            for name, tenant in settings.tenants.items()
        }
        self._default = settings.default
        # Tenants `limits.fairness.tenants` does not name, seen lately (a Tenant is immutable).
        self._others: dict[str, Tenant] = {}
        self.labels = (*settings.tenants, OTHER)

    @staticmethod
    def _tenant(tenant_id: str, label: str, tenant: TenantSettings, key: str) -> Tenant:
        cap = None if tenant.max_bytes_in_use is None else int(tenant.max_bytes_in_use)
        return Tenant(tenant_id, label, tenant.weight, cap, tenant.max_waiting, key)

    def tenant_id(self, scope: Scope) -> str:
        headers = scope["headers"]
        for name in self._proxy_headers:
            value = get_header(headers, name)
            if value is not None and value.strip():
                return value.decode("latin-1").strip()
        source = self.settings.tenant_from
        if source is TenantFrom.API_KEY:
            key = _bearer(scope)
            return DEFAULT_ID if key is None else api_key_id(key, self._salt)
        if source is TenantFrom.HEADER:
            value = get_header(scope["headers"], self._header)
            text = value.decode("latin-1").strip() if value is not None else ""
            return text or DEFAULT_ID
        client = scope.get("client")
        return str(client[0]) if client else DEFAULT_ID

    def of(self, tenant_id: str) -> Tenant:
        configured = self._configured.get(tenant_id)
        if configured is not None:
            return configured
        tenant = self._others.get(tenant_id)
        if tenant is None:
            if len(self._others) >= _OTHERS_KEPT:
                self._others.clear()
            tenant = self._others[tenant_id] = self._tenant(tenant_id, OTHER, self._default, "limits.fairness.default")
        return tenant

    def resolve(self, scope: Scope) -> tuple[Tenant, Band]:
        """The request's tenant and band: batch when its tenant's `band` is batch or the priority header says
        `batch` (the header cannot raise a batch tenant to interactive; any other value is ignored)."""
        if not self.enabled:
            return DEFAULT_TENANT, Band.INTERACTIVE
        tenant_id = self.tenant_id(scope)
        tenant = self.of(tenant_id)
        configured = self.settings.tenants.get(tenant_id, self._default)
        band = configured.band
        if band is Band.INTERACTIVE:
            value = get_header(scope["headers"], self._priority_header)
            if value is not None and value.strip().lower() == b"batch":
                band = Band.BATCH
        return tenant, band
