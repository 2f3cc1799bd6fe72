"""PLOT tables with the real teacher on a tiny corpus: exactness, fallback order, index, integrity.

Expected states are computed by running the teacher's lower layers on the framed fragments directly
(SplitBert.lower), never read back through the lookup code under test.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from academus.shared.models.model import TeacherEncoder, pad_batch
from academus.shared.models.plot import InvalidTokens, PlotManifest, PlotStore, TableError, UnknownDomain, load_version
from academus.shared.models.plot.hierarchical import HierarchicalEncoder
from academus.shared.models.plot.layers import SplitBert
from academus.shared.models.plot.ngrams import MISSING, NgramIndex, pack, unpack, window_starts
from academus.shared.models.plot.store import SLOT_WEIGHTS
from academus.shared.models.plot.table import read_manifest
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.runtime.config import ConfigError, PlotConfig, load
from academus.shared.training.plot_build import BuildOptions, build, count_ngrams, most_frequent, tokenize
from tests.conftest import sample

K = 3
CLS, SEP, UNK = 101, 102, 100
ROOT_TEXTS = [
    "hello", "", "the cat sat on the mat", "a red apple fell from the tree", "she baked an apple pie",
    "the design of this phone is great", "i really like the style", "markets fell sharply today",
    "the committee approved the budget", "we need more time to finish the report",
]
DOMAIN_TEXTS = ["the cat sat on the mat", "the cat sat on the mat", "i really like the style",
                "win a free cruise now", "click here to claim your prize"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def teacher() -> TeacherEncoder:
    return TeacherEncoder.load()


@pytest.fixture(scope="module")
def lower(teacher) -> SplitBert:
    return SplitBert(teacher.body, K)


def shifted(teacher, k: int) -> SplitBert:
    """A stand-in for a further-pretrained domain model (HMI §5.1): the teacher with its first layer shifted."""
    bert = copy.deepcopy(teacher.body)
    noise = torch.randn(bert.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        bert.encoder.layer[0].output.dense.bias.add_(noise)
    return SplitBert(bert, k)


@pytest.fixture(scope="module")
def domain_lower(teacher) -> SplitBert:
    return shifted(teacher, K)


@pytest.fixture(scope="module")
def tokenizer() -> TeacherTokenizer:
    return TeacherTokenizer(teacher_dir())


def ids_of(tokenizer: TeacherTokenizer, text: str) -> list[int]:
    return tokenizer.encode([text])[0].input_ids


def words(tokenizer: TeacherTokenizer, text: str) -> list[int]:
    return ids_of(tokenizer, text)[1:-1]


@pytest.fixture(scope="module")
def table_dir(tmp_path_factory, lower, domain_lower) -> Path:
    out = tmp_path_factory.mktemp("plot")
    build(ROOT_TEXTS, out, BuildOptions(lower_layers=K, unigrams="corpus"), layers=lower)
    build(DOMAIN_TEXTS, out, BuildOptions(lower_layers=K, domain="spamlike", top_percent=50), layers=domain_lower)
    return out


@pytest.fixture(scope="module")
def store(table_dir) -> PlotStore:
    return PlotStore.open(table_dir, model="minilm", lower_layers=K)


def framed_states(layers: SplitBert, fragment: list[int]) -> np.ndarray:
    """The fragment's own states when run as the builder frames it ([CLS]/[SEP] unless present)."""
    fragment = [int(t) for t in fragment]
    front, back = fragment[0] != CLS, fragment[-1] != SEP
    framed = [CLS] * front + fragment + [SEP] * back
    out = layers.lower(torch.tensor([framed]))[0].numpy()
    return out[int(front):int(front) + len(fragment)]


def one_window(store: PlotStore, fragment: list[int], domain: str = "") -> np.ndarray:
    return store.lookup(np.array(fragment), np.array([len(fragment)]), domain).states


def close(actual: np.ndarray, expected: np.ndarray) -> None:
    np.testing.assert_allclose(actual, expected, rtol=2e-3, atol=2e-3)   # the table stores fp16


