"""Gateway core with a real Redis: auth, catalogue, limits, tokenization."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from academus.services.gateway.core import (
    EMBED,
    LABEL,
    SCORE,
    Authenticator,
    Catalogue,
    Gateway,
    InferCall,
    Tokenizers,
    resolve_output,
)
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.runtime.config import GatewayConfig
from academus.shared.runtime.errors import InvalidArgument, NotFound, Unauthenticated, Unavailable
from academus.shared.runtime.redis_conn import connect
from academus.shared.state.catalogue import CLASSIFICATION, EMBEDDING, ModelSpec
from academus.shared.state.keys import Keys

KEYS = Keys("acd")


@pytest.fixture(scope="module")
def tokenizer() -> TeacherTokenizer:
    return TeacherTokenizer(teacher_dir(), max_tokens=32)


@pytest.fixture
async def gateway(redis_url, tokenizer):
    redis = connect(redis_url)
    await redis.hset(KEYS.api_key("good-key"), mapping={"tenant": "acme", "role": "tenant"})
    await redis.hset(KEYS.models(), "spam", ModelSpec("spam", CLASSIFICATION, ["ham", "spam"]).to_json())
    await redis.hset(KEYS.models(), "minilm", ModelSpec("minilm", EMBEDDING).to_json())
    config = GatewayConfig(max_inputs=4, max_tokens=32, max_text_chars=500)
    yield Gateway(config, tokenizer, Authenticator(redis, KEYS, 5.0), Catalogue(redis, KEYS))
    await redis.aclose()


def call(texts, model="spam", truncate=True, output=""):
    return InferCall(model=model, texts=texts, pairs=[""] * len(texts), output=output, truncate=truncate)


async def test_admits_and_tokenizes(gateway):
    admitted = await gateway.admit("good-key", call(["free money now", "see you at lunch"]))
    assert admitted.principal.tenant == "acme"
    assert admitted.output == LABEL
    assert [e.input_ids[0] for e in admitted.encoded] == [101, 101]
    assert all(e.input_ids[-1] == 102 for e in admitted.encoded)


@pytest.mark.parametrize("key", [None, "", "wrong-key"])
async def test_missing_or_wrong_key_is_unauthenticated(gateway, key):
    with pytest.raises(Unauthenticated):
        await gateway.admit(key, call(["hi"]))


async def test_empty_text_names_the_field(gateway):
    with pytest.raises(InvalidArgument, match=r"inputs\[1\]\.text is empty"):
        await gateway.admit("good-key", call(["ok", "   "]))


async def test_no_inputs_is_invalid(gateway):
    with pytest.raises(InvalidArgument, match="inputs is empty"):
        await gateway.admit("good-key", call([]))


async def test_too_many_texts_names_the_limit(gateway):
    with pytest.raises(InvalidArgument, match="inputs has 5 entries; the limit is 4"):
        await gateway.admit("good-key", call(["a"] * 5))


async def test_too_many_characters_names_the_limit(gateway):
    with pytest.raises(InvalidArgument, match="the limit is 500"):
        await gateway.admit("good-key", call(["x" * 501]))


async def test_long_text_without_truncation_names_the_token_limit(gateway):
    text = "word " * 60
    with pytest.raises(InvalidArgument, match=r"inputs\[0\]\.text has 62 tokens; the limit is 32 tokens"):
        await gateway.admit("good-key", call([text], truncate=False))
    admitted = await gateway.admit("good-key", call([text], truncate=True))
    assert len(admitted.encoded[0].input_ids) == 32 and admitted.truncated == [True]


async def test_a_text_exactly_at_the_token_limit_is_whole_not_truncated(gateway):
    exact, over = "cat " * 30, "cat " * 31                    # 30 + [CLS] + [SEP] = the limit of 32
    admitted = await gateway.admit("good-key", call([exact, over]))
    assert [len(e.input_ids) for e in admitted.encoded] == [32, 32] and admitted.truncated == [False, True]
    assert (await gateway.admit("good-key", call([exact], truncate=False))).truncated == [False]


@pytest.fixture
async def wide_gateway(redis_url):
    """A gateway that takes the serving limits: 64 texts of 100,000 characters, cut at 256 tokens."""
    redis = connect(redis_url)
    await redis.hset(KEYS.api_key("good-key"), mapping={"tenant": "acme", "role": "tenant"})
    await redis.hset(KEYS.models(), "minilm", ModelSpec("minilm", EMBEDDING).to_json())
    config = GatewayConfig(max_inputs=64, max_tokens=256, max_text_chars=100_000)
    yield Gateway(config, TeacherTokenizer(teacher_dir(), 256), Authenticator(redis, KEYS, 5.0), Catalogue(redis, KEYS))
    await redis.aclose()


def on_thread(gateway: Gateway, method: str) -> list[str]:
    """Wraps the gateway's `method` (a tokenizer's call) to note the thread each call runs on."""
    threads, inner = [], getattr(gateway, method)

    def noted(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return inner(*args, **kwargs)
    setattr(gateway, method, noted)
    return threads


async def test_a_large_request_is_tokenized_off_the_event_loop_and_a_small_one_on_it(wide_gateway):
    """Past 16,384 characters the tokenizing thread takes the work, so other calls go on meanwhile; the answer is
    the same as a tokenizer's that tokenizes every text whole."""
    threads = on_thread(wide_gateway, "tokenize")
    texts = [f"review {i}: " + "a fine film, well made and long " * 3000 for i in range(64)]   # 96,000 characters
    admitted = await wide_gateway.admit("good-key", call(texts, model="minilm"))
    small = await wide_gateway.admit("good-key", call(["a fine film"], model="minilm"))
    assert threads == ["tokenize_0", threading.current_thread().name]
    whole = TeacherTokenizer(teacher_dir(), 256, cut_long=False).encode(texts)
    assert admitted.encoded == whole and admitted.truncated == [True] * 64 and small.truncated == [False]
    with pytest.raises(InvalidArgument, match=r"inputs\[3\]\.text has at least \d+ tokens; the limit is 256 tokens"):
        await wide_gateway.admit("good-key", call(["fine"] * 3 + ["word " * 20_000], model="minilm", truncate=False))
    assert threads[2:] == ["tokenize_0"]


async def test_tokenize_and_decode_of_many_characters_run_off_the_event_loop(wide_gateway):
    tokenizer = wide_gateway.tokenizers.teacher
    threads = on_thread(tokenizer, "tokens")
    told = await wide_gateway.tokens("good-key", "minilm", ["word " * 4000])
    assert threads == ["tokenize_0"] and len(told[0]) == 4002
    threads = on_thread(tokenizer, "decode")
    assert await wide_gateway.decode("good-key", "minilm", [[2773] * 20_000]) == ["word" + " word" * 19_999]
    assert await wide_gateway.decode("good-key", "minilm", [[2773]]) == ["word"]
    assert threads == ["tokenize_0", threading.current_thread().name]


