from __future__ import annotations

import hashlib
from typing import Any

from gateway.config import Band, FairnessSettings, TenantFrom, TenantSettings
from gateway.tenants import Tenants, api_key_id


def scope(*headers: tuple[str, str], client: str = "10.0.0.7") -> dict[str, Any]:
    return {"headers": [(k.encode(), v.encode()) for k, v in headers], "client": (client, 5555)}


def test_the_api_key_is_a_stable_short_digest_never_the_key() -> None:
    tenants = Tenants(FairnessSettings())
    tenant, band = tenants.resolve(scope(("Authorization", "Bearer sk-secret")))
    assert tenant.id == hashlib.blake2b(b"sk-secret", digest_size=8).hexdigest() == api_key_id(b"sk-secret")
    assert "sk-secret" not in repr(tenant)
    assert tenant.label == "other"
    assert band is Band.INTERACTIVE
    # Anthropic clients send x-api-key; the same key is the same tenant.
    assert tenants.resolve(scope(("x-api-key", "sk-secret")))[0].id == tenant.id
    salted = Tenants(FairnessSettings(key_salt="pepper"))
    assert salted.resolve(scope(("authorization", "Bearer sk-secret")))[0].id == api_key_id(b"sk-secret", "pepper")
    assert api_key_id(b"sk-secret", "pepper") != tenant.id


def test_requests_without_a_tenant_share_the_default() -> None:
    tenants = Tenants(FairnessSettings())
    assert tenants.resolve(scope())[0].id == "default"
    assert tenants.resolve(scope(("authorization", "Basic abc")))[0].id == "default"
    header = Tenants(FairnessSettings(tenant_from=TenantFrom.HEADER))
    assert header.resolve(scope())[0].id == "default"


def test_configured_tenants_are_their_own_label_with_their_settings() -> None:
    settings = FairnessSettings(
        tenant_from=TenantFrom.HEADER,
        tenant_header="X-Tenant-ID",
        tenants={"acme": TenantSettings(weight=3, max_bytes_in_use=1 << 20, max_waiting=2)},
    )
    tenants = Tenants(settings)
    assert tenants.labels == ("acme", "other")
    acme, _ = tenants.resolve(scope(("x-tenant-id", "acme")))
    assert (acme.label, acme.weight, acme.max_bytes_in_use, acme.max_waiting) == ("acme", 3, 1 << 20, 2)
    assert acme.settings_key == "limits.fairness.tenants.acme"
    stranger, _ = tenants.resolve(scope(("x-tenant-id", "someone")))
    assert (stranger.id, stranger.label, stranger.settings_key) == ("someone", "other", "limits.fairness.default")


def test_client_address_is_the_tenant_when_configured() -> None:
    tenants = Tenants(FairnessSettings(tenant_from=TenantFrom.CLIENT))
    assert tenants.resolve(scope(client="192.0.2.1"))[0].id == "192.0.2.1"


def test_the_band_comes_from_the_header_or_the_tenant_and_the_header_cannot_promote() -> None:
    settings = FairnessSettings(tenant_from=TenantFrom.HEADER, tenants={"jobs": TenantSettings(band=Band.BATCH)})
    tenants = Tenants(settings)
    assert tenants.resolve(scope(("x-tenant-id", "a"), ("x-mmgate-priority", "batch")))[1] is Band.BATCH
    assert tenants.resolve(scope(("x-tenant-id", "a"), ("x-mmgate-priority", "urgent")))[1] is Band.INTERACTIVE
    assert tenants.resolve(scope(("x-tenant-id", "jobs"), ("x-mmgate-priority", "interactive")))[1] is Band.BATCH


def test_fair_queueing_off_puts_everyone_in_the_default_tenant() -> None:
    tenants = Tenants(FairnessSettings(enabled=False))
    tenant, band = tenants.resolve(scope(("authorization", "Bearer k"), ("x-mmgate-priority", "batch")))
    assert (tenant.id, band) == ("default", Band.INTERACTIVE)


def test_a_proxys_fairness_id_is_the_tenant_whatever_tenant_from_says() -> None:
    """llm-d's header first, the Gateway API Inference Extension's older one next; without either, `tenant_from`.
    (Only a trusted proxy's headers reach `Tenants`: `TrustedProxies` drops them from other peers.)"""
    tenants = Tenants(FairnessSettings(tenants={"team-a": TenantSettings(weight=2)}))
    key = ("authorization", "Bearer sk-1")
    both = tenants.resolve(
        scope(key, ("x-gateway-inference-fairness-id", "old"), ("x-llm-d-inference-fairness-id", "team-a"))
    )[0]
    assert (both.id, both.label, both.weight) == ("team-a", "team-a", 2)
    assert tenants.resolve(scope(key, ("x-gateway-inference-fairness-id", "old")))[0].id == "old"
    assert tenants.resolve(scope(key, ("x-llm-d-inference-fairness-id", " ")))[0].id == api_key_id(b"sk-1")
    off = Tenants(FairnessSettings(proxy_tenant_headers=()))
    assert off.resolve(scope(key, ("x-llm-d-inference-fairness-id", "team-a")))[0].id == api_key_id(b"sk-1")
