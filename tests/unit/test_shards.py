"""STI's shards: the quantizer, the elastic layer against the original, the artifact's checks, the pipeline."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from academus.shared.models.embedding_rows import BLOCK_ROWS, EmbeddingRows
from academus.shared.models.model import ClassifierHead, TeacherEncoder, pad_batch
from academus.shared.models.shard_io import (
    ColdSource,
    FileSource,
    ReadAhead,
    ThrottledSource,
    address,
    io_source,
)
from academus.shared.models.shard_native import LIBRARY, NATIVE, BadShard, LoaderThread, PlanLoads
from academus.shared.models.shard_store import ShardStore, add_task, shape_key
from academus.shared.models.shards import (
    BITS,
    FULL,
    VERSIONS,
    LayerBuilder,
    LayerQuantization,
    LayerResident,
    LayerWeights,
    ShardGeometry,
    ShardWeights,
    decode_shard,
    elastic_layer,
    encode_shard,
    fit_codebook,
    key_mask,
    outlier_mask,
    pack_codes,
    shard_vector,
)
from academus.shared.models.sti_pipeline import DeadlineMissed, ElasticModel, ShardPipeline, load_layer_s
from academus.shared.models.sti_planner import Pace, Plan
from academus.shared.state.artifacts import ArtifactError, crc32
from academus.shared.training.shards import _layer_ms, profile_fidelity, write_encoder_shards


def tiny_encoder(layers: int = 2) -> TeacherEncoder:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=120, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64)
    return TeacherEncoder(BertModel(config, add_pooling_layer=False).eval())


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n", [1, 8, 13, 1000])
def test_codes_pack_and_decode_round_trip(bits: int, n: int) -> None:
    rng = np.random.default_rng(bits * 100 + n)
    values = rng.normal(0, 0.05, n).astype(np.float32)
    codebook = fit_codebook(rng.normal(0, 0.05, 4096).astype(np.float32), bits)
    outliers = np.zeros(n, dtype=bool)
    outliers[rng.choice(n, size=min(3, n), replace=False)] = True
    blob = encode_shard(values, bits, codebook, outliers)
    assert len(blob) == -(-n // 8) * bits + 8 + 8 * int(outliers.sum())
    decoded = decode_shard(blob, bits, n, codebook.pair_table(), int(outliers.sum()))
    expected = codebook.centroids[codebook.codes(values)]
    expected[outliers] = values[outliers]
    np.testing.assert_array_equal(decoded, expected)
    assert len(pack_codes(codebook.codes(values), bits)) == -(-n // 8) * bits


def test_the_c_loader_is_built() -> None:
    assert NATIVE is not None, f"make setup builds {LIBRARY} (a C compiler is needed; without it NumPy decodes)"


def _stored(geometry: ShardGeometry, bits: int, rng: np.random.Generator) -> tuple[bytes, np.ndarray | None, int]:
    """A random shard stored at `bits`, with outliers in every part: its bytes, pair table and outlier count."""
    codebook = None if bits == FULL else fit_codebook(rng.normal(0, 0.05, 4096).astype(np.float32), bits)
    values = rng.normal(0, 0.05, geometry.params).astype(np.float32)
    outliers = np.zeros(geometry.params, dtype=bool)
    outliers[rng.choice(geometry.params, size=9, replace=False)] = True
    blob = encode_shard(values, bits, codebook, outliers)
    return blob, None if codebook is None else codebook.pair_table(), 0 if bits == FULL else int(outliers.sum())


# rows of 10 and 6 weights hold no whole group of 8 codes; rows of 16 and 8 hold only whole groups (the pair table)
GEOMETRIES = {"part groups": ShardGeometry(layers=1, heads=2, hidden=10, intermediate=6),
              "whole groups": ShardGeometry(layers=1, heads=2, hidden=16, intermediate=16)}


def test_a_library_built_from_an_older_source_leaves_the_numpy_path_serving(monkeypatch) -> None:
    from isal import isal_zlib

    from academus.shared.models import shard_native

    monkeypatch.setattr(shard_native, "LIBRARY", Path(isal_zlib.__file__))    # a library without the call
    assert shard_native._load() is None


@pytest.mark.parametrize("shape", GEOMETRIES)
@pytest.mark.parametrize("bits", VERSIONS)
def test_the_c_loader_puts_a_stored_shard_where_numpy_puts_it(bits: int, shape: str) -> None:
    geometry = GEOMETRIES[shape]
    rng = np.random.default_rng(bits)
    native, numpy = (LayerBuilder([1, 0], None, geometry, native=flag) for flag in (True, False))
    for i in range(2):
        blob, table, count = _stored(geometry, bits, rng)
        native.put_stored([i], [blob], [bits], [table], [count])
        numpy.put_stored([i], [memoryview(blob)], [bits], [table], [count])
    for name in ("query", "key", "value", "output", "ffn_in", "ffn_out"):
        np.testing.assert_array_equal(getattr(native, name), getattr(numpy, name), err_msg=name)


def test_the_c_loader_puts_a_layer_of_mixed_versions_in_one_call_where_numpy_puts_it() -> None:
    """A plan's layer mixes versions: one call puts them all, each with its own table and outliers."""
    geometry = ShardGeometry(layers=1, heads=len(VERSIONS), hidden=24, intermediate=12)
    rng = np.random.default_rng(7)
    stored = [_stored(geometry, bits, rng) for bits in VERSIONS]
    places = list(range(len(VERSIONS)))[::-1]
    native, numpy = (LayerBuilder(places, None, geometry, native=flag) for flag in (True, False))
    for built in (native, numpy):
        built.put_stored(places, [s[0] for s in stored], list(VERSIONS), [s[1] for s in stored],
                         [s[2] for s in stored])
    for name in ("query", "key", "value", "output", "ffn_in", "ffn_out"):
        np.testing.assert_array_equal(getattr(native, name), getattr(numpy, name), err_msg=name)


def test_the_c_loader_refuses_bytes_that_do_not_fill_a_shard() -> None:
    geometry = ShardGeometry(layers=1, heads=2, hidden=10, intermediate=6)
    built = LayerBuilder([0], None, geometry)
    with pytest.raises(ValueError, match="1036 bytes at 32 bits with 0 outliers does not fill"):
        built.put_stored([0], [bytes(4 * geometry.params - 4)], [FULL], [None], [0])
    codebook = fit_codebook(np.linspace(-1, 1, 64, dtype=np.float32), 4)
    blob = encode_shard(np.zeros(geometry.params, np.float32), 4, codebook, np.zeros(geometry.params, bool))
    with pytest.raises(ValueError, match="at 4 bits with 1 outliers"):
        built.put_stored([0], [blob], [4], [codebook.pair_table()], [1])
    with pytest.raises(ValueError, match="at 4 bits with 0 outliers"):   # a quantized shard needs its table
        built.put_stored([0], [blob], [4], [None], [0])


def test_a_layer_with_one_bad_shard_is_refused_before_any_shard_is_put() -> None:
    geometry = ShardGeometry(layers=1, heads=2, hidden=10, intermediate=6)
    built = LayerBuilder([0, 1], None, geometry)
    built.query[:] = 7.0
    good = np.ones(geometry.params, np.float32).tobytes()
    with pytest.raises(ValueError, match="1036 bytes at 32 bits"):
        built.put_stored([0, 1], [good, good[:-4]], [FULL, FULL], [None, None], [0, 0])
    assert (built.query == 7.0).all()


@pytest.mark.parametrize("native", [True, False])
def test_a_layers_shards_are_checked_against_their_crc32_before_any_is_put(native: bool) -> None:
    """The loader checks a layer's checksums in its one call (ISA-L's CRC-32, zlib's as `crc32` computes it)."""
    geometry = ShardGeometry(layers=1, heads=2, hidden=16, intermediate=16)
    rng = np.random.default_rng(3)
    stored = [_stored(geometry, bits, rng) for bits in (6, FULL)]
    blobs, tables, counts = [s[0] for s in stored], [s[1] for s in stored], [s[2] for s in stored]
    crcs = [crc32(b) for b in blobs]
    built = LayerBuilder([0, 1], None, geometry, native=native)
    built.query[:] = 7.0
    with pytest.raises(BadShard, match="does not match its CRC-32") as refused:
        built.put_stored([0, 1], blobs, [6, FULL], tables, counts, [crcs[0], crcs[1] ^ 1])
    assert refused.value.i == 1 and (built.query == 7.0).all()
    built.put_stored([0, 1], blobs, [6, FULL], tables, counts, crcs)
    unchecked = LayerBuilder([0, 1], None, geometry, native=native)
    unchecked.put_stored([0, 1], blobs, [6, FULL], tables, counts)
    np.testing.assert_array_equal(built.query, unchecked.query)
    assert not (built.query == 7.0).any()