async def test_a_blank_text_pair_is_invalid_and_named(gateway):
    with pytest.raises(InvalidArgument, match=r"inputs\[1\]\.text_pair is blank"):
        await gateway.admit("good-key", paired_call(["a", "b"], ["c", "  "]))


async def test_an_unknown_policy_from_an_unknown_caller_is_unauthenticated(gateway):
    with pytest.raises(Unauthenticated):
        await gateway.admit("wrong-key", call(["hi"]), policy="batchy")
    with pytest.raises(InvalidArgument, match="'batchy' is not a policy"):
        await gateway.admit("good-key", call(["hi"]), policy="batchy")


async def test_unknown_model_is_not_found_and_lists_served(gateway):
    with pytest.raises(NotFound, match="'nope' not found; served models: minilm, spam"):
        await gateway.admit("good-key", call(["hi"], model="nope"))


async def test_describe_gives_the_spec_of_a_model_the_key_may_name(gateway):
    assert await gateway.describe("good-key", "spam") == ModelSpec("spam", CLASSIFICATION, ["ham", "spam"])
    assert (await gateway.describe("good-key", "minilm")).kind == EMBEDDING
    with pytest.raises(NotFound, match="'nope' not found"):
        await gateway.describe("good-key", "nope")
    with pytest.raises(Unauthenticated):
        await gateway.describe("wrong-key", "spam")


async def test_a_model_registered_just_after_a_catalogue_read_is_served_not_refused(gateway, redis_url, tokenizer):
    """A worker registers a model within MISS_READ_S of the gateway's last read (`academus up` returns then):
    the request waits for the next read instead of answering NOT_FOUND, and misses share that read."""
    ticks = itertools.count()
    catalogue = Catalogue(gateway.catalogue.redis, KEYS, clock=lambda: next(ticks) * 0.001)  # 1 ms a look
    gateway = Gateway(gateway.config, tokenizer, gateway.auth, catalogue)
    await gateway.admit("good-key", call(["hi"]))                 # the catalogue is read now
    reads = 0
    refresh = catalogue.refresh

    async def counted() -> None:
        nonlocal reads
        reads += 1
        await refresh()

    catalogue.refresh = counted
    await catalogue.redis.hset(KEYS.models(), "fresh", ModelSpec("fresh", EMBEDDING).to_json())
    admitted, *refused = await asyncio.gather(gateway.admit("good-key", call(["hi"], model="fresh")),
                                              *(gateway.admit("good-key", call(["hi"], model="nope"))
                                                for _ in range(5)), return_exceptions=True)
    assert not isinstance(admitted, Exception), admitted
    assert admitted.spec.name == "fresh" and reads == 1
    assert all(isinstance(e, NotFound) and "served models: fresh, minilm, spam" in e.message for e in refused)


async def test_label_from_embedding_model_is_invalid(gateway):
    with pytest.raises(InvalidArgument, match="embedding model"):
        await gateway.admit("good-key", call(["hi"], model="minilm", output=LABEL))


def test_natural_output():
    assert resolve_output(ModelSpec("m", EMBEDDING), "") == EMBED
    assert resolve_output(ModelSpec("m", CLASSIFICATION, ["a", "b"]), "") == LABEL
    assert resolve_output(ModelSpec("m", CLASSIFICATION, ["a", "b"]), EMBED) == EMBED


def paired_call(texts, pairs, model="minilm", output="", truncate=True):
    return InferCall(model=model, texts=texts, pairs=pairs, output=output, truncate=truncate)


async def test_an_embedding_model_scores_text_pairs_from_each_texts_own_embedding(gateway):
    """Pairs to an embedding model: each distinct text tokenized alone (no [SEP] joins a pair, no segment 1)
    and embedded once, and each pair answered with one score from its two rows."""
    from academus.services.gateway.server import schedule_request
    from academus.v1 import inference_pb2

    admitted = await gateway.admit("good-key", paired_call(["a cat sat", "rain today"], ["a dog sat", "sunny"]))
    assert admitted.paired and admitted.output == SCORE and admitted.model_output == EMBED
    alone = await gateway.admit("good-key", call(["a cat sat", "rain today", "a dog sat", "sunny"], model="minilm"))
    assert [e.input_ids for e in admitted.encoded] == [e.input_ids for e in alone.encoded]
    assert not any(t for e in admitted.encoded for t in e.token_type_ids)
    request = schedule_request(admitted, "r1")
    assert request.output == inference_pb2.OUTPUT_EMBEDDING and list(request.tokens.lengths) == [
        len(e.input_ids) for e in alone.encoded]
    assert admitted.pair_rows == ((0, 2), (1, 3))
    scored = await gateway.admit("good-key", paired_call(["a"], ["b"], output=SCORE))
    assert scored.output == SCORE
    # A query against candidates (a rerank): the query is embedded once; a text on both sides is one row.
    ranked = await gateway.admit("good-key", paired_call(["query"] * 4, ["x", "y", "query", "x"]))
    assert [e.input_ids for e in ranked.encoded] == [e.input_ids for e in gateway.tokenize(
        call(["query", "x", "y"], model="minilm"))]
    assert ranked.pair_rows == ((0, 1), (0, 2), (0, 0), (0, 1))


async def test_pairs_a_model_cannot_score_are_refused_naming_the_field(gateway):
    with pytest.raises(InvalidArgument, match=r"inputs\[1\]\.text_pair: model 'spam' classifies single texts"):
        await gateway.admit("good-key", paired_call(["a", "b"], ["", "c"], model="spam"))
    with pytest.raises(InvalidArgument, match=r"inputs\[0\]\.text_pair is empty: a request scores text pairs"):
        await gateway.admit("good-key", paired_call(["a", "b"], ["", "c"]))
    with pytest.raises(InvalidArgument, match="inputs has 3 text pairs, 5 distinct texts to embed; the limit is 4"):
        await gateway.admit("good-key", paired_call(["a", "b", "c"], ["d", "e", "a"]))
    await gateway.admit("good-key", paired_call(["q"] * 4, ["a", "b", "c", "q"]))   # 4 distinct: within
    with pytest.raises(InvalidArgument, match="output=embedding: model 'minilm' answers a text pair with one score"):
        await gateway.admit("good-key", paired_call(["a"], ["b"], output=EMBED))
    with pytest.raises(InvalidArgument, match=r"inputs\[1\]\.text_pair has \d+ tokens; the limit is 32"):
        await gateway.admit("good-key", paired_call(["short", "short"], ["ok", "word " * 40], truncate=False))
    with pytest.raises(InvalidArgument, match=r"inputs\[1\]\.text has \d+ tokens; the limit is 32"):
        await gateway.admit("good-key", paired_call(["short", "word " * 40], ["ok", "fine"], truncate=False))
    with pytest.raises(InvalidArgument, match=r"output=score: .* embedding model.*send text pairs"):
        await gateway.admit("good-key", call(["a"], model="minilm", output=SCORE))


