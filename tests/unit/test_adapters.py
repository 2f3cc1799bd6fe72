"""Tenant adapters: batched == per-tenant == each row alone, base rows untouched, the file format, JSONL
input and a quick real training run (adapter-hub style: optimized path vs reference path, save -> load)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as st_save

from academus.shared.models.adapters import (
    AdapterWeights,
    BatchedAdapters,
    encode_with_adapters,
    install_adapters,
    remove_adapters,
)
from academus.shared.models.model import TeacherEncoder, pad_batch
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.training.adapters import (
    lower_states,
    read_labelled_jsonl,
    train_adapter,
    upper_pooled,
)
from tests.conftest import write_reviews

TEXTS = [
    "a quietly devastating film that earns every one of its tears",
    "dull",
    "the plot makes no sense, the acting is wooden and the jokes land with a thud every single time",
    "a small gem",
    "neither funny nor scary, just long",
    "one of the year's best: sharp, warm and beautifully shot from start to finish",
    "ok",
]


@pytest.fixture(scope="module")
def encoder() -> TeacherEncoder:
    return TeacherEncoder.load()


@pytest.fixture(scope="module")
def tokenizer() -> TeacherTokenizer:
    return TeacherTokenizer(teacher_dir())


def make_adapter(seed: int, labels: list[str], rank: int = 16, scale: float = 0.1) -> AdapterWeights:
    """An adapter with every tensor random (a fresh one's up projection is zero, which would test nothing)."""
    adapter = AdapterWeights.init(labels, rank=rank, seed=seed)
    generator = torch.Generator().manual_seed(1000 + seed)
    for weights in adapter.layers.values():
        for key, tensor in weights.items():
            weights[key] = torch.randn(tensor.shape, generator=generator) * scale
    return adapter


def batch(tokenizer: TeacherTokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    encoded = tokenizer.encode(texts)
    return pad_batch([e.input_ids for e in encoded], [e.token_type_ids for e in encoded])


# --- application -------------------------------------------------------------------------------

def test_batched_equals_per_tenant_and_each_row_alone(encoder, tokenizer):
    tenants = [make_adapter(1, ["no", "yes"]), make_adapter(2, ["a", "b", "c"], rank=8),
               make_adapter(3, ["p", "q", "r", "s"])]
    rows = [tenants[0], None, tenants[1], tenants[2], None, tenants[0], tenants[2]]
    ids, mask, types = batch(tokenizer, TEXTS)
    with torch.no_grad():
        base = encoder(ids, mask, types)
        pooled, probs = encode_with_adapters(encoder, ids, mask, types, rows, batched=True)
        looped, looped_probs = encode_with_adapters(encoder, ids, mask, types, rows, batched=False)
    assert (pooled - looped).abs().max() <= 1e-5
    assert (probs - looped_probs).abs().max() <= 1e-5
    for b, adapter in enumerate(rows):
        n = int(mask[b].sum())
        with torch.no_grad():
            alone, alone_probs = encode_with_adapters(encoder, ids[b:b + 1, :n], mask[b:b + 1, :n],
                                                      types[b:b + 1, :n], [adapter])
        assert (pooled[b] - alone[0]).abs().max() <= 1e-5, b
        if adapter is None:
            assert (pooled[b] - base[b]).abs().max() <= 1e-6
            assert alone_probs is None and not probs[b].any()
        else:
            width = len(adapter.labels)
            assert (pooled[b] - base[b]).abs().max() > 1e-3        # the adapter does change the row
            assert (probs[b, :width] - alone_probs[0]).abs().max() <= 1e-5
            assert probs[b, :width].sum().item() == pytest.approx(1.0, abs=1e-6)
            assert not probs[b, width:].any()
    assert probs.shape == (len(rows), 4)


def test_no_adapters_batch_is_the_plain_teacher(encoder, tokenizer):
    ids, mask, types = batch(tokenizer, TEXTS[:3])
    with torch.no_grad():
        base = encoder(ids, mask, types)
        pooled, probs = encode_with_adapters(encoder, ids, mask, types, [None, None, None])
    assert probs is None
    assert (pooled - base).abs().max() <= 1e-6


def test_hooks_idle_outside_the_batch_and_removable(encoder, tokenizer):
    ids, mask, types = batch(tokenizer, TEXTS[:4])
    adapter = make_adapter(4, ["x", "y"])
    with torch.no_grad():
        base = encoder(ids, mask, types)
        injector = install_adapters(encoder)
        assert install_adapters(encoder) is injector               # one set of hooks per encoder
        seen: dict[str, torch.Tensor] = {}
        with injector.active(BatchedAdapters([adapter] * 4)):       # active here, not in another thread
            worker = threading.Thread(target=lambda: seen.update(out=encoder(ids, mask, types)))
            worker.start()
            worker.join()
            adapted = encoder(ids, mask, types)
        assert torch.equal(seen["out"], base)
        assert (adapted - base).abs().max() > 1e-3
        assert torch.equal(encoder(ids, mask, types), base)        # context left: hooks idle again
        remove_adapters(encoder)
        assert not any(layer.attention.output.dense._forward_hooks for layer in encoder.body.encoder.layer)
        assert torch.equal(encoder(ids, mask, types), base)
        pooled, _ = encode_with_adapters(encoder, ids, mask, types, [adapter] * 4)   # reinstalls
    assert (pooled - adapted).abs().max() <= 1e-6


def test_cached_lower_layers_plus_upper_equal_the_full_forward(encoder, tokenizer):
    adapter = make_adapter(5, ["x", "y"])
    ids, mask, types = batch(tokenizer, TEXTS)
    with torch.no_grad():
        full, _ = encode_with_adapters(encoder, ids, mask, types, [adapter] * len(TEXTS))
        states = lower_states(encoder.body, tokenizer.encode(TEXTS), 3, batch_size=2)
        with install_adapters(encoder).active(BatchedAdapters([adapter] * len(TEXTS), batched=False)):
            split = upper_pooled(encoder.body, states, 3)
    assert (full - split).abs().max() <= 1e-5


def test_incomplete_adapter_and_row_count_refused(encoder, tokenizer):
    adapter = make_adapter(6, ["x", "y"])
    piece = AdapterWeights.from_bytes(adapter.to_bytes(layers=[3, 4]))
    with pytest.raises(ValueError, match="lacks layers \\[5\\]"):
        BatchedAdapters([piece])
    headless = AdapterWeights.from_bytes(adapter.to_bytes(head=False))
    with pytest.raises(ValueError, match="has no head"):
        BatchedAdapters([headless]).probabilities(torch.zeros(1, 384))
    ids, mask, types = batch(tokenizer, TEXTS[:2])
    with pytest.raises(ValueError, match="1 adapters for a batch of 2"):
        encode_with_adapters(encoder, ids, mask, types, [adapter])


# --- serialization -----------------------------------------------------------------------------

def assert_same(a: AdapterWeights, b: AdapterWeights) -> None:
    assert (a.base, a.labels, a.rank, a.layer_ids) == (b.base, b.labels, b.rank, b.layer_ids)
    assert len(a.tensors()) == len(b.tensors())
    assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors(), strict=True))


