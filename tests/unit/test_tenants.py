"""Tenant registry and quotas with a real Redis: keys, models, isolation of deletes, token buckets."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from redis.exceptions import RedisError

from academus.services.gateway.core import Authenticator
from academus.shared.runtime.config import GatewayConfig
from academus.shared.runtime.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted, Unauthenticated
from academus.shared.state.catalogue import CLASSIFICATION, EMBEDDING, ModelSpec
from academus.shared.state.keys import Keys
from academus.shared.state.tenants import TRAINING, Limits, Quotas, TenantModel, TenantRegistry, gateway_quotas

KEYS = Keys("acd")


@pytest.fixture
def registry(redis) -> TenantRegistry:
    return TenantRegistry(redis, KEYS, rate=50.0, burst=100)


def spam_model(name: str = "spam", version: int = 1) -> TenantModel:
    return TenantModel(name, base="minilm", adapter="spam-adapter", version=version, labels=["ham", "spam"])


async def test_a_new_key_authenticates_to_its_tenant(redis, registry):
    key = await registry.create_tenant("acme")
    principal = await Authenticator(redis, KEYS, cache_s=0.0).authenticate(key)
    assert (principal.tenant, principal.role) == ("acme", "tenant")
    assert await registry.tenants() == ["acme"]
    record = await registry.tenant("acme")
    assert (float(record["rate"]), int(record["burst"])) == (50.0, 100)


async def test_the_key_is_stored_only_hashed(redis, registry):
    key = await registry.create_tenant("acme", rate=5, burst=10)
    secret = key.removeprefix("acd_acme_")
    names = [k async for k in redis.scan_iter("*")]
    assert KEYS.api_key(key) in names
    for name in names:
        assert secret not in name
        kind = await redis.type(name)
        values = (await redis.hgetall(name)).items() if kind == "hash" else await redis.smembers(name)
        assert not any(secret in str(v) for v in values)


async def test_creating_an_existing_tenant_is_refused(registry):
    await registry.create_tenant("acme")
    with pytest.raises(AlreadyExists, match="tenant 'acme' already exists"):
        await registry.create_tenant("acme")


@pytest.mark.parametrize("tenant", ["", "a b", "x" * 65, "acme/../b"])
async def test_a_bad_tenant_name_names_the_field(registry, tenant):
    with pytest.raises(InvalidArgument, match=r"tenant=.* is invalid: it must match"):
        await registry.create_tenant(tenant)


async def test_bad_quotas_and_the_reserved_admin_are_refused(registry):
    with pytest.raises(InvalidArgument, match="rate=0 is invalid"):
        await registry.create_tenant("acme", rate=0)
    with pytest.raises(InvalidArgument, match="burst=0 is invalid"):
        await registry.create_tenant("acme", burst=0)
    with pytest.raises(InvalidArgument, match="reserved"):
        await registry.create_tenant("admin")


async def test_models_register_list_look_up_and_delete(registry):
    await registry.create_tenant("acme")
    await registry.register_model("acme", spam_model())
    await registry.register_model("acme", TenantModel("vec", "minilm", "vec-adapter", 3, kind=EMBEDDING))
    found = await registry.model("acme", "spam")
    assert (found.base, found.adapter, found.version, found.labels) == ("minilm", "spam-adapter", 1, ["ham", "spam"])
    assert [m.name for m in await registry.models("acme")] == ["spam", "vec"]
    await registry.register_model("acme", spam_model(version=2))  # a retrained version replaces it
    assert (await registry.model("acme", "spam")).version == 2
    await registry.delete_model("acme", "spam")
    assert await registry.model("acme", "spam") is None
    with pytest.raises(NotFound, match="model 'spam' not found"):
        await registry.delete_model("acme", "spam")


async def test_a_model_json_round_trips():
    model = TenantModel("m", "minilm", "a", 4, ["x", "y"], CLASSIFICATION, TRAINING, created=12.5)
    assert TenantModel.from_json(model.to_json()) == model


@pytest.mark.parametrize(("model", "field"), [
    (TenantModel("bad name", "minilm", "a", 1, ["x"]), "model.name"),
    (TenantModel("m", "mini/lm", "a", 1, ["x"]), "model.base"),
    (TenantModel("m", "minilm", "", 1, ["x"]), "model.adapter"),
    (TenantModel("m", "minilm", "a", 0, ["x"]), "model.version"),
    (TenantModel("m", "minilm", "a", 1, []), "model.labels"),
    (TenantModel("m", "minilm", "a", 1, ["x"], kind=EMBEDDING), "model.labels"),
    (TenantModel("m", "minilm", "a", 1, ["x"], kind="regression"), "model.kind"),
    (TenantModel("m", "minilm", "a", 1, ["x"], status="lost"), "model.status"),
])
async def test_an_invalid_model_names_the_field(registry, model, field):
    await registry.create_tenant("acme")
    with pytest.raises(InvalidArgument, match=rf"^{field}"):
        await registry.register_model("acme", model)


async def test_a_model_needs_its_tenant_and_must_not_shadow_a_served_model(redis, registry):
    with pytest.raises(NotFound, match="tenant 'ghost' not found"):
        await registry.register_model("ghost", spam_model())
    await registry.create_tenant("acme")
    await redis.hset(KEYS.models(), "spam", ModelSpec("spam", CLASSIFICATION, ["a", "b"]).to_json())
    with pytest.raises(InvalidArgument, match="a served model has that name"):
        await registry.register_model("acme", spam_model())


async def test_tenants_do_not_see_each_others_models(registry):
    await registry.create_tenant("a")
    await registry.create_tenant("b")
    await registry.register_model("a", spam_model())
    assert await registry.model("b", "spam") is None
    assert await registry.models("b") == []
    with pytest.raises(NotFound):
        await registry.delete_model("b", "spam")
    assert await registry.model("a", "spam") is not None


async def test_deleting_a_tenant_removes_keys_models_quota_and_record(redis, registry):
    key = await registry.create_tenant("acme", rate=1, burst=1)
    extra = "acd_acme_extra"  # a key made outside create_tenant (`academus keys create`)
    await redis.hset(KEYS.api_key(extra), mapping={"tenant": "acme", "role": "tenant"})
    await redis.hset(KEYS.api_key("other"), mapping={"tenant": "other", "role": "tenant"})
    other = await registry.create_tenant("keep")
    await registry.register_model("acme", spam_model())
    await registry.register_model("keep", spam_model())
    await Quotas(redis, KEYS).take("acme")
    assert await redis.exists(KEYS.quota("acme"))

    await registry.delete_tenant("acme")
    auth = Authenticator(redis, KEYS, cache_s=0.0)
    for gone in (key, extra):
        with pytest.raises(Unauthenticated):
            await auth.authenticate(gone)
    assert not await redis.exists(KEYS.tenant("acme"), KEYS.tenant_models("acme"), KEYS.quota("acme"))
    assert await registry.tenants() == ["keep"]
    assert (await auth.authenticate(other)).tenant == "keep"
    assert (await auth.authenticate("other")).tenant == "other"
    assert await registry.model("keep", "spam") is not None
    with pytest.raises(NotFound, match="tenant 'acme' not found"):
        await registry.delete_tenant("acme")
    await registry.create_tenant("acme")  # the name is free again


async def test_the_bucket_allows_the_burst_then_refuses_then_refills(redis, registry):
    await registry.create_tenant("acme", rate=5, burst=3)
    quotas = Quotas(redis, KEYS)
    for _ in range(3):
        await quotas.take("acme")
    with pytest.raises(ResourceExhausted, match="tenant 'acme' is over its rate limit of 5 requests/s") as refused:
        await quotas.take("acme")
    assert 1 <= refused.value.pushback_ms <= 200  # one token at 5/s takes at most 200 ms
    await asyncio.sleep(0.7)  # 3.5 tokens' worth: the bucket is full again (3)
    for _ in range(3):
        await quotas.take("acme")
    with pytest.raises(ResourceExhausted):
        await quotas.take("acme")


async def test_one_tenant_over_quota_does_not_limit_another(redis, registry):
    await registry.create_tenant("a", rate=0.5, burst=1)
    await registry.create_tenant("b", rate=0.5, burst=1)
    quotas = Quotas(redis, KEYS)
    await quotas.take("a")
    with pytest.raises(ResourceExhausted):
        await quotas.take("a")
    await quotas.take("b")


async def test_a_tenant_without_a_record_is_not_limited(redis):
    quotas = Quotas(redis, KEYS)
    for _ in range(50):
        await quotas.take("admin")
    assert not await redis.exists(KEYS.quota("admin"))


async def test_no_quota_is_remembered_briefly_then_read_again(redis, registry):
    now = [0.0]
    quotas = Quotas(redis, KEYS, unlimited_cache_s=5.0, clock=lambda: now[0])
    await quotas.take("acme")                       # no record yet: unlimited, remembered
    await registry.create_tenant("acme", rate=0.01, burst=1)
    await quotas.take("acme")
    await quotas.take("acme")                       # still within the 5 s: no Redis trip, no token taken
    assert not await redis.exists(KEYS.quota("acme"))
    now[0] = 6.0
    await quotas.take("acme")                       # read again: the new quota applies
    with pytest.raises(ResourceExhausted):
        await quotas.take("acme")


async def test_a_changed_quota_applies_at_once(redis, registry):
    await registry.create_tenant("acme", rate=0.5, burst=1)
    quotas = Quotas(redis, KEYS)
    await quotas.take("acme")
    with pytest.raises(ResourceExhausted):
        await quotas.take("acme")
    await registry.set_quota("acme", rate=1000, burst=5)
    await asyncio.sleep(0.01)
    await quotas.take("acme")


async def test_a_token_given_back_is_taken_again_once_and_never_beyond_the_burst(redis, registry):
    await registry.create_tenant("acme", rate=0.01, burst=2)   # no refill within the test
    quotas = Quotas(redis, KEYS)
    assert await quotas.take("acme") and await quotas.take("acme")
    with pytest.raises(ResourceExhausted):
        await quotas.take("acme")
    assert await quotas.give_back("acme", "r1")
    assert not await quotas.give_back("acme", "r1")            # the same refund, retried: nothing more
    assert await quotas.take("acme")                            # the one token given back
    with pytest.raises(ResourceExhausted):
        await quotas.take("acme")
    for i in range(5):
        await quotas.give_back("acme", f"many-{i}")
    assert await quotas.take("acme") and await quotas.take("acme")
    with pytest.raises(ResourceExhausted):                      # five refunds filled the bucket to its burst only
        await quotas.take("acme")
    assert not await quotas.take("no-record")                   # no quota: nothing taken, nothing to give back
    assert not await quotas.give_back("no-record")


async def test_every_key_has_a_quota_and_the_admins_is_configured(redis, registry):
    config = GatewayConfig(tenant_rate=0.01, tenant_burst=2, admin_rate=0.01, admin_burst=1)
    quotas = gateway_quotas(config, redis, KEYS)
    assert await quotas.take("made-by-keys-create") and await quotas.take("made-by-keys-create")
    with pytest.raises(ResourceExhausted, match=r"over its rate limit of 0\.01 requests/s \(burst 2\)"):
        await quotas.take("made-by-keys-create")            # no record: the new tenant's default
    assert await quotas.give_back("made-by-keys-create", "r1")
    assert await quotas.take("made-by-keys-create")
    assert await quotas.take("admin")
    with pytest.raises(ResourceExhausted, match=r"burst 1\)"):
        await quotas.take("admin")
    await registry.create_tenant("acme", rate=1000, burst=50)
    assert all([await quotas.take("acme") for _ in range(10)])   # a record's own quota wins
    unlimited = gateway_quotas(GatewayConfig(), redis, KEYS)     # the default: the admin is unlimited
    assert not any([await unlimited.take("admin") for _ in range(300)])


def test_the_admins_burst_defaults_to_twice_its_rate(redis):
    quotas = gateway_quotas(GatewayConfig(admin_rate=50.0), redis, KEYS)
    assert quotas.admin == (50.0, 100) and quotas.default == (100.0, 200)


async def test_a_gateway_takes_a_lease_of_tokens_and_spends_it_without_redis(redis, registry):
    """At 100 requests/s a lease is a tenth of a second's tokens: ten requests, one script call."""
    await registry.create_tenant("acme", rate=100, burst=50)
    now = [0.0]
    quotas = Quotas(redis, KEYS, clock=lambda: now[0])
    assert await quotas.take("acme")
    left = float(await redis.hget(KEYS.quota("acme"), "tokens"))
    assert 40 <= left < 41                                   # ten taken at once (a refill of under a token)
    for _ in range(9):
        assert await quotas.take("acme")
    assert float(await redis.hget(KEYS.quota("acme"), "tokens")) == left   # spent here, Redis untouched
    assert await quotas.take("acme")                          # the next lease
    assert float(await redis.hget(KEYS.quota("acme"), "tokens")) < left - 9
    now[0] += Quotas.LEASE_HOLD_S                             # unspent tokens lapse: the next request asks Redis
    before = float(await redis.hget(KEYS.quota("acme"), "tokens"))
    assert await quotas.take("acme")
    assert float(await redis.hget(KEYS.quota("acme"), "tokens")) != before


