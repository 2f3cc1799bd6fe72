"""Gateway core: authentication, quotas, the model catalogue and tenant models, input limits and tokenization.
No gRPC here."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from academus.shared.models.tokenization import (
    Encoded,
    TeacherTokenizer,
    TextTooLong,
    Token,
    TooManyTokens,
)
from academus.shared.runtime.config import EVERY_MODEL, POLICY_NAMES, GatewayConfig, ModelSelection, split_names
from academus.shared.runtime.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServingError,
    Unauthenticated,
    Unavailable,
    Unreachable,
)
from academus.shared.runtime.expiring import ExpiringCache
from academus.shared.runtime.redis_conn import RedisAbsence
from academus.shared.state.catalogue import CLASSIFICATION, EMBEDDING, ModelSpec
from academus.shared.state.keys import Keys
from academus.shared.state.tenants import READY, Quotas, TenantModel, TenantRegistry

# What the caller asked for, as the core names it (the edge maps the proto enum).
LABEL, SCORE, EMBED = "label", "score", "embedding"
T = TypeVar("T")
DOWN_S = 1.0   # a scheduler that answered UNAVAILABLE is tried after the others this long (a placement refresh)
MISS_REFRESH_S = 0.1   # a request no known scheduler serves re-reads the registry, at most this often
# Tokens a Tokenize answer, and ids a Decode request, hold at most: 64 texts of 2,048 tokens. Far past what a request
# to a model takes (512 tokens a text at most), and it bounds what one call costs: a Token object a token, and about
# 78 bytes of JSON a token over HTTP (10 MB); 100,000 characters of spam mail are 28,069 tokens, 2.2 MB of JSON.
MAX_TOKENS_ANSWERED = 1 << 17
# A request of more characters (or Decode ids) is tokenized on the gateway's tokenizing thread, so that its event loop
# serves other calls meanwhile: 64 texts of 4,096 characters take the tokenizer 60-70 ms, and the library lets go of
# the GIL as it works. One thread: large requests queue behind each other, not the small ones behind them.
OFF_LOOP_CHARS = 1 << 14
HOLD_S, HOLD_WAIT_S = 5.0, 0.05   # a model served this recently waits for a scheduler, trying this often
STALE_KEY_S = 3600.0   # while Redis is unreachable, a key verified within this long before is still trusted


@dataclass(frozen=True)
class Principal:
    tenant: str
    role: str


@dataclass(frozen=True)
class InferCall:
    model: str
    texts: Sequence[str]
    pairs: Sequence[str]           # empty strings where there is no pair
    output: str                    # "" (the model's natural output), LABEL, SCORE or EMBED
    truncate: bool = True
    early_exit: bool = False       # each text's first result, from an exit ramp where one is confident (Apparate)

    @functools.cached_property
    def chars(self) -> int:
        """Characters to tokenize: what decides where (Gateway.off_loop)."""
        return sum(map(len, self.texts)) + sum(map(len, self.pairs))


@dataclass(frozen=True)
class Admitted:
    principal: Principal
    spec: ModelSpec
    output: str
    encoded: list[Encoded]
    tokenize_ms: float
    tenant_model: TenantModel | None = None  # set when `spec` is the caller's own model on a served base
    charged: bool = False                    # a quota token was taken for it
    pair_rows: tuple[tuple[int, int], ...] = ()  # text pairs scored by an embedding model: `encoded` holds
    #                                              each distinct text once, and these are each pair's two rows

    @property
    def paired(self) -> bool:
        return bool(self.pair_rows)

    @property
    def truncated(self) -> list[bool]:
        return [e.truncated for e in self.encoded]

    @property
    def model_output(self) -> str:
        """What the model computes: a pair's score is folded from its two texts' embeddings (pair_scores)."""
        return EMBED if self.paired else self.output


@dataclass(frozen=True)
class Answer:
    """A call's answer for an edge other than gRPC's (the HTTP/JSON one) to shape: the model, its labels,
    one float32 row a text (its embedding, or its probabilities over `labels`) and each text's tokens. Text pairs
    scored by an embedding model have one cosine similarity a pair instead of rows, and both texts' tokens."""

    model: str
    labels: list[str]
    rows: np.ndarray
    num_tokens: list[int]
    pair_scores: list[float] | None = None
    tokenize_ms: float = 0.0   # where its time went: the gateway's tokenizing, the scheduler's queue, the forward pass
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    policy: str = ""           # the policy of the deployment that served it
    exit_layers: list[int] | None = None   # early_exit: each text's releasing layer (0: the full model)
    indices: list[int] | None = None       # an exit event's texts, which `rows` hold (None: every text, in order)


