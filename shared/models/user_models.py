"""The user's models in the catalogue: `academus models add NAME --from DIR`, `models list`, `models remove NAME`.

DIR is a transformers directory: config.json, safetensors weights, and tokenizer.json (or the files a
tokenizer is built from: vocab.txt, or vocab.json + merges.txt). `add` checks it whole before anything is
written, copies what serving needs to `<artifacts>/models/NAME/` with a manifest of sha256 checksums (workers
verify them before loading), and only then adds the catalogue entry that workers watch: a refused or failed
add leaves nothing behind. Nothing is fetched from a hub.

Pooling of an embedding model: `--pooling`, else its sentence-transformers config (1_Pooling/config.json),
else the mean. Its embeddings are L2-normalised unless a sentence-transformers modules.json without a
Normalize module says otherwise. A sequence classifier is served with its own head and id2label.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from academus.shared.models.architectures import (
    FIRST,
    MEAN,
    POOLINGS,
    Architecture,
    UnsupportedArchitecture,
    read_architecture,
)
from academus.shared.state.artifacts import MANIFEST, ArtifactError, Manifest, read_manifest, sha256_file, verify_files
from academus.shared.state.catalogue import (
    CLASSIFICATION,
    EMBEDDING,
    MODEL_NAME,
    ModelSpec,
    read_catalogue,
    write_entry,
)

MODELS_DIR = "models"             # under the artifacts
USER_MODEL_KIND = "user-model"    # the manifest's kind
EMBED, CLASSIFY = "embed", "classify"
TOKENIZER = "tokenizer.json"
MAX_TOKENS = 512                  # the longest input served, whatever the position embeddings allow
HEAD_ON = "encoder_model"         # a head's catalogue entry: the user's model whose encoder it reads
STUDENTS_OF = "teacher_model"     # a student group's entry: the user's model whose tokenizer it reads
ST_POOLING = {"pooling_mode_mean_tokens": MEAN, "pooling_mode_cls_token": FIRST}


class ModelRefused(ValueError):
    """`models add` or `models remove` refused: the message names the file (or model) and the problem."""


@dataclass(frozen=True)
class ModelSource:
    """A checked model directory and how it will be served."""

    directory: Path
    architecture: Architecture
    task: str                      # EMBED | CLASSIFY
    pooling: str
    normalize: bool
    labels: list[str]
    weights: list[str]             # safetensors files, relative to the directory
    shapes: dict[str, list[int]]
    max_tokens: int
    tokenizer_json: str = ""       # tokenizer.json as the copy holds it (read, or built from the vocabulary files)
    pairs: bool = False            # a classifier of text pairs (a cross-encoder), `models add --pairs`


def inspect_model_dir(directory: Path, task: str = "", pooling: str = "", pairs: bool = False) -> ModelSource:
    """Checks everything `add` needs, reading only headers and small files; ModelRefused otherwise. `pairs`: the
    classifier reads a text and its pair together (a cross-encoder), as it was trained."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ModelRefused(f"{directory} is not a directory")
    config = _json_file(directory / "config.json", required=True)
    try:
        architecture = read_architecture(config, str(directory / "config.json"))
    except UnsupportedArchitecture as e:
        raise ModelRefused(str(e)) from e
    task = _task(directory, architecture, task)
    labels = _labels(directory, config) if task == CLASSIFY else []
    weights = _weight_files(directory)
    shapes = _check_weights(directory, weights, architecture)
    tokenizer_json = _check_tokenizer(directory, architecture)
    if pooling and task == CLASSIFY:
        raise ModelRefused(f"--pooling applies to embedding models; {directory} is served as a classifier, pooled at "
                           "its first token as its head was trained")
    if pairs and task != CLASSIFY:
        raise ModelRefused(f"--pairs applies to classifiers; {directory} is served as an embedding model, which scores "
                           "a pair by its two texts' embeddings")
    pooled, normalize = (FIRST, False) if task == CLASSIFY else _sentence_pooling(directory, pooling)
    return ModelSource(directory, architecture, task, pooled, normalize, labels, weights, shapes,
                       _max_tokens(directory, architecture), tokenizer_json, pairs)