def _plan_loads_layers(geometry: ShardGeometry, layers: int, bits: int = 6
                       ) -> tuple[list[LayerBuilder], list[tuple[list[bytes], list, list[int], list[int]]]]:
    """A buffer a layer, zeroed, and each layer's stored shards (blobs, tables, outliers, CRC-32s)."""
    rng = np.random.default_rng(layers)
    buffers, stored = [], []
    for _ in range(layers):
        built = LayerBuilder([0, 1], None, geometry)
        built.query[:] = 0.0
        shards = [_stored(geometry, bits, rng) for _ in range(2)]
        buffers.append(built)
        stored.append(([s[0] for s in shards], [s[1] for s in shards], [s[2] for s in shards],
                       [crc32(s[0]) for s in shards]))
    return buffers, stored


def _publish(loads: PlanLoads, built: LayerBuilder, blobs: list[bytes], tables: list, counts: list[int],
             crcs: list[int]) -> None:
    """A layer of two 6-bit shards, the blobs and tables kept alive by the caller."""
    loads.publish(built.native, [0, 1], [address(b) for b in blobs], [len(b) for b in blobs], [6, 6],
                  [t.ctypes.data for t in tables], counts, crcs)


def _assert_put_as_numpy_puts(geometry: ShardGeometry, buffers: list[LayerBuilder], stored: list) -> None:
    """Each buffer holds its layer's two 6-bit shards as the NumPy loader puts them."""
    for built, (blobs, tables, counts, _) in zip(buffers, stored, strict=True):
        expected = LayerBuilder([0, 1], None, geometry, native=False)
        expected.put_stored([0, 1], blobs, [6, 6], tables, counts)
        np.testing.assert_array_equal(built.query, expected.query)
        np.testing.assert_array_equal(built.ffn_out, expected.ffn_out)


def test_the_c_loaders_thread_puts_a_plan_in_order_within_its_window() -> None:
    """At most `window` layers are put ahead of the caller's: the next waits until the caller is done with one."""
    geometry = ShardGeometry(layers=3, heads=2, hidden=16, intermediate=16)
    buffers, stored = _plan_loads_layers(geometry, 3)
    loads = PlanLoads(3, window=1)
    try:
        for built, (blobs, tables, counts, crcs) in zip(buffers, stored, strict=True):
            _publish(loads, built, blobs, tables, counts, crcs)
        loads.wait(0)
        time.sleep(0.05)                                   # room for a thread that ignored its window to run on
        assert (buffers[1].query == 0.0).all()
        loads.done()
        loads.wait(1)
        loads.done()
        loads.wait(2)
    finally:
        assert loads.finish() > 0
    _assert_put_as_numpy_puts(geometry, buffers, stored)


def test_a_kept_loader_thread_puts_plan_after_plan_and_takes_one_at_a_time() -> None:
    """One thread serves plans in turn; a plan started while another is unfinished is refused, and closing the thread
    stops a plan it is waiting on."""
    geometry = ShardGeometry(layers=2, heads=2, hidden=16, intermediate=16)
    thread = LoaderThread()
    try:
        for seed in range(3):
            buffers, stored = _plan_loads_layers(geometry, 2 + seed)
            loads = PlanLoads(len(buffers), window=1, thread=thread)
            with pytest.raises(RuntimeError, match="still loads another plan"):
                PlanLoads(1, window=0, thread=thread)
            try:
                for k, (built, (blobs, tables, counts, crcs)) in enumerate(zip(buffers, stored, strict=True)):
                    _publish(loads, built, blobs, tables, counts, crcs)
                    loads.wait(k)
                    loads.done()
            finally:
                assert loads.finish() > 0
            _assert_put_as_numpy_puts(geometry, buffers, stored)
        buffers, stored = _plan_loads_layers(geometry, 2)
        loads = PlanLoads(2, window=0, thread=thread)
        _publish(loads, buffers[0], *stored[0])
        loads.wait(0)
    finally:
        thread.close()                  # waiting on layer 1, never published
    assert (buffers[1].query == 0.0).all()
    thread.close()


def test_a_forked_child_starts_a_loader_thread_of_its_own() -> None:
    """A child forked from a process that kept a loader thread has the loader but not its thread: it starts its own,
    and dropping the parent's neither joins nor hangs."""
    import os

    from academus.shared.models.sti_pipeline import LoaderBuffers

    geometry = ShardGeometry(layers=2, heads=2, hidden=16, intermediate=16)
    buffers = LoaderBuffers()
    parents = buffers.loader_thread()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            thread = buffers.loader_thread()
            built, stored = _plan_loads_layers(geometry, 1)
            loads = PlanLoads(1, window=0, thread=thread)
            _publish(loads, built[0], *stored[0])
            loads.wait(0)
            loads.finish()
            fresh = thread is not parents
            del parents
            buffers.close()
            code = 0 if fresh and (built[0].query != 0.0).any() else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert buffers.loader_thread() is parents
    buffers.close()


def test_the_c_loaders_thread_refuses_a_bad_shard_and_puts_nothing_after_it() -> None:
    geometry = ShardGeometry(layers=3, heads=2, hidden=16, intermediate=16)
    buffers, stored = _plan_loads_layers(geometry, 3)
    loads = PlanLoads(3, window=0)
    try:
        for k, (built, (blobs, tables, counts, crcs)) in enumerate(zip(buffers, stored, strict=True)):
            _publish(loads, built, blobs, tables, counts, [crcs[0], crcs[1] ^ (k == 1)])
        loads.wait(0)
        with pytest.raises(BadShard, match="does not match its CRC-32") as refused:
            loads.wait(1)
        assert refused.value.i == 1
        with pytest.raises(RuntimeError, match="ended before layer 2"):
            loads.wait(2)
    finally:
        loads.finish()
    assert (buffers[1].query == 0.0).all() and (buffers[2].query == 0.0).all()


@pytest.mark.parametrize("published", [0, 1, 3])
def test_the_c_loaders_thread_stops_when_asked_whatever_it_waits_for(published: int) -> None:
    """Stopped waiting for a layer not yet published, or for room in its window, it ends at once."""
    geometry = ShardGeometry(layers=3, heads=2, hidden=16, intermediate=16)
    buffers, stored = _plan_loads_layers(geometry, 3)
    loads = PlanLoads(3, window=1)
    for built, (blobs, tables, counts, crcs) in list(zip(buffers, stored, strict=True))[:published]:
        _publish(loads, built, blobs, tables, counts, crcs)
    if published:
        loads.wait(0)
    assert loads.finish() >= 0
    assert (buffers[-1].query == 0.0).all()


def test_the_c_loaders_thread_reads_shards_from_their_files_through_its_staging_buffer(tmp_path: Path) -> None:
    """Shards published as (descriptor, offset) are read by the thread itself, a held one taken where it lies; reads
    that outgrow the staging buffer, or stop short at the file's end, are refused with nothing put."""
    import os

    geometry = ShardGeometry(layers=3, heads=2, hidden=16, intermediate=16)
    buffers, stored = _plan_loads_layers(geometry, 3)
    path = tmp_path / "shards"
    path.write_bytes(b"x" * 5 + b"".join(b for blobs, *_ in stored for b in blobs))
    fd = os.open(path, os.O_RDONLY)
    offsets, at = [], 5
    for blobs, *_ in stored:
        offsets.append([at, at + len(blobs[0])])
        at += sum(len(b) for b in blobs)
    largest = max(sum(len(b) for b in blobs) for blobs, *_ in stored)
    try:
        loads = PlanLoads(3, window=0, staging=np.empty(largest, np.uint8), ahead=1)
        try:
            for k, (built, (blobs, tables, counts, crcs)) in enumerate(zip(buffers, stored, strict=True)):
                reads = [(-1, 0), (fd, offsets[k][1])] if k == 0 else [(fd, o) for o in offsets[k]]
                loads.publish(built.native, [0, 1], [address(blobs[0]), 0], [len(b) for b in blobs], [6, 6],
                              [t.ctypes.data for t in tables], counts, crcs, reads)
            for k in range(3):
                loads.wait(k)
        finally:
            assert loads.finish() > 0
        _assert_put_as_numpy_puts(geometry, buffers, stored)
        blobs, tables, counts, crcs = stored[1]
        lengths = [len(b) for b in blobs]
        for staging, offset, why in ((sum(lengths) - 1, offsets[1][1], "outgrows"), (sum(lengths), at - 3, "short")):
            built = LayerBuilder([0, 1], None, geometry)
            built.query[:] = 0.0
            loads = PlanLoads(1, window=0, staging=np.empty(staging, np.uint8))
            loads.publish(built.native, [0, 1], [0, 0], lengths, [6, 6], [t.ctypes.data for t in tables], counts,
                          crcs, [(fd, offsets[1][0]), (fd, offset)])
            with pytest.raises(OSError, match="shards of layer 0 could not be read whole"):
                loads.wait(0)
            loads.finish()
            assert (built.query == 0.0).all(), why
    finally:
        os.close(fd)