async def test_a_pair_classifier_reads_each_text_with_its_pair_and_takes_pairs_only(gateway, redis_url):
    """A cross-encoder (`models add --pairs`): each pair is one input, its second text marked by its token types, as
    the teacher's tokenizer frames a pair; a text without its pair is refused, naming it."""
    from academus.services.gateway.server import schedule_request

    redis = connect(redis_url)
    await redis.hset(KEYS.models(), "rr", ModelSpec("rr", CLASSIFICATION, ["relevance"], pairs=True).to_json())
    await redis.aclose()
    admitted = await gateway.admit("good-key", paired_call(["what is rain", "what is rain"], ["water falling", "a cat"],
                                                           model="rr"))
    assert not admitted.paired and admitted.output == LABEL and len(admitted.encoded) == 2
    expected = gateway.tokenizers.teacher.encode(["what is rain"] * 2, ["water falling", "a cat"])
    assert [e.input_ids for e in admitted.encoded] == [e.input_ids for e in expected]
    assert all(set(e.token_type_ids) == {0, 1} for e in admitted.encoded)   # the pair's second text is marked
    assert list(schedule_request(admitted, "r1").tokens.token_type_ids) == [
        t for e in admitted.encoded for t in e.token_type_ids]
    with pytest.raises(InvalidArgument, match=r"inputs\[1\]\.text_pair is empty: model 'rr' classifies text pairs"):
        await gateway.admit("good-key", paired_call(["a", "b"], ["c", ""], model="rr"))
    with pytest.raises(InvalidArgument, match=r"inputs\[0\]\.text_pair is empty: model 'rr' classifies text pairs"):
        await gateway.admit("good-key", call(["a"], model="rr"))
    with pytest.raises(InvalidArgument, match=r"inputs\[0\] \(its text and text_pair together\) has \d+ tokens; "
                                              r"the limit is 32"):
        await gateway.admit("good-key", paired_call(["word " * 20], ["word " * 20], model="rr", truncate=False))


def test_a_pairs_score_is_the_cosine_of_its_two_embeddings():
    from academus.services.gateway.core import pair_scores

    rows = [[1.0, 0.0], [3.0, 4.0], [2.0, 0.0], [-4.0, 3.0]]
    assert pair_scores(rows, [(0, 2), (1, 3), (0, 1), (3, 3)]) == pytest.approx([1.0, 0.0, 0.6, 1.0])
    assert pair_scores([[1.0, 1.0], [-2.0, -2.0]], [(0, 1)]) == pytest.approx([-1.0])


def test_a_pair_of_zero_embeddings_scores_zero_not_nan():
    """The null model answers zeros: a zero vector has no direction, so its pairs score 0.0."""
    from academus.services.gateway.core import pair_scores

    zeros = np.zeros((2, 384), dtype=np.float32)
    assert pair_scores(zeros, [(0, 1), (0, 0)]) == [0.0, 0.0]
    assert pair_scores([[0.0, 0.0], [3.0, 4.0]], [(0, 1)]) == [0.0]


async def test_to_pb_answers_each_pair_with_its_score_and_both_texts_tokens(gateway):
    from academus.services.gateway.server import to_pb
    from academus.v1 import tensors_pb2

    admitted = await gateway.admit("good-key", paired_call(["one", "two words"], ["uno", "dos"]))
    values = [1.0, 0.0, 0.6, 0.8, 1.0, 0.0, 0.0, 1.0]      # one, two words, uno, dos
    response = to_pb(admitted, tensors_pb2.ModelOutput(values=tensors_pb2.Matrix(rows=4, dim=2, values=values)), "r1")
    assert [p.score for p in response.predictions] == pytest.approx([1.0, 0.8])
    assert [p.input_index for p in response.predictions] == [0, 1]
    assert [p.num_tokens for p in response.predictions] == [3 + 3, 4 + 3]
    assert all(not p.embedding and not p.probs and not p.label for p in response.predictions)


async def test_answer_of_scores_each_pair_with_both_texts_tokens(gateway):
    """The core's Answer (what the HTTP edge shapes) agrees with to_pb's predictions."""
    from academus.services.gateway.server import answer_of
    from academus.v1 import tensors_pb2

    admitted = await gateway.admit("good-key", paired_call(["one", "two words"], ["uno", "dos"]))
    values = [1.0, 0.0, 0.6, 0.8, 1.0, 0.0, 0.0, 1.0]      # one, two words, uno, dos
    answer = answer_of(admitted, tensors_pb2.ModelOutput(values=tensors_pb2.Matrix(rows=4, dim=2, values=values)))
    assert answer.pair_scores == pytest.approx([1.0, 0.8]) and answer.num_tokens == [3 + 3, 4 + 3]
    assert answer.rows.size == 0


async def test_first_answer_gives_each_text_its_first_result_as_first_results_does(gateway):
    """`early_exit` over HTTP: the core's Answer holds each text's row from the ramp that released it, else the full
    model's, with the releasing layer (0: the full model), as the gRPC response's predictions do."""
    from academus.services.gateway.server import first_answer, first_results
    from academus.v1 import tensors_pb2

    admitted = await gateway.admit("good-key", call(["free money now", "see you at noon", "lunch?"]))

    def output(rows: list[int], layer: int, probs: list[list[float]]) -> tensors_pb2.ModelOutput:
        flat = [p for row in probs for p in row]
        return tensors_pb2.ModelOutput(labels=["ham", "spam"], rows=rows, exit_layer=layer,
                                       values=tensors_pb2.Matrix(rows=len(probs), dim=2, values=flat))

    early = [output([2], 1, [[0.9, 0.1]]), output([0], 3, [[0.25, 0.75]])]
    final = output([], 0, [[0.5, 0.5], [0.75, 0.25], [0.125, 0.875]])
    answer = first_answer(admitted, early, final)
    assert answer.exit_layers == [3, 0, 1]
    np.testing.assert_allclose(answer.rows, [[0.25, 0.75], [0.75, 0.25], [0.9, 0.1]], rtol=1e-6)
    response = first_results(admitted, early, final, "r1")
    np.testing.assert_allclose([list(p.probs) for p in response.predictions], answer.rows, rtol=1e-6)
    assert [p.exit_layer for p in response.predictions] == answer.exit_layers
    every_text_early = first_answer(admitted, [*early, output([1], 2, [[0.625, 0.375]])], None)
    assert every_text_early.exit_layers == [3, 2, 1] and every_text_early.labels == ["ham", "spam"]
    np.testing.assert_allclose(every_text_early.rows[1], [0.625, 0.375])
    assert every_text_early.num_tokens == answer.num_tokens


async def test_auth_cache_expires_with_the_clock(redis_url):
    redis = connect(redis_url)
    now = [0.0]
    auth = Authenticator(redis, KEYS, cache_s=5.0, clock=lambda: now[0])
    await redis.hset(KEYS.api_key("k"), mapping={"tenant": "t"})
    assert (await auth.authenticate("k")).tenant == "t"
    await redis.delete(KEYS.api_key("k"))
    assert (await auth.authenticate("k")).tenant == "t"  # cached
    now[0] = 6.0
    with pytest.raises(Unauthenticated):
        await auth.authenticate("k")
    await redis.aclose()