def add_model(artifacts: Path, name: str, directory: Path, task: str = "", pooling: str = "",
              pairs: bool = False) -> dict[str, Any]:
    """Copies the checked model under the artifacts, verifies it loads, then registers it; returns its entry."""
    if not MODEL_NAME.match(name):
        raise ModelRefused(f"model name {name!r} must be 1-63 of a-z 0-9 . _ -, starting with a letter or digit")
    if name in read_catalogue(artifacts):
        raise ModelRefused(f"model {name!r} is already in the catalogue: remove it first (academus models remove "
                           f"{name})")
    source = inspect_model_dir(directory, task, pooling, pairs)
    target = Path(artifacts) / MODELS_DIR / name
    staging = target.parent / f".{name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        staging.mkdir(parents=True)
        _copy(source, staging)
        _write_manifest(source, staging)
        _check_loads(staging)
        if target.exists():            # left by a remove that crashed half-way: not in the catalogue
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    entry = catalogue_entry(source, f"{MODELS_DIR}/{name}")
    write_entry(artifacts, name, entry)
    return {"name": name, **entry}


def catalogue_entry(source: ModelSource, ref: str) -> dict[str, Any]:
    a = source.architecture
    # `added` tells a re-added model from the one it replaces, whose entry it may otherwise equal: a worker
    # retries an entry that failed to load only once it changes
    return {"kind": CLASSIFICATION if source.task == CLASSIFY else EMBEDDING, "source": ref,
            "architecture": a.name, "dim": a.hidden_size, "layers": a.layers, "max_tokens": source.max_tokens,
            "pooling": source.pooling, "normalize": source.normalize, "labels": source.labels,
            **({"pairs": True} if source.pairs else {}), "added": datetime.now(UTC).isoformat(timespec="microseconds")}


def list_models(artifacts: Path) -> list[dict[str, Any]]:
    """Every catalogue entry: the user's models with their architecture and size on disk, then the rest."""
    rows = []
    for name, entry in sorted(read_catalogue(artifacts).items()):
        row = {"name": name, "kind": entry.get("kind", ""), "user": "source" in entry or HEAD_ON in entry}
        if HEAD_ON in entry:   # a head trained on a user's model (`academus heads train`)
            row |= {"encoder_model": entry[HEAD_ON], "labels": entry.get("labels", [])}
        if "source" in entry:
            directory = Path(artifacts) / entry["source"]
            row |= {k: entry.get(k) for k in ("architecture", "dim", "layers", "max_tokens", "pooling", "labels")}
            row["pairs"] = bool(entry.get("pairs"))
            row["bytes"] = sum(p.stat().st_size for p in directory.iterdir()) if directory.is_dir() else 0
        rows.append(row)
    return rows


def remove_model(artifacts: Path, name: str, tenants_on_it: list[str] = ()) -> None:
    """Drops a user's model, or a head, student group, PLOT model or shard-served model on one, from the catalogue
    (workers unload it) and then its files (a table or shards once no entry names them). Refused for a bundled model,
    for a model heads, groups, PLOT tables or shards are built on (named), and while tenant models use it as their
    base (`tenants_on_it`, read from the mesh)."""
    catalogue = read_catalogue(artifacts)
    entry = catalogue.get(name)
    if entry is None:
        raise ModelRefused(f"model {name!r} is not in the catalogue {Path(artifacts) / 'models.json'}")
    # `plot build --model` or `shard build --model` on a user's model
    on_user_model = ("plot" in entry or "shards" in entry) and "source" in catalogue.get(entry.get("base", ""), {})
    if not on_user_model and not any(key in entry for key in ("source", HEAD_ON, STUDENTS_OF)):
        raise ModelRefused(f"model {name!r} is built by `academus prepare`, not added with `models add`: "
                           "it is not removed here")
    if plots := sorted(n for n, e in catalogue.items() if "plot" in e and e.get("base") == name):
        raise ModelRefused(f"model {name!r} is the base of the PLOT models {', '.join(plots)}: remove those first")
    if sharded := sorted(n for n, e in catalogue.items() if "shards" in e and e.get("base") == name):
        raise ModelRefused(f"model {name!r} is cut into the shards of {', '.join(sharded)}: remove those first")
    if heads := sorted(n for n, e in catalogue.items() if e.get(HEAD_ON) == name):
        raise ModelRefused(f"model {name!r} carries the heads {', '.join(heads)}: remove those first")
    if groups := sorted(n for n, e in catalogue.items() if e.get("teacher") == name and STUDENTS_OF in e):
        raise ModelRefused(f"model {name!r} is the teacher of the student groups {', '.join(groups)}: remove those "
                           "first")
    if tenants_on_it:
        raise ModelRefused(f"model {name!r} is the base of tenant models of {', '.join(sorted(tenants_on_it))}: "
                           "delete those first (academus tenants delete)")
    write_entry(artifacts, name, None)
    files = next((entry[k] for k in ("source", "head", "students", "plot", "shards") if entry.get(k)), None)
    if files and not any(files in e.values() for e in read_catalogue(artifacts).values()):   # `-2l` shares them
        shutil.rmtree(Path(artifacts) / files, ignore_errors=True)


