"""The worker's model runner: teacher encoder + task heads, one padded or packed batch at a time.

Knows nothing of gRPC. All three default models share one encoder pass: `minilm` returns the
embedding, `sentiment` and `spam` apply their linear heads to the same embedding. `null` has no
encoder: it answers zeros, so that a mesh serving it measures the serving stack alone. A user's model
(`academus models add`) is its own encoder and, for a classifier, its own head; a runner serving the whole
catalogue follows it as models are added and removed (`refresh`).
"""

from __future__ import annotations

import logging
import re
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from prometheus_client import Gauge, Histogram
from torch import nn

from academus.services.worker.adapters import TenantBatch
from academus.services.worker.exits import ExitRun, ModelExits, Release, load_exits, ramps_stamp
from academus.services.worker.sti import StiModel, StiSettings
from academus.services.worker.student_memory import StudentMemory
from academus.services.worker.traced import trace_layers
from academus.shared.models.adapters import encode_with_adapters
from academus.shared.models.exits import ControllerSettings
from academus.shared.models.model import (
    HIDDEN_SIZE,
    ClassifierHead,
    TeacherEncoder,
    pad_batch,
    probabilities,
    weight_bytes,
)
from academus.shared.models.packing import Attention, PackedBatch, PackingPlan, check_plan, encode_packed, pack
from academus.shared.models.plot.table import PlotError
from academus.shared.models.shard_io import io_source
from academus.shared.models.student_shards import STUDENT_SHARDS, open_student_shards
from academus.shared.models.students import SEQUENCE, Student, StudentGroup
from academus.shared.models.teacher_files import TEACHER_NAME
from academus.shared.models.user_models import HEAD_ON, STUDENTS_OF, TOKENIZER
from academus.shared.models.work import FINISH_L2, FINISH_SOFTMAX, FINISH_SUM, Batch, PlotStates, ShardRun, split_flat
from academus.shared.runtime.config import visible_cuda_devices
from academus.shared.runtime.errors import DeadlineExceeded, InvalidArgument, NotFound
from academus.shared.runtime.logs import log_event
from academus.shared.runtime.metrics import children
from academus.shared.state.artifacts import ArtifactError, Manifest, read_manifest
from academus.shared.state.catalogue import CLASSIFICATION, EMBEDDING, ModelSpec, catalogue_stamp, read_catalogue

if TYPE_CHECKING:
    from academus.shared.models.plot import PlotStore

OUTPUT_EMBEDDING = "embedding"
OUTPUT_PROBS = "probs"
WARM_UP_TOKEN = 1996   # any id of the shared vocabulary ("the"): tracing needs inputs, not meaning
LAYER_NAME = re.compile(r"encoder\.layer\.(\d+)$")  # HF BERT layers, in the teacher and in students