def test_the_gateways_caches_stay_within_their_bound_dropping_the_least_recently_stored():
    from academus.shared.runtime.expiring import ExpiringCache

    now = [0.0]
    cache: ExpiringCache[str, int] = ExpiringCache(5.0, lambda: now[0], max_entries=3)
    for i in range(5):
        cache.put(f"tenant{i}", i)
    assert len(cache) == 3 and cache.get("tenant0") is None and cache.get("tenant4") == 4
    cache.put("tenant2", 22)                       # stored again: now the most recent
    cache.put("tenant5", 5)
    assert cache.get("tenant3") is None and cache.get("tenant2") == 22
    now[0] = 5.0
    assert cache.get("tenant5") is None            # expired with the clock


async def test_only_the_key_hash_is_stored(redis_url):
    redis = connect(redis_url)
    await redis.hset(KEYS.api_key("secret-value"), mapping={"tenant": "t"})
    stored = [k async for k in redis.scan_iter("*")]
    assert stored and not any("secret-value" in k for k in stored)
    await redis.aclose()


async def test_directory_routes_by_model_and_policy(redis_url):
    from academus.services.gateway.core import SchedulerDirectory

    redis = connect(redis_url)
    await redis.sadd(KEYS.schedulers(), "s0", "s1", "gone")
    await redis.hset(KEYS.scheduler("s0"), mapping={"address": "a:0", "policy": "student",
                                                     "models": "sentiment-students"})
    await redis.hset(KEYS.scheduler("s1"), mapping={"address": "a:1", "policy": "padded", "models": ""})
    directory = SchedulerDirectory(redis, KEYS)
    await directory.refresh()
    assert directory.addresses == ["a:0", "a:1"]  # an expired scheduler key is skipped
    assert await directory.pick(model="sentiment", policy="") == "a:1"
    assert await directory.pick(model="sentiment-students", policy="student") == "a:0"
    assert await directory.pick(model="sentiment-students", policy="padded") == "a:1"
    with pytest.raises(Unavailable, match="policy 'student'"):
        await directory.pick(model="sentiment", policy="student")
    await redis.aclose()


async def test_what_serves_a_model_is_read_again_with_the_registry(redis_url):
    """The directory answers which deployments serve a model from its last registry read, kept between reads
    (two questions a request): a scheduler registered since is served from the next read, one gone is not,
    and `exclude` leaves out the ones a request already tried."""
    redis = connect(redis_url)
    directory = await two_schedulers(redis, "padded", "spam", "m")
    assert list(directory.serving("spam")) == ["m:0", "m:1"] and list(directory.serving("ham")) == []
    assert directory.serving("spam", exclude={"m:0"}) == ["m:1"] and list(directory.serving("spam")) == ["m:0", "m:1"]
    await redis.sadd(KEYS.schedulers(), "m.2")
    await redis.hset(KEYS.scheduler("m.2"), mapping={"address": "m:2", "policy": "student", "models": "ham"})
    await redis.delete(KEYS.scheduler("m.0"))
    assert list(directory.serving("ham")) == []                               # not read yet
    await directory.refresh()
    assert list(directory.serving("ham")) == ["m:2"] and list(directory.serving("spam")) == ["m:1"]
    assert list(directory.serving("ham", "padded")) == [] and list(directory.serving("ham", "student")) == ["m:2"]
    await redis.aclose()


async def two_schedulers(redis, policy: str, models: str, prefix: str = "a", clock=None):
    """Two live schedulers of one deployment (two shards) at PREFIX:0 and PREFIX:1, and a refreshed
    directory over them."""
    from academus.services.gateway.core import SchedulerDirectory

    await redis.sadd(KEYS.schedulers(), f"{prefix}.0", f"{prefix}.1")
    for k in range(2):
        await redis.hset(KEYS.scheduler(f"{prefix}.{k}"), mapping={"address": f"{prefix}:{k}", "policy": policy,
                                                                     "models": models})
    directory = SchedulerDirectory(redis, KEYS, **({"clock": clock} if clock else {}))
    await directory.refresh()
    return directory


async def test_a_full_scheduler_gets_nothing_until_its_pushback_passes(redis_url):
    from academus.services.gateway.core import SchedulerDirectory
    from academus.shared.runtime.errors import ResourceExhausted

    redis = connect(redis_url)
    now = [10.0]
    directory = await two_schedulers(redis, "padded", "spam", "b", clock=lambda: now[0])
    directory.push_back("b:0", "spam", 50)
    assert {await directory.pick(model="spam") for _ in range(4)} == {"b:1"}  # the other deployment serves
    directory.push_back("b:1", "spam", 80)
    now[0] += 0.030
    with pytest.raises(ResourceExhausted, match="full queue; retry in 20 ms") as refused:
        await directory.pick(model="spam")
    assert refused.value.pushback_ms == 20                                     # the soonest hint to end
    now[0] += 0.021
    assert {await directory.pick(model="spam") for _ in range(4)} == {"b:0"}
    ignoring = SchedulerDirectory(redis, KEYS, honour_pushback=False, clock=lambda: now[0])
    await ignoring.refresh()
    ignoring.push_back("b:0", "spam", 50)
    ignoring.push_back("b:1", "spam", 50)
    assert {await ignoring.pick(model="spam") for _ in range(4)} == {"b:0", "b:1"}  # the ablation
    await redis.aclose()



async def test_a_pushback_holds_back_only_the_model_it_was_for(redis_url):
    """Two deployments serving two models each: one refused for spam's queue still gets ham."""
    redis = connect(redis_url)
    now = [10.0]
    directory = await two_schedulers(redis, "student", "spam,ham", "m", clock=lambda: now[0])
    directory.push_back("m:0", "spam", 50)
    assert {await directory.pick(model="spam") for _ in range(4)} == {"m:1"}
    assert {await directory.pick(model="ham") for _ in range(4)} == {"m:0", "m:1"}
    await redis.aclose()


async def test_a_request_goes_to_the_shard_with_the_fewest_in_flight(redis_url):
    """Two shards of one deployment: while a:0 holds two of this gateway's requests and a:1 one, the
    next goes to a:1; once a:1 holds as many, they take turns; answered requests no longer count."""

    redis = connect(redis_url)
    directory = await two_schedulers(redis, "student", "ss")
    held: dict[str, list[asyncio.Future]] = {"a:0": [], "a:1": []}

    async def send(address: str) -> str:
        waiter = asyncio.get_running_loop().create_future()
        held[address].append(waiter)
        await waiter
        return address

    calls = [asyncio.create_task(directory.route("ss", "", 1e9, send)) for _ in range(3)]
    await asyncio.sleep(0)
    assert sorted(len(w) for w in held.values()) == [1, 2]      # turns while even, then the emptier one
    emptier = min(held, key=lambda a: len(held[a]))
    fuller = "a:1" if emptier == "a:0" else "a:0"
    held[emptier].pop().set_result(None)                          # answered: it holds none now
    await asyncio.sleep(0)
    more = [asyncio.create_task(directory.route("ss", "", 1e9, send)) for _ in range(2)]
    await asyncio.sleep(0)
    assert (len(held[emptier]), len(held[fuller])) == (2, 2)    # both to the emptier (turns would split them)
    for waiter in [*held["a:0"], *held["a:1"]]:
        waiter.set_result(None)
    answered = await asyncio.gather(*calls, *more)
    assert (answered.count(emptier), answered.count(fuller)) == (3, 2)
    assert {await directory.pick(model="ss") for _ in range(4)} == {"a:0", "a:1"}  # nothing in flight: turns
    await redis.aclose()