async def test_while_redis_is_away_each_tenant_keeps_its_quota_from_the_gateways_own_bucket(tmp_path):
    """Redis is coordination, not the request path: with it gone, a tenant is limited by the limits Redis last
    gave, one never seen by the default, and a key verified before still authenticates."""
    from academus.shared.cli.redis_server import RedisServer
    from academus.shared.runtime.redis_conn import connect

    server = RedisServer(tmp_path / "redis").start()
    redis = connect(server.url)
    try:
        key = await TenantRegistry(redis, KEYS).create_tenant("acme", rate=0.01, burst=3)
        quotas = Quotas(redis, KEYS, default=Limits(0.01, 1))
        auth = Authenticator(redis, KEYS, cache_s=0.0)
        assert (await auth.authenticate(key)).tenant == "acme"
        assert await quotas.take("acme")                       # its limits learnt (burst 3)
        server.process.kill()
        server.process.wait()
        assert (await auth.authenticate(key)).tenant == "acme"  # verified before: trusted while Redis is away
        with pytest.raises(RedisError):
            await auth.authenticate("acd_never_seen")          # UNAVAILABLE at the edge, not UNAUTHENTICATED
        assert [await quotas.take("acme") for _ in range(3)] == [True] * 3   # its burst, from this gateway
        with pytest.raises(ResourceExhausted, match=r"over its rate limit of 0\.01 requests/s"):
            await quotas.take("acme")
        assert await quotas.take("stranger")                   # never seen: the default quota
        with pytest.raises(ResourceExhausted):
            await quotas.take("stranger")
        auth.forget()                                          # a revocation announced before: none trusted
        with pytest.raises(RedisError):
            await auth.authenticate(key)
    finally:
        await redis.aclose()
        server.stop()


async def test_a_job_replaces_its_model_only_while_the_record_is_still_its_own(redis, registry):
    """A training job that finishes after its model was deleted, or taken over by a newer job, writes nothing:
    the check and the write are one step, so a deleted model never comes back."""
    await registry.create_tenant("acme")
    changed = await registry.models_changed()
    await registry.register_model("acme", replace(spam_model(), job="job-1", status=TRAINING))
    assert await registry.replace_job_model("acme", replace(spam_model(version=2), job="job-1"), "job-1")
    assert (await registry.model("acme", "spam")).version == 2
    assert await registry.models_changed() == changed + 2
    assert not await registry.replace_job_model("acme", replace(spam_model(version=3), job="job-0"), "job-0")
    await registry.delete_model("acme", "spam")
    assert not await registry.replace_job_model("acme", replace(spam_model(version=3), job="job-1"), "job-1")
    assert await registry.model("acme", "spam") is None