# --- index ---------------------------------------------------------------------------------------

@given(st.lists(st.lists(st.integers(0, (1 << 21) - 1), min_size=3, max_size=3), min_size=1, max_size=50))
def test_pack_unpack_round_trip(grams):
    grams = np.array(grams, dtype=np.int64)
    np.testing.assert_array_equal(unpack(pack(grams), 3), grams)


def test_pack_keeps_order_of_ids_apart():
    assert pack(np.array([[1, 2, 3]]))[0] != pack(np.array([[3, 2, 1]]))[0]
    with pytest.raises(ValueError):
        pack(np.array([[1 << 21, 0, 0]]))


def test_index_finds_present_keys_and_misses_absent_ones():
    keys = np.sort(pack(np.array([[5, 6, 7], [1, 2, 3], [9, 9, 9]])))
    index = NgramIndex(keys)
    queries = pack(np.array([[1, 2, 3], [9, 9, 9], [1, 2, 4], [0, 0, 0], [9, 9, 10]]))
    rows = index.find(queries)
    np.testing.assert_array_equal(keys[rows[:2]], queries[:2])
    assert list(rows[2:]) == [MISSING] * 3
    assert index.is_valid() and not NgramIndex(keys[::-1]).is_valid()
    assert list(NgramIndex(np.zeros(0, np.uint64)).find(queries)) == [MISSING] * 5


def test_window_starts_match_a_loop():
    lengths = np.array([5, 1, 3, 2, 4])
    expected, offset = [], 0
    for n in lengths:
        expected += [offset + i for i in range(max(n - 2, 0))]
        offset += n
    assert list(window_starts(lengths, 3)) == expected
    assert list(window_starts(lengths, 2, only=lengths == 2)) == [9]


# --- build and table -------------------------------------------------------------------------------