async def test_a_scheduler_that_answered_unavailable_is_tried_last_for_a_while(redis_url):
    """A shard whose only group was lost answers UNAVAILABLE at once, so it always holds the fewest requests:
    after its answer the others get the traffic for DOWN_S, then it is back in turn; alone, it is still tried."""
    from academus.services.gateway.core import DOWN_S, HOLD_S
    from academus.shared.runtime.errors import Unavailable

    redis = connect(redis_url)
    now = [10.0]
    directory = await two_schedulers(redis, "student", "ss", clock=lambda: now[0])
    sent: list[str] = []

    async def send(address: str) -> str:
        sent.append(address)
        if address == "a:0":
            raise Unavailable("no live worker serves model 'ss'")
        return address

    assert [await directory.route("ss", "", 1e9, send) for _ in range(4)] == ["a:1"] * 4
    assert sent.count("a:0") == 1                                   # asked once, then passed over
    now[0] += DOWN_S
    assert {await directory.pick(model="ss") for _ in range(4)} == {"a:0", "a:1"}   # back in turn
    await redis.srem(KEYS.schedulers(), "a.1")
    await directory.refresh()
    now[0] += HOLD_S                  # nothing served lately: no scheduler is thought to be on its way back
    with pytest.raises(Unavailable):
        await directory.route("ss", "", 1e9, send)                  # the only one left is still asked
    assert await directory.pick(model="ss") == "a:0"
    await redis.aclose()


async def test_a_request_waits_within_its_deadline_for_a_scheduler_that_served_its_model_moments_ago(redis_url):
    """A restarting scheduler (deregistered, or refusing connections) is back within a second: a request of a
    model it served waits for it rather than failing; a model no scheduler served lately fails at once."""
    from academus.services.gateway.core import SchedulerDirectory
    from academus.shared.runtime.errors import Unavailable, Unreachable

    redis = connect(redis_url)
    await redis.sadd(KEYS.schedulers(), "r0")
    await redis.hset(KEYS.scheduler("r0"), mapping={"address": "r:0", "policy": "padded", "models": "spam,ham"})
    directory = SchedulerDirectory(redis, KEYS)
    await directory.refresh()
    refusing = [True]

    async def send(address: str) -> str:
        if refusing[0]:
            raise Unreachable(f"{address}: connection refused")
        return address

    refusing[0] = False
    assert await directory.route("spam", "", time.monotonic() + 5, send) == "r:0"
    refusing[0] = True                                 # killed: still listed, refusing connections
    held = asyncio.create_task(directory.route("spam", "", time.monotonic() + 5, send))
    await asyncio.sleep(0.2)
    assert not held.done()
    await redis.srem(KEYS.schedulers(), "r0")         # then gone from the registry (a SIGTERM deregisters)
    await asyncio.sleep(0.2)
    assert not held.done()
    await redis.sadd(KEYS.schedulers(), "r0")         # back on its address
    refusing[0] = False
    assert await held == "r:0"
    refusing[0] = True
    with pytest.raises(Unavailable, match="connection refused"):
        await directory.route("ham", "", time.monotonic() + 5, send)   # never served here: no wait
    with pytest.raises(Unavailable, match="connection refused"):
        await directory.route("spam", "", time.monotonic() + 0.02, send)   # no time left to wait

    async def no_workers(address: str) -> str:
        raise Unavailable("no live worker serves model 'spam'")   # the scheduler's own answer: heard at once

    held = asyncio.create_task(directory.route("spam", "", time.monotonic() + 5, no_workers))
    await asyncio.sleep(0.2)
    assert held.done() and isinstance(held.exception(), Unavailable)
    await redis.aclose()


async def test_requests_held_together_share_each_registry_read(redis_url):
    """A scheduler killed under load leaves hundreds of requests held at once: each tries again on its own timer
    (the restarted scheduler meets a trickle), but they share the registry reads, about one a HOLD_WAIT_S rather
    than one each, so the gateway's core stays with the scheduler restarting beside it (the hold_cost probe)."""
    from academus.loadgen.probes.hold_cost import hold_round
    from academus.services.gateway.core import HOLD_WAIT_S

    held = await hold_round(redis_url, 200, 0.5)
    assert held["answered_unavailable"] == 200                       # each answered, at its deadline
    assert held["registry_reads"] <= 2 * held["wall_s"] / HOLD_WAIT_S + 3   # a read each: 200 a HOLD_WAIT_S


def test_an_unknown_policy_is_invalid_and_names_the_known_ones():
    from academus.services.gateway.core import check_policy

    assert check_policy("") == "" and check_policy("student") == "student"
    with pytest.raises(InvalidArgument, match="'batchy' is not a policy; known: fifo, padded, student"):
        check_policy("batchy")


# Tenant models and quotas: the caller's own models on a served base, never another tenant's.


@pytest.fixture
async def tenants(redis_url, tokenizer):
    from academus.shared.state.tenants import TenantModel, TenantRegistry

    redis = connect(redis_url)
    await redis.hset(KEYS.models(), "spam", ModelSpec("spam", CLASSIFICATION, ["ham", "spam"]).to_json())
    await redis.hset(KEYS.models(), "minilm", ModelSpec("minilm", EMBEDDING).to_json())
    registry = TenantRegistry(redis, KEYS)
    keys = {t: await registry.create_tenant(t) for t in ("a", "b")}
    await registry.register_model("a", TenantModel("reviews", "minilm", "reviews-adapter", 2, ["neg", "neu", "pos"]))
    await registry.register_model("a", TenantModel("vec", "minilm", "vec-adapter", 1, kind=EMBEDDING))
    config = GatewayConfig(max_inputs=4, max_tokens=32, max_text_chars=500)
    gateway = Gateway(config, tokenizer, Authenticator(redis, KEYS, 5.0), Catalogue(redis, KEYS))
    yield gateway, registry, keys
    await redis.aclose()


async def test_a_tenant_model_resolves_on_its_base(tenants):
    gateway, _, keys = tenants
    admitted = await gateway.admit(keys["a"], call(["great film"], model="reviews"))
    assert admitted.tenant_model.adapter == "reviews-adapter"
    assert (admitted.spec.name, admitted.spec.kind, admitted.spec.labels) == ("reviews", CLASSIFICATION,
                                                                             ["neg", "neu", "pos"])
    assert admitted.output == LABEL
    served = await gateway.admit(keys["a"], call(["hi"], model="spam"))  # served models as before
    assert served.tenant_model is None and served.spec.name == "spam"