BATCH_SIZE = Histogram("academus_worker_batch_size_texts", "Texts a batch the worker ran", ["model"],
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
PADDING_RATIO = Histogram("academus_worker_padding_ratio",
                          "Share of a batch's computed token positions that held no text: padding (padded batches), "
                          "unused row slots (packed, ConcatBatching)", ["model"],
                          buckets=(0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0))
MODEL_BYTES = Gauge("academus_worker_model_bytes", "Bytes of a served model's weights in this worker's memory "
                    "(weights shared by several models counted in each)", ["model"])
_batch_size, _padding_ratio = children(BATCH_SIZE), children(PADDING_RATIO)


class CallerLeft(Exception):
    """The batch's call was cancelled (every caller went away): the rest of its forward pass is skipped."""


@dataclass(frozen=True)
class BatchResult:
    values: np.ndarray       # rows x dim, float32
    labels: list[str]
    compute_ms: float
    padded_tokens: int
    real_tokens: int
    student_count: int = 1
    finish: str = ""         # group-member answers: what the combiner applies after summing (FINISHES)
    shards: ShardRun | None = None   # a model served from shards: the submodel that ran (STI)

    @property
    def padding_ratio(self) -> float:
        """The share of the computed token positions that held no text."""
        return 1 - self.real_tokens / max(self.padded_tokens, 1)



def resolve_device(wanted: str) -> torch.device:
    """The configured device, or CPU when CUDA is not there (every GPU path falls back)."""
    if wanted.startswith("cuda") and torch.cuda.is_available():
        return torch.device(wanted)
    return torch.device("cpu")


def device_label(device: torch.device) -> str:
    """The device as placement sees it: a GPU by its physical index (CUDA_VISIBLE_DEVICES pins a
    worker to one GPU, which it then calls cuda:0), else "cpu"."""
    if device.type != "cuda":
        return "cpu"
    visible = visible_cuda_devices()
    return f"cuda:{visible}" if visible and "," not in visible else str(device)


def split_lengths(flat: Sequence[int], lengths: Sequence[int], name: str = "input_ids") -> list[Sequence[int]]:
    """Each text's `flat` ids; INVALID_ARGUMENT when the lengths do not add up to them."""
    try:
        return split_flat(flat, lengths, name)
    except ValueError as e:
        raise InvalidArgument(str(e)) from e


@dataclass
class ServedModel:
    """One served name: an encoder that pools (the teacher, or a student group) and an optional head."""

    spec: ModelSpec
    encoder: nn.Module
    head: nn.Module | None = None  # ClassifierHead, or a user's classifier's own (SequenceClassifierHead)
    max_students: int = 0          # 0: the teacher, not a student group
    default_students: int = 0      # the artifact's best-pruned k
    packable: bool = True          # False: PLOT models, whose lower layers are lookups, run padded only
    null: bool = False             # the null model: answers zeros without computing (NULL_MODEL)
    exits: ModelExits | None = None  # exit ramps (Apparate), when `academus ramps train` made them
    exit_task: str = ""            # whose ramps it may have: a bundled task (its head on the teacher), or a user's
                                   # classifier or head on a user's model (the model's own name)
    sti: StiModel | None = None    # served from shards under a memory budget (STI), planned batch by batch
    memory: StudentMemory | None = None   # a group's students held within a budget, new ones from shards

    def students(self, wanted: int) -> int:
        """The student count to run: the default for 0, refused beyond what the group holds."""
        if not self.max_students:
            return 1
        if wanted > self.max_students:
            raise InvalidArgument(f"num_students={wanted} exceeds the {self.max_students} students of "
                                  f"{self.spec.name!r}")
        return wanted or self.default_students

    def pool(self, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor, students: int,
             plot_states: PlotStates | None = None) -> torch.Tensor:
        if self.max_students:
            members = self.members(range(students), ids.numel())
            return self.encoder(ids, mask, types, num_students=students, members=members)
        if not self.packable:
            try:
                return self.encoder(ids, mask, types, states=plot_states)
            except (ValueError, PlotError) as e:  # PLOT: input the table cannot represent, states of another
                raise InvalidArgument(str(e)) from e
        return self.encoder(ids, mask, types)

    def member_share(self, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor, indices: Sequence[int],
                     probs: bool) -> tuple[torch.Tensor, str]:
        """This worker's additive share of a student group's output, and how the combiner finishes it.
        The head is linear, so Σ_members W·(Σ α·S) + b = head(Σ α·S): each member applies W, the
        member holding student 0 adds the bias, and the combiner only sums and applies softmax."""
        if not self.max_students:
            raise InvalidArgument(f"student_indices set for {self.spec.name!r}, which is not a student group")
        try:
            share = self.encoder.partial(ids, mask, types, indices, members=self.members(indices, ids.numel()))
        except ValueError as e:
            raise InvalidArgument(str(e)) from e
        return self.finish_share(share, indices, probs)

    def members(self, indices: Sequence[int], tokens: int) -> dict[int, nn.Module] | None:
        """The students a batch of `tokens` (padded) runs when this worker holds only some (None: the group holds
        them all)."""
        if self.memory is None:
            return None
        try:   # an index outside the group: the ValueError `partial` also raises, answered INVALID_ARGUMENT there
            return self.memory.members(indices, tokens)
        except ArtifactError as e:   # a shard corrupted since the store opened: refused, never served
            raise InvalidArgument(f"{self.spec.name} cannot be served: {e}") from e

    def finish_share(self, share: torch.Tensor, indices: Sequence[int], probs: bool) -> tuple[torch.Tensor, str]:
        """A member's share through the head's weight (bias on the member holding student 0)."""
        if probs and not isinstance(self.head, ClassifierHead):   # tanh before its projection: shares do not add
            raise InvalidArgument(f"{self.spec.name!r} has a sequence classifier's nonlinear head: its students "
                                  "run whole on one worker, not as shares (student_indices)")
        if probs:
            logits = share @ self.head.linear.weight.T
            return (logits + self.head.linear.bias if 0 in indices else logits), FINISH_SOFTMAX
        return share, FINISH_L2 if getattr(self.encoder, "normalize", False) else FINISH_SUM


class ModelRunner:
    """Loads the configured models once (the teacher shared by all teacher-backed names) and runs
    batches synchronously, one at a time, on the worker's compute thread."""

    def __init__(self, artifacts: Path, models: Sequence[str], device: str = "cpu",
                 clock: Callable[[], float] = time.monotonic, attention: Attention = "sdpa",
                 traced: bool = True, exit_settings: ControllerSettings | None = None,
                 sti_settings: StiSettings | None = None, student_budget_bytes: int = 0) -> None:
        """`exit_settings`: serve the bundled tasks' exit ramps (early exits) under these settings; None: no ramps.
        `sti_settings`: how models served from shards read them, their budget and target."""
        self.device = resolve_device(device)
        self.exit_settings = exit_settings
        self.sti_settings = sti_settings or StiSettings()
        self.student_budget_bytes = student_budget_bytes   # 0: student groups held whole
        self.traced = traced         # layers run as traced graphs (services/worker/traced.py)
        self.clock = clock
        self.attention = attention   # packed batches: own SDPA layers or HF layers with a 4-D mask
        self.artifacts = Path(artifacts)
        # the stamp of the catalogue as read (taken first: a change while it is read is seen again), which a
        # watch started later compares with: a standby's worker serves long after it loaded (shared/cli/standby.py)
        self.catalogue_stamp = catalogue_stamp(self.artifacts)
        catalogue = read_catalogue(self.artifacts)
        self.follows_catalogue = not models   # serving every model: added ones are loaded, removed ones dropped
        models = list(models) or sorted(catalogue)
        unknown = [m for m in models if m not in catalogue]
        if unknown:
            raise NotFound(f"models {unknown} are not in {artifacts}/models.json: `academus prepare` makes the bundled "
                           f"heads, `academus distill` student groups, `academus models add` your own")
        self._local = threading.local()  # each compute thread (student instance) has its own stop conditions
        self._teacher: TeacherEncoder | None = None
        # one memory-mapped table shared by its plot models; weak, so that once they have moved to a rebuilt
        # root (PlotStore.current) the old one's mapping is let go
        self._plot_stores: weakref.WeakValueDictionary[Path, object] = weakref.WeakValueDictionary()
        self._refused: dict[str, dict] = {}   # catalogue entries that failed to load, not retried while unchanged
        self._user_encoders: dict[Path, TeacherEncoder] = {}   # a user's embedding model's, shared by its heads
        self._exit_stamps: dict[str, tuple[int, int] | None] = {}   # model -> its ramps' manifest when loaded
        if self.follows_catalogue:   # serving every model: one that fails to load is refused, the others serve
            self.models = {}
            for name in models:
                self._load_or_refuse(name, catalogue[name], self.models)
        else:
            self.models = {name: self._load(name, catalogue[name]) for name in models}
        self.specs = {name: served.spec for name, served in self.models.items()}

    def refresh(self) -> bool:
        """Loads the catalogue's new models and drops the removed ones (a runner following it); whether the
        served set changed. The dicts are replaced, never mutated: compute threads read them meanwhile. An
        entry that fails to load is logged and left out; the others serve on."""
        if not self.follows_catalogue:
            return False
        self.catalogue_stamp = catalogue_stamp(self.artifacts)
        catalogue = read_catalogue(self.artifacts)
        models = {n: m for n, m in self.models.items() if n in catalogue}
        for name in sorted(set(catalogue) - set(models)):
            if self._refused.get(name) != catalogue[name]:
                self._load_or_refuse(name, catalogue[name], models)
        if models.keys() == self.models.keys():
            return False
        for name in set(self.models) - set(models):
            MODEL_BYTES.remove(name)
            if (memory := self.models[name].memory) is not None:
                memory.close()
        live = {self.artifacts / e["source"] for e in catalogue.values() if "source" in e}
        self._user_encoders = {d: e for d, e in self._user_encoders.items() if d in live}
        self.models, self.specs = models, {name: served.spec for name, served in models.items()}
        return True

    def _load_or_refuse(self, name: str, entry: dict, into: dict[str, ServedModel]) -> None:
        """Loads one catalogue entry into `into`; one that fails is logged and not retried while unchanged."""
        try:
            into[name] = self._load(name, entry)
            self._refused.pop(name, None)
        except (NotFound, InvalidArgument, ArtifactError, ValueError, OSError, RuntimeError, KeyError) as e:
            self._refused[name] = entry
            log_event("model_not_loaded", logging.ERROR, model=name, error=str(e))

    def _load(self, name: str, entry: dict) -> ServedModel:
        served = self._load_entry(name, entry)
        if not served.spec.memory_bytes:
            served.spec = replace(served.spec, memory_bytes=weight_bytes(served.encoder, served.head))
        if served.spec.kind == EMBEDDING and not served.null:   # what a client compares vectors by
            served.spec = replace(served.spec, pooling=served.encoder.pooling, normalized=served.encoder.normalize)
        MODEL_BYTES.labels(name).set(served.spec.memory_bytes)
        return served

    def _load_entry(self, name: str, entry: dict) -> ServedModel:
        if entry.get("null"):   # no weights: it must not load the teacher
            spec = ModelSpec(name, EMBEDDING, [], int(entry.get("dim", HIDDEN_SIZE)),
                             int(entry.get("max_tokens", ModelSpec.max_tokens)))
            return ServedModel(spec, nn.Identity(), null=True)
        if "students" in entry and self.student_budget_bytes and STUDENT_SHARDS in entry \
                and not entry.get("limit_students"):   # a prefix-only entry (the 2-layer baseline) is held whole
            return self._load_held_students(name, entry)
        if "students" in entry:
            from academus.shared.training.student_artifacts import load_student_group  # training code only when needed

            group = load_student_group(self.artifacts, Path(entry["students"]).name, self.device,
                                       entry.get("teacher", TEACHER_NAME), entry.get("task", name))
            while group.max_students > entry.get("limit_students", group.max_students):
                group.drop_last()  # a catalogue entry serving a prefix only (the single 2-layer baseline)
            self._prepare_layers(group, warm_up_token=min(WARM_UP_TOKEN, group.config.vocab_size - 1),
                                 num_students=group.max_students)
            if self.student_budget_bytes:
                log_event("student_budget_without_shards", logging.WARNING, model=name,
                          error=f"no shards of its students: held whole; run `academus shard build --model {name}`")
            return ServedModel(self._group_spec(name, entry, group), group, group.head, group.max_students,
                               group.best_k)
        if "plot" in entry:
            return self._load_plot(name, entry)
        if "shards" in entry:
            return self._load_sti(name, entry)
        if "source" in entry:
            return self._load_user_model(name, entry)
        if HEAD_ON in entry:
            return self._load_user_head(name, entry)
        teacher = self.teacher()
        if entry["kind"] != CLASSIFICATION:
            return ServedModel(ModelSpec(name, EMBEDDING, [], HIDDEN_SIZE), teacher)
        from academus.shared.training.prepare import load_head

        task = entry.get("task", name)
        head = load_head(self.artifacts, task).to(self.device).eval()
        served = ServedModel(ModelSpec(name, CLASSIFICATION, list(head.labels), HIDDEN_SIZE), teacher, head,
                             exit_task=task)
        self._load_exits(served)
        return served

    def _group_spec(self, name: str, entry: dict, group: StudentGroup) -> ModelSpec:
        kind = CLASSIFICATION if group.head is not None else EMBEDDING
        return ModelSpec(name, kind, list(group.labels) if group.head is not None else [],
                         group.config.hidden_size, int(entry.get("max_tokens", ModelSpec.max_tokens)),
                         max_students=group.max_students, default_students=group.best_k,
                         tokenizer=self._tokenizer_digest(entry.get(STUDENTS_OF, "")),
                         architecture=group.architecture.name, layers=group.layers,
                         whole_groups=group.head_kind == SEQUENCE)

    def _load_held_students(self, name: str, entry: dict) -> ServedModel:
        """A group of which this worker holds only the students placed on it, within the student budget; the
        others are absent until placed or asked for (then served from their shards while they load)."""
        from academus.shared.training.student_artifacts import load_student, load_student_shell

        group, weights = load_student_shell(self.artifacts, Path(entry["students"]).name, self.device,
                                            entry.get("teacher", TEACHER_NAME), entry.get("task", name))
        shards = open_student_shards(self.artifacts, entry)
        warm_up = min(WARM_UP_TOKEN, group.config.vocab_size - 1)

        def load_full(index: int) -> Student:
            student = load_student(weights, group, index, self.device)
            self._prepare_student(group, student, warm_up)
            return student

        memory = StudentMemory(name, group, shards, load_full, self.student_budget_bytes,
                               io_source(self.sti_settings.io), self.device, self._seconds_left)
        spec = replace(self._group_spec(name, entry, group), memory_bytes=memory.shared_bytes)
        return ServedModel(spec, group, group.head, group.max_students, group.best_k, packable=False, memory=memory)

    def _prepare_student(self, group: StudentGroup, student: Student, warm_up_token: int) -> None:
        """A student loaded while serving: deadline hooks and traced layers, traced here on this thread (both of
        the masks' kinds), not on the compute thread's first batch."""
        def warm(ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> None:
            hidden, mask4d = group.prepare_inputs(ids, mask, types)
            student(hidden, mask4d, mask)

        self._prepare_layers(student, warm_up_token, warm)

    def _load_sti(self, name: str, entry: dict) -> ServedModel:
        """A task served from an encoder's shards (STI: the teacher's, or a user's model's, `base`): only the resident
        part and a preload buffer are held; every shard read is checked against its manifest."""
        sti = StiModel(name, self.artifacts / entry["shards"], entry["task"], self.artifacts, self.sti_settings,
                       self.clock)
        geometry, architecture = sti.store.geometry, sti.model.architecture
        spec = ModelSpec(name, CLASSIFICATION, list(sti.labels), geometry.hidden,
                         int(entry.get("max_tokens", min(ModelSpec.max_tokens, architecture.max_tokens))),
                         tokenizer=self._tokenizer_digest(entry.get("base", "")), architecture=architecture.name,
                         layers=geometry.layers, memory_bytes=sti.resident_bytes())
        return ServedModel(spec, nn.Identity(), packable=False, sti=sti)

    def set_shard_budget(self, model: str, budget_bytes: int) -> int:
        """Lowers (or raises) a shard-served model's parameter-memory budget; the next batch is planned for it.
        Returns the bytes it holds now."""
        served = self.models.get(model)
        if served is None or served.sti is None:
            raise NotFound(f"model {model!r} is not served from shards by this worker")
        served.sti.set_budget(budget_bytes)
        held = served.sti.resident_bytes()
        MODEL_BYTES.labels(model).set(held)
        return held

    def _load_exits(self, served: ServedModel) -> None:
        """The served classifier's ramps as the artifacts hold them now (none: no early exits)."""
        if self.exit_settings is None or not served.exit_task:
            return
        self._exit_stamps[served.spec.name] = ramps_stamp(self.artifacts, served.exit_task)
        served.exits = load_exits(self.artifacts, served.exit_task, served.spec.dim, served.spec.labels, self.device,
                                  self.exit_settings, served.spec.name)

    def runs_ramps(self, model: str) -> bool:
        """Whether a batch of `model` that asks for early exits runs exit ramps now (some are active)."""
        served = self.models.get(model)
        return served is not None and served.exits is not None and bool(served.exits.controller.active.layers)

    def refresh_exits(self) -> list[str]:
        """Loads ramps `academus ramps train` wrote or replaced since they were loaded (the running worker
        serves them without a restart); the models whose ramps changed. A batch already running keeps the
        ones it started with."""
        changed = []
        for name, served in list(self.models.items()):
            if served.exit_task and ramps_stamp(self.artifacts, served.exit_task) != self._exit_stamps.get(name):
                self._load_exits(served)
                changed.append(name)
        return changed

    def _load_user_model(self, name: str, entry: dict) -> ServedModel:
        """A model from `academus models add`: its files checked against their sha256, then its own encoder
        and, for a classifier, its own head. The encoder of an embedding model is kept for the heads trained
        on it (one copy however many)."""
        encoder, head, manifest = self._user_encoder(entry)
        served = ServedModel(self._user_spec(name, entry, encoder, head, manifest.files[TOKENIZER]), encoder, head,
                             exit_task=name if head is not None else "")   # a classifier's ramps are its own
        self._load_exits(served)
        return served

    def _user_encoder(self, entry: dict) -> tuple[TeacherEncoder, nn.Module | None, Manifest]:
        """A user's model's encoder (hooked, traced where set), its classifier's head, and its manifest. An
        embedding model's encoder is kept for the heads and PLOT tables on it (one copy however many)."""
        from academus.shared.models.user_models import open_model

        directory = self.artifacts / entry["source"]
        encoder = self._user_encoders.get(directory)
        if encoder is not None:
            return encoder, None, read_manifest(directory)
        encoder, head, manifest = open_model(directory, self.device)   # the copy is verified as it is loaded, once
        self._prepare_layers(encoder, warm_up_token=min(WARM_UP_TOKEN, encoder.architecture.vocab_size - 1))
        if self.exit_settings is not None:   # its classifier's ramps, or its heads', may come with `ramps train`
            self._watch_ramps(encoder)
        if head is None:
            self._user_encoders[directory] = encoder
        return encoder, head, manifest

    def _load_user_head(self, name: str, entry: dict) -> ServedModel:
        """A head trained on a user's embedding model (`academus heads train`), on that model's encoder."""
        from academus.shared.training.prepare import load_head_at

        base = read_catalogue(self.artifacts).get(entry[HEAD_ON])
        if base is None or "source" not in base:
            raise NotFound(f"model {name!r} is a head on {entry[HEAD_ON]!r}, which is not in the catalogue")
        encoder = self._load_user_model(entry[HEAD_ON], base)
        head = load_head_at(self.artifacts / entry["head"]).to(self.device).eval()
        served = ServedModel(self._user_spec(name, entry, encoder.encoder, head, encoder.spec.tokenizer),
                             encoder.encoder, head, exit_task=name)
        self._load_exits(served)
        return served

    @staticmethod
    def _user_spec(name: str, entry: dict, encoder: TeacherEncoder, head: nn.Module | None,
                   tokenizer: str) -> ModelSpec:
        architecture = encoder.architecture
        return ModelSpec(name, entry["kind"], list(head.labels) if head else [], architecture.hidden_size,
                         int(entry.get("max_tokens", architecture.max_tokens)), tokenizer=tokenizer,
                         architecture=architecture.name, layers=architecture.layers,
                         memory_bytes=weight_bytes(encoder, head), pairs=bool(entry.get("pairs")))

    def _tokenizer_digest(self, model: str) -> str:
        """The sha256 of a user's model's tokenizer.json ("": the teacher's, for the bundled models)."""
        entry = read_catalogue(self.artifacts).get(model) if model else None
        if entry is None or "source" not in entry:
            return ""
        return read_manifest(self.artifacts / entry["source"]).files[TOKENIZER]

    def tokenizer_file(self, name: str) -> Path | None:
        """A user's model's tokenizer.json, or its encoder model's for a head on one (None for the models that
        use the teacher's)."""
        catalogue = read_catalogue(self.artifacts)
        entry = catalogue.get(name, {})
        # a head on, students of, or a PLOT table or shards on a user's model
        derived = "plot" in entry or "shards" in entry
        base = entry.get(HEAD_ON) or entry.get(STUDENTS_OF) or (entry.get("base") if derived else None)
        entry = catalogue.get(base, {}) if base else entry
        return self.artifacts / entry["source"] / "tokenizer.json" if "source" in entry else None

    def teacher(self) -> TeacherEncoder:
        """The one teacher every teacher-backed and PLOT model shares, its layers hooked once (deadlines, and exit
        ramps where a serving process has them)."""
        if self._teacher is None:
            self._teacher = TeacherEncoder.load(device=self.device)
            self._prepare_layers(self._teacher)
            if self.exit_settings is not None:
                self._watch_ramps(self._teacher)
        return self._teacher

    def _load_plot(self, name: str, entry: dict) -> ServedModel:
        """HMI's hierarchical model in process: PLOT lookups for the lower K layers, the upper layers of the model
        the table was built on (the shared teacher, or a user's model; already deadline-hooked), and the entry's head
        if it has one."""
        from academus.shared.models.plot import PlotStore
        from academus.shared.models.plot.hierarchical import HierarchicalEncoder, PlotEncoder

        table = self.artifacts / entry["plot"]
        store = self._plot_stores.get(table)
        store = store.current() if store is not None else PlotStore.open(
            table, model=entry.get("base", "minilm"), lower_layers=entry.get("lower_layers"))
        self._plot_stores[table] = store
        head = None
        if entry["kind"] == CLASSIFICATION:
            from academus.shared.training.prepare import load_head_at

            head = load_head_at(self.artifacts / entry["head"]).to(self.device).eval()
        user = self._plot_base(name, entry, store)
        if user is None:
            base, spec = self.teacher(), ModelSpec(name, entry["kind"], [], HIDDEN_SIZE)
        else:   # a user's model: its tokenizer, width, token limit and shape
            base, manifest = user
            spec = self._user_spec(name, entry, base, None, manifest.files[TOKENIZER])
        encoder = PlotEncoder(HierarchicalEncoder(store, base), base, entry.get("domain", ""))
        spec = replace(spec, labels=list(head.labels) if head else [], plot=store.model,
                       lower_layers=store.lower_layers, domain=entry.get("domain", ""))
        return ServedModel(spec, encoder, head, packable=False)

    def _plot_base(self, name: str, entry: dict, store: PlotStore) -> tuple[TeacherEncoder, Manifest] | None:
        """The user's embedding model a PLOT table was built on and its manifest (None: the bundled teacher),
        refused when the catalogue serves other weights under its name than the table was built on."""
        from academus.shared.models.user_models import cache_name

        base = read_catalogue(self.artifacts).get(store.model)
        if base is None or "source" not in base:
            return None
        encoder, _, manifest = self._user_encoder(base)
        built_on, served = store.root.manifest.teacher, cache_name(store.model, manifest)
        if built_on != served:
            raise ArtifactError(f"model {name!r}: its PLOT table {entry['plot']} was built on {built_on}, the "
                                f"catalogue serves {served}; rebuild it (academus plot build --model {store.model})")
        return encoder, manifest

    def _prepare_layers(self, encoder: nn.Module, warm_up_token: int = WARM_UP_TOKEN,
                        warm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object] | None = None,
                        **forward: int) -> None:
        """Deadline hooks on every layer and, when `traced`, traced graphs for their forwards, made now
        from an unpadded and a padded batch: tracing holds the GIL for a while, which a serving process
        should not pay on its first requests. `forward`: what the encoder needs to run every layer; `warm`: how
        to run it on a batch, when not `encoder(ids, mask, types, **forward)`."""
        self._watch_deadline(encoder)
        if not self.traced:
            return
        trace_layers(encoder, LAYER_NAME)
        for lengths in ((8,), (8, 5)):
            ids, mask, types = self._padded([[warm_up_token] * n for n in lengths], None)
            with torch.inference_mode():
                if warm is None:
                    encoder(ids, mask, types, **forward)
                else:
                    warm(ids, mask, types)

    def _watch_deadline(self, encoder: nn.Module) -> None:
        """Hooks every transformer layer so an expired batch stops between layers."""
        for name, module in encoder.named_modules():
            if LAYER_NAME.search(name):
                module.register_forward_pre_hook(self._deadline_check(name))

    def _watch_ramps(self, encoder: nn.Module) -> None:
        """Hooks the layers of an encoder whose classifiers may have exit ramps (the teacher, a user's model) so
        that a batch running ramps sees each layer's output; students' layers carry no hook to pass through."""
        for name, module in encoder.named_modules():
            if match := LAYER_NAME.search(name):
                module.register_forward_hook(self._ramp_hook(int(match.group(1)) + 1))

    def _ramp_hook(self, layer: int):
        def hook(_module, _args, output) -> None:
            run = getattr(self._local, "exits", None)
            if run is not None:
                run.hidden(layer, output[0] if isinstance(output, tuple) else output)

        return hook

    def _deadline_check(self, layer: str):
        def hook(_module, _args) -> None:
            self._check_deadline(layer)

        return hook

    def _seconds_left(self) -> float | None:
        """The running batch's time before its deadline (this compute thread's); None without one."""
        deadline = getattr(self._local, "deadline", None)
        return None if deadline is None else deadline - self.clock()

    def _check_deadline(self, layer: str) -> None:
        deadline = getattr(self._local, "deadline", None)
        if deadline is not None and self.clock() >= deadline:
            raise DeadlineExceeded(f"deadline passed before {layer}; the rest was not computed")
        left = getattr(self._local, "left", None)
        if left is not None and left.is_set():
            raise CallerLeft(f"the caller left before {layer}; the rest was not computed")

    def run(self, batch: Batch, deadline: float | None = None, tenants: TenantBatch | None = None,
            left: threading.Event | None = None, release: Release | None = None) -> BatchResult:
        """Runs one batch; refuses to start when `deadline` (clock time) has passed, and stops between
        layers once it passes or `left` is set (the caller went away). With `batch.student_indices`, runs only
        those students of a group and returns their additive share. With `batch.plan`, runs it packed
        (ConcatBatching) instead of padded. A PLOT model given `batch.plot_states` (prefetched by the scheduler)
        runs only its upper layers on them. `tenants`: the batch's adapters, fetched. With `release`, a
        classifier with exit ramps releases each text at its first confident ramp (Apparate) and runs on."""
        model, output = batch.model, OUTPUT_PROBS if batch.wants_probs else OUTPUT_EMBEDDING
        served = self.models.get(model)
        if served is None:
            raise NotFound(f"model {model!r} is not served by this worker")
        if batch.plot_states is not None and served.packable:
            raise InvalidArgument(f"plot_states set for {model!r}, which computes its lower layers (no PLOT)")
        lengths = batch.lengths
        if tenants is not None:
            check_tenant_batch(served, output, tenants, len(lengths))
        elif output == OUTPUT_PROBS and served.head is None and served.sti is None:
            raise InvalidArgument(f"model {model!r} is an embedding model: it has no labels")
        students = served.students(batch.num_students)
        if deadline is not None and self.clock() >= deadline:
            raise DeadlineExceeded("deadline passed before the batch started; not computed")
        self._local.deadline, self._local.left = deadline, left  # what the layer checks stop on, every path
        seqs = split_lengths(batch.input_ids, lengths)
        types = split_lengths(batch.token_type_ids, lengths, "token_type_ids") if batch.token_type_ids else None
        exits = None
        if release is not None and served.exits is not None and output == OUTPUT_PROBS and tenants is None:
            exits = ExitRun(served.exits, len(lengths), release, deferred=self.device.type == "cuda")
        self._local.exits = exits   # the layer hooks' (padded) and after_layer's (packed) ramps
        indices, plan = batch.student_indices, batch.plan
        try:
            if served.sti is not None:
                result = self._run_sti(served, output, seqs, types, deadline, indices, tenants)
            elif served.null:
                result = self._run_null(served, lengths, indices, plan, tenants, left)
            elif tenants is not None:  # tenant batches run padded: a plan's rows would mix adapters within a row
                result = self._run_tenants(served, output, seqs, types, tenants, batch.plot_states)
            elif plan is not None and served.packable:  # a PLOT model runs the plan's texts padded: same answers
                result = self._run_packed(served, output, seqs, types, plan, students, indices)
            else:
                result = self._run_padded(served, output, seqs, types, students, indices, batch.plot_states)
        finally:
            self._local.exits = None
        if exits is not None:
            exits.finish(result.values, result.compute_ms / 1e3)
        _batch_size(model).observe(len(lengths))   # one observation a batch, its label children resolved once
        _padding_ratio(model).observe(result.padding_ratio)
        return result

    def _run_padded(self, served: ServedModel, output: str, seqs: list[Sequence[int]],
                    types: list[Sequence[int]] | None, students: int, student_indices: Sequence[int],
                    plot_states: PlotStates | None) -> BatchResult:
        """The batch padded to its longest text: the whole model, or a group member's share of its students."""
        start = time.perf_counter()
        ids, mask, type_ids = self._padded(seqs, types)
        if (exits := getattr(self._local, "exits", None)) is not None:
            exits.mask = mask
        finish = ""
        with torch.inference_mode():
            if student_indices:
                values, finish = served.member_share(ids, mask, type_ids, student_indices, output == OUTPUT_PROBS)
            else:
                pooled = served.pool(ids, mask, type_ids, students, plot_states)
                values = probabilities(served.head(pooled)) if output == OUTPUT_PROBS else pooled
            if exits is not None:   # a GPU's ramps release while the device runs the layers after them
                exits.settle()
            values_np = values.float().cpu().numpy()
        return BatchResult(
            values=values_np,
            labels=served.spec.labels if output == OUTPUT_PROBS else [],
            compute_ms=(time.perf_counter() - start) * 1e3,
            padded_tokens=int(ids.numel()),
            real_tokens=int(mask.sum()),
            student_count=len(student_indices) or students,
            finish=finish,
        )

    def _run_null(self, served: ServedModel, lengths: Sequence[int], student_indices: Sequence[int],
                  plan: PackingPlan | None, tenants: TenantBatch | None, left: threading.Event | None) -> BatchResult:
        """Zeros of the answer's shape, nothing computed: what the stack costs without a model. The input was
        checked as any model's is, and what a model cannot take is refused as it would be. A packing plan is
        checked as the packed path checks it (a scheduler's plan costs the same), then answered unpacked."""
        if student_indices:
            raise InvalidArgument(f"student_indices set for {served.spec.name!r}, which is not a student group")
        if plan is not None:
            check_packing(plan, lengths)
        if tenants is not None:
            raise InvalidArgument(f"adapters set for {served.spec.name!r}, which computes nothing to adapt")
        if left is not None and left.is_set():
            raise CallerLeft("the caller left before the batch started")
        start = time.perf_counter()
        values = np.zeros((len(lengths), served.spec.dim), dtype=np.float32)
        return BatchResult(values, [], (time.perf_counter() - start) * 1e3, sum(lengths), sum(lengths))

    def _run_sti(self, served: ServedModel, output: str, seqs: list[Sequence[int]],
                 types: list[Sequence[int]] | None, deadline: float | None, student_indices: Sequence[int],
                 tenants: TenantBatch | None) -> BatchResult:
        """The batch padded, planned for the time it has, run from shards (any packing plan: answered padded)."""
        if student_indices or tenants is not None:
            raise InvalidArgument(f"{served.spec.name!r} is served from shards: no student_indices or adapters")
        if output != OUTPUT_PROBS:
            raise InvalidArgument(f"{served.spec.name!r} is served from shards: it answers labels and scores, "
                                  f"not embeddings")
        ids, mask, type_ids = pad_batch(seqs, types)
        probs, shards, compute_ms = served.sti.run(ids, mask, type_ids, deadline)
        return BatchResult(probs.float().numpy(), served.spec.labels, compute_ms, int(ids.numel()), int(mask.sum()),
                           shards=shards)

    def _padded(self, seqs: list[Sequence[int]],
                types: list[Sequence[int]] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The batch padded to its longest text, on the device."""
        ids, mask, type_ids = (t.to(self.device) for t in pad_batch(seqs, types))
        return ids, mask, type_ids

    def _run_tenants(self, served: ServedModel, output: str, seqs: list[Sequence[int]],
                     types: list[Sequence[int]] | None, tenants: TenantBatch,
                     plot_states: PlotStates | None = None) -> BatchResult:
        """Texts of many tenants in one padded batch (HMI §6.3): each row's adapter in the base's upper
        layers, applied as one batched matmul a projection, and each row's own head. Probabilities are
        zero-padded to the widest head; the gateway keeps its tenant's columns."""
        start = time.perf_counter()
        ids, mask, type_ids = self._padded(seqs, types)
        with torch.inference_mode():
            # A PLOT base looks each row up in its tenant model's domain overlay (HMI §5.1).
            forward = {} if served.packable else {"domains": tenants.row_domains(len(seqs)), "states": plot_states}
            try:
                pooled, probs = encode_with_adapters(served.encoder, ids, mask, type_ids, tenants.weights,
                                                     tenants.batched, tenants.layer_ready, **forward)
            except (ValueError, PlotError) as e:  # an adapter for another base, an unknown domain
                raise InvalidArgument(str(e)) from e
            values = (probs if output == OUTPUT_PROBS else pooled).float().cpu().numpy()
        return BatchResult(values=values, labels=[], compute_ms=(time.perf_counter() - start) * 1e3,
                           padded_tokens=int(ids.numel()), real_tokens=int(mask.sum()))

    def _run_packed(self, served: ServedModel, output: str, seqs: list[Sequence[int]],
                    types: list[Sequence[int]] | None, plan: PackingPlan, students: int,
                    student_indices: Sequence[int]) -> BatchResult:
        """ConcatBatching (TCB §4): the plan's rows, block-diagonal attention, per-text pooling; the
        answers equal the padded path's. Deadline checked before every layer, as the padded path does."""
        if student_indices and not served.max_students:
            raise InvalidArgument(f"student_indices set for {served.spec.name!r}, which is not a student group")
        start = time.perf_counter()
        batch = packed_batch(seqs, types, plan).to(self.device)
        wants_probs, finish = output == OUTPUT_PROBS, ""
        with torch.inference_mode():
            try:
                exits = getattr(self._local, "exits", None)
                pooled = encode_packed(served.encoder, batch, self.attention,
                                       num_students=students if served.max_students else None,
                                       before_layer=lambda i: self._check_deadline(f"layer {i}"),
                                       student_indices=student_indices,
                                       after_layer=None if exits is None else
                                       lambda k, pool, rows: exits.at_layer(k, pool, rows.cpu().numpy()))
            except ValueError as e:  # student indices outside the group
                raise InvalidArgument(str(e)) from e
            if student_indices:
                values, finish = served.finish_share(pooled, student_indices, wants_probs)
            else:
                values = probabilities(served.head(pooled)) if wants_probs else pooled
            if exits is not None:
                exits.settle()
            values_np = values.float().cpu().numpy()
        return BatchResult(values=values_np, labels=served.spec.labels if wants_probs else [],
                           compute_ms=(time.perf_counter() - start) * 1e3, padded_tokens=batch.computed_tokens,
                           real_tokens=batch.real_tokens, student_count=len(student_indices) or students,
                           finish=finish)


def check_tenant_batch(served: ServedModel, output: str, tenants: TenantBatch, texts: int) -> None:
    """Tenant adapters run on an embedding base (the teacher, its PLOT hierarchical model, or a user's embedding
    model), one entry a text; labels need heads."""
    if served.max_students or served.head is not None:
        raise InvalidArgument(f"adapters set for {served.spec.name!r}: tenant adapters run on an embedding "
                              "base model (minilm, minilm-plot, or a user's embedding model)")
    if len(tenants.weights) != texts:
        raise InvalidArgument(f"adapters has {len(tenants.weights)} entries for {texts} texts")
    if output == OUTPUT_PROBS and any(w is None for w in tenants.weights):
        raise InvalidArgument("output=label needs an adapter (and its head) for every text")


def check_packing(plan: PackingPlan, lengths: Sequence[int]) -> None:
    """Refuses a plan as packed_batch does, without building its tensors (the null model packs nothing)."""
    try:
        check_plan(plan, lengths)
    except ValueError as e:
        raise InvalidArgument(f"packing: {e}") from e


def packed_batch(seqs: list[Sequence[int]], types: list[Sequence[int]] | None, plan: PackingPlan) -> PackedBatch:
    """The plan's tensors; a plan that does not place every text exactly once, or crams a slot, is refused."""
    try:
        return pack(seqs, plan, types)
    except ValueError as e:
        raise InvalidArgument(f"packing: {e}") from e
