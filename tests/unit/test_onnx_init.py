"""paraphrase-MiniLM-L3-v2 from its ONNX wheel: the wire-format reader, the MatMul → bias naming, and the
real model mapped onto the students' BERT layers."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from academus.shared.models.model import mean_pool
from academus.shared.training.onnx_init import bert_state, group_from_l3, load_minilm_l3, read_graph


def _varint(n: int) -> bytes:
    out = b""
    while True:
        byte, n = n & 0x7F, n >> 7
        if not n:
            return out + bytes([byte])
        out += bytes([byte | 0x80])


def _field(number: int, payload: bytes | int) -> bytes:
    if isinstance(payload, int):
        return _varint(number << 3) + _varint(payload)
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _tensor(name: str, values: list[list[float]] | list[float]) -> bytes:
    rows = values if isinstance(values[0], list) else [values]
    dims = [len(rows), len(rows[0])] if isinstance(values[0], list) else [len(values)]
    raw = b"".join(struct.pack("<f", v) for row in rows for v in row)
    return (_field(1, b"".join(_varint(d) for d in dims)) + _field(2, 1) + _field(8, name.encode())
            + _field(9, raw))


def _node(op: str, inputs: list[str], outputs: list[str]) -> bytes:
    return (b"".join(_field(1, i.encode()) for i in inputs) + b"".join(_field(2, o.encode()) for o in outputs)
            + _field(4, op.encode()))


def test_reader_names_each_matmul_weight_after_its_bias_and_transposes_it() -> None:
    prefix = "model.0.auto_model.encoder.layer.0.attention.self."
    graph = (_field(5, _tensor("onnx::MatMul_7", [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))   # x(·,2) @ W(2,3)
             + _field(5, _tensor(prefix + "query.bias", [0.5, 0.5, 0.5]))
             + _field(1, _node("MatMul", ["hidden", "onnx::MatMul_7"], ["mm"]))
             + _field(1, _node("Add", [prefix + "query.bias", "mm"], ["q"])))
    model = _field(1, 8) + _field(7, graph)                   # ir_version, then the graph
    tensors, nodes = read_graph(model)
    assert tensors["onnx::MatMul_7"].tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    assert nodes[0] == ("MatMul", ["hidden", "onnx::MatMul_7"], ["mm"])
    state = bert_state(tensors, nodes)
    assert set(state) == {"encoder.layer.0.attention.self.query.bias", "encoder.layer.0.attention.self.query.weight"}
    linear = torch.nn.Linear(2, 3)
    linear.load_state_dict({"weight": state["encoder.layer.0.attention.self.query.weight"],
                            "bias": state["encoder.layer.0.attention.self.query.bias"]})
    with torch.no_grad():
        assert linear(torch.tensor([[1.0, 2.0]]))[0].tolist() == pytest.approx([9.5, 12.5, 15.5])


def test_the_real_l3_maps_onto_student_layers_and_keeps_its_meaning(dataset_dir: Path) -> None:
    from academus.shared.models.model import TeacherEncoder
    from academus.shared.models.teacher_files import teacher_dir
    from academus.shared.models.tokenization import TeacherTokenizer

    state = load_minilm_l3(dataset_dir)
    assert sum(k.startswith("encoder.layer.2.") for k in state) == 16 and len(state) == 53
    config = TeacherEncoder.load(teacher_dir()).body.config
    group = group_from_l3(config, state, 3, [], normalize=False).eval()
    tokenizer = TeacherTokenizer(teacher_dir(), max_tokens=64)
    texts = ["a man is playing a guitar", "someone plays the guitar", "stock markets fell sharply today"]
    encoded = tokenizer.encode(texts, truncate=True)
    width = max(len(e.input_ids) for e in encoded)
    ids = torch.tensor([e.input_ids + [0] * (width - len(e.input_ids)) for e in encoded])
    mask = (ids != 0).long()
    with torch.no_grad():
        emb = torch.nn.functional.normalize(group(ids, mask, None, 1), dim=-1)
    assert torch.allclose(emb, torch.nn.functional.normalize(mean_pool(
        _hidden(group, ids, mask), mask), dim=-1), atol=1e-5)
    assert emb[0] @ emb[1] > 0.7 > emb[0] @ emb[2] + 0.3           # paraphrases close, unrelated far
    with pytest.raises(ValueError, match=r"within 1\.\.3"):
        group_from_l3(config, state, 4, [], normalize=False)


def _hidden(group: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The same three layers run as a plain HF BertModel (an independent path through the weights)."""
    from transformers import BertModel

    bert = BertModel(group.config, add_pooling_layer=False).eval()
    bert.embeddings.load_state_dict(group.embeddings.state_dict())
    bert.encoder.load_state_dict(group.students[0].encoder.state_dict())
    with torch.no_grad():
        return bert(input_ids=ids, attention_mask=mask).last_hidden_state
