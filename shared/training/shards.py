"""`academus shard build | profile` (STI): the teacher cut into quantized shards, and this machine's profile of
them. The command line, `info`, `verify` and `plan` are in `shard_plans.py`, which imports no model code.

`build --model minilm --tasks sentiment,spam [--quick]` (for `--model <task>-students`, the group's students are
cut instead: `student_shards.py`):
1. every layer cut into one shard a head (§4.2), each stored at 2–6 bits (Gaussian outlier-aware, §6) and at
   full precision (`shared/models/shards.py`, `shared/models/shard_store.py`);
2. per task, shard importance (§5.2): the whole model at 2 bits, one shard at a time raised to full
   precision, the model's accuracy on a dev share of the validation split. Ties (a dev share is small and
   many shards move it by no text) are broken by the mean log-probability of the gold label; and the planner's
   upgrade order: the whole model at 6 bits, one shard at a time lowered to 2, ranked by how far that moves its
   output (`profile_sensitivity`);
3. per task, a head for every submodel shape (depth 1..N × width in quarters of the heads), fitted on the
   full-precision submodel's pooled output with the backbone frozen; a width-m layer runs its m most
   important shards (DynaBERT's rewiring). The full shape keeps the served head: the teacher's, on the teacher
   and on a model `shard adapt` trained under it; a user's embedding model's other tasks get one fitted here.
The evaluation runs on the shards as stored (decoded from the files just written).

`build --model NAME` on a user's sequence classifier (`academus models add --task classify`) has one task, its
own: the labels are the classifier's own predictions on the bundled tasks' texts (accuracy here is agreement
with the unmodified classifier, as Apparate defines it), the full shape keeps the classifier's own nonlinear
head, and the other shapes get linear heads on the first token's state, as the classifier pools. It serves as
`NAME-sti`.

`profile [--io SOURCE]` measures the load time per shard and version through the IO source, the decoding
alone, and one layer's compute per width and length bucket (§5.2). JSON summaries are the last line of stdout.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from academus.shared.models.model import ClassifierHead, TeacherEncoder, pad_batch
from academus.shared.models.shard_io import FileSource, io_source
from academus.shared.models.shard_store import (
    OWN_HEAD_PREFIX,
    RELATIVE_BIAS,
    ShardStore,
    add_task,
    shape_key,
    shards_dir,
    write_shard_artifact,
)
from academus.shared.models.shards import (
    ADAPTED_HEADS,
    BITS,
    FIDELITY_TOLERANCE,
    FULL,
    VERSIONS,
    WIDTH_ORDERED,
    LayerWeights,
    ShardGeometry,
    ShardWeights,
    quantize_layers,
)
from academus.shared.models.sti_pipeline import ElasticModel, RunResult, ShardPipeline, load_layer_s
from academus.shared.models.sti_planner import HardwareProfile, Plan
from academus.shared.models.students import config_keys
from academus.shared.models.teacher_files import TEACHER_NAME
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.models.user_models import EncoderBase, open_model, refuse_pairs
from academus.shared.state.catalogue import CLASSIFICATION, read_catalogue, write_entry
from academus.shared.state.uploads import parse_texts_jsonl
from academus.shared.training.data import TASKS, Example, TaskData, fetch, file_task, load_task
from academus.shared.training.prepare import (
    EITHER,
    QUICK_WEIGHT_DECAYS,
    WEIGHT_DECAYS,
    bundled_texts,
    in_text_order,
    load_head,
    padded_batches,
    subsample,
    train_head,
)

MODELS = {"minilm": TEACHER_NAME}
BUCKETS = (16, 32, 64, 128, 256)
# texts a split: (train for heads, validation, dev share for importance; None: all); --quick: a few for tests.
# Sentiment's narrower heads fit on its whole train split (10,248 short reviews): fitted on 3,000, they scored 1.2 pp
# less on its test split on average. Spam's long emails are dear to run, and 1,500 already fit heads above the whole.
SIZES = {"sentiment": (None, None, 500), "spam": (1500, None, 250)}
# --quick: texts a split (train for heads, validation, dev share for importance); 16 dev texts make the two
# rankings' 2 × 72 runs of the upgraded models a third of what 48 did, and a quick ranking is only a plumbing check
QUICK = (96, 64, 16)
OWN_TASK_SIZES = (3000, 1000, 500)   # a user's classifier's own task: its file's texts, or the bundled tasks'


def log(message: str) -> None:
    print(f"[shard] {message}", file=sys.stderr, flush=True)


def sti_model_name(task: str, model: str = "minilm") -> str:
    """The catalogue name a task's shard-served model gets (workers serving every model load it): `<task>-sti`
    on the teacher, `<model>-<task>-sti` on a user's model, `<model>-sti` for a user's classifier's own task
    (named after the classifier)."""
    if model in MODELS:
        return f"{task}-sti"
    return f"{model}-sti" if task == model else f"{model}-{task}-sti"


def encoder_base(artifacts: Path, model: str) -> EncoderBase | None:
    """The encoder whose shards `--model` names: the bundled teacher, or a user's model from the catalogue (an
    embedding model or a sequence classifier); None for anything else (a student group's shards are built
    apart)."""
    if model in MODELS:
        return EncoderBase.bundled()
    entry = read_catalogue(artifacts).get(model)
    if entry is None or "source" not in entry:
        return None
    return EncoderBase.of_entry(model, artifacts, entry)


def is_classifier(artifacts: Path, base: EncoderBase) -> bool:
    """A user's sequence classifier, served with its own head (its shards serve its own task)."""
    return base.user and read_catalogue(artifacts)[base.name]["kind"] == CLASSIFICATION