def test_more_bits_quantize_closer_and_full_precision_is_exact() -> None:
    rng = np.random.default_rng(0)
    values = rng.normal(0, 0.05, 4096).astype(np.float32)
    mask = outlier_mask(values)
    errors = []
    for bits in BITS:
        codebook = fit_codebook(values[~mask], bits)
        decoded = decode_shard(encode_shard(values, bits, codebook, mask), bits, len(values),
                               codebook.pair_table(), int(mask.sum()))
        errors.append(float(np.abs(decoded - values).mean()))
    assert errors == sorted(errors, reverse=True) and errors[-1] < errors[0] / 8
    exact = decode_shard(encode_shard(values, FULL, None, mask), FULL, len(values), None, 0)
    np.testing.assert_array_equal(exact, values)


def test_a_codebook_needs_a_weight_a_cluster() -> None:
    with pytest.raises(ValueError, match="5 weights cannot fill 8 clusters"):
        fit_codebook(np.zeros(5, dtype=np.float32), 3)


def test_equal_population_clusters_and_outliers_kept_exactly() -> None:
    rng = np.random.default_rng(1)
    values = rng.normal(0, 0.02, 20000).astype(np.float32)
    values[[5, 500, 9000]] = [0.9, -0.7, 1.3]            # far outside the Gaussian
    mask = outlier_mask(values)
    assert mask[[5, 500, 9000]].all() and mask.mean() < 0.01
    codebook = fit_codebook(values[~mask], 3)
    counts = np.bincount(codebook.codes(values[~mask]), minlength=8)
    assert counts.max() - counts.min() <= 1
    assert np.all(np.diff(codebook.centroids) > 0)