def api_key_from(metadata: Iterable[tuple[str, str]] | None) -> str | None:
    """The caller's API key: `x-api-key: KEY`, or `authorization: Bearer KEY` (what OpenAI's clients send), from
    gRPC metadata or HTTP headers (names in lower case)."""
    for key, value in metadata or ():
        if key == "x-api-key":
            return value
        if key == "authorization" and value.lower().startswith("bearer "):
            return value[7:].strip()
    return None


def peer_host(peer: str) -> str:
    """The client's address without its port, from grpc's `ipv4:1.2.3.4:5678` / `ipv6:[::1]:5678` form."""
    kind, _, rest = peer.partition(":")
    return f"{kind}:{rest.rsplit(':', 1)[0]}" if kind in ("ipv4", "ipv6") else peer


class FailedKeyLimit:
    """Invalid API keys presented from one address within a window. Past `limit`, that address's calls are refused
    before their key is looked up, until the window ends: keys cannot be guessed at the gateway's speed. A missing
    key is not counted (it guesses nothing). Clients behind one NAT share the count: `limit` 0 turns it off."""

    def __init__(self, limit: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.window_s, self.clock = limit, window_s, clock
        self._failures: ExpiringCache[str, list[float]] = ExpiringCache(window_s, clock)   # host -> [count, ends]

    def check(self, peer: str) -> None:
        entry = self._failures.get(peer_host(peer)) if self.limit and peer else None
        if entry is not None and entry[0] >= self.limit:
            wait_s = max(entry[1] - self.clock(), 0.0)
            raise ResourceExhausted(f"{entry[0]:.0f} invalid API keys from this address within {self.window_s:g} s, "
                                    f"the limit (ACADEMUS_AUTH_FAILURE_LIMIT={self.limit}); try again in "
                                    f"{wait_s:.0f} s", pushback_ms=round(wait_s * 1e3))

    def failed(self, peer: str) -> None:
        if not (self.limit and peer):
            return
        host = peer_host(peer)
        entry = self._failures.get(host)
        if entry is None:
            self._failures.put(host, [1, self.clock() + self.window_s])
        else:
            entry[0] += 1   # in place: the window keeps its end


class Authenticator:
    """API key -> principal via Redis (SHA-256 of the key); verified keys are cached briefly."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, cache_s: float,
                 clock: Callable[[], float] = time.monotonic, failures: FailedKeyLimit | None = None,
                 absence: RedisAbsence | None = None) -> None:
        self.redis, self.keys = redis, keys
        self._cache: ExpiringCache[str, Principal] = ExpiringCache(cache_s, clock)
        self._forgotten = 0   # forget() calls: a record read before one may be of a key revoked since
        self.absence = absence or RedisAbsence(clock)   # Redis failed lately: keys verified before are served
        self.failures = failures or FailedKeyLimit(0, 60.0, clock)

    async def authenticate(self, api_key: str | None, peer: str = "") -> Principal:
        """`peer`: the caller's address as grpc gives it ("": not limited, an in-process caller)."""
        if not api_key:
            raise Unauthenticated("missing API key: send it as `x-api-key` (or `authorization: Bearer`) metadata")
        self.failures.check(peer)
        principal = self._cache.get(api_key)
        if principal is not None:
            return principal
        forgotten = self._forgotten
        # Redis is coordination, not the request path: a key verified lately goes on working while it is away
        # (a revocation clears them all first: forget())
        stale = self._cache.stale(api_key, STALE_KEY_S)
        if stale is not None and self.absence.away():
            return stale
        try:
            record = await self.redis.hgetall(self.keys.api_key(api_key))
        except RedisError:
            self.absence.failed()
            if stale is not None:
                return stale
            raise
        if not record:
            self.failures.failed(peer)
            raise Unauthenticated("invalid API key")
        principal = Principal(record["tenant"], record.get("role", "tenant"))
        if forgotten == self._forgotten:
            self._cache.put(api_key, principal)
        return principal

    def forget(self) -> None:
        """Drops every verified key: a key may have been revoked (the events channel said so), and the next
        call of each key asks Redis again."""
        self._cache.clear()
        self._forgotten += 1


class Catalogue:
    """Model name -> ModelSpec as registered by workers; re-read on a miss, at most every MISS_READ_S."""

    MISS_READ_S = 0.1

    def __init__(self, redis: aioredis.Redis, keys: Keys, clock: Callable[[], float] = time.monotonic) -> None:
        self.redis, self.keys, self.clock = redis, keys, clock
        self.models: dict[str, ModelSpec] = {}
        self._read_at = float("-inf")      # when the last finished read began
        self._miss_read = asyncio.Lock()

    async def refresh(self) -> None:
        started = self.clock()
        raw = await self.redis.hgetall(self.keys.models())
        self.models = {name: ModelSpec.from_json(spec) for name, spec in raw.items()}
        self._read_at = max(self._read_at, started)

    async def find(self, name: str) -> ModelSpec | None:
        """The model, from a read at most MISS_READ_S old on a miss (a tenant model's name misses every time:
        it does not wait)."""
        if name not in self.models and self.clock() - self._read_at > self.MISS_READ_S:
            await self.refresh()
        return self.models.get(name)

    async def find_registered(self, name: str, missed_at: float) -> ModelSpec | None:
        """The model from a read begun after `missed_at`: before a name is answered NOT_FOUND, a worker that
        registered it just before the request must be seen. One such read at a time, at most one every
        MISS_READ_S; a miss waiting behind one that began after it uses that one."""
        async with self._miss_read:
            if name not in self.models and self._read_at <= missed_at:
                await asyncio.sleep(max(0.0, self._read_at + self.MISS_READ_S - self.clock()))
                await self.refresh()
        return self.models.get(name)

    def not_found(self, name: str) -> NotFound:
        """The one answer for a name the caller cannot use, whether or not another tenant has a model so named."""
        known = ", ".join(sorted(self.models)) or "none"
        return NotFound(f"model {name!r} not found; served models: {known}")


class TenantModels:
    """A tenant's own models by name, cached briefly (as verified keys are): a tenant model's request
    costs no more Redis reads than a served model's."""

    def __init__(self, registry: TenantRegistry, cache_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self._cache: ExpiringCache[tuple[str, str], TenantModel] = ExpiringCache(cache_s, clock)

    async def get(self, tenant: str, name: str) -> TenantModel | None:
        model = self._cache.get((tenant, name))
        if model is not None:
            return model
        model = await self.registry.model(tenant, name)
        if model is not None and model.status == READY:   # one training is answered READY as soon as it is
            self._cache.put((tenant, name), model)
        return model


def resolve_output(spec: ModelSpec, wanted: str, paired: bool = False) -> str:
    if paired:   # pair_plan let pairs through to an embedding model only
        if wanted not in ("", SCORE):
            raise InvalidArgument(f"output={wanted}: model {spec.name!r} answers a text pair with one score, the "
                                  "cosine similarity of the two texts' embeddings (output=score)")
        return SCORE
    if not wanted:
        return LABEL if spec.kind == CLASSIFICATION else EMBED
    if wanted in (LABEL, SCORE) and spec.kind == EMBEDDING:
        raise InvalidArgument(f"output={wanted}: model {spec.name!r} is an embedding model; use output=embedding "
                              "(or, for a score, send text pairs)")
    return wanted


@dataclass(frozen=True)
class PairPlan:
    """Text pairs an embedding model scores: each distinct text once (a query scored against many
    candidates is embedded once), and each pair's two rows among them."""

    texts: list[str]
    rows: tuple[tuple[int, int], ...]

    def field(self, row: int) -> str:
        """The input field a row's text came from, to name it in a refusal."""
        return next(f"inputs[{i}].{'text' if a == row else 'text_pair'}"
                    for i, (a, b) in enumerate(self.rows) if row in (a, b))


def first_without_pair(call: InferCall) -> int | None:
    """The first input whose text_pair is empty (None: every input has one)."""
    return next((i for i, (_, pair) in enumerate(itertools.zip_longest(call.texts, call.pairs, fillvalue=""))
                 if not pair), None)


def pair_plan(spec: ModelSpec, call: InferCall, max_inputs: int) -> PairPlan | None:
    """The call's pairs, when an embedding model scores them (else None). An embedding model scores pairs as a
    bi-encoder does (each text embedded alone, then their cosine), the way all-MiniLM-L6-v2 is meant to. A classifier
    of pairs (a cross-encoder) reads each text with its pair, as one input, and takes pairs only; any other
    classifier was trained on single texts, so a pair would get an answer its head never learned to give."""
    if spec.pairs:
        if (missing := first_without_pair(call)) is not None:
            raise InvalidArgument(f"inputs[{missing}].text_pair is empty: model {spec.name!r} classifies text pairs "
                                  "(a cross-encoder); send each text with its pair")
        return None
    if not any(call.pairs):
        return None
    pairs = list(itertools.zip_longest(call.texts, call.pairs, fillvalue=""))
    if spec.kind != EMBEDDING:
        first = next(i for i, (_, pair) in enumerate(pairs) if pair)
        raise InvalidArgument(f"inputs[{first}].text_pair: model {spec.name!r} classifies single texts; it was "
                              "not trained on text pairs")
    if (missing := first_without_pair(call)) is not None:
        raise InvalidArgument(f"inputs[{missing}].text_pair is empty: a request scores text pairs or embeds single "
                              "texts, not both")
    row: dict[str, int] = {}
    for text in [*call.texts, *call.pairs]:
        row.setdefault(text, len(row))
    if len(row) > max_inputs:
        raise InvalidArgument(f"inputs has {len(pairs)} text pairs, {len(row)} distinct texts to embed; the limit "
                              f"is {max_inputs} texts per request")
    return PairPlan(list(row), tuple((row[text], row[pair]) for text, pair in pairs))


def pair_scores(embeddings: np.ndarray, pair_rows: Sequence[tuple[int, int]]) -> list[float]:
    """The cosine similarity of each pair, from the embeddings (rows) of its two texts."""
    rows = np.asarray(embeddings, dtype=np.float64)
    a, b = rows[[i for i, _ in pair_rows]], rows[[j for _, j in pair_rows]]
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return ((a * b).sum(axis=1) / np.maximum(norms, 1e-12)).tolist()


class Tokenizers:
    """The teacher's tokenizer, used by every bundled model, and each user's model's own: its tokenizer.json,
    put in Redis by the workers under its sha256, read once."""

    def __init__(self, teacher: TeacherTokenizer, redis: aioredis.Redis, keys: Keys) -> None:
        self.teacher, self.redis, self.keys = teacher, redis, keys
        self._own: dict[tuple[str, int], TeacherTokenizer] = {}

    async def get(self, spec: ModelSpec) -> TeacherTokenizer:
        if not spec.tokenizer:
            return self.teacher
        found = self._own.get((spec.tokenizer, spec.max_tokens))
        if found is None:
            raw = await self.redis.get(self.keys.tokenizer(spec.tokenizer))
            if raw is None:
                raise Unavailable(f"model {spec.name!r}: its tokenizer is not in Redis (a worker puts it there as "
                                  "it registers the model)")
            found = TeacherTokenizer.from_json(raw, spec.max_tokens, self.teacher.ascii_path)   # as the operator set it
            self._own[(spec.tokenizer, spec.max_tokens)] = found
        return found


class Gateway:
    def __init__(self, config: GatewayConfig, tokenizer: TeacherTokenizer, auth: Authenticator,
                 catalogue: Catalogue, tenant_models: TenantModels | None = None,
                 quotas: Quotas | None = None, schedulers: SchedulerDirectory | None = None) -> None:
        self.config, self.auth, self.catalogue = config, auth, catalogue
        redis, keys = catalogue.redis, catalogue.keys
        self.tokenizers = Tokenizers(tokenizer, redis, keys)
        self.tenant_models = tenant_models or TenantModels(TenantRegistry(redis, keys), config.auth_cache_s)
        self.quotas = quotas or Quotas(redis, keys)
        self.schedulers = schedulers
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    async def off_loop(self, size: int, work: Callable[[], T]) -> T:
        """`work`'s result: on the tokenizing thread when `size` (characters, or ids) is past OFF_LOOP_CHARS, else here,
        where a small call costs less than a thread's hand-off."""
        if size < OFF_LOOP_CHARS:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, work)

    async def admit(self, api_key: str | None, call: InferCall, policy: str = "", peer: str = "") -> Admitted:
        """Everything before the scheduler: authenticates, checks limits, resolves the model, refuses at
        the edge while every deployment serving it is full, tokenizes, and takes the quota token last: the
        tenant pays neither for the node's lack of room nor for a request refused as invalid."""
        principal = await self.auth.authenticate(api_key, peer)
        check_policy(policy)
        self.check_inputs(call)
        spec, tenant_model = await self.resolve(principal, call.model)
        plan = pair_plan(spec, call, self.config.max_inputs)
        output = resolve_output(spec, call.output, plan is not None)
        if self.schedulers is not None:
            try:
                self.schedulers.refuse_if_full(tenant_model.base if tenant_model else spec.name, policy)
            except ResourceExhausted:
                # Refused untokenized, so that refusals stay cheap under overload; but a text past the token limit
                # (truncate=false) is the caller's to fix, not to retry: INVALID_ARGUMENT wins.
                if not call.truncate:
                    await self.off_loop(call.chars, functools.partial(self.tokenize, call, plan,
                                                                      await self.tokenizers.get(spec)))
                raise
        tokenizer = await self.tokenizers.get(spec)
        start = time.perf_counter()
        # a text over the limit is refused before the token is taken
        encoded = await self.off_loop(call.chars, functools.partial(self.tokenize, call, plan, tokenizer))
        tokenize_ms = (time.perf_counter() - start) * 1e3
        charged = await self.quotas.take(principal.tenant)
        return Admitted(principal, spec, output, encoded, tokenize_ms, tenant_model, charged,
                        plan.rows if plan else ())

    async def give_back(self, admitted: Admitted) -> None:
        """The request was refused downstream for want of capacity (see `for_want_of_room`): its quota
        token goes back."""
        if admitted.charged:
            await self.quotas.give_back(admitted.principal.tenant)

    async def list_models(self, api_key: str | None, peer: str = "") -> tuple[list[ModelSpec], list[TenantModel]]:
        """What the caller may name: the served models, from a fresh read (a listing is rare; a stale one would
        omit a model just registered), and the caller's own tenant models, whatever their status. It costs a
        quota token, as a request does."""
        principal = await self.auth.authenticate(api_key, peer)
        await self.quotas.take(principal.tenant)
        await self.catalogue.refresh()
        served = [self.catalogue.models[name] for name in sorted(self.catalogue.models)]
        return served, await self.tenant_models.registry.models(principal.tenant)

    async def describe(self, api_key: str | None, name: str, peer: str = "") -> ModelSpec:
        """The spec of a model the key may name (a tenant model's on its base): what it answers, before a call."""
        spec, _ = await self.resolve(await self.auth.authenticate(api_key, peer), name)
        return spec

    async def tokens(self, api_key: str | None, model: str, texts: Sequence[str], add_special_tokens: bool = True,
                     peer: str = "", field: str = "texts") -> list[list[Token]]:
        """Each text's tokens by the model's own tokenizer, untruncated (TEI's /tokenize), at most MAX_TOKENS_ANSWERED
        in all. A request's limits on texts and characters hold, named as the caller's `field`, and it costs a quota
        token, as a request does."""
        principal = await self.auth.authenticate(api_key, peer)
        self.check_count(len(texts), field, "text")
        for i, text in enumerate(texts):
            self.check_length(f"{field}[{i}]", text)
        spec, _ = await self.resolve(principal, model)
        tokenizer = await self.tokenizers.get(spec)
        await self.quotas.take(principal.tenant)
        try:
            return await self.off_loop(sum(map(len, texts)), functools.partial(
                tokenizer.tokens, texts, add_special_tokens, MAX_TOKENS_ANSWERED))
        except TooManyTokens as e:
            raise InvalidArgument(f"{field}: {e}; send fewer or shorter texts") from e

    async def decode(self, api_key: str | None, model: str, ids: Sequence[Sequence[int]],
                     skip_special_tokens: bool = True, peer: str = "", field: str = "texts[{i}].ids") -> list[str]:
        """The text of each list of token ids by the model's own tokenizer (TEI's /decode), at most
        MAX_TOKENS_ANSWERED ids in all. Ids it does not have are refused, naming the first as the caller's `field`
        does (a template of the list's index `i`). It costs a quota token, as a request does."""
        principal = await self.auth.authenticate(api_key, peer)
        lists = field.split("[{i}]")[0]
        self.check_count(len(ids), lists, "list of ids")
        if (total := sum(len(sequence) for sequence in ids)) > MAX_TOKENS_ANSWERED:
            raise InvalidArgument(f"{lists} hold {total} ids; a request holds at most {MAX_TOKENS_ANSWERED}")
        spec, _ = await self.resolve(principal, model)
        tokenizer = await self.tokenizers.get(spec)
        vocab = tokenizer.vocab_size
        for i, sequence in enumerate(ids):
            if sequence and (min(sequence) < 0 or max(sequence) >= vocab):   # then find which, to name it
                j = next(j for j, token in enumerate(sequence) if not 0 <= token < vocab)
                raise InvalidArgument(f"{field.format(i=i)}[{j}] is {sequence[j]}: model {spec.name!r}'s tokenizer "
                                      f"has ids 0 to {vocab - 1}")
        await self.quotas.take(principal.tenant)
        return await self.off_loop(total, functools.partial(tokenizer.decode, ids, skip_special_tokens))

    async def resolve(self, principal: Principal, name: str) -> tuple[ModelSpec, TenantModel | None]:
        """A served model by that name, else the caller's own tenant model (never another tenant's)."""
        missed_at = self.catalogue.clock()
        spec = await self.catalogue.find(name)
        if spec is not None:
            return spec, None
        model = await self.tenant_models.get(principal.tenant, name)
        if model is None:
            spec = await self.catalogue.find_registered(name, missed_at)
            if spec is not None:
                return spec, None
            raise self.catalogue.not_found(name)
        if model.status != READY:  # training takes minutes, a failed one never serves: not worth a retry
            raise FailedPrecondition(f"model {name!r} is {model.status}, not ready to serve")
        base = await self.catalogue.find(model.base)
        if base is None:
            raise Unavailable(f"model {name!r}: its base model {model.base!r} is not served now")
        return model.spec(base), model

    def check_inputs(self, call: InferCall) -> None:
        self.check_count(len(call.texts), "inputs", "text")
        for i, (text, pair) in enumerate(itertools.zip_longest(call.texts, call.pairs, fillvalue="")):
            if not text.strip():
                raise InvalidArgument(f"inputs[{i}].text is empty")
            if pair and not pair.strip():   # no pair is "", a blank one is a mistake
                raise InvalidArgument(f"inputs[{i}].text_pair is blank")
            self.check_length(f"inputs[{i}].text", text)
            self.check_length(f"inputs[{i}].text_pair", pair)

    def check_count(self, count: int, field: str, what: str) -> None:
        """At least one entry, and at most a request's (ACADEMUS_MAX_INPUTS)."""
        if not count:
            raise InvalidArgument(f"{field} is empty: send at least one {what}")
        if count > self.config.max_inputs:
            raise InvalidArgument(f"{field} has {count} entries; the limit is {self.config.max_inputs} per request")

    def check_length(self, field: str, text: str) -> None:
        """At most ACADEMUS_MAX_TEXT_CHARS characters, checked before anything tokenizes it."""
        if len(text) > self.config.max_text_chars:
            raise InvalidArgument(f"{field} has {len(text)} characters; the limit is {self.config.max_text_chars}")

    def tokenize(self, call: InferCall, plan: PairPlan | None = None,
                 tokenizer: TeacherTokenizer | None = None) -> list[Encoded]:
        """Token ids of each text (with its pair framed as one sequence, when the model does not score
        pairs); scoring pairs, of the plan's distinct texts, each alone. `tokenizer`: the model's (default:
        the teacher's)."""
        tokenizer = tokenizer or self.tokenizers.teacher
        try:
            if plan is not None:
                return tokenizer.encode(plan.texts, truncate=call.truncate)
            return tokenizer.encode(call.texts, list(call.pairs) if any(call.pairs) else None,
                                    truncate=call.truncate)
        except TextTooLong as e:
            if plan is not None:
                field = plan.field(e.index)
            elif any(call.pairs):   # a classifier of pairs: the text and its pair are one input
                field = f"inputs[{e.index}] (its text and text_pair together)"
            else:
                field = f"inputs[{e.index}].text"
            raise InvalidArgument(f"{field} has {e.count} tokens; the limit is {e.limit} "
                                  "tokens (truncate=false)") from e


def for_want_of_room(error: ServingError) -> bool:
    """A refusal for the node's lack of room, where nothing ran: a full queue, no live scheduler, or a
    queue too long for the deadline on arrival. Another deployment may take the request (route), and
    the tenant does not pay for it (Gateway.give_back)."""
    return isinstance(error, (ResourceExhausted, Unavailable)) or error.nothing_ran


def check_policy(policy: str) -> str:
    """A request may name the deployment's policy; an unknown name is the caller's mistake."""
    if policy and policy not in POLICY_NAMES:
        raise InvalidArgument(f"policy {policy!r} is not a policy; known: {', '.join(POLICY_NAMES)} (or empty: any)")
    return policy


Answers = Callable[[str], Awaitable[bool]]   # whether the scheduler at an address answered its health check


@dataclass(slots=True)
class SentCall:
    """A request in flight to a scheduler: when it was sent, and what another deployment would need to serve."""

    sent_at: float
    model: str
    policy: str


@dataclass(frozen=True)
class Deployment:
    """A live scheduler: its address, dispatch policy and models (empty: every model). A node's scheduler
    also registers the models its node has live groups for (`serving`; None: it serves the whole mesh)."""

    address: str
    policy: str = ""
    models: ModelSelection = EVERY_MODEL
    serving: frozenset[str] | None = None

    def serves(self, model: str, policy: str = "") -> bool:
        return (model in self.models and (self.serving is None or model in self.serving)
                and (not policy or policy == self.policy))


class SchedulerDirectory:
    """Live schedulers (deployments) from Redis: a request goes to the one serving the model (and the
    policy, when the request names one) with the fewest of this gateway's requests in flight, ties taken
    round-robin: the paper's global dispatcher. It spreads a deployment's load over its shards as they
    answer rather than in turn, so a shard of fewer or slower groups is sent less; one that answered
    UNAVAILABLE is tried after the others for DOWN_S. A scheduler that refused a model's request for a full
    queue (in requests, or in time: its wait bound) is sent nothing more of that model until its pushback
    hint has passed (when `honour_pushback`): the queue holds more work than it should wait for, and
    refusing here spares the hop and the scheduler's loop. Per model: one deployment's student groups
    may each serve a model of their own, with its own queue ahead. A scheduler that leaves its health check
    unanswered (`give_up_hung`) is hung: its calls go to another deployment and it is picked last until it answers."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, honour_pushback: bool = True,
                 clock: Callable[[], float] = time.monotonic, answers: Answers | None = None,
                 hang_s: float = 1.0) -> None:
        self.redis, self.keys, self.honour_pushback, self.clock = redis, keys, honour_pushback, clock
        self.answers, self.hang_s = answers, hang_s
        # address -> this gateway's calls sent and not answered, oldest first: how full it is, and what to give up
        self._calls: dict[str, dict[asyncio.Task, SentCall]] = {}
        self._hung: set[str] = set()   # addresses that left a health check unanswered, until one answers
        self._given_up: set[asyncio.Task] = set()   # calls cancelled as their scheduler's, to be sent elsewhere
        self.deployments: list[Deployment] = []
        self._next = itertools.count()
        self._full_until: dict[tuple[str, str], float] = {}   # (address, model) -> when its pushback hint ends
        self._down_until: dict[str, float] = {}   # address -> until when it is tried last (it said UNAVAILABLE)
        self._served_at: dict[str, float] = {}    # model -> when a scheduler last answered one of its requests
        # (model, policy) -> the deployments' addresses serving it, until the next registry read: asked twice a
        # request (the edge refusal, then the pick); keyed by catalogue models and known policies only
        self._serving: dict[tuple[str, str], tuple[str, ...]] = {}
        self._refreshed_at = float("-inf")
        self._reading: asyncio.Future[None] | None = None   # the registry read under way, shared by its callers

    @property
    def addresses(self) -> list[str]:
        return [d.address for d in self.deployments]

    async def refresh(self) -> None:
        """The live deployments from Redis; unreachable, Unavailable (nothing ran: the quota token goes back).
        Callers meanwhile share one read: a scheduler's death fails every request in flight to it at once, and a
        read each would cost the gateway's core while that scheduler restarts beside it."""
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read_registry())
            self._reading.add_done_callback(self._read_done)
        await asyncio.shield(self._reading)   # a caller that leaves does not cancel the others' read

    def _read_done(self, reading: asyncio.Future[None]) -> None:
        self._reading = None
        if not reading.cancelled():
            reading.exception()   # retrieved: every caller may have left

    async def _read_registry(self) -> None:
        try:
            ids = sorted(await self.redis.smembers(self.keys.schedulers()))
            found = [await self.redis.hgetall(self.keys.scheduler(i)) for i in ids]
        except RedisError as e:
            raise Unavailable(f"the scheduler registry is unreachable: {e}") from e
        self._refreshed_at = self.clock()
        self.deployments = [Deployment(f["address"], f.get("policy", ""), ModelSelection.parse(f.get("models", "")),
                                       frozenset(split_names(f["serving"])) if "serving" in f else None)
                            for f in found if f.get("address")]
        self._serving = {}
        live = set(self.addresses)   # a scheduler gone with nothing in flight is forgotten
        self._down_until = {a: t for a, t in self._down_until.items() if a in live}
        self._hung &= live
        self._calls = {a: calls for a, calls in self._calls.items() if calls or a in live}

    async def pick(self, exclude: frozenset[str] = frozenset(), model: str = "", policy: str = "") -> str:
        candidates = self.serving(model, policy, exclude)
        if not candidates and self.clock() - self._refreshed_at >= MISS_REFRESH_S:
            await self.refresh()   # the list may be older than a scheduler (or a node's groups) serving it now
            candidates = self.serving(model, policy, exclude)
        if not candidates:
            wanted = f" with policy {policy!r}" if policy else ""
            raise Unavailable(f"no live scheduler serves model {model!r}{wanted}")
        open_ = self._open(candidates, model)
        now = self.clock()
        # one that answered UNAVAILABLE (e.g. a shard whose only group was lost) answers at once, so it
        # would look the emptiest and draw every request: it is tried last for a while
        up = [a for a in open_ if self._down_until.get(a, now) <= now and a not in self._hung] or open_
        start = next(self._next) % len(up)
        return min(up[start:] + up[:start], key=self._in_flight)

    def _in_flight(self, address: str) -> int:
        calls = self._calls.get(address)
        return len(calls) if calls else 0

    def serving(self, model: str, policy: str = "",
                exclude: frozenset[str] | set[str] = frozenset()) -> Sequence[str]:
        """Addresses of the live deployments that serve the model (and policy), less `exclude`."""
        found = self._serving.get((model, policy))
        if found is None:
            found = self._serving[model, policy] = tuple(d.address for d in self.deployments
                                                         if d.serves(model, policy))
        return [a for a in found if a not in exclude] if exclude else found

    def refuse_if_full(self, model: str, policy: str = "") -> None:
        """The edge refusal, before anything is spent on the request (its quota token included): every
        deployment serving the model is within its pushback hint. No deployment at all is left to pick()."""
        if candidates := self.serving(model, policy):
            self._open(candidates, model)

    def _open(self, candidates: Sequence[str], model: str) -> list[str]:
        """The candidates whose pushback hint has passed; none: ResourceExhausted with the soonest end."""
        now = self.clock()
        open_ = [a for a in candidates if self._full_until.get((a, model), now) <= now]
        if not open_:
            wait_ms = max(1, round((min(self._full_until[a, model] for a in candidates) - now) * 1e3))
            raise ResourceExhausted(f"every scheduler serving model {model!r} has a full queue; retry in "
                                    f"{wait_ms} ms", pushback_ms=wait_ms)
        return open_

    def push_back(self, address: str, model: str, pushback_ms: int | None) -> None:
        """The scheduler refused a request of `model` for a full queue and asked for `pushback_ms` before
        the next one."""
        if self.honour_pushback and pushback_ms:
            self._full_until[address, model] = self.clock() + pushback_ms / 1e3

    async def route(self, model: str, policy: str, deadline: float, send: Callable[[str], Awaitable[T]]) -> T:
        """Sends to a deployment serving the model, and to another while the deadline allows when it
        refused for a full queue (its pushback noted), is gone (UNAVAILABLE: nothing ran there), or
        refused on arrival for a queue too long for the deadline (`nothing_ran`). When none is left for a
        model served moments ago (a scheduler restarting), the request waits for one (`_hold`).
        `send` raises the ServingError of the scheduler's status; `deadline` is on this directory's clock."""
        tried: set[str] = set()
        holds = 0
        while True:
            try:
                address = await self.pick(frozenset(tried), model, policy)
            except Unavailable:
                if not await self._hold(model, deadline, holds):
                    raise
                tried, holds = set(), holds + 1
                continue
            task = asyncio.current_task()
            calls = self._calls.setdefault(address, {})
            calls[task] = SentCall(self.clock(), model, policy)
            try:
                answer = await send(address)
                self._served_at[model] = self.clock()
                return answer
            except ServingError as e:
                if not for_want_of_room(e):   # e.g. it ran out of time there: so would a second try
                    raise
                error = e
            except asyncio.CancelledError:
                if task not in self._given_up or task.uncancel():   # its caller's cancel too: the caller's
                    raise
                error = Unreachable(f"scheduler {address} left its health check unanswered")
            finally:
                calls.pop(task, None)
                self._given_up.discard(task)
            if isinstance(error, ResourceExhausted):
                self.push_back(address, model, error.pushback_ms)
            elif isinstance(error, Unavailable):
                self._down_until[address] = self.clock() + DOWN_S
                await self._reread(HOLD_WAIT_S)   # gone from the registry? (unreachable: the list as it was)
            tried.add(address)
            if self.clock() >= deadline:
                raise error
            if not self.serving(model, policy, tried):
                # a scheduler that answered UNAVAILABLE itself (its workers are gone) is heard at once
                if not (isinstance(error, Unreachable) and await self._hold(model, deadline, holds)):
                    raise error
                tried, holds = set(), holds + 1

    async def give_up_hung(self) -> dict[str, int]:
        """One round of the hang check: each scheduler holding a call hang_s old, or found hung before, is asked
        for its health. One silent for hang_s is hung: it is picked last, and its calls that another deployment
        could serve are cancelled and sent there (`route`), as a dead one's would be. A call is safe to send again:
        a scheduler that resumes finds it cancelled. Each hung address -> the calls given up this round."""
        if self.answers is None:
            return {}
        now = self.clock()
        suspects = sorted(self._hung | {a for a, calls in self._calls.items()
                                        if calls and now - next(iter(calls.values())).sent_at >= self.hang_s})
        answered = await asyncio.gather(*(self.answers(a) for a in suspects))
        self._hung = {a for a, ok in zip(suspects, answered, strict=True) if not ok}
        return {address: self._give_up(address) for address in sorted(self._hung)}

    def _give_up(self, address: str) -> int:
        """Cancels the calls in flight to `address`, those sent while it was being checked too (silent throughout
        the check, it held them as well); those only it serves stay."""
        given_up = 0
        for task, call in list(self._calls.get(address, {}).items()):
            if (task not in self._given_up and not task.done()
                    and self.serving(call.model, call.policy, {address})):
                self._given_up.add(task)
                task.cancel()
                given_up += 1
        return given_up

    async def _hold(self, model: str, deadline: float, holds: int) -> bool:
        """No scheduler can take a request of `model` now. If one served it within HOLD_S, one is likely
        restarting (a supervised scheduler serves again 0.7 s after it died or deregistered, measured in
        docs/benchmarks/reliability.md): wait HOLD_WAIT_S, re-read the registry unless read meanwhile, and say to
        try again. False: never served lately, past the deadline, or held HOLD_S already: the caller answers now."""
        now = self.clock()
        if (now - self._served_at.get(model, float("-inf")) > HOLD_S or now + HOLD_WAIT_S >= deadline
                or holds * HOLD_WAIT_S >= HOLD_S):
            return False
        await asyncio.sleep(HOLD_WAIT_S)   # each on its own timer: a restarted scheduler meets a trickle, not a herd
        await self._reread(HOLD_WAIT_S)
        return True

    async def _reread(self, age_s: float) -> None:
        """The registry again unless read within `age_s`: a restart under load holds hundreds of requests, and a
        read each every HOLD_WAIT_S would take the core the restarting scheduler needs. Unreachable: as it was."""
        if self.clock() - self._refreshed_at >= age_s:
            with contextlib.suppress(Unavailable):
                await self.refresh()