async def test_another_tenants_model_is_indistinguishable_from_an_unknown_name(tenants):
    gateway, _, keys = tenants
    with pytest.raises(NotFound) as unknown:
        await gateway.admit(keys["b"], call(["hi"], model="no-such-model"))
    with pytest.raises(NotFound) as foreign:
        await gateway.admit(keys["b"], call(["hi"], model="reviews"))
    assert foreign.value.message == unknown.value.message.replace("no-such-model", "reviews")
    assert foreign.value.message == "model 'reviews' not found; served models: minilm, spam"


async def test_a_model_not_ready_is_refused(tenants):
    from academus.shared.runtime.errors import FailedPrecondition
    from academus.shared.state.tenants import TRAINING, TenantModel

    gateway, registry, keys = tenants
    await registry.register_model("a", TenantModel("draft", "minilm", "draft", 1, ["x", "y"], status=TRAINING))
    with pytest.raises(FailedPrecondition, match="model 'draft' is training"):
        await gateway.admit(keys["a"], call(["hi"], model="draft"))
    await registry.register_model("a", TenantModel("draft", "minilm", "draft", 1, ["x", "y"]))   # trained
    assert (await gateway.admit(keys["a"], call(["hi"], model="draft"))).tenant_model.status == "ready"


async def test_admit_takes_a_quota_token_per_request(tenants):
    from academus.shared.runtime.errors import ResourceExhausted

    gateway, registry, keys = tenants
    await registry.set_quota("a", rate=0.5, burst=2)
    for _ in range(2):
        await gateway.admit(keys["a"], call(["hi"]))
    with pytest.raises(ResourceExhausted, match=r"tenant 'a' is over its rate limit of 0\.5 requests/s") as e:
        await gateway.admit(keys["a"], call(["hi"], model="reviews"))
    assert e.value.pushback_ms > 0
    await gateway.admit(keys["b"], call(["hi"]))  # another tenant is not slowed
    await registry.set_quota("b", rate=0.01, burst=1)
    with pytest.raises(InvalidArgument, match="the limit is 32 tokens"):   # refused as invalid: no token taken
        await gateway.admit(keys["b"], call(["word " * 60], truncate=False))
    await gateway.admit(keys["b"], call(["hi"]))
    await registry.redis.hset(KEYS.api_key("old-key"), mapping={"tenant": "legacy", "role": "tenant"})
    for _ in range(10):  # a key without a tenant record (the admin, older keys) is not limited
        await gateway.admit("old-key", call(["hi"]))


async def test_schedule_request_sends_the_base_and_the_adapter(tenants):
    from academus.services.gateway.server import schedule_request

    gateway, _, keys = tenants
    request = schedule_request(await gateway.admit(keys["a"], call(["great film"], model="reviews")), "r1")
    assert (request.model, request.tenant) == ("minilm", "a")
    assert (request.adapter.tenant, request.adapter.name, request.adapter.version) == ("a", "reviews-adapter", 2)
    plain = schedule_request(await gateway.admit(keys["a"], call(["hi"], model="spam")), "r2")
    assert plain.model == "spam" and not plain.HasField("adapter")


async def test_to_pb_keeps_the_tenant_heads_labels_and_slices_padded_probs(tenants):
    from academus.services.gateway.server import to_pb
    from academus.v1 import tensors_pb2

    gateway, _, keys = tenants
    admitted = await gateway.admit(keys["a"], call(["good", "bad"], model="reviews"))
    # The batch's widest head had 5 classes: this head's 3 probs are zero-padded to 5.
    values = [0.1, 0.2, 0.7, 0.0, 0.0, 0.6, 0.3, 0.1, 0.0, 0.0]
    result = tensors_pb2.ModelOutput(labels=["w0", "w1", "w2", "w3", "w4"],
                                     values=tensors_pb2.Matrix(rows=2, dim=5, values=values))
    response = to_pb(admitted, result, "r1")
    assert response.model == "reviews" and list(response.labels) == ["neg", "neu", "pos"]
    assert [p.label for p in response.predictions] == ["pos", "neg"]
    assert [x for p in response.predictions for x in p.probs] == pytest.approx([0.1, 0.2, 0.7, 0.6, 0.3, 0.1])
    assert [len(p.probs) for p in response.predictions] == [3, 3]
    assert [p.score for p in response.predictions] == pytest.approx([0.7, 0.1])


async def test_answer_of_keeps_the_tenant_heads_labels_and_slices_padded_probs(tenants):
    from academus.services.gateway.server import answer_of
    from academus.v1 import tensors_pb2

    gateway, _, keys = tenants
    admitted = await gateway.admit(keys["a"], call(["good", "bad"], model="reviews"))
    values = [0.1, 0.2, 0.7, 0.0, 0.0, 0.6, 0.3, 0.1, 0.0, 0.0]   # 3 probs zero-padded to the batch's 5
    answer = answer_of(admitted, tensors_pb2.ModelOutput(labels=["w0", "w1", "w2", "w3", "w4"],
                                                         values=tensors_pb2.Matrix(rows=2, dim=5, values=values)))
    assert (answer.model, answer.labels, answer.pair_scores) == ("reviews", ["neg", "neu", "pos"], None)
    np.testing.assert_allclose(answer.rows, [[0.1, 0.2, 0.7], [0.6, 0.3, 0.1]], rtol=1e-6)


async def test_to_pb_gives_a_tenant_embedding_model_its_whole_row(tenants):
    from academus.services.gateway.server import to_pb
    from academus.v1 import tensors_pb2

    gateway, _, keys = tenants
    admitted = await gateway.admit(keys["a"], call(["good"], model="vec"))
    result = tensors_pb2.ModelOutput(values=tensors_pb2.Matrix(rows=1, dim=4, values=[0.5, -0.5, 0.5, -0.5]))
    response = to_pb(admitted, result, "r1")
    assert response.model == "vec" and list(response.labels) == []
    assert list(response.predictions[0].embedding) == pytest.approx([0.5, -0.5, 0.5, -0.5])