def test_shards_rebuild_the_original_layer_at_full_width() -> None:
    encoder = tiny_encoder()
    geometry = ShardGeometry.of(encoder.body.config)
    ids, mask, types = pad_batch([[1, 5, 9, 7, 2], [1, 3, 2]])
    with torch.inference_mode():
        reference = encoder.body(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        hidden = encoder.body.embeddings(input_ids=ids, token_type_ids=types)
        for layer in encoder.body.encoder.layer:
            weights = [ShardWeights.from_vector(shard_vector(layer, geometry, s), geometry)
                       for s in range(geometry.heads)]
            order = [2, 0, 3, 1]                            # any order of the same shards is the same layer
            resident = LayerResident.of(layer)
            hidden = elastic_layer(hidden, key_mask(mask), resident,
                                   LayerWeights.assemble(order, [weights[s] for s in order], resident, geometry),
                                   geometry)
    real = mask.bool()
    torch.testing.assert_close(hidden[real], reference[real], atol=1e-5, rtol=1e-5)


def test_a_narrower_layer_is_the_layer_with_the_other_heads_and_neurons_removed() -> None:
    encoder = tiny_encoder(1)
    layer = encoder.body.encoder.layer[0]
    geometry = ShardGeometry.of(encoder.body.config)
    keep = [1, 3]
    d, f = geometry.head_dim, geometry.neurons
    with torch.no_grad():      # the dropped shards contribute nothing once their O and FFN2 columns are 0
        for s in set(range(geometry.heads)) - set(keep):
            layer.attention.output.dense.weight[:, s * d:(s + 1) * d] = 0
            layer.output.dense.weight[:, s * f:(s + 1) * f] = 0
    ids, mask, _ = pad_batch([[1, 5, 9, 2]])
    with torch.inference_mode():
        hidden = encoder.body.embeddings(input_ids=ids)
        resident = LayerResident.of(layer)

        def run(shards: list[int]) -> torch.Tensor:
            weights = [ShardWeights.from_vector(shard_vector(layer, geometry, s), geometry) for s in shards]
            return elastic_layer(hidden, key_mask(mask), resident,
                                 LayerWeights.assemble(shards, weights, resident, geometry), geometry)

        zeroed, narrow = run(list(range(4))), run(keep)
    torch.testing.assert_close(narrow, zeroed, atol=1e-5, rtol=1e-5)



def test_a_layer_built_shard_by_shard_as_read_is_the_assembled_layer() -> None:
    """The loader copies each shard's parts into the layer as it reads it, from a read-only buffer at full
    precision: the same matrices and biases as decoding each shard and concatenating."""
    layer = tiny_encoder(1).body.encoder.layer[0]
    geometry = ShardGeometry.of(tiny_encoder(1).body.config)
    resident = LayerResident.of(layer)
    shards = [3, 0, 2]
    stored = [encode_shard(shard_vector(layer, geometry, s), FULL, None, np.zeros(geometry.params, bool))
              for s in shards]
    builder = LayerBuilder(shards, resident, geometry)
    for i, blob in enumerate(stored):
        view = decode_shard(blob, FULL, geometry.params, None, 0)
        assert not view.flags.writeable            # no copy made before the layer's own
        builder.put(i, view)
    built = builder.weights()
    expected = LayerWeights.assemble(shards, [ShardWeights.from_vector(shard_vector(layer, geometry, s), geometry)
                                              for s in shards], resident, geometry)
    for name in ("query", "key", "value", "output", "ffn_in", "ffn_out", "query_bias", "key_bias", "value_bias",
                 "ffn_in_bias", "heads"):
        assert torch.equal(getattr(built, name), getattr(expected, name)), name
    assert built.width == expected.width == 3
    again = LayerBuilder(shards, resident, geometry).weights()    # the biases are picked once a set of shards
    assert again.query_bias is built.query_bias and again.heads is built.heads

# --- the artifact and the pipeline -------------------------------------------------------------------------------

def tiny_shard_artifact(directory: Path) -> TeacherEncoder:
    """A 2-layer, 4-head random BERT cut into shards at `directory`, with task "toy": a head a shape (depth 1-2,
    width 2 or 4), shards ranked 2, 0, 3, 1 in each layer."""
    encoder = tiny_encoder()
    geometry = ShardGeometry.of(encoder.body.config)
    write_encoder_shards(directory, encoder, "tiny", {"model": "tiny"}, log=lambda _: None)
    torch.manual_seed(1)
    heads = {}
    for depth in (1, 2):
        for width in (2, 4):
            head = ClassifierHead(["no", "yes"], geometry.hidden)
            heads[f"{shape_key(depth, width)}.weight"] = head.linear.weight.detach().clone()
            heads[f"{shape_key(depth, width)}.bias"] = head.linear.bias.detach().clone()
    importance = [[k, s] for s in (2, 0, 3, 1) for k in (1, 0)]
    add_task(directory, "toy", heads, {"labels": ["no", "yes"], "importance": importance, "widths": [2, 4],
                                       "depths": [1, 2]})
    return encoder


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("shards") / "tiny"
    return directory, tiny_shard_artifact(directory)


def _plan(bits: int = 4, depth: int = 2, width: int = 4, overlap: bool = True) -> Plan:
    shards = [[2, 0, 3, 1][:width] for _ in range(depth)]
    return Plan("test", depth, width, shards, {(k, s): bits for k in range(depth) for s in shards[k]},
                overlap=overlap)


@pytest.mark.parametrize("io,lookahead", [("cold", 0), ("file", 0), ("file", 1), ("cold", 1), ("throttled:1000", 1)])
def test_store_verifies_and_the_pipeline_equals_the_in_memory_submodel(store_dir, io: str, lookahead: int,
                                                                       monkeypatch) -> None:
    """Through a mapped source the C loader's thread puts the plan where it lies, through a cold one it reads the
    files itself (a window of one layer reuses one buffer); a throttled device is read by a Python loader thread."""
    from academus.shared.models import sti_pipeline

    python_thread = io.startswith("throttled")
    monkeypatch.setattr(sti_pipeline, "NativeLoads" if python_thread else "ThreadLoads", None)
    directory, _ = store_dir
    store = ShardStore(directory)
    assert store.verify()["shards"] == 2 * 4 * 6
    assert store.tasks["toy"].layer_order(0) == [2, 0, 3, 1]
    model = ElasticModel(store, "toy")
    ids, mask, types = pad_batch([[1, 5, 9, 7, 2]])
    for plan in (_plan(4), _plan(FULL, 1, 2), _plan(2, overlap=False)):
        bank = {(k, s, b): store.decode(k, s, b, store.read_stored(k, s, b))
                for (k, s), b in plan.bits.items()}
        expected = model.run(ids, mask, model.assemble_plan(plan, bank), types)
        pipeline = ShardPipeline(model, io_source(io), lookahead=lookahead)
        try:
            result = pipeline.run(plan, ids, mask, types)
        finally:
            pipeline.close()
        torch.testing.assert_close(result.probs, expected)
        assert result.io_ms > 0 and result.total_ms >= result.compute_ms


@pytest.mark.parametrize("io,lookahead", [("file", 1), ("cold", 0), ("cold", 2)])
def test_a_pipeline_builds_a_layers_load_once_and_again_after_its_buffer_or_held_shards_change(
        store_dir, io: str, lookahead: int, monkeypatch) -> None:
    """Run after run of a plan publishes the loads its first run built (one kept loader thread puts them all); a
    new width or a new preload builds them anew. Every run equals the in-memory submodel."""
    from academus.shared.models import sti_pipeline

    built: list[int] = []
    build = sti_pipeline.NativeLoads._built

    def counting(self: sti_pipeline.NativeLoads, k: int, *args: object) -> object:
        built.append(k)
        return build(self, k, *args)

    monkeypatch.setattr(sti_pipeline.NativeLoads, "_built", counting)
    directory, _ = store_dir
    store = ShardStore(directory)
    model = ElasticModel(store, "toy")
    ids, mask, types = pad_batch([[1, 5, 9, 7, 2]])
    wide, narrow = _plan(4), _plan(6, width=2)
    preloaded = _plan(4)
    preloaded.preload = {(0, 2), (1, 0)}
    pipeline = ShardPipeline(model, io_source(io), lookahead=lookahead)
    try:
        for plan, builds in ((wide, 2), (wide, 0), (narrow, 2), (wide, 2), (preloaded, 0), ("hold", 0),
                             (preloaded, 2), (wide, 0)):
            built.clear()
            if plan == "hold":
                pipeline.preload(preloaded)
                continue
            bank = {(k, s, b): store.decode(k, s, b, store.read_stored(k, s, b)) for (k, s), b in plan.bits.items()}
            result = pipeline.run(plan, ids, mask, types)
            torch.testing.assert_close(result.probs, model.run(ids, mask, model.assemble_plan(plan, bank), types))
            assert len(built) == builds, (plan.width, plan.preload)
        assert pipeline._buffers.thread is not None
    finally:
        pipeline.close()


def test_full_precision_full_width_submodel_equals_the_encoder(store_dir) -> None:
    directory, encoder = store_dir
    store = ShardStore(directory)
    model = ElasticModel(store, "toy")
    plan = _plan(FULL)
    ids, mask, types = pad_batch([[1, 5, 9, 7, 2], [1, 4, 2]])
    with torch.inference_mode():
        hidden = model.embed(ids, mask, types)
        for k, layer in enumerate(plan.shards):
            hidden = model.layer(hidden, mask, k, model.assemble(k, layer, [store.decode(k, s, FULL, store.read_stored(
                k, s, FULL)) for s in layer]))
        reference = encoder.body(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    torch.testing.assert_close(hidden[mask.bool()], reference[mask.bool()], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family,pooling", [("bert", "cls"), ("roberta", "mean"), ("mpnet", "mean")])
def test_a_user_encoders_full_precision_shards_equal_it(family: str, pooling: str, tmp_path: Path) -> None:
    """BERT, RoBERTa (positions from its padding index + 1, one token type) and MPNet (no token types, a
    relative-position bias a head), pooled as the user's model is; through the pipeline too."""
    from tests.models import tiny_model

    # intermediate 54: shards split the FFN's neurons evenly between the heads
    body = tiny_model(family, False, tmp_path / "model", seed=3, intermediate_size=54)
    encoder = TeacherEncoder(body, pooling=pooling, normalize=pooling == "mean")
    write_encoder_shards(tmp_path / "shards", encoder, "tiny", {"model": "tiny"}, log=lambda _: None)
    store = ShardStore(tmp_path / "shards")
    model = ElasticModel(store, "", heads={})
    assert model.architecture.family.name == family and (model.pooling, model.normalize) == (pooling, pooling == "mean")
    ids, mask, types = pad_batch([[5, 17, 9, 40, 8], [5, 60, 8]])
    full = _plan(FULL, depth=store.geometry.layers, width=store.geometry.heads)
    full.shards = [list(range(store.geometry.heads))] * store.geometry.layers
    full.bits = {(k, s): FULL for k in range(store.geometry.layers) for s in range(store.geometry.heads)}
    with torch.inference_mode():
        hidden = model.embed(ids, mask, types)
        for k, layer in enumerate(model.assemble_plan(full, {(k, s, FULL): store.decode(k, s, FULL, store.read_stored(
                k, s, FULL)) for k in range(store.geometry.layers) for s in range(store.geometry.heads)})):
            hidden = model.layer(hidden, mask, k, layer)
        torch.testing.assert_close(model.pool(hidden, mask), encoder(ids, mask, types), atol=1e-5, rtol=1e-5)
        head = ClassifierHead(["a", "b"], store.geometry.hidden)
        model.heads[(store.geometry.layers, store.geometry.heads)] = head
        expected = torch.softmax(head(encoder(ids, mask, types)), dim=-1)
    pipeline = ShardPipeline(model, io_source("file"))
    try:
        torch.testing.assert_close(pipeline.run(full, ids, mask, types).probs, expected, atol=1e-5, rtol=1e-5)
    finally:
        pipeline.close()


def test_a_layers_compute_is_timed_over_every_layer_on_its_own_weights(store_dir) -> None:
    """One layer timed again and again keeps its weights in the core's caches, which a run never does."""
    directory, _ = store_dir
    store = ShardStore(directory)
    model = ElasticModel(store, "", heads={})
    geometry = store.geometry
    weights = [[store.decode(k, s, FULL, store.read_stored(k, s, FULL)) for s in range(geometry.heads)]
               for k in range(geometry.layers)]
    ran: list[tuple[int, LayerWeights]] = []
    run_layer = model.layer

    def layer(hidden: torch.Tensor, mask: torch.Tensor, k: int, w: LayerWeights, bias=None) -> torch.Tensor:
        ran.append((k, w))
        return run_layer(hidden, mask, k, w, bias)

    model.layer = layer
    ids, mask, _ = pad_batch([[1, 5, 9, 7, 2]])
    with torch.inference_mode():
        assert _layer_ms(model, weights, 2, model.embed(ids, mask), mask, repeats=4) > 0
    assert len(ran) == (3 + 4) * geometry.layers            # warm-ups and repeats, each a pass through the depth
    assert [k for k, _ in ran[:geometry.layers]] == list(range(geometry.layers))
    for k, w in ran[:geometry.layers]:
        expected = model.assemble(k, [0, 1], weights[k][:2])
        assert w.width == 2
        torch.testing.assert_close(w.ffn_in, expected.ffn_in)
        torch.testing.assert_close(w.query, expected.query)
    assert len({w.query.data_ptr() for _, w in ran}) == geometry.layers


def _recording_shard_reads(monkeypatch, source: FileSource) -> list[tuple[str, int]]:
    """(file, offset) of each shard a run reads, in order: the Python loader's reads through `source.read`, or the
    reads published to the C loader's thread (which it makes in that order; a wrong one fails its CRC-32)."""
    import os

    from academus.shared.models import sti_pipeline

    spans: list[tuple[str, int]] = []
    read, stored = source.read, sti_pipeline._stored

    def reading(path: Path, offset: int, length: int) -> bytes:
        if path.name.startswith("layer"):
            spans.append((path.name, offset))
        return read(path, offset, length)

    def published(*args: object) -> tuple:
        layout = stored(*args)
        spans.extend((Path(os.readlink(f"/proc/self/fd/{fd}")).name, at) for fd, at in layout[-1] or () if fd >= 0)
        return layout

    monkeypatch.setattr(source, "read", reading)
    monkeypatch.setattr(sti_pipeline, "_stored", published)
    return spans


@pytest.mark.parametrize("io", ["cold", "throttled:1000"])
def test_a_layers_shards_are_read_in_file_order_and_put_in_their_places(store_dir, io: str, monkeypatch) -> None:
    """A layer runs once all its shards are in, so a cold file is read in its own order (the kernel's readahead),
    whatever the plan's order, two versions a layer included; each shard still goes to its own place. The C
    loader's thread reads `cold`; a Python loader thread reads `throttled`."""
    directory, _ = store_dir
    store = ShardStore(directory)
    model = ElasticModel(store, "toy")
    plan = _plan(4)
    plan.bits[(0, 3)], plan.bits[(1, 0)] = FULL, 2
    source = io_source(io)
    spans = _recording_shard_reads(monkeypatch, source)
    pipeline = ShardPipeline(model, source)
    ids, mask, types = pad_batch([[1, 5, 9, 7, 2]])
    try:
        result = pipeline.run(plan, ids, mask, types)
    finally:
        pipeline.close()
    expected = [sorted((store.entry(k, s, plan.bits[(k, s)]).file, store.entry(k, s, plan.bits[(k, s)]).offset)
                       for s in shards) for k, shards in enumerate(plan.shards)]
    assert spans == expected[0] + expected[1] and spans != [
        (store.entry(k, s, plan.bits[(k, s)]).file, store.entry(k, s, plan.bits[(k, s)]).offset)
        for k, shards in enumerate(plan.shards) for s in shards]      # the plan's own order differs
    bank = {(k, s, b): store.decode(k, s, b, store.read_stored(k, s, b)) for (k, s), b in plan.bits.items()}
    torch.testing.assert_close(result.probs, model.run(ids, mask, model.assemble_plan(plan, bank), types))


def _recording_advice(monkeypatch) -> list[tuple[str, int, int, int]]:
    """(file, offset, length, advice) of each `posix_fadvise` from Python, in order; each still advised."""
    import os

    calls: list[tuple[str, int, int, int]] = []
    advise = os.posix_fadvise

    def recorded(fd: int, offset: int, length: int, advice: int) -> None:
        calls.append((Path(os.readlink(f"/proc/self/fd/{fd}")).name, offset, length, advice))
        advise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", recorded)
    return calls


def test_a_cold_source_asks_the_disk_for_spans_ahead_and_turns_its_readahead_off(store_dir, monkeypatch) -> None:
    """The disk reads the next shards while the loader decodes this one, and only the plan's shards; at most two
    layers (`2 * depth` spans) ahead, so that a run stopped early leaves little queued for the next."""
    import os

    directory, _ = store_dir
    store = ShardStore(directory)
    calls = _recording_advice(monkeypatch)
    wanted = [(0, 2, 4), (0, 0, 4), (1, 3, FULL), (1, 1, FULL)]
    spans = [(path.name, offset, length) for path, offset, length in (store.span(*x) for x in wanted)]

    def willneed() -> list[tuple[str, int, int]]:
        return [(name, o, n) for name, o, n, a in calls if a == os.POSIX_FADV_WILLNEED]

    with ColdSource() as source:
        reads = store.read_in_order(source, wanted, depth=1)
        assert next(reads) == store.read_stored(*wanted[0]) and willneed() == spans[:2]   # two ahead, no more
        assert next(reads) == store.read_stored(*wanted[1]) and willneed() == spans[:3]
        assert [next(reads) for _ in wanted[2:]] == [store.read_stored(*x) for x in wanted[2:]]
        reads.close()
    assert willneed() == spans
    assert sorted(name for name, *_, a in calls if a == os.POSIX_FADV_RANDOM) == ["layer0.q4", "layer1.q32"]


def test_a_run_asks_for_its_uncached_embedding_rows_before_any_shard(store_dir, monkeypatch) -> None:
    """The compute waits for the rows: through a cold page cache the disk is asked for them first, not behind the
    loader's shards; rows in the cache, and ids out of range (which `read` refuses), are not asked for."""
    import os

    directory, _ = store_dir
    store = ShardStore(directory)
    model = ElasticModel(store, "toy")
    calls = _recording_advice(monkeypatch)       # the loads' start marked among them as ("loads", 0, 0, WILLNEED)
    start = ShardPipeline._start

    def starting(self: ShardPipeline, plan: Plan) -> object:
        calls.append(("loads", 0, 0, os.POSIX_FADV_WILLNEED))
        return start(self, plan)

    def asked() -> list[tuple[str, int, int]]:
        return [(name, o, n) for name, o, n, a in calls if a == os.POSIX_FADV_WILLNEED]

    monkeypatch.setattr(ShardPipeline, "_start", starting)
    ids, mask, types = pad_batch([[1, 5, 2 * BLOCK_ROWS + 3, 7]])
    blocks = [(store.rows.path.name, *store.rows.block_span(b)) for b in (0, 2)]
    pipeline = ShardPipeline(model, ColdSource())
    try:
        first = pipeline.run(_plan(6), ids, mask, types)
        assert asked()[:3] == [*blocks, ("loads", 0, 0)]       # then the loads start, and ask for the shards
        assert all(name != store.rows.path.name for name, *_ in asked()[3:])
        calls.clear()
        torch.testing.assert_close(pipeline.run(_plan(6), ids, mask, types).probs, first.probs)
        assert asked()[:1] == [("loads", 0, 0)]                  # cached: none asked for
        assert all(name != store.rows.path.name for name, *_ in asked())
        calls.clear()
        store.rows.prefetch(torch.tensor([[-1, store.rows.rows, 3 * BLOCK_ROWS]]), pipeline.source)
        assert asked() == [(store.rows.path.name, *store.rows.block_span(3))]
    finally:
        pipeline.close()
    with io_source("file") as source:                           # a mapped source is asked nothing
        calls.clear()
        store.rows.prefetch(torch.tensor([[4 * BLOCK_ROWS]]), source)
        assert asked() == []


@pytest.mark.parametrize("io", ["cold", "throttled:1000"])
def test_finishing_a_run_cut_short_wakes_a_python_loader_waiting_for_room(store_dir, io: str, monkeypatch) -> None:
    """A run cut short (by its pace, by its deadline) no longer frees the working buffer: its end must wake the
    loader, which waits for room without a timeout, and the loader builds nothing more. (`cold` as where the C
    loader was not built.)"""
    import threading

    from academus.shared.models import sti_pipeline

    monkeypatch.setattr(sti_pipeline, "NATIVE", None)
    directory, _ = store_dir
    store = ShardStore(directory)
    pipeline = ShardPipeline(ElasticModel(store, "toy"), io_source(io), lookahead=1)
    try:
        loads = pipeline._start(_plan(6))
        loads.wait(0)                                  # the loader's window (one layer) is full: it waits
        finished: list[float] = []
        ending = threading.Thread(target=lambda: finished.append(loads.finish()))
        ending.start()
        ending.join(timeout=30)                        # a hang, not a speed: a loader never woken never ends
        assert finished and finished[0] > 0 and not ending.is_alive()
        assert 1 not in loads._out and not loads._ready[1].is_set()
    finally:
        pipeline.close()


@pytest.mark.parametrize("io", ["throttled:1", "cold"])
def test_sources_that_read_read_every_shard_but_the_preloaded(store_dir, io: str, monkeypatch) -> None:
    """A throttled or cold source is read, never mapped (a mapping would bypass its bandwidth or its cold pages):
    each shard of the plan not preloaded once, by the Python loader's `read` or by the C loader's thread."""
    directory, _ = store_dir
    store = ShardStore(directory)
    model = ElasticModel(store, "toy")
    plan = _plan(6)
    plan.preload = {x for x in plan.bits if x[0] == 0}
    source = io_source(io)
    spans = _recording_shard_reads(monkeypatch, source)
    pipeline = ShardPipeline(model, source)
    try:
        held = pipeline.preload(plan)
        spans.clear()                                   # the preload's own reads
        ids, mask, types = pad_batch([[1, 5, 2]])
        pipeline.run(plan, ids, mask, types)
    finally:
        pipeline.close()
    assert held == sum(store.shard_bytes(k, s, 6) for k, s in plan.preload)
    assert sorted(spans) == sorted((path.name, offset) for path, offset, _ in (store.span(1, s, 6)
                                                                              for s in plan.shards[1]))


def test_throttled_source_takes_its_bandwidth(store_dir) -> None:
    directory, _ = store_dir
    store = ShardStore(directory)
    source = ThrottledSource(0.5)          # 0.5 MB/s: a full-precision shard of this model (32 KB) takes 65 ms
    e = store.entry(0, 0, FULL)
    import time

    started = time.perf_counter()
    for _ in range(3):
        source.read(directory / e.file, e.offset, e.length)
    assert time.perf_counter() - started >= 3 * e.length / 0.5e6
    source.close()


def test_read_ahead_reads_in_order_ahead_of_its_consumer_and_stops_when_closed() -> None:
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    done: list[int] = []
    gate = threading.Event()

    def read(span: tuple[int]) -> bytes:
        if span[0] == 6:
            gate.wait(5)                 # held until the consumer has closed
        done.append(span[0])
        return b"%d" % span[0]

    with ThreadPoolExecutor(max_workers=1) as executor:
        reads = ReadAhead(executor, read, ((i,) for i in range(100)), depth=3)
        waited = time.monotonic() + 5
        while len(done) < 4 and time.monotonic() < waited:   # 3 queued and one more waiting for room
            time.sleep(0.01)
        assert done == [0, 1, 2, 3]     # read while nothing was taken, and no further than the depth allows
        assert [next(reads) for _ in range(3)] == [b"0", b"1", b"2"]
        reads.close()
        gate.set()
    assert len(done) <= 7               # the reads not taken stopped: at most the one in progress after close


def test_reads_run_ahead_only_where_nothing_else_reads_ahead(tmp_path: Path) -> None:
    """The page cache's copies cost CPU, and cold files have the kernel's readahead: only the throttled device
    gets a reader thread."""
    path = tmp_path / "two"
    path.write_bytes(b"ab")
    for spec, ahead in (("file", False), ("cold", False), ("throttled:100", True)):
        with io_source(spec) as source:
            reads = source.read_in_order([(path, 0, 1), (path, 1, 1)], depth=2)
            assert isinstance(reads, ReadAhead) is ahead, spec
            assert [next(reads), next(reads)] == [b"a", b"b"]
            assert next(reads, None) is None, spec    # the end comes, rather than a wait (zip(..., strict=True))
            reads.close()


def test_a_plain_file_gives_views_of_its_mapping_and_a_cold_one_reads(tmp_path: Path) -> None:
    """Through the page cache a read is a copy as dear as a 6-bit shard's decoding: `file` maps each file once and
    hands out views. A cold source must read, since the kernel drops no page a process maps."""
    path = tmp_path / "shards"
    path.write_bytes(bytes(range(256)) * 64)
    with io_source("file") as source:
        first, second = source.read_in_order([(path, 10, 5), (path, 16_380, 100)], depth=2)
        assert isinstance(first, memoryview) and first.readonly and first == bytes(range(10, 15))
        assert len(second) == 4                  # past the end: short, as a short read is, and its checksum fails
        assert source.view(path, 0, 1).obj is first.obj      # mapped once
    assert first == bytes(range(10, 15))         # a view outlives the source's close
    with io_source("cold") as source:
        assert type(next(source.read_in_order([(path, 10, 5)], depth=1))) is bytes


def test_a_failed_read_is_raised_where_its_bytes_were_due() -> None:
    from concurrent.futures import ThreadPoolExecutor

    def read(span: tuple[int]) -> bytes:
        if span[0] == 2:
            raise OSError("the disk went away")
        return b"%d" % span[0]

    with ThreadPoolExecutor(max_workers=1) as executor:
        reads = ReadAhead(executor, read, ((i,) for i in range(5)), depth=4)
        assert [next(reads), next(reads)] == [b"0", b"1"]
        with pytest.raises(OSError, match="the disk went away"):
            next(reads)
        reads.close()


def test_deadline_is_checked_between_layers(store_dir) -> None:
    directory, _ = store_dir
    store = ShardStore(directory)
    pipeline = ShardPipeline(ElasticModel(store, "toy"), ThrottledSource(1.0))
    ids, mask, types = pad_batch([[1, 5, 2]])
    import time

    try:
        with pytest.raises(DeadlineMissed, match="before layer"):
            pipeline.run(_plan(FULL), ids, mask, types, deadline=time.perf_counter() + 0.001)
    finally:
        pipeline.close()


def _toy_run(store_dir) -> tuple[ShardStore, ElasticModel, tuple[torch.Tensor, ...], Plan]:
    """The toy store, its model, one text's batch and a 2-layer plan at 4 bits."""
    store = ShardStore(store_dir[0])
    return store, ElasticModel(store, "toy"), pad_batch([[1, 5, 9, 7, 2]]), _plan(4)


def test_a_run_behind_its_pace_answers_from_the_layers_it_has(store_dir) -> None:
    """A pace whose bound is already spent stops the run before layer 1, the shallowest depth with a head: the
    answer is the 1-layer shape's, as the plan truncated to it computes it. A pace it keeps changes nothing; no
    run stops before its first layer."""
    store, model, (ids, mask, types), plan = _toy_run(store_dir)
    bank = {(k, s, b): store.decode(k, s, b, store.read_stored(k, s, b)) for (k, s), b in plan.bits.items()}
    pipeline = ShardPipeline(model, io_source("file"))
    try:
        behind = pipeline.run(plan, ids, mask, types, pace=Pace(0.0, 1.0, 0.0, frozenset({1, 2})))
        kept = pipeline.run(plan, ids, mask, types, pace=Pace(1e9, 1.0, 0.0, frozenset({1, 2})))
        no_head = pipeline.run(plan, ids, mask, types, pace=Pace(0.0, 1.0, 0.0, frozenset({2})))
    finally:
        pipeline.close()
    short = plan.truncated(1)
    assert behind.depth == 1 and short.depth == 1 and set(short.bits) == {(0, s) for s in plan.shards[0]}
    torch.testing.assert_close(behind.probs, model.run(ids, mask, model.assemble_plan(short, bank), types))
    torch.testing.assert_close(kept.probs, model.run(ids, mask, model.assemble_plan(plan, bank), types))
    assert kept.depth == no_head.depth == 2


def test_a_runs_rest_is_its_time_outside_its_layers_and_the_waits_for_their_shards(store_dir, monkeypatch) -> None:
    """What the profile times a run's rest by: a slow head counts in its rest and in its tail; a slow device's waits
    for the shards count in neither."""
    store, model, (ids, mask, types), plan = _toy_run(store_dir)
    layer_bytes = sum(store.entry(0, s, 4).length for s in plan.shards[0])
    results = {}
    for io in ("file", "file", f"throttled:{layer_bytes / 0.25 / 1e6:.6f}"):   # warmed up; then 0.25 s a layer
        pipeline = ShardPipeline(model, io_source(io))
        try:
            results[io.split(":")[0]] = pipeline.run(plan, ids, mask, types)
        finally:
            pipeline.close()
    slow = results["throttled"]
    assert slow.stall_ms >= 200 and 0 < slow.rest_ms < slow.stall_ms / 3
    finish = model.finish

    def slow_head(*args: object) -> torch.Tensor:
        time.sleep(0.02)
        return finish(*args)

    monkeypatch.setattr(model, "finish", slow_head)
    pipeline = ShardPipeline(model, io_source("file"))
    try:
        held_up = pipeline.run(plan, ids, mask, types)
    finally:
        pipeline.close()
    assert held_up.finish_ms >= 20 and held_up.rest_ms >= held_up.finish_ms
    assert results["file"].finish_ms <= results["file"].rest_ms <= results["file"].total_ms - results["file"].compute_ms


def test_the_profile_times_a_runs_rest_inside_runs_and_an_older_profile_is_measured_again(store_dir, tmp_path
                                                                                          ) -> None:
    import json

    from academus.shared.training.shard_plans import load_profile, profile_path, save_profile
    from academus.shared.training.shards import measure_profile

    directory, _ = store_dir
    profile = measure_profile(ShardStore(directory), "file", repeats=2)
    assert set(profile.finish_ms) == set(profile.overhead_ms) == set(profile.buckets) == {16, 32, 64}
    assert all(v > 0 for v in profile.finish_ms.values()) and all(v >= 0 for v in profile.overhead_ms.values())
    assert set(profile.layer_setup_ms) == {1, 2, 3, 4}
    assert all(set(by) == {16, 32, 64} and min(by.values()) >= 0 for by in profile.layer_setup_ms.values())
    assert profile.rest_ms(32, 2, 2) == pytest.approx(profile.overhead_ms[32] + 2 * profile.layer_setup_ms[2][32])
    saved = save_profile(tmp_path, "tiny", profile)
    assert saved is not None and load_profile(tmp_path, "tiny", "file") == profile
    older = json.loads(saved.read_text())
    del older["finish_ms"], older["layer_setup_ms"]
    saved.write_text(json.dumps(older))
    with pytest.raises(ArtifactError, match=rf"{profile_path(tmp_path, 'tiny', 'file')} was measured before runs"):
        load_profile(tmp_path, "tiny", "file")


def test_a_pace_stops_before_a_layer_that_would_end_past_its_bound() -> None:
    pace = Pace(bound_ms=10.0, layer_ms=2.0, rest_ms=1.0, depths=frozenset({2, 3, 4}))
    assert not pace.stops_before(2, 7.0)      # 7 + 2 + 1 = 10: within the bound
    assert pace.stops_before(2, 7.5)          # 10.5
    assert not pace.stops_before(1, 9.0)      # past it, but no head at depth 1
    assert pace.stops_before(2, 6.0, layer_seen_ms=3.5)   # this run's layers took 3.5 ms: 6 + 3.5 + 1 > 10


def copy_of(store_dir, tmp_path: Path) -> Path:
    """A copy of the module's artifact a test may damage."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(store_dir[0], copy)
    return copy


def test_a_corrupted_shard_is_refused_naming_file_shard_and_checksums(store_dir, tmp_path) -> None:
    broken = copy_of(store_dir, tmp_path)
    store = ShardStore(broken)
    e = store.entry(1, 3, 4)
    with open(broken / e.file, "r+b") as handle:
        handle.seek(e.offset + 10)
        byte = handle.read(1)
        handle.seek(e.offset + 10)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ArtifactError, match=rf"layer1\.q4: shard 3 of layer 1 at 4 bits .*sha256 {e.sha256}"):
        store.decode(1, 3, 4, store.read_stored(1, 3, 4))
    with pytest.raises(ArtifactError, match=r"layer1\.q4: sha256 .* does not match"):
        store.verify()
    for io in ("file", "cold", "throttled:1000"):   # the profile's loads: the C loader's thread (mapped, reading),
        with io_source(io) as source, pytest.raises(ArtifactError, match="shard 3 of layer 1 at 4 bits"):
            load_layer_s(ElasticModel(store, "toy"), source, 1, [0, 3], 4)       # and the Python loader's call
        pipeline = ShardPipeline(ElasticModel(store, "toy"), io_source(io))
        ids, mask, types = pad_batch([[1, 5, 2]])
        try:
            with pytest.raises(ArtifactError, match="shard 3 of layer 1"):
                pipeline.run(_plan(4), ids, mask, types)
        finally:
            pipeline.close()


def test_a_truncated_shard_file_is_refused_when_the_store_opens(store_dir, tmp_path) -> None:
    broken = copy_of(store_dir, tmp_path)
    path = broken / "layer0.q6"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ArtifactError, match=r"layer0\.q6 is truncated: \d+ bytes, the manifest's shards end at \d+"):
        ShardStore(broken)


def test_embedding_rows_are_the_encoders_table_read_by_block(store_dir) -> None:
    directory, encoder = store_dir
    table = encoder.body.embeddings.word_embeddings.weight.detach()
    store = ShardStore(directory)
    assert "embeddings.word_embeddings.weight" not in store.resident
    meta = store.manifest.extra["embedding_rows"]
    rows = EmbeddingRows(directory, meta, cache_bytes=6 * table.shape[1] * 4)   # 6 rows: evicts
    source = io_source("file")
    last = table.shape[0] - 1                     # the last block is partial when the vocabulary is not a multiple
    ids = torch.tensor([[0, BLOCK_ROWS - 1, BLOCK_ROWS, last, 7], [last, 3 * BLOCK_ROWS + 1, 0, 2, 2]])
    try:
        for _ in range(2):                        # read, then partly from the cache
            assert torch.equal(rows.read(ids, source), table[ids])
            assert 0 < rows.held_bytes() <= rows.cache_bytes
        with pytest.raises(ArtifactError, match=rf"token ids must lie in \[0, {table.shape[0]}\)"):
            rows.read(torch.tensor([[table.shape[0]]]), source)
    finally:
        source.close()


def test_embedding_rows_evict_the_least_recently_used_row_the_batch_does_not_use(store_dir) -> None:
    directory, encoder = store_dir
    table = encoder.body.embeddings.word_embeddings.weight.detach()
    meta = ShardStore(directory).manifest.extra["embedding_rows"]
    rows = EmbeddingRows(directory, meta, cache_bytes=3 * table.shape[1] * 4)   # 3 rows
    source = io_source("file")

    def misses(*ids: int) -> int:
        before = rows.misses
        assert torch.equal(rows.read(torch.tensor(ids), source), table[list(ids)])
        return rows.misses - before

    try:
        assert misses(1, 2, 3) == 3 and misses(1) == 0      # 2 is now the least recently used
        assert misses(4) == 1 and misses(1, 3) == 0          # 4 took 2's slot
        assert misses(2) == 1                                 # ... and 2 took 4's, the oldest of 1, 3, 4
        assert misses(4, 5, 6, 4) == 4                        # three new rows (4 read once, counted twice)
        assert misses(4, 5, 6) == 0 and rows.held_bytes() == rows.cache_bytes
        assert misses(7, 8, 9, 10) == 4                       # more rows than fit: the first three kept
        assert misses(7, 8, 9) == 0
    finally:
        source.close()


def test_embedding_rows_stay_right_under_eviction_from_several_threads(store_dir) -> None:
    """A cache of 10 rows, batches of up to 12 distinct rows from 4 threads at once: every answer is the table's."""
    import threading

    directory, encoder = store_dir
    table = encoder.body.embeddings.word_embeddings.weight.detach()
    meta = ShardStore(directory).manifest.extra["embedding_rows"]
    rows = EmbeddingRows(directory, meta, cache_bytes=10 * table.shape[1] * 4)
    wrong: list[int] = []

    def reader(seed: int) -> None:
        source, g = io_source("file"), torch.Generator().manual_seed(seed)
        for _ in range(60):
            ids = torch.randint(0, 40, (2, 6), generator=g)    # a small vocabulary: rows evicted and shared
            if not torch.equal(rows.read(ids, source), table[ids]):
                wrong.append(seed)
        source.close()

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong and rows.held_bytes() == rows.cache_bytes == 10 * table.shape[1] * 4


def test_a_corrupted_embedding_block_is_refused_naming_it(store_dir, tmp_path) -> None:
    broken = copy_of(store_dir, tmp_path)
    store = ShardStore(broken)
    offset, length = store.rows.block_span(2)
    with open(store.rows.path, "r+b") as handle:
        handle.seek(offset + 5)
        byte = handle.read(1)
        handle.seek(offset + 5)
        handle.write(bytes([byte[0] ^ 0xFF]))
    crc = store.rows.crcs[2]
    with pytest.raises(ArtifactError, match=rf"embeddings\.rows: rows block 2 .* the manifest says {length} bytes, "
                                            rf"crc32 {crc}"):
        ElasticModel(store, "toy").embed(*pad_batch([[2 * BLOCK_ROWS + 1]])[:2])
    with pytest.raises(ArtifactError, match=r"embeddings\.rows: sha256 .* does not match"):
        store.verify()
    with pytest.raises(ArtifactError, match="rows block 2"):
        store.rows.check_all(io_source("file"))
    (broken / "embeddings.rows").write_bytes(b"\0" * 10)
    with pytest.raises(ArtifactError, match=r"embeddings\.rows is truncated: 10 bytes"):
        ShardStore(broken)


def test_an_artifact_without_embedding_rows_is_refused_for_serving(store_dir, tmp_path) -> None:
    from dataclasses import replace

    from academus.shared.state.artifacts import read_manifest, write_manifest

    old = copy_of(store_dir, tmp_path)
    manifest = read_manifest(old)
    write_manifest(old, replace(manifest, extra={k: v for k, v in manifest.extra.items() if k != "embedding_rows"}))
    with pytest.raises(ArtifactError, match=r"no word-embedding rows .* rebuild it with `academus shard build`"):
        ElasticModel(ShardStore(old), "toy")


def test_io_source_names_are_checked() -> None:
    assert io_source("throttled:250").name == "throttled:250"
    with pytest.raises(ValueError, match="not file, cold or throttled"):
        io_source("tape")
    with pytest.raises(ValueError, match="must be > 0 MB/s"):
        io_source("throttled:0")


def test_layer_quantization_shares_codebooks_across_shards() -> None:
    encoder = tiny_encoder(1)
    geometry = ShardGeometry.of(encoder.body.config)
    vectors = [shard_vector(encoder.body.encoder.layer[0], geometry, s) for s in range(geometry.heads)]
    q = LayerQuantization.fit(vectors)
    assert set(q.codebooks) == set(BITS)
    assert [len(m) for m in q.outliers] == [geometry.params] * geometry.heads


class UniformBits:
    """An evaluator whose whole model scores `accuracy[bits]` on 1,000 texts at each uniform bit width."""

    def __init__(self, accuracy: dict[int, float]) -> None:
        self.accuracy = accuracy

    def probs(self, plan: Plan) -> torch.Tensor:
        right = round(1000 * self.accuracy[next(iter(plan.bits.values()))])
        return torch.tensor([[0.0, 1.0]] * right + [[1.0, 0.0]] * (1000 - right))


@pytest.mark.parametrize(("six_bits", "floor"), [(0.995, 6), (0.95, 32)])
def test_the_floor_is_full_precision_when_no_bit_width_keeps_the_accuracy(six_bits: float, floor: int) -> None:
    accuracy = {2: 0.5, 3: 0.7, 4: 0.8, 5: 0.9, 6: six_bits, 32: 1.0}
    gold = torch.ones(1000, dtype=torch.long)
    uniform, chosen = profile_fidelity(UniformBits(accuracy), ShardGeometry(2, 2, 8, 16), gold)
    assert uniform == {str(b): a for b, a in accuracy.items()} and chosen == floor


@pytest.mark.parametrize("family", ["bert", "mpnet"])
def test_each_importance_upgrade_equals_its_plan_run_whole(family: str, tmp_path: Path) -> None:
    """§5.2's profile runs an upgrade in layer k from the base plan's states entering layer k (MPNet: with the
    batch's relative-position bias): each answer equals the whole plan's, bit for bit, in layer-major order."""
    from academus.shared.models.tokenization import TeacherTokenizer
    from academus.shared.training.shards import Evaluator, decoded_bank, full_plan
    from tests.models import tiny_model_dir

    body = tiny_model_dir(family, False, tmp_path / "model", seed=3, intermediate_size=54)
    write_encoder_shards(tmp_path / "shards", TeacherEncoder(body, pooling="mean", normalize=True), "tiny",
                         {"model": "tiny"}, log=lambda _: None)
    store = ShardStore(tmp_path / "shards")
    geometry = store.geometry
    model = ElasticModel(store, "", heads={(geometry.layers, geometry.heads): ClassifierHead(["a", "b"],
                                                                                            geometry.hidden)},
                         labels=["a", "b"])
    texts = ["a quiet triumph", "dull, long and loud, and then longer still", "fine", "not the worst", "why"]
    evaluator = Evaluator(model, decoded_bank(store), TeacherTokenizer(tmp_path / "model"), texts, batch_size=2)
    seen = []
    for k, s, probs in evaluator.upgrades(full_plan(geometry, BITS[0]), FULL):
        plan = full_plan(geometry, BITS[0])
        plan.bits[(k, s)] = FULL
        torch.testing.assert_close(probs, evaluator.probs(plan), rtol=0, atol=0)
        seen.append((k, s))
    assert seen == [(k, s) for k in range(geometry.layers) for s in range(geometry.heads)]
    assert not torch.equal(evaluator.probs(full_plan(geometry, BITS[0])), evaluator.probs(full_plan(geometry, FULL)))


def test_the_upgrade_order_ranks_shards_by_how_far_lowering_each_moves_the_output(tmp_path: Path) -> None:
    """The planner's upgrade order: every shard at 6 bits, each in turn at 2; the table's KL divergence is the whole
    plan's, run on its own, and the order is by it, largest first."""
    from academus.shared.models.tokenization import TeacherTokenizer
    from academus.shared.training.shards import Evaluator, decoded_bank, full_plan, profile_sensitivity
    from tests.models import tiny_model_dir

    body = tiny_model_dir("bert", False, tmp_path / "model", seed=5, intermediate_size=54)
    write_encoder_shards(tmp_path / "shards", TeacherEncoder(body, pooling="mean", normalize=True), "tiny",
                         {"model": "tiny"}, log=lambda _: None)
    store = ShardStore(tmp_path / "shards")
    geometry = store.geometry
    torch.manual_seed(2)
    head = ClassifierHead(["a", "b", "c"], geometry.hidden)
    model = ElasticModel(store, "", heads={(geometry.layers, geometry.heads): head}, labels=["a", "b", "c"])
    texts = ["a quiet triumph", "dull, long and loud, and then longer still", "fine", "not the worst", "why"]
    evaluator = Evaluator(model, decoded_bank(store), TeacherTokenizer(tmp_path / "model"), texts, batch_size=2)
    order, table = profile_sensitivity(evaluator, geometry)
    expected = evaluator.probs(full_plan(geometry, 6))
    kl = {}
    for k in range(geometry.layers):
        for s in range(geometry.heads):
            lowered = full_plan(geometry, 6)
            lowered.bits[(k, s)] = 2
            probs = evaluator.probs(lowered)
            kl[(k, s)] = (expected * (expected.log() - probs.log())).sum(1).mean().item()
    assert {(r["layer"], r["shard"]): r["kl"] for r in table} == pytest.approx(kl, abs=1e-6)
    assert sorted(order) == sorted(kl) and len(set(kl.values())) > 1
    assert [round(kl[x], 6) for x in order] == sorted((round(v, 6) for v in kl.values()), reverse=True)


def test_the_planner_upgrades_in_the_stores_upgrade_order_and_older_stores_in_importance_order(
        store_dir, tmp_path: Path) -> None:
    """A store's `upgrade_order` orders the planner's second pass; a width-m layer still runs its m most important
    shards. A store built before the order was measured upgrades by importance, as it did."""
    import shutil

    from safetensors.torch import load_file

    from academus.shared.models.shard_store import heads_file
    from academus.shared.models.sti_planner import HardwareProfile
    from academus.shared.training.shard_plans import planner_for

    directory, _ = store_dir
    profile = HardwareProfile("file", dict.fromkeys(VERSIONS, 0.1), dict.fromkeys(VERSIONS, 0.05),
                              {2: {32: 0.2}, 4: {32: 0.3}}, {32: 0.1}, (32,))
    older = ShardStore(directory)
    assert older.tasks["toy"].upgrades == older.tasks["toy"].importance
    assert planner_for(older, "toy", profile).importance == older.tasks["toy"].importance
    copy = tmp_path / "tiny"
    shutil.copytree(directory, copy)
    order = [[0, 1], [1, 3], [0, 0], [1, 2], [0, 2], [1, 0], [0, 3], [1, 1]]
    meta = older.manifest.extra["tasks"]["toy"] | {"upgrade_order": order}
    add_task(copy, "toy", load_file(copy / heads_file("toy")), meta)
    store = ShardStore(copy)
    planner = planner_for(store, "toy", profile)
    assert planner.importance == [tuple(x) for x in order]
    assert [planner.layer_order(k) for k in (0, 1)] == [[2, 0, 3, 1]] * 2