def test_round_trip_and_layer_wise_pieces():
    adapter = make_adapter(7, ["ham", "spam", "eggs"], rank=4)
    loaded = AdapterWeights.from_bytes(adapter.to_bytes())
    assert_same(adapter, loaded)
    assert loaded.complete
    pieces = [AdapterWeights.from_bytes(adapter.to_bytes(layers=[i], head=False)) for i in (5, 3, 4)]
    head = AdapterWeights.from_bytes(adapter.to_bytes(layers=[], head=True))
    assert not pieces[0].complete and set(pieces[0].layers) == {5} and pieces[0].head_weight is None
    assert pieces[0].layer_ids == (3, 4, 5)                       # the piece knows the whole adapter
    assert_same(adapter, AdapterWeights.merge([*pieces, head]))
    with pytest.raises(ValueError, match="same layers \\[3\\]"):
        AdapterWeights.merge([pieces[1], pieces[1]])
    with pytest.raises(ValueError, match="different adapters"):
        AdapterWeights.merge([pieces[0], AdapterWeights.from_bytes(make_adapter(8, ["a", "b"]).to_bytes([3]))])


def test_to_copies_to_a_dtype():
    adapter = make_adapter(11, ["a", "b"])
    doubled = adapter.to("cpu", torch.float64)
    assert all(t.dtype == torch.float64 for t in doubled.tensors())
    assert all(t.dtype == torch.float32 for t in adapter.tensors())
    assert_same(adapter, AdapterWeights.from_bytes(doubled.to_bytes()))   # files are always float32


