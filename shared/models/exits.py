"""Early exits (Apparate): when a ramp's result is released, and how its threshold is kept accurate.

Every text runs the whole model; a ramp only decides when a text's result is *released* early. So the full
model's answer arrives for every text, and says whether each released result agreed with it: the feedback the
thresholds are tuned on (§3.2), and the savings each ramp earns against its cost (§3.3).

- `ExitSignals`: what the ramps said about a batch (per text and ramp: confidence, prediction, entropy).
- Exit rules, each deciding at ramp j from the ramps up to j (the worker decides layer by layer, the replay
  the same way): `ThresholdRule` (per-ramp confidence thresholds: Apparate's, or tuned once), `EntropyRule`
  (DeeBERT: one entropy threshold tuned once), `PatienceRule` (PABEE: t consecutive ramps agree).
- `ThresholdTuner`: greedy hill-climbing over the thresholds (Apparate's `threshold_tuner.py`): raise the one
  whose step costs least agreement per unit of saved time, doubling steps that pay and halving when none
  does, within the agreement constraint.
- `ExitController`: per worker and model, a window of recent texts, started with the ramps' `Evidence` (their
  signals on the texts `ramps train` validated them on); re-tunes when the released results' agreement over
  the window falls below the constraint, every `retune_every` texts, and after `retune_s`; then adjusts the
  ramps (§3.3): drops a ramp whose exits save less than it costs, adds one where exits are likely while the
  ramps' cost stays within `budget` of the model's time.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

NEVER = 1.0   # a confidence threshold no result passes (exits need conf > threshold)
MIN_FEEDBACK = 16   # texts of feedback before their agreement may trigger a tuning, or judge a ramp
AGREEMENT_SPAN = 256   # the latest texts whose released results' agreement is watched
MIN_MARGIN = 0.05      # the least share of the allowed disagreement a tuning may spend
COST_SMOOTHING = 0.1   # weight of a batch's measured times in the running ones (a ramp's, the model's)
# A worker's first batches pay the device's one-time set-up (a GPU loads each kernel at its first launch, and
# allocates pinned host memory): their times are neither a ramp's cost nor the model's, and as the first samples
# they would stand for both until the first tuning, which drops ramps by them.
WARM_UP_BATCHES = 2
PENDING_BATCHES = 4096  # batches' feedback held for `drain`; the oldest go first when nothing drains
APPARATE, NONE, DEEBERT, STATIC, PABEE2, PABEE3 = "apparate", "none", "deebert", "static", "pabee2", "pabee3"
POLICIES = (APPARATE, NONE, DEEBERT, STATIC, PABEE2, PABEE3)


@dataclass(frozen=True)
class ExitSignals:
    """What ramps said about n texts: [n, R] confidence (top probability), prediction and entropy."""

    conf: np.ndarray
    preds: np.ndarray
    entropy: np.ndarray

    @classmethod
    def from_probs(cls, probs: Sequence[np.ndarray]) -> ExitSignals:
        """From each ramp's [n, C] probabilities."""
        stacked = np.stack(probs, axis=1) if probs else np.zeros((0, 0, 1))
        return cls(*ramp_signal(stacked))

    def __len__(self) -> int:
        return len(self.conf)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax of [n, C] logits."""
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def ramp_signal(probs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Confidence (top probability), prediction and entropy of [..., C] probabilities."""
    return probs.max(-1), probs.argmax(-1), -(probs * np.log(np.maximum(probs, 1e-12))).sum(-1)


