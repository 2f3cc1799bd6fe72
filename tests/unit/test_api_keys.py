"""Operators' API keys on a real Redis: listed by id (never the key), revoked by id or key with the gateways told
on the events channel, rotated in one transaction; a gateway's verified keys are dropped on that event.
(The command line against a running mesh: tests/e2e/test_keys_cli.py.)"""

from __future__ import annotations

import asyncio

import pytest

from academus.services.gateway.core import Authenticator, FailedKeyLimit, peer_host
from academus.shared.runtime.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
)
from academus.shared.state.api_keys import KEY_ID_DIGITS, REVOKED, ApiKeys
from academus.shared.state.keys import Keys, hash_key
from academus.shared.state.tenants import TenantRegistry

KEYS = Keys("acd")


@pytest.fixture
def api_keys(redis) -> ApiKeys:
    return ApiKeys(redis, KEYS)


async def test_keys_are_listed_by_id_and_tenant_never_by_the_key(api_keys):
    acme = [await api_keys.create("acme") for _ in range(2)]
    admin = await api_keys.create("admin", "admin")
    listed = await api_keys.list()
    assert {(r.key_id, r.tenant, r.role) for r in listed} == {
        *((hash_key(k)[:KEY_ID_DIGITS], "acme", "tenant") for k in acme), (hash_key(admin)[:KEY_ID_DIGITS], "admin",
                                                                             "admin")}
    assert [r.tenant for r in listed] == ["acme", "acme", "admin"]
    assert all(k not in repr(listed) for k in [*acme, admin])
    assert [r.tenant for r in await api_keys.list("acme")] == ["acme", "acme"]


async def test_a_revoked_key_is_gone_and_the_gateways_hear_of_it_at_once(redis, api_keys):
    key = await api_keys.create("acme")
    other = await api_keys.create("acme")
    auth = Authenticator(redis, KEYS, cache_s=600)
    assert (await auth.authenticate(key)).tenant == "acme"          # now cached for ten minutes
    events = redis.pubsub()
    await events.subscribe(KEYS.events())
    await events.get_message(timeout=1)                               # the subscription's confirmation
    record = await api_keys.revoke(hash_key(key)[:8])                 # an id's first 8 digits name it
    assert record.tenant == "acme" and not await redis.exists(KEYS.api_key(key))
    message = await events.get_message(timeout=5)
    assert message["data"] == f"{REVOKED} {record.key_id}"
    assert (await auth.authenticate(key)).tenant == "acme", "the cache holds it until the gateway hears the event"
    auth.forget()                                                     # what the gateway does on the event
    with pytest.raises(Unauthenticated):
        await auth.authenticate(key)
    assert (await auth.authenticate(other)).tenant == "acme"          # the tenant's other key still works
    await api_keys.revoke(other)                                      # the key itself names it too
    assert await api_keys.list() == []
    await events.aclose()


async def test_a_key_read_before_a_revocation_is_not_cached_after_it(redis, api_keys):
    key = await api_keys.create("acme")
    auth = Authenticator(redis, KEYS, cache_s=600)
    reading = asyncio.ensure_future(auth.authenticate(key))
    await asyncio.sleep(0)                                            # it has asked Redis, not yet heard back
    auth.forget()                                                     # the event lands while Redis answers
    await reading
    await api_keys.revoke(key)
    with pytest.raises(Unauthenticated):
        await auth.authenticate(key)


async def test_bad_ids_and_the_admins_key_are_refused_naming_why(api_keys):
    admin = await api_keys.create("admin", "admin")
    with pytest.raises(InvalidArgument, match="shorter than 8 hex digits"):
        await api_keys.revoke("abc1")
    with pytest.raises(NotFound, match="no API key with id 00000000"):
        await api_keys.revoke("00000000")
    with pytest.raises(FailedPrecondition, match="rotate it"):
        await api_keys.revoke(admin)
    with pytest.raises(NotFound, match="'nobody' has no API key"):
        await api_keys.rotate("nobody")


async def test_rotation_replaces_every_key_of_the_tenant_and_its_record(redis, api_keys):
    registry = TenantRegistry(redis, KEYS, rate=50.0, burst=100)
    first = await registry.create_tenant("acme")
    extra = await api_keys.create("acme")
    bystander = await api_keys.create("globex")
    key, revoked = await api_keys.rotate("acme")
    assert {r.key_id for r in revoked} == {hash_key(k)[:KEY_ID_DIGITS] for k in (first, extra)}
    assert [r.key_id for r in await api_keys.list("acme")] == [hash_key(key)[:KEY_ID_DIGITS]]
    assert (await registry.tenant("acme"))["api_key_id"] == KEYS.api_key(key)
    assert await redis.exists(KEYS.api_key(bystander))
    admin = await api_keys.create("admin", "admin")
    new_admin, _ = await api_keys.rotate("admin")
    assert [(r.role, r.key_id) for r in await api_keys.list("admin")] == [("admin", hash_key(new_admin)[:16])]
    assert not await redis.exists(KEYS.api_key(admin))


def test_a_peer_is_its_address_without_the_port():
    assert peer_host("ipv4:10.0.0.7:51234") == "ipv4:10.0.0.7"
    assert peer_host("ipv6:[::1]:51234") == "ipv6:[::1]"
    assert peer_host("unix:local-plane") == "unix:local-plane"


async def test_an_address_presenting_invalid_keys_is_refused_until_its_window_ends(redis, api_keys):
    now = [0.0]
    auth = Authenticator(redis, KEYS, cache_s=5, clock=lambda: now[0],
                         failures=FailedKeyLimit(3, 60.0, clock=lambda: now[0]))
    good = await api_keys.create("acme")
    for port in (1, 2, 3):   # new connections, one address
        with pytest.raises(Unauthenticated):
            await auth.authenticate(f"acd_guess_{port}", f"ipv4:10.0.0.7:{port}")
    for _ in range(3):       # a missing key guesses nothing: not counted, and not refused for the count
        with pytest.raises(Unauthenticated, match="missing API key"):
            await auth.authenticate("", "ipv4:10.0.0.7:9")
    now[0] = 20.0
    refusal = r"3 invalid API keys .*\(ACADEMUS_AUTH_FAILURE_LIMIT=3\); try again in 40 s"
    with pytest.raises(ResourceExhausted, match=refusal) as e:
        await auth.authenticate(good, "ipv4:10.0.0.7:4")   # even a good key: its check would answer a guess
    assert e.value.pushback_ms == 40_000
    assert (await auth.authenticate(good, "ipv4:10.0.0.8:1")).tenant == "acme"   # another address
    assert (await auth.authenticate(good)).tenant == "acme"                      # in-process: not limited
    now[0] = 60.5
    assert (await auth.authenticate(good, "ipv4:10.0.0.7:5")).tenant == "acme"   # the window ended