def test_round_trip_stores_every_fragment_as_the_teacher_computes_it(store, lower):
    for name, n in (("trigram", 3), ("bigram", 2), ("unigram", 1)):
        table = store.root.tables[name]
        assert table.index.is_valid() and table.states.shape[1:] == (n, 384)
        grams = unpack(table.index.keys, n)
        for row in (0, len(table) // 2, len(table) - 1):
            close(table.states[row].astype(np.float32), framed_states(lower, list(grams[row])))


def test_root_holds_every_corpus_ngram(store):
    tokens = tokenize(ROOT_TEXTS)
    for name, n in (("trigram", 3), ("bigram", 2)):
        keys, _ = count_ngrams(tokens, n)
        assert (store.root.tables[name].find(keys) >= 0).all()
        assert len(store.root.tables[name]) == len(keys)


def test_overlay_keeps_the_most_frequent_trigrams(store):
    keys, counts = count_ngrams(tokenize(DOMAIN_TEXTS), 3)
    overlay = store.domains["spamlike"].tables["trigram"]
    assert len(overlay) == math.ceil(len(keys) * 0.5)
    kept = overlay.find(keys) >= 0
    assert counts[kept].min() >= counts[~kept].max()
    chosen, coverage = most_frequent(keys, counts, len(overlay))
    np.testing.assert_array_equal(chosen, overlay.index.keys)
    assert coverage == pytest.approx(counts[kept].sum() / counts.sum())


# --- lookup ------------------------------------------------------------------------------------------

def test_lookup_is_exact_for_inputs_of_up_to_three_tokens(store, lower, tokenizer):
    for text in ("hello", ""):
        ids = ids_of(tokenizer, text)
        assert len(ids) <= 3
        computed = lower.lower(torch.tensor([ids]))[0].numpy()
        close(one_window(store, ids), computed)


def test_aggregation_is_the_slot_weighted_mean_over_the_windows_holding_each_token(store, lower, tokenizer):
    texts = ["the cat sat on the mat", "hello", "i really like the style"]
    seqs = [ids_of(tokenizer, t) for t in texts]
    result = store.lookup(np.concatenate(seqs), np.array([len(s) for s in seqs]))
    expected = []
    for seq in seqs:                       # the reference path: one window at a time
        total, terms = np.zeros((len(seq), 384)), np.zeros(len(seq))
        for i in range(max(len(seq) - 2, 1)):
            fragment = seq[i:i + 3]
            for slot, state in enumerate(framed_states(lower, fragment)):
                total[i + slot] += SLOT_WEIGHTS[slot] * state
                terms[i + slot] += SLOT_WEIGHTS[slot]
        expected.append(total / terms[:, None])
    close(result.states, np.concatenate(expected))
    assert result.counts.root == sum(len(s) - 2 for s in seqs) and result.counts.backoff == 0
    with pytest.raises(ValueError, match="positive"):
        PlotStore(store.root, slot_weights=(1.0, 0.0, 1.0))


def test_fallback_order_domain_root_bigram_unigram(store, lower, domain_lower, tokenizer):
    both = words(tokenizer, "the cat sat")                 # in the overlay and the root
    assert not np.allclose(framed_states(domain_lower, both), framed_states(lower, both), atol=0.1)
    close(one_window(store, both, "spamlike"), framed_states(domain_lower, both))
    close(one_window(store, both), framed_states(lower, both))
    root_only = words(tokenizer, "committee approved the")
    assert (store.domains["spamlike"].tables["trigram"].find(pack(np.array([root_only]))) < 0).all()
    close(one_window(store, root_only, "spamlike"), framed_states(lower, root_only))

    red, apple, pie = words(tokenizer, "red apple pie")    # bigrams (red apple), (apple pie); no trigram
    bigrams = one_window(store, [red, apple, pie], "spamlike")
    close(bigrams[:2], framed_states(lower, [red, apple]))
    close(bigrams[2], framed_states(lower, [apple, pie])[1])

    cat = words(tokenizer, "cat")[0]                       # only the right bigram (apple pie)
    right_only = one_window(store, [cat, apple, pie])
    close(right_only[0], framed_states(lower, [cat])[0])
    close(right_only[1:], framed_states(lower, [apple, pie]))

    budget, tree = words(tokenizer, "budget tree")           # no bigram either: unigrams
    unigrams = one_window(store, [cat, budget, tree])
    for slot, token in enumerate((cat, budget, tree)):
        close(unigrams[slot], framed_states(lower, [token])[0])


def test_counts_say_which_level_answered_and_the_windows_are_cache_hits_or_misses(store, tokenizer):
    seqs = [words(tokenizer, "the cat sat"), words(tokenizer, "committee approved the"),
            words(tokenizer, "red apple pie"), [CLS, SEP]]
    hits = sample("academus_cache_hits_total", cache="plot")
    misses = sample("academus_cache_misses_total", cache="plot")
    counts = store.lookup(np.concatenate(seqs), np.array([3, 3, 3, 2]), "spamlike").counts
    assert (counts.domain, counts.root, counts.backoff, counts.short) == (1, 1, 1, 1)
    # a table answered the overlay's and the root's windows; the back-off window was a miss
    assert sample("academus_cache_hits_total", cache="plot") == hits + 2
    assert sample("academus_cache_misses_total", cache="plot") == misses + 1


def test_oov_tokens_take_unk_and_invalid_ids_are_refused(store, lower, tokenizer):
    zebra = words(tokenizer, "zebra")[0]                   # a vocabulary word the corpus never had
    result = store.lookup(np.array([CLS, zebra, SEP]), np.array([3]))
    assert result.counts.unknown_tokens == 1 and result.counts.backoff == 1
    close(result.states[1], framed_states(lower, [UNK])[0])
    with pytest.raises(InvalidTokens, match="outside the vocabulary"):
        store.lookup(np.array([CLS, 30522, SEP]), np.array([3]))
    with pytest.raises(InvalidTokens, match="lengths sum"):
        store.lookup(np.array([CLS, SEP]), np.array([3]))
    with pytest.raises(InvalidTokens, match="at least one token"):
        store.lookup(np.array([CLS, SEP]), np.array([2, 0]))
    with pytest.raises(UnknownDomain, match="nosuch"):
        store.lookup(np.array([CLS, SEP]), np.array([2]), "nosuch")


# --- integrity -----------------------------------------------------------------------------------------

@pytest.fixture
def table_copy(table_dir, tmp_path) -> Path:
    return Path(shutil.copytree(table_dir, tmp_path / "copy"))


def test_corrupt_table_is_refused(table_copy):
    states = table_copy / "root" / "trigram.states.npy"
    raw = bytearray(states.read_bytes())
    raw[-1] ^= 0xFF
    states.write_bytes(bytes(raw))
    with pytest.raises(TableError, match="sha256"):
        PlotStore.open(table_copy)


def test_truncated_table_is_refused_without_checksums(table_copy):
    keys = table_copy / "root" / "bigram.keys.npy"
    keys.write_bytes(keys.read_bytes()[:-16])
    with pytest.raises(TableError, match="bigram"):
        load_version(table_copy / "root", verify=False)


def test_table_of_another_model_or_k_is_refused(table_dir, table_copy):
    with pytest.raises(TableError, match="layer-3 states, not layer-2"):
        PlotStore.open(table_dir, lower_layers=2)
    with pytest.raises(TableError, match="built for model 'minilm', not 'bert-base'"):
        PlotStore.open(table_dir, model="bert-base")
    manifest = table_copy / "domains" / "spamlike" / "manifest.json"
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**data, "lower_layers": 2}))
    with pytest.raises(TableError, match="not layer-3"):
        PlotStore.open(table_copy)
    manifest.write_text(json.dumps({**data, "format_version": 99}))
    with pytest.raises(TableError, match="format_version 99"):
        PlotStore.open(table_copy)