def test_file_uses_the_documented_names():
    from safetensors.torch import load

    names = {k: tuple(v.shape) for k, v in load(make_adapter(9, ["a", "b"]).to_bytes()).items()}
    assert names["layers.3.down.weight"] == (16, 384) and names["layers.5.up.weight"] == (384, 16)
    assert names["head.weight"] == (2, 384) and names["head.bias"] == (2,)
    assert len(names) == 3 * 4 + 2


def _edited(edit) -> bytes:
    from safetensors.torch import load

    adapter = make_adapter(10, ["a", "b"])
    tensors = load(adapter.to_bytes())
    meta = adapter.metadata()
    edit(tensors, meta)
    return st_save(tensors, metadata=meta)


BAD_FILES = {
    "shape": (lambda t, m: t.update({"layers.4.up.weight": torch.zeros(384, 15)}), "layers.4.up.weight has shape"),
    "name": (lambda t, m: t.update({"layers.4.gate.weight": torch.zeros(2)}), "unexpected tensor 'layers.4.gate"),
    "missing": (lambda t, m: t.pop("layers.3.down.bias"), "layer 3 lacks layers.3.down.bias"),
    "head rows": (lambda t, m: m.update(labels='["a", "b", "c"]'), "head.weight has shape \\[2, 384\\]"),
    "head half": (lambda t, m: t.pop("head.bias"), "head.weight and head.bias must come together"),
    "extra layer": (lambda t, m: m.update(layers="[3, 4]"), "layers \\[5\\], which are not among"),
    "layer range": (lambda t, m: m.update(layers="[3, 4, 5, 6]"), "subset of 0..5"),
    "format": (lambda t, m: m.pop("format"), "metadata format is None"),
    "labels": (lambda t, m: m.update(labels="not json"), "metadata is missing or malformed"),
    # a base that is not bundled needs its shape in the file
    "base": (lambda t, m: (m.update(base="bert-large"), m.pop("base_layers")), "unknown adapter base 'bert-large'"),
    "bundled shape": (lambda t, m: m.update(base_layers="12"), "base 'minilm' has 6 layers of hidden size 384"),
    "nan": (lambda t, m: t["head.bias"].fill_(float("nan")), "head.bias holds NaN"),
    "dtype": (lambda t, m: t.update({"head.bias": torch.zeros(2, dtype=torch.long)}), "head.bias has dtype"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_files_refused(case):
    edit, message = BAD_FILES[case]
    with pytest.raises(ValueError, match=message):
        AdapterWeights.from_bytes(_edited(edit))


@pytest.mark.parametrize("data", [b"", b"garbage bytes, not safetensors", b"\x10" + b"\x00" * 7 + b"{not json}"])
def test_garbage_refused(data):
    with pytest.raises(ValueError, match="not a valid safetensors adapter file"):
        AdapterWeights.from_bytes(data)


# --- JSONL input and training ------------------------------------------------------------------

def write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_read_labelled_jsonl(tmp_path):
    path = write_lines(tmp_path / "ok.jsonl", [b'{"text": "good", "label": "pos"}', b"",
                                               '{"text": "mauvais \u00e9t\u00e9", "label": 0}'.encode()])
    assert read_labelled_jsonl(path) == (["good", "mauvais \u00e9t\u00e9"], ["pos", "0"])


@pytest.mark.parametrize(("line", "message"), [
    (b'{"text": "caf\xe9", "label": "a"}', ":2: not valid UTF-8"),
    (b'{"text": "x", "label": ', ":2: not valid JSON"),
    (b'["x", "a"]', ":2: expected a JSON object"),
    (b'{"text": "x"}', ":2: missing field 'label'"),
    (b'{"label": "a"}', ":2: missing field 'text'"),
    (b'{"text": "", "label": "a"}', ':2: "text" must be a non-empty string'),
    (b'{"text": "x", "label": true}', ':2: "label" must be'),
])
def test_read_labelled_jsonl_errors_name_the_line(tmp_path, line, message):
    path = write_lines(tmp_path / "bad.jsonl", [b'{"text": "fine", "label": "b"}', line])
    with pytest.raises(ValueError, match=message):
        read_labelled_jsonl(path)


def test_read_labelled_jsonl_needs_two_labels(tmp_path):
    path = write_lines(tmp_path / "one.jsonl", [b'{"text": "a", "label": "x"}', b'{"text": "b", "label": "x"}'])
    with pytest.raises(ValueError, match="at least 2 distinct labels"):
        read_labelled_jsonl(path)


def test_bases_and_domains_are_checked(encoder, tmp_path, monkeypatch):
    texts, labels = ["a", "b", "c", "d"], ["x", "y", "x", "y"]
    with pytest.raises(ValueError, match="unknown adapter base 'nope'"):
        train_adapter(texts, labels, base="nope", encoder=encoder)
    with pytest.raises(ValueError, match="domain 'legal': domains are PLOT overlays; base 'minilm' has no PLOT"):
        train_adapter(texts, labels, encoder=encoder, domain="legal", progress=False)
    monkeypatch.setenv("ACADEMUS_ARTIFACTS", str(tmp_path))   # no PLOT table built there
    with pytest.raises(ValueError, match=r"base 'minilm-plot' is not in the catalogue .*academus plot build"):
        train_adapter(texts, labels, base="minilm-plot", encoder=encoder, progress=False)


def test_training_beats_the_untrained_adapter(tmp_path, dataset_dir, encoder, tokenizer):
    from academus.shared.training.data import load_task
    from academus.shared.training.prepare import subsample

    task = load_task("sentiment", dataset_dir)
    path = write_reviews(tmp_path / "sentiment.jsonl", [(e.text, task.labels[e.label])
                                                         for e in subsample(task.train, 300)])
    texts, labels = read_labelled_jsonl(path)
    flags = [p.requires_grad for p in encoder.parameters()]
    adapter, summary = train_adapter(texts, labels, epochs=6, validation_fraction=0.3, encoder=encoder,
                                     tokenizer=tokenizer, progress=False)
    before, after = summary["untrained_validation"], summary["validation"]
    assert summary["counts"] == {"train": 210, "validation": 90}
    assert after["accuracy"] >= 0.65 and after["accuracy"] >= before["accuracy"] + 0.08, summary
    assert after["f1"] >= before["f1"] + 0.15, summary
    assert [p.requires_grad for p in encoder.parameters()] == flags   # the shared encoder's flags restored
    assert_same(adapter, AdapterWeights.from_bytes(adapter.to_bytes()))
    ids, mask, types = batch(tokenizer, ["a triumph, moving and funny", "a tedious, lifeless mess"])
    with torch.no_grad():
        _, probs = encode_with_adapters(encoder, ids, mask, types, [adapter, adapter])
    fresh = adapter.labels.index("fresh")
    assert probs[0, fresh] > probs[1, fresh]


def test_many_adapters_train_together_each_on_its_own_subset(encoder):
    """Batched across tenants: every adapter moves away from its start, each differently; whole
    tenants share a batch; a start adapter with other labels is refused."""
    import random

    from academus.shared.training.adapters import _tenant_batches, train_many_adapters

    texts = TEXTS * 4
    labels = ["pos", "neg", "neg", "pos", "neg", "pos", "pos"] * 4
    subsets = [[0, 1, 2, 3, 4, 5], [7, 8, 9, 10], [14, 15, 16, 17, 18]]
    start = make_adapter(3, ["neg", "pos"])
    trained = train_many_adapters(texts, labels, subsets, epochs=2, batch_size=8, encoder=encoder, progress=False,
                                  start=start)
    deltas = [(a.layers[3]["up.weight"] - start.layers[3]["up.weight"]).abs().max().item() for a in trained]
    assert all(d > 0 for d in deltas) and len({round(d, 9) for d in deltas}) == 3
    assert not any(t.requires_grad for a in trained for t in a.tensors())
    batches = _tenant_batches(subsets, 8, random.Random(0))
    assert sorted(r for b in batches for r in b) == sorted((k, i) for k, s in enumerate(subsets) for i in s)
    assert all(len({k for k, _ in b}) == 1 or len(b) <= 8 for b in batches)
    with pytest.raises(ValueError, match="start adapter labels"):
        train_many_adapters(texts, labels, subsets, encoder=encoder, progress=False, start=make_adapter(1, ["x", "y"]))