def open_model(directory: Path, device: str | Any = "cpu") -> tuple[Any, Any, Manifest]:
    """A copy under the artifacts as it is served: its files checked against their sha256, then its encoder
    pooled as its manifest says, and its own head when it is served as a classifier. (encoder, head, manifest)."""
    from academus.shared.models.model import load_encoder

    manifest = verify_model_files(directory)
    encoder, head = load_encoder(directory, device, manifest.extra["pooling"], manifest.extra["normalize"],
                                 classify=manifest.task == CLASSIFY)
    return encoder, head, manifest


def refuse_pairs(artifacts: Path, name: str, built: str) -> None:
    """What is `built` on a model (students, ramps, shards) learns from single texts: refused for a classifier of text
    pairs, whose answers a single text cannot give."""
    if read_catalogue(artifacts).get(name, {}).get("pairs"):
        raise ModelRefused(f"model {name!r} classifies text pairs (a cross-encoder, `models add --pairs`): {built} "
                           "learn from single texts, and are not built on it")


def cache_name(model: str, manifest: Manifest) -> str:
    """What names a user's model's embedding caches: its name and weights' digest (a model re-added under the
    same name with other weights does not read the old cache)."""
    weights = sorted(v for k, v in manifest.files.items() if k.endswith(".safetensors"))
    digest = weights[0] if len(weights) == 1 else hashlib.sha256("".join(weights).encode()).hexdigest()
    return f"{model}-{digest[:12]}"


BUNDLED_BASE = "minilm"   # the bundled teacher's served name: the base every other model here is not


@dataclass(frozen=True)
class EncoderBase:
    """An encoder others are built on (tenant adapters, PLOT tables): the bundled teacher, or a user's embedding
    model from the catalogue. It opens its encoder and tokenizer, and names its weights."""

    name: str
    directory: Path     # its tokenizer.json; a user's model's checked files
    max_tokens: int
    user: bool

    @classmethod
    def bundled(cls) -> EncoderBase:
        from academus.shared.models.teacher_files import teacher_dir

        return cls(BUNDLED_BASE, teacher_dir(), ModelSpec.max_tokens, False)

    @classmethod
    def of_entry(cls, name: str, artifacts: Path, entry: dict[str, Any]) -> EncoderBase:
        """A user's model, from its catalogue entry."""
        return cls(name, Path(artifacts) / entry["source"], int(entry["max_tokens"]), True)

    def encoder(self, device: str | Any = "cpu") -> Any:
        """Its encoder, pooled as it is served (a user's model's files checked against their sha256 first)."""
        from academus.shared.models.model import TeacherEncoder

        return open_model(self.directory, device)[0] if self.user else TeacherEncoder.load(device=device)

    def tokenizer(self) -> Any:
        from academus.shared.models.tokenization import TeacherTokenizer

        return TeacherTokenizer(self.directory, max_tokens=self.max_tokens)

    def identity(self) -> str:
        """What names its weights: the bundled checkpoint; a user's model's name and weights' digest (one added again
        under its name with other weights is another)."""
        from academus.shared.models.teacher_files import TEACHER_NAME

        return cache_name(self.name, read_manifest(self.directory)) if self.user else TEACHER_NAME


def verify_model_files(directory: Path) -> Manifest:
    """The manifest, after checking every file it lists against its sha256 (what a worker does before loading)."""
    manifest = read_manifest(directory)
    if manifest.kind != USER_MODEL_KIND:
        raise ArtifactError(f"{directory}/{MANIFEST} is a {manifest.kind!r}, not a {USER_MODEL_KIND!r}")
    verify_files(directory, manifest)
    return manifest