def test_missing_table_names_the_build_command(tmp_path):
    with pytest.raises(TableError, match="academus plot build"):
        PlotStore.open(tmp_path)


# --- hierarchical model ------------------------------------------------------------------------------------

def test_hierarchical_equals_the_teacher_where_the_table_is_exact(store, teacher, tokenizer):
    ids = [ids_of(tokenizer, "hello")]
    emb = HierarchicalEncoder(store, teacher).pool(ids)
    with torch.no_grad():
        reference = teacher(*pad_batch(ids)[:2])
    torch.testing.assert_close(emb, reference, rtol=0, atol=2e-3)


def test_hierarchical_embeddings_keep_each_text_nearest_its_teacher_embedding(store, teacher, tokenizer):
    texts = ROOT_TEXTS[2:]
    ids = [ids_of(tokenizer, t) for t in texts]
    emb = HierarchicalEncoder(store, teacher).pool(ids)
    with torch.no_grad():
        reference = teacher(*pad_batch(ids)[:2])
    assert emb.shape == (len(texts), 384)
    torch.testing.assert_close(emb.norm(dim=1), torch.ones(len(texts)))
    assert (emb @ reference.T).argmax(dim=1).tolist() == list(range(len(texts)))


# --- config and command line -------------------------------------------------------------------------------

def test_plot_config_reads_env_and_checks_ranges(tmp_path):
    config = load(PlotConfig, env={"ACADEMUS_PLOT_DIR": str(tmp_path), "ACADEMUS_DOMAINS": "a, b",
                                   "ACADEMUS_LOWER_LAYERS": "2"})
    assert config.table_dir == tmp_path and config.domain_list == ["a", "b"] and config.lower_layers == 2
    assert load(PlotConfig, env={}).domain_list is None
    assert load(PlotConfig, env={"ACADEMUS_DOMAINS": ""}).domain_list == []
    with pytest.raises(ConfigError, match="ACADEMUS_MAX_TOKENS"):
        load(PlotConfig, env={"ACADEMUS_MAX_TOKENS": "0"})
    with pytest.raises(ConfigError, match="ACADEMUS_LOWER_LAYERS"):
        load(PlotConfig, env={"ACADEMUS_LOWER_LAYERS": "0"})