class ExitRule(Protocol):
    """Decides, at ramp j (0-based among the rule's ramps), which texts exit there, from ramps 0..j."""

    def exits_at(self, j: int, conf: np.ndarray, preds: np.ndarray, entropy: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class ThresholdRule(ExitRule):
    """Exit at ramp j when its confidence passes thresholds[j] (Apparate; per-ramp thresholds tuned once)."""

    thresholds: tuple[float, ...]

    def exits_at(self, j: int, conf: np.ndarray, preds: np.ndarray, entropy: np.ndarray) -> np.ndarray:
        return conf[:, j] > self.thresholds[j]


@dataclass(frozen=True)
class EntropyRule(ExitRule):
    """DeeBERT: exit at the first ramp whose prediction entropy is below one threshold S."""

    threshold: float

    def exits_at(self, j: int, conf: np.ndarray, preds: np.ndarray, entropy: np.ndarray) -> np.ndarray:
        return entropy[:, j] < self.threshold


@dataclass(frozen=True)
class PatienceRule(ExitRule):
    """PABEE: exit once `patience` consecutive ramps predict the same class."""

    patience: int

    def exits_at(self, j: int, conf: np.ndarray, preds: np.ndarray, entropy: np.ndarray) -> np.ndarray:
        if j + 1 < self.patience:
            return np.zeros(len(preds), dtype=bool)
        window = preds[:, j + 1 - self.patience: j + 1]
        return (window == window[:, -1:]).all(axis=1)


@dataclass(frozen=True)
class NoExit(ExitRule):
    def exits_at(self, j: int, conf: np.ndarray, preds: np.ndarray, entropy: np.ndarray) -> np.ndarray:
        return np.zeros(len(conf), dtype=bool)


def replay(rule: ExitRule, signals: ExitSignals) -> np.ndarray:
    """Each text's exit ramp under `rule` (R: none), deciding ramp by ramp as the worker does."""
    n, ramps = signals.conf.shape if signals.conf.ndim == 2 else (len(signals), 0)
    exit_at = np.full(n, ramps)
    for j in range(ramps):
        fresh = (exit_at == ramps) & rule.exits_at(j, signals.conf, signals.preds, signals.entropy)
        exit_at[fresh] = j
    return exit_at


def released_agreement(exit_at: np.ndarray, agree: np.ndarray) -> np.ndarray:
    """Per text: whether its first released result agreed with the full model's (True when it did not exit)."""
    ramps = agree.shape[1]
    return np.concatenate([agree, np.ones((len(agree), 1), dtype=bool)], axis=1)[np.arange(len(agree)), exit_at] \
        if ramps else np.ones(len(agree), dtype=bool)


# ---------------------------------------------------------------- tuning (§3.2)


@dataclass(frozen=True)
class Tuning:
    thresholds: tuple[float, ...]   # confidence thresholds, one a ramp (exit when conf > threshold)
    agreement: float                # released results agreeing with the full model, over the window
    saving: float                   # mean share of the model's time saved before a text's first result
    exit_rates: tuple[float, ...]   # share of texts released at each ramp
    evaluations: int                # configurations evaluated


class ThresholdTuner:
    """Greedy hill-climbing over per-ramp thresholds on (1 - confidence), from 0 (no exit) upwards: each step
    takes the ramp whose raise costs the least agreement per unit of time saved, among raises that keep the
    agreement at or above `constraint`; a raise that pays doubles that ramp's step, none paying halves them
    all, and the search stops when every step is below `min_step`. Run from several starting steps; the
    configuration saving most wins."""

    def __init__(self, constraint: float = 0.99, starts: Sequence[float] = (0.0125, 0.025, 0.05),
                 min_step: float = 0.0125, slack_errors: float = 0.0) -> None:
        """`slack_errors`: disagreements a configuration is charged beyond those it made, when checked against
        the constraint: on a few texts, "no error seen" is weak evidence (32 texts without one allow thresholds
        that release texts wrongly at once); on many, it hardly matters."""
        self.constraint, self.starts, self.min_step = constraint, tuple(starts), min_step
        self.slack_errors = slack_errors

    def tune(self, conf: np.ndarray, agree: np.ndarray, saving: Sequence[float]) -> Tuning:
        """`conf`, `agree`: [n, R] per text and ramp (agree: the ramp's prediction is the full model's);
        `saving`: [R] the share of the model's time a release at each ramp saves."""
        n, ramps = conf.shape
        if not n or not ramps:
            return Tuning((NEVER,) * ramps, 1.0, 0.0, (0.0,) * ramps, 0)
        doubt = (1.0 - conf.astype(np.float64))[None]              # [1, n, R]
        agree_ext = np.concatenate([agree, np.ones((n, 1), dtype=bool)], axis=1)
        saving_ext = np.append(np.asarray(saving, dtype=np.float64), 0.0)
        rows = np.arange(n)[None]
        slack = self.slack_errors / n
        counter = [0]

        def evaluate(configs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            counter[0] += len(configs)
            exits = doubt < configs[:, None, :]                     # [D, n, R]
            exit_at = np.where(exits.any(-1), exits.argmax(-1), ramps)
            return agree_ext[rows, exit_at].mean(-1), saving_ext[exit_at].mean(-1), exit_at

        best: tuple[float, np.ndarray] | None = None
        for start in self.starts:
            config = self._climb(evaluate, ramps, start, slack)
            _, saved, _ = evaluate(config[None])
            if best is None or saved[0] > best[0]:
                best = (float(saved[0]), config)
        assert best is not None
        config = best[1]
        accuracy, saved, exit_at = evaluate(config[None])
        rates = np.bincount(exit_at[0], minlength=ramps + 1)[:ramps] / n
        return Tuning(tighten(conf, exit_at[0], ramps), float(accuracy[0]), float(saved[0]),
                      tuple(float(r) for r in rates), counter[0])

    def _climb(self, evaluate, ramps: int, start: float, slack: float) -> np.ndarray:
        config, steps = np.zeros(ramps), np.full(ramps, start)
        accuracy, saved, _ = (v[0] for v in evaluate(config[None]))
        while True:
            candidates = config + np.diag(steps)                   # [R, R]: one ramp raised each
            allowed = candidates.max(axis=1) <= 1.0 + 1e-9
            acc, sav, _ = evaluate(candidates)
            ok = allowed & (acc - slack >= self.constraint - 1e-12)
            gain = sav - saved
            paying = ok & (gain > 1e-12)
            neutral = ok & ~paying
            if paying.any():
                score = np.where(paying, np.maximum(accuracy - acc, 0.0) / np.maximum(gain, 1e-12), np.inf)
                j = int(score.argmin())
                config, accuracy, saved = candidates[j], acc[j], sav[j]
                steps[j] *= 2
                steps[neutral] *= 2   # free moves: larger steps there next time
                continue
            if neutral.any():   # a plateau (no text's exit changes): cross it, as the reference tuner does
                j = int(neutral.argmax())
                config = candidates[j]
                steps[j] *= 2
                continue
            shrink = (steps > self.min_step + 1e-12) & (config < 1.0)
            if not shrink.any():
                return config
            steps[shrink] /= 2


# ---------------------------------------------------------------- the controller (§3.2, §3.3)


def tighten(conf: np.ndarray, exit_at: np.ndarray, ramps: int) -> tuple[float, ...]:
    """Confidence thresholds as strict as the window allows: each ramp's just below the least confidence it
    released a text at (NEVER where it released none). The window's exits are the same; on texts not seen, a
    threshold the climb reached across a stretch without data (a plateau) releases nothing it was not shown."""
    out = []
    for j in range(ramps):
        released = conf[exit_at == j, j]
        out.append(float(np.nextafter(np.float32(released.min()), np.float32(-1))) if len(released) else NEVER)
    return tuple(out)


@dataclass(frozen=True)
class Evidence:
    """Every ramp's signals on the texts `ramps train` validated them on, [n, R] over the artifact's layers: its
    confidence, and whether its answer was the model's. A controller's window starts with them, so its first
    tunings weigh hundreds of texts, not the few served since it started (they age out as traffic comes)."""

    conf: np.ndarray
    agree: np.ndarray


@dataclass(frozen=True)
class RampCandidate:
    layer: int       # the transformer layers computed before it (1 .. N-1)
    saving: float    # the share of the model's time a release here saves (what is left after it)
    cost: float      # its own time, as a share of the model's (paid by every text that reaches it)


@dataclass(frozen=True)
class ActiveRamps:
    """What the compute thread reads: the active ramps' layers (ascending) and their rule."""

    layers: tuple[int, ...]
    rule: ExitRule


@dataclass
class ControllerSettings:
    constraint: float = 0.99     # released results agreeing with the full model
    window: int = 1024           # texts a tuning looks at
    retune_every: int = 64       # texts between scheduled tunings
    retune_s: float = 30.0       # at least this often while traffic comes
    budget: float = 0.02         # the active ramps' summed cost, as a share of the model's time
    cooldown: int = 4            # tunings before a dropped ramp may be added back
    policy: str = APPARATE
    slack_errors: float = 0.5    # ThresholdTuner's: disagreements charged beyond those seen
    min_texts: int = 64          # feedback before the first tuning replaces the bootstrap thresholds


@dataclass
class ExitEvent:
    at: float
    kind: str                    # "tuned", "dropped", "added"
    layer: int = 0
    reason: str = ""

    def as_dict(self) -> dict:
        return {"at": round(self.at, 3), "kind": self.kind, "layer": self.layer, "reason": self.reason}


@dataclass
class _Window:
    """Recent texts: each candidate ramp's confidence and agreement (NaN/False where it did not run), and
    whether the result released for it agreed with the full model."""

    size: int
    layers: tuple[int, ...]
    conf: deque = field(init=False)
    agree: deque = field(init=False)
    released_ok: deque = field(init=False)

    def __post_init__(self) -> None:
        self.conf, self.agree, self.released_ok = (deque(maxlen=self.size) for _ in range(3))


class ExitController:
    """One model's ramps on one worker: the rule the compute thread applies, fed back with every batch's
    ramp signals and full answers (`feed`, an append on the compute thread; `drain` observes them off it);
    `tune` (off the compute thread) re-tunes thresholds and adjusts the ramps. `policy` other than apparate
    fixes the rule once (baselines)."""

    def __init__(self, candidates: Sequence[RampCandidate], settings: ControllerSettings | None = None,
                 fixed: ExitRule | None = None, initial: dict[int, float] | None = None,
                 clock: Callable[[], float] = time.monotonic, evidence: Evidence | None = None) -> None:
        """`fixed`: a baseline's rule over every candidate ramp, never tuned. `initial`: thresholds to start
        from (tuned once on the bootstrap data), until the first tuning. `evidence`: the window's first texts,
        one column a candidate in layer order."""
        self.settings = settings or ControllerSettings()
        self.candidates = {c.layer: c for c in sorted(candidates, key=lambda c: c.layer)}
        self.cost = {c.layer: c.cost for c in candidates}   # shares of the model's time, as `observe` measures
        self._ramp_s: float | None = None        # one ramp's seconds on a batch, smoothed (see `observe`)
        self._batch_s: float | None = None       # a batch's compute seconds, smoothed
        self._samples = {"ramp": 0, "batch": 0}  # times seen, the first WARM_UP_BATCHES of each left out
        self.clock = clock
        self.margin = 1.0                        # the share of the allowance the next tuning may spend
        self._errors_since = 0                   # released results that disagreed since the last tuning
        self.tuner = ThresholdTuner(self._target(), slack_errors=self.settings.slack_errors)
        self._lock = threading.Lock()
        self.window = _Window(self.settings.window, tuple(self.candidates))
        self.events: deque[ExitEvent] = deque(maxlen=64)
        self.tunings = 0
        self.seen = 0
        self.exits: dict[int, int] = {}
        self._since_tuning = 0
        self._tuned_at = clock()
        self._dropped_at: dict[int, int] = {}    # layer -> the tuning that dropped it
        self._added_at: dict[int, int] = {}      # layer -> the tuning that added it (judged only after one more)
        self._fed: deque[tuple] = deque(maxlen=PENDING_BATCHES)   # `feed`'s batches, not yet observed
        self._draining = threading.Lock()
        self.adaptive = fixed is None and self.settings.policy == APPARATE
        if evidence is not None and self.adaptive:
            if evidence.conf.shape[1:] != (len(self.candidates),) or evidence.agree.shape != evidence.conf.shape:
                raise ValueError(f"evidence of shape {evidence.conf.shape} is not one column a ramp "
                                 f"({len(self.candidates)})")
            self.window.conf.extend(evidence.conf.astype(np.float64))
            self.window.agree.extend(evidence.agree.astype(bool))
        self.evidence = evidence if self.adaptive else None   # judges a ramp the window no longer holds
        if self.settings.policy == NONE:   # no ramp runs: vanilla's cost
            self.active = ActiveRamps((), NoExit())
        elif fixed is not None:
            self.active = ActiveRamps(tuple(self.candidates), fixed)
        else:
            layers = self._initial_layers()
            self.active = ActiveRamps(layers, ThresholdRule(tuple((initial or {}).get(k, NEVER) for k in layers)))

    def _initial_layers(self) -> tuple[int, ...]:
        """The earliest ramps whose summed cost fits the budget (at least one)."""
        chosen, spent = [], 0.0
        for layer, c in self.candidates.items():
            if chosen and spent + c.cost > self.settings.budget:
                break
            chosen.append(layer)
            spent += c.cost
        return tuple(chosen)

    # -- feedback ------------------------------------------------------------------------------
    def feed(self, layers: Sequence[int], signals: ExitSignals, final: np.ndarray,
             exit_at: np.ndarray, ramp_seconds: Sequence[float] = (), batch_s: float | None = None) -> None:
        """`observe`'s arguments, queued (the compute thread's part): observing a batch of 1-3 texts costs about
        as much as a ramp, mostly fixed costs, on the batch's critical path. `drain` observes the queued
        batches together, off it; `due` and `tune` drain first."""
        if self.adaptive and len(final):
            self._fed.append((tuple(layers), signals, final, exit_at, tuple(ramp_seconds), batch_s))

    def drain(self) -> int:
        """Observes the batches `feed` queued, in order, those in a row with the same ramps at once; returns
        how many."""
        with self._draining:
            fed = [self._fed.popleft() for _ in range(len(self._fed))]
            for layers, group in itertools.groupby(fed, key=lambda batch: batch[0]):
                run = list(group)
                for _, _, _, _, ramp_seconds, batch_s in run:
                    self._measure_costs(ramp_seconds, batch_s)
                signals = ExitSignals(*(np.concatenate([getattr(b[1], k) for b in run])
                                        for k in ("conf", "preds", "entropy")))
                self._observe(layers, signals, np.concatenate([b[2] for b in run]), np.concatenate([b[3] for b in run]))
            return len(fed)

    def observe(self, layers: Sequence[int], signals: ExitSignals, final: np.ndarray,
                exit_at: np.ndarray, ramp_seconds: Sequence[float] = (), batch_s: float | None = None) -> None:
        """A batch's ramp signals at `layers`, the full model's predictions and where each text was released
        (index into `layers`, len(layers): not released early); `ramp_seconds`: what each ramp at `layers` took
        on it, `batch_s`: its compute time (the serving cost, which small batches make larger than the
        bootstrap measured)."""
        if not self.adaptive or not len(final):
            return
        self._measure_costs(ramp_seconds, batch_s)
        self._observe(layers, signals, final, exit_at)

    def _observe(self, layers: Sequence[int], signals: ExitSignals, final: np.ndarray, exit_at: np.ndarray) -> None:
        index = {layer: i for i, layer in enumerate(self.window.layers)}
        conf = np.full((len(final), len(index)), np.nan)
        agree = np.zeros((len(final), len(index)), dtype=bool)
        for j, layer in enumerate(layers):
            conf[:, index[layer]] = signals.conf[:, j]
            agree[:, index[layer]] = signals.preds[:, j] == final
        ok = released_agreement(exit_at, signals.preds == final[:, None]) if layers else np.ones(len(final), bool)
        with self._lock:
            self._errors_since += int((~ok).sum())
            self.window.conf.extend(conf)
            self.window.agree.extend(agree)
            self.window.released_ok.extend(ok.tolist())
            self.seen += len(final)
            self._since_tuning += len(final)
            for j, layer in enumerate(layers):
                self.exits[layer] = self.exits.get(layer, 0) + int((exit_at == j).sum())

    def _measure_costs(self, ramp_seconds: Sequence[float], batch_s: float | None) -> None:
        """Every ramp's cost: a ramp's measured seconds over the model's, both smoothed. The ramps share one
        shape (a pooling and one small head), so the running ones' time is also the estimate for those not
        running; and a ramp's time on a few texts is mostly fixed, so their share follows the batches' time
        as the load changes, even while no ramp runs."""
        if batch_s and self._warm("batch"):
            self._batch_s = _smoothed(self._batch_s, batch_s)
        if len(ramp_seconds) and self._warm("ramp"):
            self._ramp_s = _smoothed(self._ramp_s, float(np.mean(ramp_seconds)))
        if self._ramp_s is not None and self._batch_s:
            self.cost = dict.fromkeys(self.candidates, self._ramp_s / self._batch_s)

    def _warm(self, kind: str) -> bool:
        """Whether this sample of `kind` comes after the device's set-up (see WARM_UP_BATCHES)."""
        self._samples[kind] += 1
        return self._samples[kind] > WARM_UP_BATCHES

    def window_agreement(self) -> float:
        with self._lock:
            ok = list(self.window.released_ok)
        return float(np.mean(ok)) if ok else 1.0

    def due(self) -> str:
        """Why a tuning is due now ("" if not): agreement below the constraint, texts since the last, time."""
        self.drain()
        if not self.adaptive or not self._since_tuning or self.seen < self.settings.min_texts:
            return ""
        errors = self._span_errors()
        if self._errors_since and errors > self._span_allowance():
            return f"{errors} of the last {AGREEMENT_SPAN} released results disagreed, over the constraint's " \
                   f"{self._span_allowance():.1f}"
        if self._since_tuning >= self.settings.retune_every:
            return f"{self._since_tuning} texts since the last tuning"
        if self.clock() - self._tuned_at >= self.settings.retune_s:
            return f"{self.clock() - self._tuned_at:.0f} s since the last tuning"
        return ""

    # -- tuning and adjustment (off the compute thread) ------------------------------------------
    def tune(self, reason: str = "") -> Tuning | None:
        """Re-tunes the active ramps' thresholds on the window, then adjusts the ramp set (§3.3)."""
        self.drain()
        with self._lock:
            conf = np.array(self.window.conf) if self.window.conf else np.zeros((0, len(self.window.layers)))
            agree = np.array(self.window.agree) if self.window.agree else np.zeros_like(conf, dtype=bool)
            self._since_tuning, self._tuned_at, self._errors_since = 0, self.clock(), 0
        layers = self.active.layers
        if not len(conf):
            return None
        columns = [self.window.layers.index(layer) for layer in layers]
        seen = ~np.isnan(conf[:, columns]).any(axis=1)      # texts every active ramp has seen
        conf_a, agree_a = conf[seen][:, columns], agree[seen][:, columns]
        saving = [self.candidates[layer].saving for layer in layers]
        self._adapt_margin()
        tuning = self.tuner.tune(conf_a, agree_a, saving)
        texts = int(seen.sum())
        # a target stricter than the constraint (after disagreements) may release nothing for a while: the
        # ramps are judged on what they release at the constraint itself, or every ramp would look useless
        judged = tuning if self.margin >= 1.0 or not self._judges(texts) else \
            ThresholdTuner(self.settings.constraint, slack_errors=self.settings.slack_errors).tune(
                conf_a, agree_a, saving)
        self.tunings += 1
        self.active = ActiveRamps(layers, ThresholdRule(tuning.thresholds))
        self._log("tuned", 0, f"{reason or 'requested'}: thresholds "
                  f"{', '.join(f'L{k}={t:.3f}' for k, t in zip(layers, tuning.thresholds, strict=True))}, "
                  f"agreement {tuning.agreement:.4f}, saving {tuning.saving:.3f} over {texts} texts")
        self._adjust(tuning.thresholds, judged.exit_rates, texts)
        return tuning

    def _judges(self, texts: int) -> bool:
        """Whether a tuning over `texts` texts judges the ramps: on as many texts as their agreement is watched."""
        return texts >= min(AGREEMENT_SPAN, self.settings.window) or not self.active.layers

    def _target(self) -> float:
        return 1.0 - (1.0 - self.settings.constraint) * self.margin

    def _span_errors(self) -> int:
        with self._lock:
            recent = list(self.window.released_ok)[-AGREEMENT_SPAN:]
        return len(recent) - sum(recent)

    def _span_allowance(self) -> float:
        """The disagreements the constraint allows over the watched span of texts."""
        return (1.0 - self.settings.constraint) * AGREEMENT_SPAN

    def _adapt_margin(self) -> None:
        """The tuning target follows what clients got: a tuning may spend what the latest released results left
        of the span's allowance. Thresholds tuned to the constraint exactly on past texts break it on the next
        ones as traffic drifts (the replay bench): so after errors the target is stricter, until they age out."""
        self.margin = min(1.0, max(MIN_MARGIN, 1.0 - self._span_errors() / self._span_allowance()))
        self.tuner.constraint = self._target()

    def _adjust(self, tuned: Sequence[float], exit_rates: Sequence[float], texts: int) -> None:
        """Given the `tuned` thresholds and the `exit_rates` each ramp is judged on: drops the ramp whose exits
        saved least below its cost (one a tuning, never one added since the last), and the least useful ones
        while the ramps' measured cost is over the budget; then adds the unused ramp before the busiest one
        (earlier exits save more), or while none releases the one likeliest to save (`_likeliest`), if the ramps'
        summed cost stays within the budget."""
        if not self._judges(texts):
            return
        layers, thresholds = list(self.active.layers), list(tuned)
        reach, net = 1.0, {}
        for j, layer in enumerate(layers):   # what each ramp's exits saved, and what it cost
            net[layer] = (exit_rates[j] * self.candidates[layer].saving, reach * self.cost[layer])
            reach -= exit_rates[j]
        judged = [k for k in layers if self.tunings - self._added_at.get(k, 0) > 1 and net[k][0] < net[k][1]]
        if judged:
            worst = min(judged, key=lambda k: net[k][0] - net[k][1])
            self._drop(layers, thresholds, worst,
                       f"its exits saved {net[worst][0]:.4f} of the model's time, it cost {net[worst][1]:.4f}")
        while layers and sum(self.cost[k] for k in layers) > self.settings.budget:   # costs measured in serving
            spent = sum(self.cost[k] for k in layers)
            self._drop(layers, thresholds, min(layers, key=lambda k: net[k][0] - net[k][1]),
                       f"the ramps' cost {spent:.4f} is over the budget {self.settings.budget}")
        spent = sum(self.cost[layer] for layer in layers)
        added, why = self._addable(layers, exit_rates, spent)
        if added:
            self._added_at[added] = self.tunings
            layers.append(added)
            thresholds.append(NEVER)   # no exits until a tuning has seen its confidences
            order = np.argsort(layers)
            layers, thresholds = [layers[i] for i in order], [thresholds[i] for i in order]
            self._log("added", added, f"{why}; ramps' cost "
                      f"{spent + self.cost[added]:.4f} within the budget {self.settings.budget}")
        self.active = ActiveRamps(tuple(layers), ThresholdRule(tuple(thresholds)))

    def _drop(self, layers: list[int], thresholds: list[float], layer: int, reason: str) -> None:
        i = layers.index(layer)
        del layers[i], thresholds[i]
        self._dropped_at[layer] = self.tunings
        self._log("dropped", layer, reason)

    def _addable(self, layers: list[int], exit_rates: Sequence[float], spent: float) -> tuple[int, str]:
        """The ramp to add (0: none), and why."""
        free = [k for k in self.candidates if k not in layers and
                self.tunings - self._dropped_at.get(k, -10**9) > self.settings.cooldown and
                spent + self.cost[k] <= self.settings.budget]
        if not free:
            return 0, ""
        rates = dict(zip(self.active.layers, exit_rates, strict=False))
        busiest = max((k for k in layers), key=lambda k: rates.get(k, 0.0), default=None)
        if busiest is None or rates.get(busiest, 0.0) <= 0:
            return self._likeliest(free)
        before = [k for k in free if k < busiest]
        return (max(before), "exits likely before the busiest ramp") if before else (0, "")

    def _likeliest(self, free: list[int]) -> tuple[int, str]:
        """While none releases: the free ramp whose exits would save most, alone and net of its cost, tuned at
        the constraint on the latest texts it saw (the window's, else the ramps' evidence); the deepest, the
        likeliest to be confident, when none has enough texts or none would pay. A deep ramp saves little: on
        MiniLM a release after layer 5 saves 17 % of the model's time, one after layer 2 66 %."""
        tuner = ThresholdTuner(self.settings.constraint, slack_errors=self.settings.slack_errors)
        with self._lock:
            conf = np.array(self.window.conf) if self.window.conf else np.zeros((0, len(self.window.layers)))
            agree = np.array(self.window.agree) if self.window.agree else np.zeros_like(conf, dtype=bool)
        net = {}
        for layer in free:
            j = self.window.layers.index(layer)
            seen = ~np.isnan(conf[:, j])
            if seen.sum() >= AGREEMENT_SPAN:
                c, a = conf[seen, j], agree[seen, j]
            elif self.evidence is not None and len(self.evidence.conf) >= AGREEMENT_SPAN:
                c, a = self.evidence.conf[:, j].astype(np.float64), self.evidence.agree[:, j].astype(bool)
            else:
                continue
            net[layer] = tuner.tune(c[:, None], a[:, None], [self.candidates[layer].saving]).saving - self.cost[layer]
        best = max(net, key=net.__getitem__, default=None)
        if best is None or net[best] <= 0:
            return max(free), "no ramp releases: the deepest free one, the likeliest to be confident"
        return best, f"no ramp releases: alone it would save {net[best]:.4f} of the model's time net of its cost"

    def _log(self, kind: str, layer: int, reason: str) -> None:
        self.events.append(ExitEvent(self.clock(), kind, layer, reason))

    def status(self) -> dict:
        """What `academus ramps status` shows."""
        rule = self.active.rule
        thresholds = list(rule.thresholds) if isinstance(rule, ThresholdRule) else []
        return {"policy": self.settings.policy, "constraint": self.settings.constraint,
                "active": list(self.active.layers), "thresholds": [round(t, 4) for t in thresholds],
                "window_agreement": round(self.window_agreement(), 4), "margin": round(self.margin, 3),
                "texts": self.seen,
                "exits": {str(k): v for k, v in sorted(self.exits.items())}, "tunings": self.tunings,
                "costs": {str(k): round(self.cost[k], 5) for k in self.active.layers},
                "events": [e.as_dict() for e in list(self.events)[-16:]]}


def _smoothed(running: float | None, sample: float) -> float:
    return sample if running is None else (1 - COST_SMOOTHING) * running + COST_SMOOTHING * sample


def controller_for(layers: Sequence[int], extra: dict, settings: ControllerSettings,
                   evidence: Evidence | None = None) -> ExitController:
    """The controller of ramps at `layers` from their manifest's `extra` (`academus ramps train`: each ramp's
    saving and cost, the thresholds tuned once): a baseline's fixed rule, or Apparate's from those thresholds,
    its window started with the ramps' `evidence`. A manifest lacking them raises KeyError, TypeError or
    ValueError."""
    candidates = [RampCandidate(k, float(extra["saving"][str(k)]), float(extra["cost"][str(k)])) for k in layers]
    tuned_once = extra.get("tuned_once", {})
    initial = {int(k): float(v) for k, v in tuned_once.get("static", {}).items()}
    return ExitController(candidates, settings, fixed=fixed_rule(settings.policy, tuned_once, layers),
                          initial=initial, evidence=evidence)


def fixed_rule(policy: str, tuned_once: dict, layers: Sequence[int]) -> ExitRule | None:
    """The baselines' rules, from the thresholds tuned once on the bootstrap data (the ramps' manifest);
    None for Apparate's adaptive rule."""
    if policy == APPARATE:
        return None
    if policy == NONE:
        return NoExit()
    if policy == DEEBERT:
        return EntropyRule(float(tuned_once["deebert_entropy"]))
    if policy == STATIC:
        static = {int(k): float(v) for k, v in tuned_once["static"].items()}
        return ThresholdRule(tuple(static.get(layer, NEVER) for layer in layers))
    if policy in (PABEE2, PABEE3):
        return PatienceRule(int(policy[-1]))
    raise ValueError(f"exit policy {policy!r} is not one of {', '.join(POLICIES)}")


def tune_entropy_once(entropy: np.ndarray, agree: np.ndarray, constraint: float) -> float:
    """DeeBERT's one entropy threshold: the largest (most exits) on a grid that keeps agreement >= constraint."""
    best, top = 0.0, float(np.nanmax(entropy)) if entropy.size else 0.0
    for threshold in np.linspace(0.0, top, 201)[1:]:
        exits = entropy < threshold
        exit_at = np.where(exits.any(1), exits.argmax(1), entropy.shape[1])   # the first confident ramp
        if released_agreement(exit_at, agree).mean() >= constraint:
            best = float(threshold)
    return best