def widths_of(heads: int) -> list[int]:
    """Quarters of the heads, as DynaBERT's width multipliers (0.25, 0.5, 0.75, 1)."""
    return sorted({max(1, round(heads * q / 4)) for q in range(1, 5)})


# --- building -------------------------------------------------------------------------------------------------

def decoded_bank(store: ShardStore) -> dict[tuple[int, int, int], ShardWeights]:
    """Every stored shard version decoded (checked against its sha256 on the way)."""
    bank = {}
    for (layer, bits), entries in store.index.items():
        with open(store.directory / entries[0].file, "rb") as handle:
            for s, e in enumerate(entries):
                handle.seek(e.offset)
                bank[(layer, s, bits)] = store.decode(layer, s, bits, handle.read(e.length))
    return bank


def write_encoder_shards(directory: Path, encoder: TeacherEncoder, teacher: str, extra: dict[str, Any],
                         log: Callable[[str], None], classifier: bool = False) -> None:
    """The encoder's layers cut and quantized, its word embeddings stored by row, the rest resident; no task
    yet (`add_task`). `classifier`: the encoder is a sequence classifier's body, and the manifest names the
    classifier's architecture (what the shards serve)."""
    config = encoder.body.config
    geometry = ShardGeometry.of(config)
    blobs, resident = quantize_layers(encoder.body.encoder.layer, geometry, log)
    embeddings = encoder.body.embeddings
    resident |= {f"embeddings.{k}": v for k, v in embeddings.state_dict().items()
                 if not k.endswith("_ids") and not k.startswith("word_embeddings.")}
    if encoder.architecture.family.relative_attention:
        resident[RELATIVE_BIAS] = encoder.body.encoder.relative_attention_bias.weight.detach()
    settings = {**config_keys(config), "num_hidden_layers": config.num_hidden_layers}   # what ElasticModel rebuilds
    if classifier:
        settings["architectures"] = list(config.architectures)
    write_shard_artifact(directory, teacher=teacher, geometry=geometry, layer_norm_eps=config.layer_norm_eps,
                         blobs=blobs, resident=resident, heads={}, tasks={},
                         extra={**extra, "config": settings, "pooling": encoder.pooling,
                                "normalize": encoder.normalize},
                         embedding_rows=embeddings.word_embeddings.weight)