def test_cli_build_prints_the_summary_last(tmp_path, capsys):
    from academus.shared.cli.main import main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat\nhello world\n")
    out = tmp_path / "table"
    assert main(["plot", "build", "--lower-layers", "1", "--corpus", str(corpus), "--unigrams", "corpus",
                 "--threads", "1", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["entries"]["trigram"] == 8 and summary["lower_layers"] == 1
    assert summary["bytes"] == sum(p.stat().st_size for p in (out / "root").glob("*.npy"))
    assert PlotStore.open(out, lower_layers=1).root.manifest.counts == summary["entries"]
    assert main(["plot", "build", "--corpus", "no-such-corpus", "--out", str(out)]) == 1
    assert "neither a file" in capsys.readouterr().err


def test_corpora_join_with_commas_and_limit_each(tmp_path):
    from academus.shared.training.plot_build import corpus_texts

    (tmp_path / "a.txt").write_text("a1\na2\na3\n")
    (tmp_path / "b.txt").write_text("b1\nb2\n")
    assert corpus_texts(f"{tmp_path / 'a.txt'},{tmp_path / 'b.txt'}", limit=2) == ["a1", "a2", "b1", "b2"]


def test_max_bigrams_keeps_the_most_frequent(tmp_path, lower):
    texts = ["the cat sat", "the cat ran", "the cat hid", "a dog sat"]
    build(texts, tmp_path, BuildOptions(lower_layers=K, unigrams="corpus", max_bigrams=2), layers=lower)
    bigrams = PlotStore.open(tmp_path, lower_layers=K).root.tables["bigram"]
    keys, counts = count_ngrams(tokenize(texts), 2)
    assert len(bigrams) == 2
    np.testing.assert_array_equal(bigrams.index.keys, most_frequent(keys, counts, 2)[0])


def test_cli_build_registers_minilm_plot_for_a_root_under_the_artifacts(tmp_path, capsys, monkeypatch):
    from academus.shared.cli.main import main

    monkeypatch.setenv("ACADEMUS_ARTIFACTS", str(tmp_path / "artifacts"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat\n")
    assert main(["plot", "build", "--lower-layers", "1", "--corpus", str(corpus), "--unigrams", "corpus",
                 "--threads", "1", "--out", str(tmp_path / "elsewhere")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["registered"] is None
    assert not (tmp_path / "artifacts" / "models.json").exists()
    assert main(["plot", "build", "--lower-layers", "1", "--corpus", str(corpus), "--unigrams", "corpus",
                 "--threads", "1"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["registered"] == "minilm-plot"
    entry = json.loads((tmp_path / "artifacts" / "models.json").read_text())["minilm-plot"]
    assert (entry["kind"], entry["plot"], entry["lower_layers"]) == ("embedding", "plot/minilm-k1", 1)


def mapped_under(directory: Path) -> list[str]:
    """This process's memory mappings of files under `directory` (Linux /proc)."""
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if str(directory) in line]


def test_a_rebuilt_overlay_is_served_as_rebuilt_and_a_deleted_one_is_let_go(table_copy, lower, domain_lower,
                                                                           tokenizer):
    store = PlotStore.open(table_copy, model="minilm", lower_layers=K)
    both = words(tokenizer, "the cat sat")
    close(one_window(store, both, "spamlike"), framed_states(domain_lower, both))
    overlay = table_copy / "domains" / "spamlike"
    assert mapped_under(overlay)

    # Deleted and built again under the same name (DeleteDomain, CreateDomain), from the root's own layers.
    shutil.rmtree(overlay)
    build(DOMAIN_TEXTS, table_copy, BuildOptions(lower_layers=K, domain="spamlike", top_percent=50), layers=lower)
    assert store.load_domain("spamlike")
    close(one_window(store, both, "spamlike"), framed_states(lower, both))

    shutil.rmtree(overlay)
    assert not store.load_domain("spamlike") and "spamlike" not in store.domains
    with pytest.raises(UnknownDomain, match="spamlike"):
        one_window(store, both, "spamlike")
    assert not mapped_under(overlay)          # its memmaps closed with the last reference


def test_the_plot_service_announces_overlays_as_they_are_on_disk(table_copy, lower):
    from academus.services.plot.core import PlotLookup

    core = PlotLookup(PlotStore.open(table_copy, model="minilm", lower_layers=K), max_tokens=64)
    assert core.refresh_domains() == ["spamlike"]
    build(DOMAIN_TEXTS[:2], table_copy, BuildOptions(lower_layers=K, domain="legal", top_percent=100), layers=lower)
    assert core.refresh_domains() == ["legal", "spamlike"]
    shutil.rmtree(table_copy / "domains" / "spamlike")
    assert core.refresh_domains() == ["legal"] and not mapped_under(table_copy / "domains" / "spamlike")
    fixed = PlotLookup(PlotStore.open(table_copy, model="minilm", lower_layers=K, domains=[]), 64, load_new=False)
    assert fixed.refresh_domains() == []      # ACADEMUS_DOMAINS fixed the set


def test_a_root_rebuilt_while_serving_is_served_from_the_next_lookup_and_one_of_another_k_is_refused(
        table_copy, lower, teacher, tokenizer, monkeypatch):
    """`academus plot build` again over a served root: the worker's hierarchical encoder and the plot
    service's core serve the new root from their next lookup, keeping their overlays; the old store's
    lookups stay on the old build. A rebuild of another K is refused once and the loaded root kept."""
    from academus.services.plot.core import PlotLookup

    store = PlotStore.open(table_copy, model="minilm", lower_layers=K)
    encoder, core = HierarchicalEncoder(store, teacher), PlotLookup(store, max_tokens=64)
    assert store.current() is store and encoder.current_store() is store     # nothing rebuilt: one stat
    text = "zebras graze quietly"                    # none of its trigrams is in the root's corpus
    ids = ids_of(tokenizer, text)
    assert store.lookup(np.array(ids), np.array([len(ids)])).counts.root == 0

    build([*ROOT_TEXTS, text], table_copy, BuildOptions(lower_layers=K, unigrams="corpus"), layers=lower)
    assert core.refresh_domains() == ["spamlike"] and core.store is not store    # the overlay kept
    served = core.lookup(np.array(ids), np.array([len(ids)]))
    assert served.counts.root == len(ids) - 2 and served.counts.backoff == 0
    close(one_window(core.store, ids[1:4]), framed_states(lower, ids[1:4]))   # its trigrams' states ...
    rebuilt = encoder.pool([ids])
    assert encoder.store is not store and encoder.store.root_entries == core.store.root_entries
    assert encoder.store is core.store          # opened once: every holder of the old store moved to one new
    close(rebuilt.numpy(), HierarchicalEncoder(core.store, teacher).pool([ids]).numpy())
    assert store.lookup(np.array(ids), np.array([len(ids)])).counts.root == 0    # ... the old build's do not

    served_store = core.store
    build(ROOT_TEXTS, table_copy, BuildOptions(lower_layers=2, unigrams="corpus"), layers=shifted(teacher, 2))
    assert core.refresh_domains() == ["spamlike"] and core.store is served_store   # refused: K=2, not 3
    monkeypatch.setattr(PlotStore, "open", lambda *a, **k: pytest.fail("a refused root is not opened again"))
    assert served_store.current() is served_store
    assert core.lookup(np.array(ids), np.array([len(ids)])).counts.root == len(ids) - 2


def test_service_core_applies_the_request_limits(store):
    from academus.services.plot.core import PlotLookup

    core = PlotLookup(store, max_tokens=4)
    assert core.lookup(np.array([CLS, SEP]), np.array([2])).states.shape == (2, 384)
    with pytest.raises(InvalidTokens, match="limit is 4"):
        core.lookup(np.array([CLS] * 5), np.array([5]))
    with pytest.raises(InvalidTokens, match="no sequence"):
        core.lookup(np.array([], np.int64), np.array([], np.int64))


# --- bigram windows (n=2, HMI Table 8) -------------------------------------------------------------------

@pytest.fixture(scope="module")
def lower1(teacher) -> SplitBert:
    return SplitBert(teacher.body, 1)


@pytest.fixture(scope="module")
def domain_lower1(teacher) -> SplitBert:
    return shifted(teacher, 1)


@pytest.fixture(scope="module")
def bigram_dir(tmp_path_factory, lower1, domain_lower1) -> Path:
    out = tmp_path_factory.mktemp("plot-n2")
    build(ROOT_TEXTS, out, BuildOptions(lower_layers=1, unigrams="corpus", ngram=2), layers=lower1)
    build(DOMAIN_TEXTS, out, BuildOptions(lower_layers=1, domain="spamlike", top_percent=50, ngram=2),
          layers=domain_lower1)
    return out


@pytest.fixture(scope="module")
def bigram_store(bigram_dir) -> PlotStore:
    return PlotStore.open(bigram_dir, model="minilm", lower_layers=1, ngram=2)


def test_bigram_build_records_n_and_runs_no_trigrams(bigram_store, bigram_dir, table_dir, tmp_path):
    root, overlay = bigram_store.root.manifest, bigram_store.domains["spamlike"].manifest
    assert (root.ngram, overlay.ngram, bigram_store.ngram, bigram_store.slot_weights) == (2, 2, 2, (1.0, 1.0))
    assert set(root.counts) == {"bigram", "unigram"} and set(overlay.counts) == {"bigram"}
    assert "bigram_coverage" in root.corpus and "trigram_coverage" not in root.corpus
    keys, _ = count_ngrams(tokenize(ROOT_TEXTS), 2)
    assert bigram_store.root_entries == len(keys) and (bigram_store.root.tables["bigram"].find(keys) >= 0).all()
    domain_keys, _ = count_ngrams(tokenize(DOMAIN_TEXTS), 2)
    assert overlay.counts["bigram"] == math.ceil(len(domain_keys) * 0.5)
    # the manifest round trip keeps n; a manifest written before the field existed reads as n=3
    assert PlotManifest.from_json(root.to_json(), "test") == root
    assert read_manifest(bigram_dir / "root").ngram == 2
    old = Path(shutil.copytree(table_dir, tmp_path / "old"))
    data = json.loads((old / "root" / "manifest.json").read_text())
    del data["ngram"]
    (old / "root" / "manifest.json").write_text(json.dumps(data))
    assert read_manifest(old / "root").ngram == 3
    assert PlotStore.open(old, domains=[]).ngram == 3


def test_bigram_lookup_is_exact_for_inputs_of_up_to_two_tokens(bigram_store, lower1, tokenizer):
    ids = ids_of(tokenizer, "")                            # [CLS] [SEP]: one bigram window
    assert len(ids) == 2
    close(one_window(bigram_store, ids), lower1.lower(torch.tensor([ids]))[0].numpy())
    cat = words(tokenizer, "cat")[0]                       # one token: its unigram
    close(one_window(bigram_store, [cat]), framed_states(lower1, [cat]))
    counts = bigram_store.lookup(np.array([*ids, cat]), np.array([2, 1])).counts
    assert (counts.root, counts.backoff, counts.short) == (1, 0, 1)


def test_bigram_aggregation_is_the_mean_over_the_two_windows_holding_each_token(bigram_store, lower1, tokenizer):
    texts = ["the cat sat on the mat", "hello", "i really like the style"]
    seqs = [ids_of(tokenizer, t) for t in texts]
    result = bigram_store.lookup(np.concatenate(seqs), np.array([len(s) for s in seqs]))
    expected = []
    for seq in seqs:                       # the reference path: one bigram at a time, slot weights (1, 1)
        total, terms = np.zeros((len(seq), 384)), np.zeros(len(seq))
        for i in range(len(seq) - 1):
            total[i:i + 2] += framed_states(lower1, seq[i:i + 2])
            terms[i:i + 2] += 1
        expected.append(total / terms[:, None])
    close(result.states, np.concatenate(expected))
    assert result.counts.root == sum(len(s) - 1 for s in seqs) and result.counts.backoff == 0
    with pytest.raises(ValueError, match="2 positive numbers"):
        PlotStore(bigram_store.root, slot_weights=SLOT_WEIGHTS)


def test_bigram_fallback_order_domain_root_unigram(bigram_store, lower1, domain_lower1, tokenizer):
    the_cat = words(tokenizer, "the cat")                  # in the overlay and the root
    assert not np.allclose(framed_states(domain_lower1, the_cat), framed_states(lower1, the_cat), atol=0.1)
    close(one_window(bigram_store, the_cat, "spamlike"), framed_states(domain_lower1, the_cat))
    close(one_window(bigram_store, the_cat), framed_states(lower1, the_cat))
    budget, tree = words(tokenizer, "budget tree")         # no such bigram anywhere: both unigrams
    result = bigram_store.lookup(np.array([budget, tree]), np.array([2]), "spamlike")
    assert (result.counts.domain, result.counts.root, result.counts.backoff) == (0, 0, 1)
    for slot, token in enumerate((budget, tree)):
        close(result.states[slot], framed_states(lower1, [token])[0])
    zebra = words(tokenizer, "zebra")[0]                   # not even a unigram: [UNK]'s state
    result = bigram_store.lookup(np.array([CLS, zebra]), np.array([2]))
    assert result.counts.unknown_tokens == 1 and result.counts.backoff == 1
    close(result.states[1], framed_states(lower1, [UNK])[0])


def test_overlay_of_another_n_is_refused(bigram_dir, tmp_path, lower1):
    with pytest.raises(TableError, match="2-gram windows; an overlay of 3-grams"):
        build(DOMAIN_TEXTS, bigram_dir, BuildOptions(lower_layers=1, domain="tri", ngram=3), layers=lower1)
    assert not (bigram_dir / "domains" / "tri").exists()
    with pytest.raises(TableError, match="2-gram windows, not 3-grams"):
        PlotStore.open(bigram_dir, ngram=3)
    copy_dir = Path(shutil.copytree(bigram_dir, tmp_path / "copy"))
    manifest = copy_dir / "domains" / "spamlike" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "ngram": 3}))
    with pytest.raises(TableError, match="spamlike holds 3-gram windows, not 2-grams"):
        PlotStore.open(copy_dir)
    root = load_version(copy_dir / "root")
    with pytest.raises(TableError, match="overlay 'spamlike' holds 3-gram windows, not 2-grams"):
        PlotStore(root, {"spamlike": load_version(copy_dir / "domains" / "spamlike")})
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "ngram": 4}))
    with pytest.raises(TableError, match="ngram 4"):
        PlotStore.open(copy_dir)


def test_cli_build_ngram_2_and_its_overlay_follows_the_root(tmp_path, capsys):
    from academus.shared.cli.main import main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat\nhello world\n")
    out = tmp_path / "table"
    base = ["plot", "build", "--lower-layers", "1", "--corpus", str(corpus), "--unigrams", "corpus",
            "--threads", "1", "--out", str(out)]
    assert main([*base, "--ngram", "2"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["ngram"] == 2 and set(summary["entries"]) == {"bigram", "unigram"}
    assert summary["entries"]["bigram"] == 10           # 7 + 3 windows, all distinct
    assert main([*base, "--domain", "d", "--top-percent", "100"]) == 0
    overlay = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert overlay["ngram"] == 2 and set(overlay["entries"]) == {"bigram"}
    assert main([*base, "--domain", "e", "--ngram", "3"]) == 1
    assert "2-gram windows; an overlay of 3-grams" in capsys.readouterr().err
    assert main([*base, "--ngram", "2", "--max-bigrams", "3"]) == 1
    assert "use --max-entries" in capsys.readouterr().err