async def test_a_listing_shows_the_served_models_and_the_callers_own_only(tenants):
    from academus.services.gateway.server import model_info_pb, tenant_model_info_pb
    from academus.shared.state.tenants import TRAINING, TenantModel

    gateway, registry, keys = tenants
    await registry.register_model("b", TenantModel("draft", "gone-base", "draft", 1, ["x", "y"], status=TRAINING))
    served, own = await gateway.list_models(keys["a"])
    assert [m.name for m in served] == ["minilm", "spam"] and [m.name for m in own] == ["reviews", "vec"]
    assert model_info_pb(served[1]).labels == ["ham", "spam"] and model_info_pb(served[1]).status == "ready"
    reviews = tenant_model_info_pb(own[0], served[0])
    assert (reviews.base, reviews.kind, list(reviews.labels), reviews.dim) == ("minilm", CLASSIFICATION,
                                                                               ["neg", "neu", "pos"], 384)
    base = replace(served[0], pooling="mean", normalized=True)   # as the worker that serves it registered it
    vec = tenant_model_info_pb(own[1], base)                       # an adapter's vectors: pooled as its base's
    assert (vec.kind, vec.pooling, vec.normalized) == (EMBEDDING, "mean", True)
    assert (tenant_model_info_pb(own[0], base).pooling, model_info_pb(base).pooling) == ("", "mean")
    _, theirs = await gateway.list_models(keys["b"])
    draft = tenant_model_info_pb(theirs[0], None)   # its base is not served: no limits to give
    assert [m.name for m in theirs] == ["draft"] and (draft.status, draft.dim, draft.max_tokens) == ("training", 0, 0)
    with pytest.raises(Unauthenticated):
        await gateway.list_models("wrong-key")


async def deployments(redis_url, clock, honour_pushback=True):
    from academus.services.gateway.core import SchedulerDirectory

    redis = connect(redis_url)
    await redis.sadd(KEYS.schedulers(), "p0", "p1")
    for name, address in (("p0", "b:0"), ("p1", "b:1")):
        await redis.hset(KEYS.scheduler(name), mapping={"address": address, "policy": "padded", "models": "spam"})
    directory = SchedulerDirectory(redis, KEYS, honour_pushback, clock=clock)
    await directory.refresh()
    return redis, directory


@pytest.mark.parametrize("honour_pushback", [True, False])
async def test_a_request_refused_for_a_full_queue_goes_to_another_deployment(redis_url, honour_pushback):
    from academus.shared.runtime.errors import ResourceExhausted, Unavailable

    now = [10.0]
    redis, directory = await deployments(redis_url, lambda: now[0], honour_pushback)
    sent = []

    async def send(address):
        sent.append(address)
        if address == "b:0":
            raise ResourceExhausted("scheduler queue is full (1 requests waiting)", pushback_ms=50)
        return f"answer from {address}"

    answers = [await directory.route("spam", "", deadline=11.0, send=send) for _ in range(4)]
    assert answers == ["answer from b:1"] * 4                   # no request refused while b:1 has room
    # A full one is skipped while its hint lasts; ignoring hints, round-robin sends every request there first.
    assert sent.count("b:0") == (1 if honour_pushback else 4)

    async def all_full(address):
        sent.append(address)
        raise ResourceExhausted(f"{address} queue is full", pushback_ms=50)

    now[0] += 0.1
    with pytest.raises(ResourceExhausted, match=r"b:\d queue is full"):  # every one tried: the last refusal
        await directory.route("spam", "", deadline=11.0, send=all_full)
    assert sent[-2:] in (["b:0", "b:1"], ["b:1", "b:0"])

    async def gone(address):
        sent.append(address)
        raise Unavailable(f"{address} is gone")

    now[0] += 0.1
    before = len(sent)
    with pytest.raises(Unavailable, match=r"b:\d is gone"):
        await directory.route("spam", "", deadline=now[0], send=gone)
    assert len(sent) == before + 1                                      # past the deadline: no other try
    await redis.aclose()


async def test_a_scheduler_gone_while_redis_is_unreachable_leaves_the_others_and_no_redis_error(redis_url):
    """A scheduler answered UNAVAILABLE and the registry cannot be read: the request goes to another
    deployment of the list as it was; with no list at all, UNAVAILABLE (for want of room: the token goes back)."""
    from academus.services.gateway.core import SchedulerDirectory, for_want_of_room
    from academus.shared.runtime.errors import Unavailable

    redis, directory = await deployments(redis_url, time.monotonic)
    directory.redis = connect("redis://127.0.0.1:1/0")        # nothing listens there

    async def send(address):
        if address == "b:0":
            raise Unavailable(f"{address} is gone")
        return f"answer from {address}"

    assert {await directory.route("spam", "", time.monotonic() + 5, send) for _ in range(4)} == {"answer from b:1"}
    blind = SchedulerDirectory(directory.redis, KEYS)
    with pytest.raises(Unavailable, match="the scheduler registry is unreachable") as refused:
        await blind.pick(model="spam")
    assert for_want_of_room(refused.value)
    await directory.redis.aclose()
    await redis.aclose()


async def test_a_request_refused_at_the_edge_costs_no_quota_token(redis_url, tokenizer):
    from academus.shared.runtime.errors import ResourceExhausted
    from academus.shared.state.tenants import TenantRegistry

    now = [10.0]
    redis, directory = await deployments(redis_url, lambda: now[0])
    await redis.hset(KEYS.models(), "spam", ModelSpec("spam", CLASSIFICATION, ["ham", "spam"]).to_json())
    registry = TenantRegistry(redis, KEYS)
    key = await registry.create_tenant("t", rate=0.01, burst=1)    # one token, no refill within the test
    gateway = Gateway(GatewayConfig(max_inputs=4, max_tokens=32, max_text_chars=500), tokenizer,
                      Authenticator(redis, KEYS, 5.0), Catalogue(redis, KEYS), schedulers=directory)
    directory.push_back("b:0", "spam", 50)
    directory.push_back("b:1", "spam", 50)
    for _ in range(3):
        with pytest.raises(ResourceExhausted, match="every scheduler serving model 'spam' has a full queue"):
            await gateway.admit(key, call(["hi"]))
    # a text past the token limit is the caller's to fix, full queues or not: not a refusal to retry
    with pytest.raises(InvalidArgument, match=r"inputs\[0\]\.text has 62 tokens; the limit is 32"):
        await gateway.admit(key, call(["word " * 60], truncate=False))
    now[0] += 0.06
    admitted = await gateway.admit(key, call(["hi"]))             # the one token is still there
    assert admitted.charged
    await gateway.give_back(admitted)                             # refused downstream: the token returns
    await gateway.admit(key, call(["hi"]))
    with pytest.raises(ResourceExhausted, match="over its rate limit"):
        await gateway.admit(key, call(["hi"]))
    await redis.aclose()


async def test_a_request_refused_on_arrival_for_its_deadline_goes_to_another_deployment(redis_url):
    from academus.services.gateway.core import for_want_of_room
    from academus.shared.runtime.errors import DeadlineExceeded

    now = [10.0]
    redis, directory = await deployments(redis_url, lambda: now[0])
    ran_out = DeadlineExceeded("deadline passed before layer 3")

    async def send(address):
        if address == "b:0":
            raise DeadlineExceeded("the deadline cannot be met: about 900 ms of queued work ahead", nothing_ran=True)
        return f"answer from {address}"

    assert {await directory.route("spam", "", deadline=11.0, send=send) for _ in range(4)} == {"answer from b:1"}

    async def late(address):
        raise ran_out

    with pytest.raises(DeadlineExceeded) as info:  # it ran and ran out of time: not sent again
        await directory.route("spam", "", deadline=11.0, send=late)
    assert info.value is ran_out and not for_want_of_room(ran_out)
    assert for_want_of_room(DeadlineExceeded("cannot be met", nothing_ran=True))
    await redis.aclose()