# --- checks ---------------------------------------------------------------------------------------

def _json_file(path: Path, required: bool = False, expected: type = dict) -> Any:
    """The file's JSON, which must be an `expected` (dict: an object, list: a list); an empty one when absent."""
    if not path.is_file():
        if required:
            raise ModelRefused(f"{path} is missing: a model directory needs its config.json")
        return expected()
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelRefused(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, expected):
        raise ModelRefused(f"{path} is not a JSON {'object' if expected is dict else 'list of modules'}")
    return data


def _task(directory: Path, architecture: Architecture, task: str) -> str:
    if task not in ("", EMBED, CLASSIFY):
        raise ModelRefused(f"--task {task!r} is not one of {EMBED}, {CLASSIFY}")
    if task == CLASSIFY and not architecture.classifier:
        raise ModelRefused(f"{directory}/config.json: {architecture.name} has no classification head; serve it "
                           f"with --task {EMBED}")
    return task or (CLASSIFY if architecture.classifier else EMBED)


def _labels(directory: Path, config: dict[str, Any]) -> list[str]:
    """A classifier's answers: config.json's id2label, ids 0..n-1."""
    id2label = config.get("id2label")
    if not isinstance(id2label, dict) or not id2label:
        raise ModelRefused(f"{directory}/config.json has no id2label: a classifier's labels are its answers")
    try:
        by_id = {int(k): str(v) for k, v in id2label.items()}
    except ValueError as e:
        raise ModelRefused(f"{directory}/config.json: id2label keys must be integers: {e}") from e
    if sorted(by_id) != list(range(len(by_id))):
        raise ModelRefused(f"{directory}/config.json: id2label ids {sorted(by_id)} are not 0..{len(by_id) - 1}")
    return [by_id[i] for i in range(len(by_id))]


def _weight_files(directory: Path) -> list[str]:
    if (directory / "model.safetensors").is_file():
        return ["model.safetensors"]
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_json_file(index).get("weight_map", {}).values()))
        missing = [s for s in shards if not (directory / s).is_file()]
        if not shards or missing:
            raise ModelRefused(f"{index} names shards that are not there: {missing or 'none listed'}")
        return shards
    if any((directory / f).is_file() for f in ("pytorch_model.bin", "model.bin")):
        raise ModelRefused(f"{directory} holds pickled weights (pytorch_model.bin) only: Academus loads safetensors, "
                           "which cannot run code; save the model with save_pretrained(safe_serialization=True)")
    raise ModelRefused(f"{directory} has no weights: expected model.safetensors (or model.safetensors.index.json "
                       "and its shards)")