class Evaluator:
    """Runs submodels on tokenized texts in padded batches; caches nothing but the batches."""

    def __init__(self, model: ElasticModel, bank: dict[tuple[int, int, int], ShardWeights],
                 tokenizer: TeacherTokenizer, texts: Sequence[str], batch_size: int = 64) -> None:
        self.model, self.bank = model, bank
        self.batches = list(padded_batches(tokenizer, texts, batch_size))
        self.n = len(texts)

    def probs(self, plan: Plan) -> torch.Tensor:
        out = torch.empty(self.n, len(self.model.labels))
        layers = self.model.assemble_plan(plan, self.bank)
        for batch, ids, mask, types in self.batches:
            out[batch] = self.model.run(ids, mask, layers, types)
        return out

    @torch.inference_mode()
    def upgrades(self, base: Plan, bits: int) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(layer, shard, probabilities) of `base` with each shard in turn at `bits`. An upgrade in layer k starts
        from base's states entering layer k (the layers below are base's), so it costs L − k layers, not L: about
        half the compute of running each plan whole, with the same result."""
        layers = self.model.assemble_plan(base, self.bank)
        states = [(batch, self.model.embed(ids, mask, types), mask) for batch, ids, mask, types in self.batches]
        biases = [self.model.position_bias(hidden) for _, hidden, _ in states]
        for k, shards in enumerate(base.shards):
            for s in shards:
                weights = [self.bank[(k, t, bits if t == s else base.bits[(k, t)])] for t in shards]
                upgraded = [*layers[:k], self.model.assemble(k, shards, weights), *layers[k + 1:]]
                out = torch.empty(self.n, len(self.model.labels))
                for (batch, hidden, mask), bias in zip(states, biases, strict=True):
                    out[batch] = self.model.run_from(hidden, mask, upgraded, k, bias)
                yield k, s, out
            states = [(batch, self.model.layer(hidden, mask, k, layers[k], bias), mask)
                      for (batch, hidden, mask), bias in zip(states, biases, strict=True)]

    @torch.no_grad()   # not inference mode: heads are fitted on these with autograd
    def pooled_states(self, shards: list[list[int]]) -> torch.Tensor:
        """[n, depth, H]: the pooled output of each layer of the full-precision submodel."""
        out = torch.empty(self.n, len(shards), self.model.store.geometry.hidden)
        layers = [self.model.assemble(k, layer, [self.bank[(k, s, FULL)] for s in layer])
                  for k, layer in enumerate(shards)]
        for batch, ids, mask, types in self.batches:
            hidden = self.model.embed(ids, mask, types)
            bias = self.model.position_bias(hidden)
            for k, layer in enumerate(layers):
                hidden = self.model.layer(hidden, mask, k, layer, bias)
                out[batch, k] = self.model.pool(hidden, mask)
        return out


def accuracy(probs: torch.Tensor, gold: torch.Tensor) -> tuple[float, float]:
    """Accuracy and the mean log-probability of the gold label."""
    acc = (probs.argmax(1) == gold).float().mean().item()
    logp = probs.gather(1, gold[:, None]).clamp_min(1e-12).log().mean().item()
    return acc, logp


def full_plan(geometry: ShardGeometry, bits: int, order: list[list[int]] | None = None) -> Plan:
    """Every shard at `bits`: the whole model, or the shape `order` names (its layers' shards)."""
    shards = order or [list(range(geometry.heads)) for _ in range(geometry.layers)]
    return Plan("full", len(shards), len(shards[0]), shards,
                {(k, s): bits for k, layer in enumerate(shards) for s in layer})


def profile_importance(evaluator: Evaluator, geometry: ShardGeometry, gold: torch.Tensor
                       ) -> tuple[list[tuple[int, int]], list[dict[str, Any]], float]:
    """§5.2: every shard at the lowest bits; each in turn at full precision; ranked by the dev accuracy."""
    base = full_plan(geometry, BITS[0])
    base_acc, _ = accuracy(evaluator.probs(base), gold)
    table = []
    for k, s, probs in evaluator.upgrades(base, FULL):
        acc, logp = accuracy(probs, gold)
        table.append({"layer": k, "shard": s, "accuracy": round(acc, 5), "log_prob": round(logp, 5)})
        if s == geometry.heads - 1:
            log(f"importance: layer {k} done (all at {BITS[0]} bits: accuracy {base_acc:.4f})")
    ranked = sorted(table, key=lambda r: (-r["accuracy"], -r["log_prob"], r["layer"], r["shard"]))
    return [(r["layer"], r["shard"]) for r in ranked], table, base_acc


def profile_sensitivity(evaluator: Evaluator, geometry: ShardGeometry
                        ) -> tuple[list[tuple[int, int]], list[dict[str, Any]]]:
    """The order of the planner's upgrades (§5.4's second pass): every shard at the highest quantized version, each
    in turn at the lowest, ranked by how far that moves the model's output (mean KL divergence from the base's
    probabilities). §5.2's ranking (`profile_importance`) raises one shard at a time from a model at 2 bits, which
    is at chance on MiniLM: on sentiment its order lost to random orders when upgrading the whole model's shards,
    where this one was ahead of them; on spam neither was reliably ahead (docs/benchmarks/sti.md, the upgrade
    study). It needs no labels."""
    base = full_plan(geometry, BITS[-1])
    expected = evaluator.probs(base)
    table = []
    for k, s, probs in evaluator.upgrades(base, BITS[0]):
        kl = torch.nn.functional.kl_div(probs.clamp_min(1e-12).log(), expected, reduction="batchmean").item()
        table.append({"layer": k, "shard": s, "kl": round(kl, 6)})
    ranked = sorted(table, key=lambda r: (-r["kl"], r["layer"], r["shard"]))
    return [(r["layer"], r["shard"]) for r in ranked], table


def profile_fidelity(evaluator: Evaluator, geometry: ShardGeometry, gold: torch.Tensor) -> tuple[dict[str, float], int]:
    """The whole model's dev accuracy with every shard at one version, and the fewest bits within
    FIDELITY_TOLERANCE of full precision (full precision itself when none is): the task's floor. MiniLM at 2 bits
    is at chance (DynaBERT, the paper's model, is not), so plans that buy width with 2-bit shards lose more than
    the width gains."""
    uniform = {str(b): round(accuracy(evaluator.probs(full_plan(geometry, b)), gold)[0], 4) for b in VERSIONS}
    # none within the tolerance: full precision is the floor (a plan at 6 bits would lose more than it allows)
    floor = next((b for b in BITS if uniform[str(b)] >= uniform[str(FULL)] - FIDELITY_TOLERANCE), FULL)
    return uniform, floor


def fit_head(x: torch.Tensor, y: torch.Tensor, vx: torch.Tensor, vy: torch.Tensor, labels: list[str],
             weight_decays: Sequence[float] = WEIGHT_DECAYS) -> ClassifierHead:
    """A linear head on pooled states, its weight decay chosen on the validation ones (as the served heads'),
    and whether to fit it on standardized states: a narrow submodel's first-token state can barely move between
    texts, where mean-pooled, normalized states fit better raw."""
    head, _, _ = train_head({"train": (x, y), "validation": (vx, vy), "test": (vx, vy)}, labels, weight_decays,
                            scalings=EITHER)
    return head


def fit_shape_heads(train: Evaluator, validation: Evaluator, ytrain: torch.Tensor, yval: torch.Tensor,
                    order: list[list[int]], widths: Sequence[int], served: torch.nn.Module,
                    labels: list[str], weight_decays: Sequence[float] = WEIGHT_DECAYS,
                    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A head for every (depth, width), on the full-precision submodel's pooled output; the full shape keeps
    the served head. Returns the tensors and each shape's validation accuracy."""
    geometry = train.model.store.geometry
    tensors, scores = {}, {}
    for width in widths:
        shards = [layer[:width] for layer in order]
        x, vx = train.pooled_states(shards), validation.pooled_states(shards)
        for depth in range(1, geometry.layers + 1):
            if (depth, width) == (geometry.layers, geometry.heads):
                head = served
            else:
                head = fit_head(x[:, depth - 1], ytrain, vx[:, depth - 1], yval, labels, weight_decays)
            key = shape_key(depth, width)
            if isinstance(head, ClassifierHead):   # a classifier's own head is stored whole (by `build_task`)
                tensors[f"{key}.weight"] = head.linear.weight.detach().clone()
                tensors[f"{key}.bias"] = head.linear.bias.detach().clone()
            with torch.no_grad():
                scores[key] = round((head(vx[:, depth - 1]).argmax(1) == yval).float().mean().item(), 4)
        log(f"heads: width {width}: validation accuracy by depth "
            f"{[scores[shape_key(d, width)] for d in range(1, geometry.layers + 1)]}")
    return tensors, scores


def build(artifacts: Path, model: str, tasks: Sequence[str] | None = None, data_dir: Path | None = None,
          quick: bool = False, texts_file: Path | None = None) -> dict[str, Any]:
    """Writes `shards/<model>/` and registers `<task>-sti` (`<model>-<task>-sti` on a user's model, `<model>-sti`
    for a user's classifier) for each task in the catalogue. `tasks`: the bundled tasks by default; a
    classifier has only its own, on `texts_file`'s texts (JSON lines) or the bundled tasks'."""
    artifacts = Path(artifacts).resolve()
    base = encoder_base(artifacts, model)
    if base is None:
        raise ValueError(f"--model {model!r}: shards are built for minilm or a user's embedding model or classifier")
    refuse_pairs(artifacts, model, "shards")
    classifier = is_classifier(artifacts, base)
    tasks = checked_tasks(model, classifier, tasks)
    if texts_file is not None and not classifier:
        raise ValueError(f"--data gives a sequence classifier's own texts; {model!r} is not one: its shards fit "
                         f"heads on the bundled tasks' labelled examples (--tasks)")
    sizes = dict(zip(("train", "validation"), QUICK if quick else OWN_TASK_SIZES, strict=False))
    texts = own_texts(sizes, texts_file, data_dir) if classifier else {}
    config = json.loads((Path(base.directory) / "config.json").read_text())
    kept_heads = {} if classifier else teachers_heads(artifacts, model, tasks, config, base.user)
    started = time.perf_counter()
    encoder, own_head = open_model(base.directory)[:2] if classifier else (base.encoder(), None)
    directory = shards_dir(artifacts, model)
    teacher = base.identity()   # a user's model: its name and weights' digest, read from its manifest once
    origin = {"own_texts": str(texts_file or "bundled")} if classifier else {}
    write_encoder_shards(directory, encoder, teacher, {"model": model, "quick": quick, **origin}, log, classifier)
    store = ShardStore(directory)
    bank = decoded_bank(store)
    tokenizer = base.tokenizer()
    summary: dict[str, Any] = {"model": model, "geometry": store.geometry.__dict__, "tasks": {}}
    in_index_order = WIDTH_ORDERED in config
    for task in tasks:
        if classifier:
            data, served_head = own_task(model, encoder, own_head, tokenizer, texts), own_head
        else:   # None: a user's embedding model's head is fitted here
            served_head, data = kept_heads.get(task), load_task(task, fetch(data_dir))
        summary["tasks"][task] = build_task(store, bank, tokenizer, task, data, served_head, quick, in_index_order)
        served = sti_model_name(task, model)
        write_entry(artifacts, served, {"kind": CLASSIFICATION, "labels": summary["tasks"][task]["labels"],
                                        "shards": str(directory.relative_to(artifacts)), "task": task,
                                        "teacher": teacher,
                                        **({"base": model, "max_tokens": base.max_tokens} if base.user else {})})
        summary["tasks"][task]["served_as"] = served
    summary |= {"artifact": str(directory), "bytes": store.bytes_by_version(), "quick": quick,
                "seconds": round(time.perf_counter() - started, 1)}
    log(f"wrote {directory} in {summary['seconds']} s")
    return summary


def checked_tasks(model: str, classifier: bool, tasks: Sequence[str] | None) -> list[str]:
    """The tasks a build profiles, checked before anything is written."""
    if classifier:
        if tasks and list(tasks) != [model]:
            raise ValueError(f"--model {model!r} is a sequence classifier: its shards serve its own task (as "
                             f"{sti_model_name(model, model)}), so --tasks {','.join(tasks)} does not apply")
        return [model]
    tasks = list(tasks) if tasks else list(TASKS)
    for task in tasks:
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(TASKS)}")
    return tasks


def own_texts(sizes: dict[str, int | None], texts_file: Path | None, data_dir: Path | None) -> dict[str, list[str]]:
    """A classifier's texts a split, at most `sizes`: its user's file's (split by text hash, as `heads train`
    splits a file), else the bundled tasks' in equal shares. Read before anything is written."""
    if texts_file is None:
        root = fetch(data_dir)
        return {split: bundled_texts(split, n, root) for split, n in sizes.items()}
    if Path(texts_file).is_dir():
        raise ValueError(f"--data {texts_file}: a file of JSON lines {{\"text\": ...}} is wanted, not a directory "
                         f"(dataset packages are --data-dir)")
    if not Path(texts_file).is_file():
        raise ValueError(f"--data {texts_file}: no such file")
    task = file_task(str(texts_file), parse_texts_jsonl(Path(texts_file).read_bytes(), str(texts_file)))
    return {split: [e.text for e in subsample(getattr(task, split), n)] for split, n in sizes.items()}


def own_task(model: str, encoder: TeacherEncoder, head: torch.nn.Module, tokenizer: TeacherTokenizer,
             texts: dict[str, list[str]]) -> TaskData:
    """A classifier's own task: `texts` of each split, each labelled with the classifier's own prediction (so a
    submodel's accuracy is its agreement with the unmodified classifier)."""
    splits: dict[str, list[Example]] = {"train": [], "validation": [], "test": []}
    for split, chunk in texts.items():
        predicted = in_text_order(list(padded_batches(tokenizer, chunk, 64)), len(chunk),
                                  lambda ids, mask, types: head(encoder(ids, mask, types))).argmax(1)
        splits[split] = [Example(t, int(y)) for t, y in zip(chunk, predicted.tolist(), strict=True)]
    return TaskData(model, list(head.labels), splits["train"], splits["validation"], splits["test"])


def build_task(store: ShardStore, bank: dict, tokenizer: TeacherTokenizer, task: str, data: Any,
               served: torch.nn.Module | None, quick: bool, in_index_order: bool = False) -> dict[str, Any]:
    """A task's importance, floor and heads. `served`: the head the whole model serves the task with (None: fitted
    here on the whole model's pooled output, as the other shapes' are; a user's classifier's own head is stored
    whole, as `own.*` tensors). `in_index_order`: the model was trained at every width on its first shards
    (`shard adapt`), so a layer's shards are ranked in index order."""
    geometry = store.geometry
    labels = list(served.labels) if served is not None else list(data.labels)
    train_n, val_n, dev_n = QUICK if quick else SIZES.get(task, OWN_TASK_SIZES)
    decays = QUICK_WEIGHT_DECAYS if quick else WEIGHT_DECAYS
    train, validation = subsample(data.train, train_n), subsample(data.validation, val_n)
    dev = subsample(validation, dev_n)
    log(f"{task}: {len(train)} train texts for heads, {len(validation)} validation, {len(dev)} dev for importance")
    model = ElasticModel(store, task, heads={}, labels=labels)
    fitting = (Evaluator(model, bank, tokenizer, _texts(train)), Evaluator(model, bank, tokenizer, _texts(validation)))
    if served is None:
        whole = [list(range(geometry.heads))] * geometry.layers
        served = fit_head(fitting[0].pooled_states(whole)[:, -1], _gold(train),
                          fitting[1].pooled_states(whole)[:, -1], _gold(validation), labels, decays)
    model.heads[(geometry.layers, geometry.heads)] = served
    on_dev = Evaluator(model, bank, tokenizer, _texts(dev))
    importance, table, base_acc = profile_importance(on_dev, geometry, _gold(dev))
    if in_index_order:
        importance = layers_in_index_order(importance)
    upgrade_order, sensitivity = profile_sensitivity(on_dev, geometry)
    uniform, min_bits = profile_fidelity(on_dev, geometry, _gold(dev))
    log(f"{task}: the whole model at uniform bits {uniform} on dev: fewest bits within "
        f"{FIDELITY_TOLERANCE:.0%} of full precision: {min_bits}")
    order = [[s for (k, s) in importance if k == layer] for layer in range(geometry.layers)]
    widths = widths_of(geometry.heads)
    tensors, scores = fit_shape_heads(*fitting, _gold(train), _gold(validation), order, widths, served, labels,
                                      decays)
    own = not isinstance(served, ClassifierHead)   # a user's classifier's own head: stored whole
    if own:
        tensors |= {f"{OWN_HEAD_PREFIX}{k}": v.detach().clone() for k, v in served.state_dict().items()}
    meta = {"labels": labels, "importance": [list(x) for x in importance],
            "upgrade_order": [list(x) for x in upgrade_order], "widths": widths,
            "depths": list(range(1, geometry.layers + 1)), "min_bits": min_bits, "own_head": own,
            "metrics": {"validation_texts": len(validation), "dev_texts": len(dev),
                        "all_low_bits_accuracy": round(base_acc, 4), "uniform_accuracy": uniform,
                        "importance_table": table, "sensitivity_table": sensitivity, "validation_accuracy": scores}}
    add_task(store.directory, task, tensors, meta)
    return {"labels": labels, "importance_top": importance[:8], "upgrade_order_top": upgrade_order[:8],
            "all_low_bits_accuracy": round(base_acc, 4),
            "validation_accuracy_full": scores[shape_key(geometry.layers, geometry.heads)]}


def teachers_heads(artifacts: Path, model: str, tasks: Sequence[str], config: dict[str, Any], user: bool
                   ) -> dict[str, ClassifierHead]:
    """The served heads the full shape keeps: all of them on the teacher; on a user's model, those of the tasks
    `shard adapt` trained it under (its config names them). Refused by name, before anything is written, when the
    model's states are not a head's width."""
    kept = [t for t in tasks if not user or t in config.get(ADAPTED_HEADS, [])]
    heads = {task: load_head(artifacts, task) for task in kept}
    for task, head in heads.items():
        if head.linear.in_features != config["hidden_size"]:
            raise ValueError(f"--model {model!r}: its config names {task!r} among the tasks trained under the "
                             f"teacher's heads ({ADAPTED_HEADS}), but its states have {config['hidden_size']} "
                             f"features and the head reads {head.linear.in_features}")
    return heads


def layers_in_index_order(importance: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ranking with each layer keeping the places it had, filled with its shards in index order."""
    taken: Counter[int] = Counter()
    ranked = []
    for layer, _ in importance:
        ranked.append((layer, taken[layer]))
        taken[layer] += 1
    return ranked


def _texts(examples: Sequence[Example]) -> list[str]:
    return [e.text for e in examples]


def _gold(examples: Sequence[Example]) -> torch.Tensor:
    return torch.tensor([int(e.label) for e in examples])


# --- profiling and planning -----------------------------------------------------------------------------------

def measure_profile(store: ShardStore, source_spec: str, repeats: int = 20) -> HardwareProfile:
    """§5.2 on this machine: a layer's compute per width and length bucket; per version, a shard's load (read
    through the source, check, decode, its share of putting the layer together) and its decoding alone, measured a
    whole layer at a time *while a layer computes* on the other thread, as in the pipeline (alone, loads measured
    10-40 % faster than the pipeline's), beside a layer of each width; then the rest of a run, timed inside runs
    (`_rest_in_runs`)."""
    geometry = store.geometry
    model = ElasticModel(store, "", heads={})
    weights = [[store.decode(k, s, FULL, store.read_stored(k, s, FULL)) for s in range(geometry.heads)]
               for k in range(geometry.layers)]
    compute: dict[int, dict[int, float]] = {}
    config = store.manifest.extra["config"]
    token = min(1996, int(config["vocab_size"]) - 1)   # any id: timing needs no meaning
    buckets = tuple(b for b in BUCKETS if b <= int(config["max_position_embeddings"]))
    with torch.inference_mode():
        for bucket in buckets:
            ids, mask, _ = pad_batch([[token] * bucket])
            hidden = model.embed(ids, mask)
            for width in widths_of(geometry.heads):
                compute.setdefault(width, {})[bucket] = _layer_ms(model, weights, width, hidden, mask, repeats)
    source = io_source(source_spec)
    by_width = {width: _load_profile(store, model, source, max(3, repeats // 4),
                                     model.assemble(0, list(range(width)), weights[0][:width]), token)
                for width in widths_of(geometry.heads)}
    overhead, finish, setup = _rest_in_runs(model, source, buckets, repeats)   # closes the model and the source
    load_ms, decode_ms = by_width[geometry.heads]
    return HardwareProfile(source.name, load_ms, decode_ms, compute, overhead, buckets,
                           {w: loads for w, (loads, _) in by_width.items()},
                           {w: decodes for w, (_, decodes) in by_width.items()}, finish, setup)


def _rest_in_runs(model: ElasticModel, source: FileSource, buckets: Sequence[int], repeats: int
                  ) -> tuple[dict[int, float], dict[int, float], dict[int, dict[int, float]]]:
    """What a pipeline run spends outside its layers and the waits for their shards: (per bucket, the fixed part;
    per bucket, the part after the last layer; per width and bucket, the part a layer of the plan adds). Runs at
    the lowest version, one layer deep and the whole depth, on ids whose rows the first run caches, as traffic's
    frequent tokens are. Timed in a loop, the rows, the embedding, pooling and head took a third of what runs pay
    them, their caches cold after the layers; setting up a plan's loads costs the compute tens of microseconds a
    layer, more at a wider width and a longer text (docs/benchmarks/sti.md)."""
    store = model.store
    geometry = store.geometry
    vocab = int(store.manifest.extra["config"]["vocab_size"])
    bits, depth, widths = min(store.versions), geometry.layers, widths_of(geometry.heads)
    model.heads.update({(d, w): ClassifierHead(["a", "b"], geometry.hidden) for d in (1, depth) for w in widths})
    pipeline = ShardPipeline(model, source)

    def runs(d: int, w: int, bucket: int) -> list[RunResult]:
        ids, mask, _ = pad_batch([[(1000 + i) % vocab for i in range(bucket)]])
        plan = full_plan(geometry, bits, [list(range(w))] * d)
        return [pipeline.run(plan, ids, mask) for _ in range(repeats + 1)][1:]   # the first caches the rows and
        # builds the plan's loads, as a worker's first run of a plan does

    def rest(done: list[RunResult]) -> float:
        return statistics.median(r.rest_ms for r in done)

    overhead: dict[int, float] = {}
    finish: dict[int, float] = {}
    setup: dict[int, dict[int, float]] = {w: {} for w in widths}
    try:
        for bucket in buckets:
            shallow = {w: runs(1, w, bucket) for w in widths}
            for w in widths:
                setup[w][bucket] = max(0.0, (rest(runs(depth, w, bucket)) - rest(shallow[w])) / max(1, depth - 1))
            whole = shallow[geometry.heads]
            overhead[bucket] = max(0.0, rest(whole) - setup[geometry.heads][bucket])
            finish[bucket] = statistics.median(r.finish_ms for r in whole)
    finally:
        pipeline.close()
    return overhead, finish, setup


def _layer_ms(model: ElasticModel, weights: list[list[ShardWeights]], width: int, hidden: torch.Tensor,
              mask: torch.Tensor, repeats: int) -> float:
    """A layer's compute at `width`: a pass through every layer, each on its own weights, over the depth. One
    layer run again and again keeps its weights in the core's caches: it measured 4-38 % under a pass."""
    layers = [model.assemble(k, list(range(width)), shards[:width]) for k, shards in enumerate(weights)]

    def sweep() -> None:
        states = hidden
        for k, layer in enumerate(layers):
            states = model.layer(states, mask, k, layer)

    return median_ms(sweep, repeats) / len(layers)


def _load_profile(store: ShardStore, model: ElasticModel, source: FileSource, repeats: int, busy: LayerWeights,
                  token: int) -> tuple[dict[int, float], dict[int, float]]:
    """Per version: (load, decode) ms a shard, medians over whole layers loaded while `busy` computes."""
    geometry = store.geometry
    stop = threading.Event()
    ids, mask, _ = pad_batch([[token] * 32])

    def compute() -> None:
        with torch.inference_mode():
            hidden = model.embed(ids, mask)
            while not stop.is_set():
                model.layer(hidden, mask, 0, busy)

    worker = threading.Thread(target=compute, daemon=True)
    worker.start()
    load_ms: dict[int, float] = {}
    decode_ms: dict[int, float] = {}
    try:
        for bits in store.versions:
            loads, decodes = [], []
            for r in range(repeats):
                k = r % geometry.layers
                shards = list(range(geometry.heads))
                blobs = [store.read_stored(k, s, bits) for s in shards]
                source.before_run(store.paths())
                loads.append(load_layer_s(model, source, k, shards, bits) / len(shards))   # as a plan loads
                t1 = time.perf_counter()
                store.build_layer(k, shards, bits, blobs, model.residents[k])
                decodes.append((time.perf_counter() - t1) / len(shards))
            load_ms[bits], decode_ms[bits] = statistics.median(loads) * 1e3, statistics.median(decodes) * 1e3
    finally:
        stop.set()
        worker.join()
    return load_ms, decode_ms


def median_ms(fn: Any, repeats: int) -> float:
    """The median wall time of `fn` in ms over `repeats` calls, after three warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3