async def test_a_node_scheduler_is_sent_only_the_models_its_node_serves(redis_url):
    """Two nodes' schedulers of one deployment for every model: node a's workers serve ss, node b's serve
    ss and t. A request for t goes to b alone; one for a model neither node serves is refused here, without a
    hop; a scheduler that registers no `serving` (one for the whole mesh) is sent every model it names."""
    from academus.services.gateway.core import SchedulerDirectory

    redis = connect(redis_url)
    keys = Keys("acd-nodes")
    for node, serving in (("a", "ss"), ("b", "ss,t")):
        await redis.sadd(keys.schedulers(), f"s@{node}")
        await redis.hset(keys.scheduler(f"s@{node}"), mapping={"address": f"{node}:1", "policy": "student",
                                                               "models": "", "node": node, "serving": serving})
    directory = SchedulerDirectory(redis, keys)
    await directory.refresh()
    assert {await directory.pick(model="ss") for _ in range(4)} == {"a:1", "b:1"}
    assert {await directory.pick(model="t") for _ in range(4)} == {"b:1"}
    with pytest.raises(Unavailable, match="no live scheduler serves model 'u'"):
        await directory.pick(model="u")
    await redis.sadd(keys.schedulers(), "whole")
    await redis.hset(keys.scheduler("whole"), mapping={"address": "w:1", "policy": "student", "models": ""})
    await directory.refresh()
    assert await directory.pick(model="u") == "w:1"
    await redis.aclose()


async def test_a_request_no_known_scheduler_serves_rereads_the_registry_at_most_so_often(redis_url):
    """A node's scheduler that began serving a model after the gateway's last read is found by the next
    request for it; a run of requests for a model nobody serves reads the registry once a MISS_REFRESH_S."""
    from academus.services.gateway.core import MISS_REFRESH_S, SchedulerDirectory

    redis, keys, now = connect(redis_url), Keys("acd-miss"), [0.0]
    await redis.sadd(keys.schedulers(), "n")
    await redis.hset(keys.scheduler("n"), mapping={"address": "n:1", "models": "", "node": "a", "serving": ""})
    directory = SchedulerDirectory(redis, keys, clock=lambda: now[0])
    await directory.refresh()
    await redis.hset(keys.scheduler("n"), "serving", "ss")       # its node's first group formed
    with pytest.raises(Unavailable):
        await directory.pick(model="ss")                          # read a moment ago: not again yet
    now[0] += MISS_REFRESH_S
    assert await directory.pick(model="ss") == "n:1"
    await redis.aclose()


@pytest.mark.parametrize("ascii_path", [True, False])
async def test_a_users_tokenizer_follows_the_setting_of_the_teachers(redis_url, ascii_path: bool):
    """ACADEMUS_ASCII_TOKENIZER reaches every model's tokenizer, a user's read from Redis as well."""
    redis = connect(redis_url)
    raw = (teacher_dir() / "tokenizer.json").read_text()
    await redis.set(KEYS.tokenizer("d1"), raw)
    tokenizers = Tokenizers(TeacherTokenizer(teacher_dir(), 32, ascii_path=ascii_path), redis, KEYS)
    own = await tokenizers.get(ModelSpec("mine", EMBEDDING, tokenizer="d1", max_tokens=16))
    assert own.max_tokens == 16 and (own.ascii is not None) is ascii_path
    assert own.encode(["a fine film"])[0].input_ids == [101, 1037, 2986, 2143, 102]
    await redis.aclose()


async def hang_directory(redis_url, silent: set[str], now: list[float]):
    """Two schedulers of spam, b:0 also serving ham alone, behind a directory whose health checks find the
    addresses in `silent` hung."""
    from academus.services.gateway.core import SchedulerDirectory

    redis = connect(redis_url)
    await redis.sadd(KEYS.schedulers(), "p0", "p1")
    for name, address, models in (("p0", "b:0", "spam,ham"), ("p1", "b:1", "spam")):
        await redis.hset(KEYS.scheduler(name), mapping={"address": address, "policy": "padded", "models": models})
    asked: list[str] = []

    async def answers(address: str) -> bool:
        asked.append(address)
        return address not in silent

    directory = SchedulerDirectory(redis, KEYS, clock=lambda: now[0], answers=answers, hang_s=1.0)
    await directory.refresh()
    return redis, directory, asked


@pytest.mark.timeout(30)
async def test_a_silent_schedulers_calls_are_given_up_and_sent_to_another(redis_url):
    """A hung scheduler neither answers nor refuses: its calls would wait out their deadlines. Found silent, its
    calls another deployment serves go there, and it is picked last until it answers again."""
    now, silent = [10.0], {"b:0"}
    redis, directory, asked = await hang_directory(redis_url, silent, now)
    sent: list[str] = []
    hang = asyncio.Event()

    async def send(address: str) -> str:
        sent.append(address)
        if address == "b:0":
            await hang.wait()   # never set: the scheduler froze with the call
        return f"answer from {address}"

    held = asyncio.ensure_future(directory.route("spam", "", deadline=20.0, send=send))   # one to each: the
    other = asyncio.ensure_future(directory.route("spam", "", deadline=20.0, send=send))  # fewest in flight
    held_ham = asyncio.ensure_future(directory.route("ham", "", deadline=20.0, send=send))
    await asyncio.sleep(0.01)
    assert sorted(sent) == ["b:0", "b:0", "b:1"] and not held_ham.done()
    assert await directory.give_up_hung() == {} and asked == []   # no call old enough: nobody asked
    now[0] += 1.0
    assert await directory.give_up_hung() == {"b:0": 1}            # ham's call stays: only b:0 serves ham
    assert [await held, await other] == ["answer from b:1"] * 2 and not held_ham.done()
    hang.set()
    assert await held_ham == "answer from b:0"   # nothing in flight now: the picks would alternate
    assert {await directory.pick(model="spam") for _ in range(4)} == {"b:1"}   # picked last while silent
    assert await directory.give_up_hung() == {"b:0": 0}   # asked again: still silent
    silent.clear()
    assert await directory.give_up_hung() == {}
    now[0] += 1.0   # and past the DOWN_S that its given-up call's Unreachable set
    assert {await directory.pick(model="spam") for _ in range(4)} == {"b:0", "b:1"}
    await redis.aclose()


@pytest.mark.timeout(30)
async def test_a_callers_own_cancel_is_not_taken_for_a_hung_scheduler(redis_url):
    now = [10.0]
    redis, directory, _ = await hang_directory(redis_url, set(), now)

    async def send(address: str) -> str:
        await asyncio.Event().wait()
        return address

    call = asyncio.ensure_future(directory.route("ham", "", deadline=20.0, send=send))
    await asyncio.sleep(0.01)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    now[0] += 5.0
    assert await directory.give_up_hung() == {}   # the cancelled call left nothing to check
    await redis.aclose()