def _check_weights(directory: Path, weights: list[str], architecture: Architecture) -> dict[str, list[int]]:
    """Every tensor's shape, from the files' headers; the word embeddings must match the config."""
    from safetensors import SafetensorError, safe_open

    shapes: dict[str, list[int]] = {}
    for name in weights:
        try:
            with safe_open(str(directory / name), framework="pt") as f:
                shapes |= {key: list(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelRefused(f"{directory / name} is not a readable safetensors file: {e}") from e
    embeddings = [shape for key, shape in shapes.items() if key.endswith("word_embeddings.weight")]
    expected = [architecture.vocab_size, architecture.hidden_size]
    if not embeddings:
        raise ModelRefused(f"{directory / weights[0]} holds no word embeddings (no *.word_embeddings.weight)")
    if embeddings[0] != expected:
        raise ModelRefused(f"{directory / weights[0]}: the word embeddings are {embeddings[0]}, config.json says "
                           f"vocab_size x hidden_size = {expected}")
    return shapes


def _check_tokenizer(directory: Path, architecture: Architecture) -> str:
    """tokenizer.json's text: the file's, or built from the vocabulary files when there is none. Its ids must
    all be rows of the embeddings."""
    from tokenizers import Tokenizer

    path = directory / TOKENIZER
    if path.is_file():
        raw, where = path.read_text(encoding="utf-8"), str(path)
    else:
        where = f"the tokenizer from {', '.join(_tokenizer_sources(directory))} in {directory}"
        raw = _built_tokenizer(directory).backend_tokenizer.to_str()
    try:
        vocab = Tokenizer.from_str(raw).get_vocab(with_added_tokens=True)
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        raise ModelRefused(f"{where} cannot be read as a tokenizer: {e}") from e
    top = max(vocab.values(), default=-1)
    if top >= architecture.vocab_size:
        raise ModelRefused(f"{where} has token ids up to {top}; config.json's vocab_size (the embeddings' rows) is "
                           f"{architecture.vocab_size}: the tokenizer is not this model's")
    return raw


def _tokenizer_sources(directory: Path) -> list[str]:
    for files in (["vocab.txt"], ["vocab.json", "merges.txt"]):
        if all((directory / f).is_file() for f in files):
            return files
    raise ModelRefused(f"{directory} has no tokenizer: expected {TOKENIZER}, or vocab.txt, or vocab.json and "
                       "merges.txt")


def _built_tokenizer(directory: Path) -> Any:
    """The fast tokenizer transformers builds from the vocabulary files (and tokenizer_config.json)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), use_fast=True)
    except (OSError, ValueError, TypeError) as e:
        raise ModelRefused(f"{directory}: no tokenizer can be built from its vocabulary files: {e}") from e


def _sentence_pooling(directory: Path, pooling: str) -> tuple[str, bool]:
    if pooling and pooling not in POOLINGS:
        raise ModelRefused(f"--pooling {pooling!r} is not one of {', '.join(POOLINGS)}")
    modules = directory / "modules.json"
    normalize = True
    if modules.is_file():
        types = [str(m.get("type", "")) for m in _json_file(modules, expected=list) if isinstance(m, dict)]
        normalize = any(t.endswith("Normalize") for t in types)
    if pooling:
        return pooling, normalize
    config = _json_file(directory / "1_Pooling" / "config.json")
    modes = [mode for key, mode in ST_POOLING.items() if config.get(key)]
    other = [k for k, v in config.items() if k.startswith("pooling_mode") and v and k not in ST_POOLING]
    if other or len(modes) > 1:
        raise ModelRefused(f"{directory}/1_Pooling/config.json asks for {', '.join(other + modes)}; served "
                           f"poolings: {', '.join(POOLINGS)} (choose one with --pooling)")
    return (modes[0] if modes else MEAN), normalize


def _max_tokens(directory: Path, architecture: Architecture) -> int:
    """The longest input: what the positions can number, the sentence-transformers limit, and MAX_TOKENS."""
    limits = [architecture.max_tokens, MAX_TOKENS]
    if seq := _json_file(directory / "sentence_bert_config.json").get("max_seq_length"):
        limits.append(int(seq))
    return min(limits)


# --- writing ----------------------------------------------------------------------------------------

def _copy(source: ModelSource, staging: Path) -> None:
    # shards load only through their index (transformers looks for model.safetensors otherwise)
    index = [] if source.weights == ["model.safetensors"] else ["model.safetensors.index.json"]
    for name in ("config.json", *index, *source.weights):
        shutil.copyfile(source.directory / name, staging / name)
    (staging / TOKENIZER).write_text(source.tokenizer_json, encoding="utf-8")


def _write_manifest(source: ModelSource, staging: Path) -> None:
    a = source.architecture
    files = {p.name: sha256_file(p) for p in sorted(staging.iterdir())}
    manifest = Manifest(
        kind=USER_MODEL_KIND, teacher=a.name, task=source.task, created=datetime.now(UTC).isoformat(timespec="seconds"),
        shapes=source.shapes, files=files, labels=source.labels,
        extra={"architecture": a.name, "family": a.family.name, "pooling": source.pooling,
               "normalize": source.normalize, "hidden_size": a.hidden_size, "layers": a.layers, "heads": a.heads,
               "vocab_size": a.vocab_size, "max_tokens": source.max_tokens, "from": str(source.directory)})
    (staging / MANIFEST).write_text(manifest.to_json() + "\n")


def _check_loads(staging: Path) -> None:
    """Loads the copy as a worker will: a weight the architecture needs and the files lack is refused here."""
    manifest = read_manifest(staging)
    try:
        open_model(staging)
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelRefused(f"{manifest.extra['from']}: the weights do not load as {manifest.teacher}: {e}") from e
