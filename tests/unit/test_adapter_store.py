"""The adapter store core over a real Redis and a temp data dir: versions, layer-wise gets, deletes,
every refused input, and metadata that survives a Redis restart."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from academus.services.adapter_store.core import AdapterFile, AdapterStore, FileCache, pack
from academus.shared.cli.redis_server import RedisServer
from academus.shared.runtime import config as cfg
from academus.shared.runtime.errors import InvalidArgument, NotFound
from academus.shared.runtime.redis_conn import connect
from academus.shared.state.keys import Keys

LIMIT = 64 * 1024
KEYS = Keys("as-unit")


def tensors(layers: int = 3, seed: int = 0, head: bool = True) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(layers):
        out[f"layers.{i}.down.weight"] = torch.randn(4, 16, generator=gen)
        out[f"layers.{i}.down.bias"] = torch.randn(4, generator=gen)
        out[f"layers.{i}.up.weight"] = torch.randn(16, 4, generator=gen).to(torch.bfloat16)
        out[f"layers.{i}.up.bias"] = torch.randn(16, generator=gen)
    if head:
        out["head.weight"] = torch.randn(2, 16, generator=gen)
        out["head.bias"] = torch.randn(2, generator=gen)
    return out


def weights(**kw) -> bytes:
    return st_save(tensors(**kw))


def make_store(url: str, data_dir: Path, cache_bytes: int = 1 << 20) -> AdapterStore:
    return AdapterStore(connect(url), KEYS, data_dir, max_bytes=LIMIT, cache_bytes=cache_bytes)


@pytest.fixture
async def store(redis_url, tmp_path):
    s = make_store(redis_url, tmp_path / "adapters")
    yield s
    await s.redis.aclose()


async def test_put_then_get_round_trips_bytes_and_metadata(store):
    data = weights()
    stored = await store.put("acme", "spam", data, {"base": "minilm", "rank": "4"})
    assert (stored.tenant, stored.name, stored.version, stored.bytes) == ("acme", "spam", 1, len(data))
    assert store.path("acme", "spam", 1).read_bytes() == data
    assert not list(store.path("acme", "spam", 1).parent.glob("*.tmp"))  # the temp file was renamed
    fetched = await store.get("acme", "spam")
    assert fetched.weights == data
    assert (fetched.stored.version, fetched.stored.metadata) == (1, {"base": "minilm", "rank": "4"})


async def test_versions_increment_and_zero_means_latest(store):
    blobs = [weights(seed=s) for s in range(3)]
    versions = [(await store.put("acme", "spam", b, {"seed": str(i)})).version for i, b in enumerate(blobs)]
    assert versions == [1, 2, 3]
    assert (await store.get("acme", "spam")).weights == blobs[2]
    old = await store.get("acme", "spam", version=2)
    assert (old.weights, old.stored.metadata) == (blobs[1], {"seed": "1"})
    record = await store.redis.hgetall(KEYS.adapter("acme", "spam"))
    assert (json.loads(record["versions"]), record["latest"]) == ([1, 2, 3], "3")
    assert json.loads(record["metadata"])["metadata"] == {"seed": "2"}


async def test_concurrent_puts_get_distinct_versions(store):
    results = await asyncio.gather(*(store.put("acme", "spam", weights(seed=s), {}) for s in range(5)))
    assert sorted(r.version for r in results) == [1, 2, 3, 4, 5]
    [info] = await store.list("acme")
    assert (info.versions, info.latest.version) == ([1, 2, 3, 4, 5], 5)


async def test_list_shows_each_adapter_of_the_tenant_only(store):
    first, second = weights(seed=1), weights(layers=1, seed=2)
    await store.put("acme", "spam", first, {"v": "1"})
    await store.put("acme", "spam", second, {"v": "2"})
    await store.put("acme", "topic", first, {})
    await store.put("other", "secret", first, {})
    infos = await store.list("acme")
    assert [(i.latest.name, i.versions, i.latest.version) for i in infos] == [("spam", [1, 2], 2), ("topic", [1], 1)]
    assert (infos[0].latest.bytes, infos[0].latest.metadata) == (len(second), {"v": "2"})
    assert await store.list("nobody") == []


@pytest.mark.parametrize(("layers", "head"), [([1], False), ([0, 2], True), ([2], True)])
async def test_layer_wise_get_returns_only_those_tensors(store, layers, head):
    stored = tensors()
    await store.put("acme", "spam", st_save(stored), {})
    fetched = st_load((await store.get("acme", "spam", layers=layers, head=head)).weights)
    wanted = {n for n in stored if n.split(".")[0] == "layers" and int(n.split(".")[1]) in layers}
    assert set(fetched) == wanted | ({"head.weight", "head.bias"} if head else set())
    for name, tensor in fetched.items():
        assert tensor.dtype == stored[name].dtype and torch.equal(tensor, stored[name])


async def test_layer_the_adapter_lacks_gives_an_empty_file(store):
    await store.put("acme", "spam", weights(layers=1), {})
    empty = (await store.get("acme", "spam", layers=[7])).weights
    assert st_load(empty) == {} and safetensors.deserialize(empty) == []


async def test_layer_wise_gets_are_served_from_the_cache(store):
    stored = tensors()
    await store.put("acme", "spam", st_save(stored), {})
    await store.get("acme", "spam", layers=[0])
    store.path("acme", "spam", 1).unlink()  # the next gets must not need the disk
    for layer in (1, 2):
        fetched = st_load((await store.get("acme", "spam", layers=[layer])).weights)
        assert torch.equal(fetched[f"layers.{layer}.up.weight"], stored[f"layers.{layer}.up.weight"])


async def test_layer_pieces_parse_and_merge_as_shared_adapters_files(store):
    adapters = pytest.importorskip("academus.shared.models.adapters")
    adapter = adapters.AdapterWeights.init(["ham", "spam"], rank=4, seed=3)
    await store.put("acme", "spam", adapter.to_bytes(), adapter.metadata())
    layers = list(adapter.layer_ids)
    fetched = [await store.get("acme", "spam", layers=[i], head=i == layers[-1]) for i in layers]
    pieces = [adapters.AdapterWeights.from_bytes(f.weights) for f in fetched]
    assert [sorted(p.layers) for p in pieces] == [[i] for i in layers]
    merged = adapters.AdapterWeights.merge(pieces)
    assert merged.complete and merged.metadata() == adapter.metadata()
    assert all(torch.equal(a, b) for a, b in zip(merged.tensors(), adapter.tensors(), strict=True))


def test_cache_evicts_least_recently_used_within_its_budget():
    files = {k: AdapterFile.parse(pack({"head.bias": ("F32", [n], bytes(4 * n))})) for k, n in
             [(("t", "a", 1), 10), (("t", "b", 1), 10), (("t", "c", 1), 10)]}
    size = len(next(iter(files.values())).raw)
    cache = FileCache(budget=2 * size)
    for key, file in files.items():
        cache.put(key, file)
        cache.get(("t", "a", 1))  # keeps a recent
    assert set(cache.entries) == {("t", "a", 1), ("t", "c", 1)} and cache.size == 2 * size
    cache.put(("t", "big", 1), AdapterFile.parse(pack({"head.bias": ("F32", [100], bytes(400))})))
    assert ("t", "big", 1) not in cache.entries  # over the whole budget: never cached


@pytest.mark.parametrize(("tenant", "name", "field"), [
    ("", "spam", "ref.tenant"), ("a b", "spam", "ref.tenant"), ("x" * 65, "spam", "ref.tenant"),
    ("acme", "", "ref.name"), ("acme", "..", "ref.name"), ("acme", "a/b", "ref.name"), ("acme", "é", "ref.name"),
])
async def test_bad_names_are_refused_naming_the_field_and_rule(store, tenant, name, field):
    with pytest.raises(InvalidArgument) as err:
        await store.put(tenant, name, weights(), {})
    assert field in err.value.message and "[A-Za-z0-9_.-]{1,64}" in err.value.message
    for call in (store.get(tenant, name), store.delete(tenant, name)):
        with pytest.raises(InvalidArgument, match=field):
            await call


@pytest.mark.parametrize(("data", "message"), [
    (b"", "weights are empty"),
    (b"x" * (LIMIT + 1), f"{LIMIT + 1} bytes; the limit is {LIMIT} bytes"),
    (b"not a safetensors file at all", "not a safetensors file"),
    (st_save({}), "no tensor"),
    (st_save({"encoder.weight": torch.zeros(2)}), "'encoder.weight'"),
    (st_save({"layers.0.down.weight": torch.zeros(2), "layers.x.up.bias": torch.zeros(2)}), "'layers.x.up.bias'"),
    (st_save({"head.weight": torch.zeros(2), "layers.1.mid.weight": torch.zeros(2)}), "'layers.1.mid.weight'"),
])
async def test_bad_weights_are_refused_and_nothing_is_recorded(store, data, message):
    with pytest.raises(InvalidArgument) as err:
        await store.put("acme", "spam", data, {})
    assert message in err.value.message
    assert not await store.redis.exists(KEYS.adapter("acme", "spam"))
    assert not store.path("acme", "spam", 1).parent.exists()


async def test_oversized_metadata_and_bad_layers_or_versions_are_refused(store):
    with pytest.raises(InvalidArgument, match=r"metadata is \d+ bytes as JSON; the limit is 65536 bytes"):
        await store.put("acme", "spam", weights(), {"labels": "x" * 70_000})
    await store.put("acme", "spam", weights(), {})
    with pytest.raises(InvalidArgument, match=r"layers=\[-1\] is invalid"):
        await store.get("acme", "spam", layers=[-1])
    with pytest.raises(InvalidArgument, match=r"ref\.version=-2"):
        await store.get("acme", "spam", version=-2)


async def test_unknown_adapters_are_not_found_without_naming_other_tenants(store):
    await store.put("other", "spam", weights(), {"owner": "other"})
    await store.put("acme", "topic", weights(), {})
    for call in (store.get("acme", "spam"), store.delete("acme", "spam"), store.get("acme", "nope", version=1)):
        with pytest.raises(NotFound) as err:
            await call
        assert "other" not in err.value.message
    with pytest.raises(NotFound, match="acme/topic has no version 9"):
        await store.get("acme", "topic", version=9)


async def test_delete_one_version_then_every_version(store):
    blobs = [weights(seed=s) for s in range(3)]
    for b in blobs:
        await store.put("acme", "spam", b, {})
    assert await store.delete("acme", "spam", version=3) == 1
    assert not store.path("acme", "spam", 3).exists()
    assert (await store.get("acme", "spam")).weights == blobs[1]  # latest falls back to 2
    with pytest.raises(NotFound):
        await store.get("acme", "spam", version=3)
    with pytest.raises(NotFound):
        await store.delete("acme", "spam", version=3)
    assert await store.delete("acme", "spam") == 2
    with pytest.raises(NotFound):
        await store.get("acme", "spam")
    assert await store.list("acme") == []
    assert await store.redis.hgetall(KEYS.adapter("acme", "spam")) == {"next": "3"}  # only the counter stays
    assert not (store.data_dir / "acme" / "spam").exists()
    with pytest.raises(NotFound):
        await store.delete("acme", "spam")
    # A re-created adapter never gets a number a deleted one had: caches keyed by version stay right.
    assert (await store.put("acme", "spam", blobs[0], {})).version == 4


async def test_the_last_single_version_deleted_keeps_the_counter(store):
    await store.put("acme", "ham", weights(seed=1), {})
    assert await store.delete("acme", "ham", version=1) == 1
    assert await store.list("acme") == []
    with pytest.raises(NotFound):
        await store.get("acme", "ham")
    assert (await store.put("acme", "ham", weights(seed=2), {})).version == 2


async def test_deleting_the_last_version_removes_the_adapter(store):
    await store.put("acme", "spam", weights(), {})
    await store.get("acme", "spam", layers=[0])  # cached
    assert await store.delete("acme", "spam", version=1) == 1
    assert await store.list("acme") == [] and not store.cache.entries
    assert not await store.redis.sismember(KEYS.adapters("acme"), "spam")
    with pytest.raises(NotFound):
        await store.get("acme", "spam", layers=[0])


async def test_versions_and_metadata_survive_a_redis_restart(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    data = weights()
    store = make_store(server.url, tmp_path / "adapters")
    await store.put("acme", "spam", weights(seed=9), {"base": "minilm"})
    await store.put("acme", "spam", data, {"base": "minilm", "labels": '["ham", "spam"]'})
    await store.redis.aclose()
    port = server.port
    server.stop()
    restarted = RedisServer(tmp_path / "redis", port=port).start()
    store = make_store(restarted.url, tmp_path / "adapters")
    try:
        fetched = await store.get("acme", "spam")
        assert (fetched.stored.version, fetched.weights) == (2, data)
        assert fetched.stored.metadata == {"base": "minilm", "labels": '["ham", "spam"]'}
        [info] = await store.list("acme")
        assert info.versions == [1, 2]
        assert (await store.put("acme", "spam", data, {})).version == 3  # the counter survived too
    finally:
        await store.redis.aclose()
        restarted.stop()


def test_config_reads_its_variables_and_defaults_under_artifacts(tmp_path, monkeypatch):
    monkeypatch.setenv("ACADEMUS_ARTIFACTS", str(tmp_path / "art"))
    config = cfg.load(cfg.AdapterStoreConfig, env={})
    assert (config.max_adapter_bytes, config.heartbeat_ttl_s) == (8 * 1024 * 1024, 5.0)
    assert config.store_dir == tmp_path / "art" / "adapters"
    config = cfg.load(cfg.AdapterStoreConfig, env={"ACADEMUS_ADAPTER_DIR": str(tmp_path / "d"),
                                                    "ACADEMUS_MAX_ADAPTER_BYTES": "1024"})
    assert (config.store_dir, config.max_adapter_bytes) == (tmp_path / "d", 1024)
    with pytest.raises(cfg.ConfigError, match="ACADEMUS_MAX_ADAPTER_BYTES=0"):
        cfg.load(cfg.AdapterStoreConfig, env={"ACADEMUS_MAX_ADAPTER_BYTES": "0"})
    with pytest.raises(cfg.ConfigError, match="ACADEMUS_HEARTBEAT_TTL_S"):
        cfg.load(cfg.AdapterStoreConfig, env={"ACADEMUS_HEARTBEAT_TTL_S": "0.5"})
    assert cfg.load(cfg.AdapterStoreConfig, env={"ACADEMUS_MAX_GET_MANY": "8"}).max_get_many == 8
    with pytest.raises(cfg.ConfigError, match=r"ACADEMUS_MAX_GET_MANY=0 must be in 1\.\.256"):
        cfg.load(cfg.AdapterStoreConfig, env={"ACADEMUS_MAX_GET_MANY": "0"})
    assert cfg.load(cfg.WorkerConfig, env={"ACADEMUS_ADAPTER_FETCH_BATCH": "1"}).adapter_fetch_batch == 1
    with pytest.raises(cfg.ConfigError, match=r"ACADEMUS_ADAPTER_FETCH_BATCH=0 must be in 1\.\.256"):
        cfg.load(cfg.WorkerConfig, env={"ACADEMUS_ADAPTER_FETCH_BATCH": "0"})


async def test_get_many_answers_each_piece_in_order_and_a_missing_one_alone(store):
    await store.put("acme", "spam", weights(seed=1), {})
    await store.put("globex", "news", weights(seed=2), {})
    results = await store.get_many([("acme", "spam", 1, [0], True), ("nobody", "x", 1, [0], True),
                                    ("globex", "news", 0, [1], False)])
    assert set(st_load(results[0].weights)) == {"head.weight", "head.bias", "layers.0.down.weight",
                                                "layers.0.down.bias", "layers.0.up.weight", "layers.0.up.bias"}
    assert isinstance(results[1], NotFound) and "nobody/x" in results[1].message
    assert results[2].weights == (await store.get("globex", "news", 1, [1])).weights
    with pytest.raises(InvalidArgument, match="gets has 65 items; the limit is 64 a call"):
        await store.get_many([("acme", "spam", 1, [0], True)] * 65)
