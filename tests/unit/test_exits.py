"""Early exits: the rules' replay, the greedy threshold tuner and the controller, on hand-built signals."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from academus.shared.models.exits import (
    AGREEMENT_SPAN,
    MIN_MARGIN,
    NEVER,
    ActiveRamps,
    ControllerSettings,
    EntropyRule,
    Evidence,
    ExitController,
    ExitSignals,
    NoExit,
    PatienceRule,
    RampCandidate,
    ThresholdRule,
    ThresholdTuner,
    Tuning,
    fixed_rule,
    released_agreement,
    replay,
)

# ---------------------------------------------------------------- helpers


def signals(conf: Sequence[Sequence[float]] | np.ndarray, preds: Sequence[Sequence[int]] | np.ndarray | None = None,
            entropy: Sequence[Sequence[float]] | np.ndarray | None = None) -> ExitSignals:
    """ExitSignals from [n, R] lists; preds and entropy default to zeros."""
    conf = np.asarray(conf, dtype=np.float64)
    preds = np.zeros(conf.shape, dtype=int) if preds is None else np.asarray(preds, dtype=int)
    entropy = np.zeros(conf.shape) if entropy is None else np.asarray(entropy, dtype=np.float64)
    return ExitSignals(conf, preds, entropy)


def fake_clock(start: float = 0.0) -> tuple[list[float], Callable[[], float]]:
    """A clock reading the list's last value: append to move time on."""
    now = [start]

    def clock() -> float:
        return now[-1]

    return now, clock


def candidates(layers: Sequence[int] = (2, 4, 6, 8), cost: float = 0.01, depth: int = 12) -> list[RampCandidate]:
    """Ramps at `layers` of a `depth`-layer model, each costing `cost`."""
    return [RampCandidate(layer, 1.0 - layer / depth, cost) for layer in layers]


def settings(**overrides: object) -> ControllerSettings:
    """Settings that tune only when a test makes it due: huge retune_every and retune_s unless overridden."""
    values: dict[str, object] = {"retune_every": 10**6, "retune_s": 1e9}
    values.update(overrides)
    return ControllerSettings(**values)


def feed(ctrl: ExitController, layers: Sequence[int], conf: np.ndarray, agree: np.ndarray,
         exit_at: np.ndarray | None = None) -> None:
    """Observes a batch: the full model answers class 0, a ramp class 0 where `agree` (else 1); released nowhere
    unless `exit_at` says."""
    n = len(conf)
    preds = np.where(agree, 0, 1)
    exit_at = np.full(n, len(layers)) if exit_at is None else exit_at
    ctrl.observe(layers, ExitSignals(conf, preds, np.zeros(conf.shape)), np.zeros(n, dtype=int), exit_at)


def columns(n: int, *values: float) -> np.ndarray:
    """[n, R] with column j filled with values[j]."""
    return np.tile(np.asarray(values, dtype=np.float64), (n, 1))


# ---------------------------------------------------------------- rules and replay


def test_threshold_rule_exits_at_first_confident_ramp() -> None:
    """A text exits at the first ramp with conf > threshold (strictly); never-confident texts get R."""
    sig = signals([[0.2, 0.95, 0.99], [0.97, 0.1, 0.99], [0.1, 0.2, 0.3], [0.9, 0.9, 0.91]])
    assert replay(ThresholdRule((0.9, 0.9, 0.9)), sig).tolist() == [1, 0, 3, 2]


def test_threshold_rule_per_ramp_thresholds() -> None:
    """Each ramp is judged against its own threshold."""
    sig = signals([[0.8, 0.8], [0.6, 0.8]])
    assert replay(ThresholdRule((0.7, NEVER)), sig).tolist() == [0, 2]
    assert replay(ThresholdRule((NEVER, 0.7)), sig).tolist() == [1, 1]


def test_never_threshold_means_no_exits() -> None:
    """Threshold 1.0 lets nothing out, even conf 1.0."""
    sig = signals(np.ones((5, 3)))
    assert replay(ThresholdRule((NEVER,) * 3), sig).tolist() == [3] * 5


def test_entropy_rule_exits_at_first_low_entropy() -> None:
    """DeeBERT: the first ramp whose entropy is below the threshold."""
    sig = signals(np.zeros((3, 3)), entropy=[[0.9, 0.2, 0.1], [0.05, 0.9, 0.9], [0.5, 0.5, 0.3]])
    assert replay(EntropyRule(0.3), sig).tolist() == [1, 0, 3]


@pytest.mark.parametrize(("patience", "expected"), [(2, [1, 2, 1, 4]), (3, [4, 3, 2, 4])])
def test_patience_rule(patience: int, expected: list[int]) -> None:
    """PABEE: exit at ramp j once the last `patience` predictions agree."""
    preds = [[1, 1, 2, 2], [0, 1, 1, 1], [3, 3, 3, 3], [0, 1, 0, 1]]
    assert replay(PatienceRule(patience), signals(np.zeros((4, 4)), preds=preds)).tolist() == expected


@pytest.mark.parametrize("patience", [2, 3])
def test_patience_rule_never_before_patience_minus_one(patience: int) -> None:
    """Even unanimous ramps release no earlier than ramp patience-1."""
    sig = signals(np.zeros((3, 4)), preds=np.full((3, 4), 7))
    rule = PatienceRule(patience)
    assert replay(rule, sig).tolist() == [patience - 1] * 3
    for j in range(patience - 1):
        assert not rule.exits_at(j, sig.conf, sig.preds, sig.entropy).any()


def test_no_exit() -> None:
    """NoExit releases nothing, whatever the signals."""
    sig = signals(np.ones((4, 2)), entropy=np.zeros((4, 2)))
    assert replay(NoExit(), sig).tolist() == [2] * 4


def test_replay_without_ramps() -> None:
    """No ramps: every text gets index 0 (= R)."""
    assert replay(ThresholdRule(()), signals(np.zeros((3, 0)))).tolist() == [0, 0, 0]


def test_signals_from_probs() -> None:
    """from_probs: top probability, argmax and entropy per text and ramp."""
    sig = ExitSignals.from_probs([np.array([[0.9, 0.1], [0.5, 0.5]]), np.array([[0.2, 0.8], [1.0, 0.0]])])
    assert sig.conf.shape == (2, 2) and len(sig) == 2
    np.testing.assert_allclose(sig.conf, [[0.9, 0.8], [0.5, 1.0]])
    assert sig.preds.tolist() == [[0, 1], [0, 0]]
    np.testing.assert_allclose(sig.entropy[1], [np.log(2), 0.0], atol=1e-9)


def test_released_agreement() -> None:
    """The released ramp's agreement; True for texts not released early."""
    agree = np.array([[True, False], [True, False], [False, False], [False, True]])
    exit_at = np.array([0, 1, 2, 1])
    assert released_agreement(exit_at, agree).tolist() == [True, False, True, True]


def test_released_agreement_without_ramps() -> None:
    """No ramps: every text agrees."""
    assert released_agreement(np.zeros(3, dtype=int), np.zeros((3, 0), dtype=bool)).tolist() == [True] * 3


# ---------------------------------------------------------------- tuner


def test_tuner_uses_an_always_right_confident_ramp() -> None:
    """A ramp always right and confident gets its threshold lowered: most texts exit there, agreement 1."""
    n = 200
    conf = columns(n, 0.995, 0.5)
    agree = np.ones((n, 2), dtype=bool)
    tuning = ThresholdTuner(0.99).tune(conf, agree, [0.8, 0.4])
    assert tuning.thresholds[0] < 0.995
    assert tuning.exit_rates[0] > 0.9
    assert tuning.agreement == 1.0
    assert tuning.saving > 0.0
    assert tuning.evaluations > 0


def test_tuner_keeps_the_constraint_when_a_ramp_is_confidently_wrong() -> None:
    """Ramp 0 is confident on all but wrong on 5 %: exiting everything there would break 0.99; the tuning
    keeps agreement >= 0.99 and still saves through the always-right ramp 1."""
    n = 200
    conf = columns(n, 0.995, 0.999)
    conf[:10, 0] = 0.99
    agree = np.ones((n, 2), dtype=bool)
    agree[:10, 0] = False
    assert released_agreement(np.zeros(n, dtype=int), agree).mean() < 0.99   # the construction's point
    tuning = ThresholdTuner(0.99).tune(conf, agree, [0.8, 0.4])
    assert tuning.agreement >= 0.99
    assert tuning.saving > 0.0
    exit_at = replay(ThresholdRule(tuning.thresholds), signals(conf))
    assert released_agreement(exit_at, agree).mean() >= 0.99


@pytest.mark.parametrize("constraint", [0.95, 0.99])
def test_tuner_respects_constraint_on_random_data(constraint: float) -> None:
    """Random, roughly calibrated ramps: the tuned agreement meets the constraint, and replaying the thresholds
    reproduces the reported agreement and exit rates."""
    rng = np.random.default_rng(7)
    n, ramps = 512, 3
    conf = rng.uniform(0.5, 1.0, (n, ramps)) ** np.array([3.0, 1.5, 0.5])
    agree = rng.random((n, ramps)) < conf
    saving = [0.75, 0.5, 0.25]
    tuning = ThresholdTuner(constraint).tune(conf, agree, saving)
    assert tuning.agreement >= constraint
    assert all(0.0 <= t <= 1.0 for t in tuning.thresholds)
    exit_at = replay(ThresholdRule(tuning.thresholds), signals(conf))
    assert released_agreement(exit_at, agree).mean() == pytest.approx(tuning.agreement)
    rates = np.bincount(exit_at, minlength=ramps + 1)[:ramps] / n
    np.testing.assert_allclose(rates, tuning.exit_rates)
    assert tuning.saving == pytest.approx(float(np.append(saving, 0.0)[exit_at].mean()))


def test_tuner_slack_errors_need_more_texts() -> None:
    """slack_errors=1 charges one error: 64 perfect texts cannot show 0.995, 256 can."""
    tuner = ThresholdTuner(0.995, slack_errors=1.0)
    few = tuner.tune(columns(64, 0.999), np.ones((64, 1), dtype=bool), [0.5])
    many = tuner.tune(columns(256, 0.999), np.ones((256, 1), dtype=bool), [0.5])
    assert few.thresholds == (NEVER,) and few.saving == 0.0
    assert many.thresholds[0] < 0.999 and many.exit_rates == (1.0,)


def test_tuner_empty_input() -> None:
    """No texts (or no ramps): NEVER thresholds, nothing evaluated."""
    tuning = ThresholdTuner().tune(np.zeros((0, 2)), np.zeros((0, 2), dtype=bool), [0.5, 0.2])
    assert tuning == Tuning((NEVER, NEVER), 1.0, 0.0, (0.0, 0.0), 0)
    assert ThresholdTuner().tune(np.zeros((4, 0)), np.zeros((4, 0), dtype=bool), []).thresholds == ()


def test_tuner_time_is_reported() -> None:
    """One tune of 2 ramps x 256 texts evaluates configurations (its wall time is printed, not asserted)."""
    rng = np.random.default_rng(0)
    conf = rng.uniform(0.5, 1.0, (256, 2))
    agree = rng.random((256, 2)) < conf
    start = time.perf_counter()
    tuning = ThresholdTuner(0.99).tune(conf, agree, [0.6, 0.3])
    elapsed = time.perf_counter() - start
    print(f"tune 2 ramps x 256 texts: {elapsed * 1e3:.1f} ms, {tuning.evaluations} evaluations")
    assert tuning.evaluations > 0


# ---------------------------------------------------------------- controller


def test_initial_layers_fit_budget_and_initial_thresholds() -> None:
    """Costs 0.01 each and budget 0.02: the two earliest ramps, with `initial` thresholds (NEVER otherwise)."""
    _, clock = fake_clock()
    ctrl = ExitController(candidates(), settings(budget=0.02), initial={2: 0.9, 8: 0.5}, clock=clock)
    assert ctrl.active.layers == (2, 4)
    assert ctrl.active.rule == ThresholdRule((0.9, NEVER))
    assert ctrl.adaptive


def test_initial_layers_at_least_one_ramp() -> None:
    """A first ramp over the budget is still chosen (alone)."""
    ctrl = ExitController(candidates(cost=0.05), settings(budget=0.02), clock=fake_clock()[1])
    assert ctrl.active.layers == (2,)


def test_due_on_agreement_drop() -> None:
    """Released results disagreeing beyond the constraint's allowance over the watched span make a tuning due,
    once min_texts texts came and only for new disagreements since the last tuning."""
    ctrl = ExitController(candidates(), settings(min_texts=64), clock=fake_clock()[1])
    wrong = np.zeros((20, 2), dtype=bool)
    feed(ctrl, (2, 4), columns(20, 0.99, 0.99), wrong, exit_at=np.zeros(20, dtype=int))
    assert ctrl.window_agreement() == 0.0
    assert ctrl.due() == ""   # too little feedback yet
    feed(ctrl, (2, 4), columns(44, 0.5, 0.5), np.ones((44, 2), dtype=bool))
    assert "20 of the last 256 released results disagreed" in ctrl.due()
    assert ctrl.window_agreement() == pytest.approx(44 / 64)
    assert ctrl.exits == {2: 20, 4: 0}
    ctrl.tune()
    feed(ctrl, (2, 4), columns(1, 0.5, 0.5), np.ones((1, 2), dtype=bool))
    assert ctrl.due() == ""   # the old disagreements were answered by the last tuning
    feed(ctrl, (2, 4), columns(1, 0.99, 0.99), np.zeros((1, 2), dtype=bool), exit_at=np.zeros(1, dtype=int))
    assert "21 of the last 256" in ctrl.due()


def test_due_after_retune_every_texts() -> None:
    """`retune_every` agreeing texts make a tuning due (not before min_texts texts were seen)."""
    ctrl = ExitController(candidates(), settings(retune_every=80, min_texts=64), clock=fake_clock()[1])
    feed(ctrl, (2, 4), columns(79, 0.5, 0.5), np.ones((79, 2), dtype=bool))
    assert ctrl.due() == ""
    feed(ctrl, (2, 4), columns(1, 0.5, 0.5), np.ones((1, 2), dtype=bool))
    assert ctrl.due() == "80 texts since the last tuning"


def test_due_waits_for_min_texts() -> None:
    """With retune_every below min_texts, nothing is due until min_texts texts were seen."""
    ctrl = ExitController(candidates(), settings(retune_every=16, min_texts=64), clock=fake_clock()[1])
    feed(ctrl, (2, 4), columns(63, 0.5, 0.5), np.ones((63, 2), dtype=bool))
    assert ctrl.due() == ""
    feed(ctrl, (2, 4), columns(1, 0.5, 0.5), np.ones((1, 2), dtype=bool))
    assert ctrl.due() == "64 texts since the last tuning"


def test_due_after_retune_s() -> None:
    """Time since the last tuning (on the injected clock) makes a tuning due, once texts came."""
    now, clock = fake_clock(100.0)
    ctrl = ExitController(candidates(), settings(retune_s=30.0, min_texts=64), clock=clock)
    now.append(200.0)
    assert ctrl.due() == ""   # no text yet
    now.append(100.0)
    feed(ctrl, (2, 4), columns(64, 0.5, 0.5), np.ones((64, 2), dtype=bool))
    now.append(129.0)
    assert ctrl.due() == ""
    now.append(131.0)
    assert ctrl.due() == "31 s since the last tuning"


def test_tune_changes_thresholds_and_resets_due() -> None:
    """tune() returns a Tuning, the active rule takes its thresholds, and nothing is due right after."""
    now, clock = fake_clock()
    ctrl = ExitController(candidates(), settings(retune_every=256), clock=clock)
    before = ctrl.active.rule
    feed(ctrl, (2, 4), columns(256, 0.999, 0.5), np.ones((256, 2), dtype=bool))
    assert ctrl.due()
    now.append(5.0)
    tuning = ctrl.tune("test")
    assert isinstance(tuning, Tuning)
    assert ctrl.active.layers == (2, 4)
    assert ctrl.active.rule == ThresholdRule(tuning.thresholds) != before
    assert tuning.thresholds[0] < 0.999 and tuning.exit_rates[0] > 0.9
    assert ctrl.tunings == 1 and ctrl.due() == ""
    assert ctrl.status()["events"][-1]["kind"] == "tuned"
    assert ctrl.status()["events"][-1]["at"] == 5.0


def test_tune_small_window_keeps_never_thresholds() -> None:
    """With slack_errors=1, 64 error-free texts are too weak evidence for the 0.995 target: no exits."""
    ctrl = ExitController(candidates(), settings(slack_errors=1.0), clock=fake_clock()[1])
    feed(ctrl, (2, 4), columns(64, 0.999, 0.5), np.ones((64, 2), dtype=bool))
    assert ctrl.tune().thresholds == (NEVER, NEVER)


def test_tune_adapts_margin() -> None:
    """A tuning spends what the latest released results left of the span's allowance: all of it without
    disagreements, a share after one, MIN_MARGIN past the allowance."""
    allowance = 0.01 * AGREEMENT_SPAN
    bad = ExitController(candidates(), settings(), clock=fake_clock()[1])
    feed(bad, (2, 4), columns(32, 0.99, 0.99), np.zeros((32, 2), dtype=bool), exit_at=np.zeros(32, dtype=int))
    bad.tune()
    assert bad.margin == MIN_MARGIN and bad.tuner.constraint == pytest.approx(1.0 - 0.01 * MIN_MARGIN)
    good = ExitController(candidates(), settings(), clock=fake_clock()[1])
    feed(good, (2, 4), columns(32, 0.5, 0.5), np.ones((32, 2), dtype=bool))
    good.tune()
    assert good.margin == 1.0 and good.tuner.constraint == pytest.approx(0.99)
    feed(good, (2, 4), columns(1, 0.99, 0.99), np.zeros((1, 2), dtype=bool), exit_at=np.zeros(1, dtype=int))
    good.tune()
    assert good.margin == pytest.approx(1 - 1 / allowance)


def released_disagreements(ctrl: ExitController, texts: int, wrong: int) -> None:
    """`texts` texts on which ramp 2 is confident (0.999) and agrees, then `wrong` it released and got wrong at a
    low confidence (0.6): what a tuning after them sees."""
    feed(ctrl, (2, 4), columns(texts, 0.999, 0.5), np.ones((texts, 2), dtype=bool))
    feed(ctrl, (2, 4), columns(wrong, 0.6, 0.5), np.zeros((wrong, 2), dtype=bool), exit_at=np.zeros(wrong, dtype=int))


def test_evidence_lets_a_young_controller_release_after_disagreements() -> None:
    """Two disagreements among the first 64 texts make the target stricter than 64 texts can show (a blackout);
    the ramps' evidence from `ramps train` (800 texts) shows it, so the same feed still releases."""
    conf = np.tile([0.999, 0.5, 0.5, 0.5], (800, 1))
    evidence = Evidence(conf, np.tile([True, False, False, False], (800, 1)))
    young, seeded = (ExitController(candidates(), settings(), clock=fake_clock()[1], evidence=e)
                     for e in (None, evidence))
    for ctrl in (young, seeded):
        released_disagreements(ctrl, 62, 2)
    assert len(young.window.conf) == 64 and len(seeded.window.conf) == 864
    blind, informed = young.tune(), seeded.tune()
    assert young.margin == seeded.margin < 1.0
    assert blind.thresholds == (NEVER, NEVER) and blind.saving == 0.0
    assert informed.thresholds[0] < 0.999 < NEVER and informed.exit_rates[0] > 0.9
    assert informed.thresholds[0] > 0.6   # the released disagreements stay below it


def test_evidence_of_the_wrong_width_is_refused_and_baselines_ignore_it() -> None:
    """Evidence needs one column a candidate ramp; a baseline's window stays empty."""
    with pytest.raises(ValueError, match="one column a ramp"):
        ExitController(candidates(), settings(), evidence=Evidence(np.ones((4, 3)), np.ones((4, 3), dtype=bool)))
    fixed = ExitController(candidates(), settings(policy="static"), fixed=ThresholdRule((0.9,) * 4),
                           evidence=Evidence(np.ones((4, 4)), np.ones((4, 4), dtype=bool)))
    assert not fixed.window.conf


def test_ramps_are_judged_at_the_constraint_not_the_stricter_target() -> None:
    """After disagreements past the allowance the target is so strict that no ramp releases; a ramp that releases
    at the constraint itself is not dropped for it (it would be, judged on the strict tuning's exits)."""
    ctrl = ExitController(candidates(), settings(), clock=fake_clock()[1])
    released_disagreements(ctrl, 2 * AGREEMENT_SPAN, 3)
    ctrl.tune()
    strict = ctrl.tune()
    assert ctrl.margin == MIN_MARGIN and strict.thresholds == (NEVER, NEVER)
    assert ctrl.active.layers[0] == 2
    assert not [e for e in ctrl.status()["events"] if e["kind"] == "dropped" and e["layer"] == 2]


def test_tune_empty_window_returns_none() -> None:
    """Nothing observed: no tuning."""
    ctrl = ExitController(candidates(), settings(), clock=fake_clock()[1])
    assert ctrl.tune() is None and ctrl.tunings == 0


def test_tune_drops_a_ramp_that_never_releases() -> None:
    """A ramp with no exits saves less than its cost: dropped at the second tuning (judged after one)."""
    ctrl = ExitController(candidates(), settings(), clock=fake_clock()[1])
    feed(ctrl, (2, 4), columns(AGREEMENT_SPAN, 0.3, 0.999), np.array([[False, True]] * AGREEMENT_SPAN))
    ctrl.tune()
    assert ctrl.active.layers == (2, 4)   # not judged on the first tuning
    ctrl.tune()
    assert ctrl.active.layers == (4,)
    assert [(e["kind"], e["layer"]) for e in ctrl.status()["events"] if e["kind"] != "tuned"] == [("dropped", 2)]


def test_tune_adds_the_deepest_free_ramp_while_none_releases() -> None:
    """No exits anywhere: the deepest unused ramp within budget is added, with a NEVER threshold."""
    cands = [RampCandidate(2, 0.8, 0.01), RampCandidate(4, 0.6, 0.015), RampCandidate(6, 0.4, 0.005)]
    ctrl = ExitController(cands, settings(budget=0.02), clock=fake_clock()[1])
    assert ctrl.active.layers == (2,)
    feed(ctrl, (2,), columns(AGREEMENT_SPAN, 0.3), np.zeros((AGREEMENT_SPAN, 1), dtype=bool))
    ctrl.tune()
    assert ctrl.active.layers == (2, 6)   # 4 would break the budget
    assert ctrl.active.rule == ThresholdRule((NEVER, NEVER))
    events = ctrl.status()["events"]
    assert (events[-1]["kind"], events[-1]["layer"]) == ("added", 6)


@pytest.mark.parametrize("served", [AGREEMENT_SPAN, 1024])
def test_while_none_releases_the_ramp_that_would_save_most_alone_is_added(served: int) -> None:
    """Ramps 4 and 6 were confident and right on the evidence, ramp 2 confident and wrong: 4 is added, whose exits
    save more than 6's, judged on the window's texts (256 served) or on the evidence once the window has pushed it
    out (1024 served, none seen by 4 or 6)."""
    cands = [RampCandidate(2, 0.8, 0.01), RampCandidate(4, 0.6, 0.015), RampCandidate(6, 0.4, 0.005)]
    evidence = Evidence(columns(300, 0.999, 0.999, 0.999), np.array([[False, True, True]] * 300))
    ctrl = ExitController(cands, settings(budget=0.03), clock=fake_clock()[1], evidence=evidence)
    ctrl.active = ActiveRamps((2,), ThresholdRule((NEVER,)))
    feed(ctrl, (2,), columns(served, 0.3), np.zeros((served, 1), dtype=bool))
    ctrl.tune()
    assert ctrl.active.layers == (2, 4)
    events = ctrl.status()["events"]
    assert (events[-1]["kind"], events[-1]["layer"]) == ("added", 4)
    assert "alone it would save 0.5850" in events[-1]["reason"]   # 0.6 saved on every text, less 0.015


def test_adjust_drops_costly_ramp_and_adds_one_before_busiest() -> None:
    """_adjust: drops the ramp saving less than its cost and adds the free ramp before the busiest one."""
    ctrl = ExitController(candidates(), settings(budget=0.02), clock=fake_clock()[1])
    ctrl.active = ActiveRamps((2, 6), ThresholdRule((0.9, 0.8)))
    ctrl.tunings = 3
    ctrl._adjust((0.9, 0.8), (0.0, 0.6), texts=AGREEMENT_SPAN)
    assert ctrl.active == ActiveRamps((4, 6), ThresholdRule((NEVER, 0.8)))
    kinds = [(e["kind"], e["layer"]) for e in ctrl.status()["events"]]
    assert kinds == [("dropped", 2), ("added", 4)]


def test_adjust_keeps_ramps_that_pay() -> None:
    """Ramps whose exits save more than their cost stay; too little feedback changes nothing."""
    ctrl = ExitController(candidates(), settings(budget=0.02), clock=fake_clock()[1])
    ctrl.tunings = 3
    ctrl._adjust((0.9, 0.8), (0.3, 0.3), texts=AGREEMENT_SPAN)
    assert ctrl.active.layers == (2, 4)
    ctrl._adjust((0.9, 0.8), (0.0, 0.0), texts=AGREEMENT_SPAN - 1)
    assert ctrl.active.layers == (2, 4) and not ctrl.events


@pytest.mark.parametrize("kwargs", [{"fixed": ThresholdRule((0.9,) * 4)}, {"policy": "none"}])
def test_fixed_baselines_never_tune(kwargs: dict) -> None:
    """A fixed rule or policy "none": not adaptive, observe ignored, nothing ever due."""
    now, clock = fake_clock()
    fixed = kwargs.get("fixed")
    ctrl = ExitController(candidates(), settings(retune_every=1, retune_s=1.0, policy=kwargs.get("policy", "apparate")),
                          fixed=fixed, clock=clock)
    assert not ctrl.adaptive
    layers = ctrl.active.layers
    assert layers == ((2, 4, 6, 8) if fixed else ())
    feed(ctrl, layers, np.full((32, len(layers)), 0.3), np.zeros((32, len(layers)), dtype=bool),
         exit_at=np.zeros(32, dtype=int))
    now.append(1e6)
    assert ctrl.due() == ""
    assert ctrl.seen == 0 and ctrl.exits == {} and ctrl.window_agreement() == 1.0


def test_status_keys() -> None:
    """status() reports the policy, ramps, thresholds, agreement, counts and events."""
    ctrl = ExitController(candidates(), settings(), initial={2: 0.91234}, clock=fake_clock()[1])
    feed(ctrl, (2, 4), columns(4, 0.99, 0.5), np.array([[True, True]] * 3 + [[False, True]]),
         exit_at=np.zeros(4, dtype=int))
    status = ctrl.status()
    assert {"policy", "active", "thresholds", "window_agreement", "texts", "exits", "tunings", "events"} <= set(status)
    assert status["policy"] == "apparate" and status["active"] == [2, 4]
    assert status["thresholds"] == [0.9123, 1.0]
    assert status["window_agreement"] == 0.75 and status["texts"] == 4
    assert status["exits"] == {"2": 4, "4": 0} and status["tunings"] == 0 and status["events"] == []


# ---------------------------------------------------------------- fixed_rule


TUNED_ONCE = {"deebert_entropy": 0.25, "static": {"2": 0.9, "6": 0.7}}


@pytest.mark.parametrize(("policy", "expected"), [
    ("none", NoExit()),
    ("deebert", EntropyRule(0.25)),
    ("static", ThresholdRule((0.9, NEVER, 0.7))),
    ("pabee2", PatienceRule(2)),
    ("pabee3", PatienceRule(3)),
    ("apparate", None),
])
def test_fixed_rule(policy: str, expected: object) -> None:
    """Each baseline policy's rule (static thresholds by layer, NEVER where untuned); None for apparate."""
    assert fixed_rule(policy, TUNED_ONCE, (2, 4, 6)) == expected


def test_fixed_rule_unknown_policy() -> None:
    """An unknown policy is a ValueError."""
    with pytest.raises(ValueError, match="not one of"):
        fixed_rule("bogus", TUNED_ONCE, (2,))


def test_measured_costs_over_the_budget_drop_ramps() -> None:
    """Ramps whose cost measured in serving puts the active set over the budget are dropped, least useful first,
    even when each still pays for itself; what remains fits the budget."""
    ctrl = ExitController(candidates(cost=0.005), settings(budget=0.02), clock=fake_clock()[1])
    assert ctrl.active.layers == (2, 4, 6, 8)
    for _ in range(3):   # small batches: each ramp costs more than bootstrapped, 0.9 ms of a 100 ms batch
        ctrl.observe((2, 4, 6, 8), signals(np.full((1, 4), 0.5)), np.zeros(1, dtype=int), np.array([4]),
                     ramp_seconds=(0.0009,) * 4, batch_s=0.1)
    assert ctrl.cost[2] == pytest.approx(0.009, rel=1e-6)
    ctrl._adjust((0.9, 0.9, 0.9, 0.9), (0.3, 0.2, 0.1, 0.05), texts=AGREEMENT_SPAN)
    assert sum(ctrl.cost[k] for k in ctrl.active.layers) <= 0.02
    assert ctrl.active.layers == (2, 4)   # the deeper ramps saved least
    reasons = [e["reason"] for e in ctrl.status()["events"] if e["kind"] == "dropped"]
    assert len(reasons) == 2 and all("over the budget" in r for r in reasons)


def test_a_ramp_not_running_costs_what_the_running_ones_do_at_the_current_batches() -> None:
    """The ramps share one shape: after the measured cost drops all but one ramp, the others are estimated at the
    running one's seconds, not at their bootstrap share, so none is added back over the budget; when batches
    grow (more load), the same seconds are a smaller share and ramps are added again, though none ran."""
    ctrl = ExitController(candidates(cost=0.004), settings(budget=0.02, cooldown=0), clock=fake_clock()[1])
    assert ctrl.active.layers == (2, 4, 6, 8)

    def batch(layers: tuple[int, ...], seconds: float) -> None:
        ctrl.observe(layers, signals(np.full((1, len(layers)), 0.5)), np.zeros(1, dtype=int),
                     np.array([len(layers)]), ramp_seconds=(0.0003,) * len(layers), batch_s=seconds)

    for _ in range(100):
        batch((2, 4, 6, 8), 0.02)            # one text a batch: 0.3 ms of a 20 ms forward, 1.5 % a ramp
    assert ctrl.cost == pytest.approx(dict.fromkeys((2, 4, 6, 8), 0.015), rel=1e-3)
    ctrl._adjust((0.9,) * 4, (0.0, 0.0, 0.3, 0.0), texts=AGREEMENT_SPAN)
    assert ctrl.active.layers == (6,)        # the budget holds one, the busiest
    ctrl.tunings += 10                       # past the dropped ramps' cooldown
    ctrl._adjust((0.9,), (0.3,), texts=AGREEMENT_SPAN)
    assert ctrl.active.layers == (6,)        # ramp 4, before the busiest, would not fit at 1.5 % (0.4 % bootstrapped)
    for _ in range(100):
        batch((6,), 0.06)                    # bigger batches: the same 0.3 ms is 0.5 % of the model's time
    assert ctrl.cost[4] == pytest.approx(0.005, rel=1e-2)
    ctrl._adjust((0.9,), (0.3,), texts=AGREEMENT_SPAN)
    assert ctrl.active.layers == (4, 6)
    assert ctrl.status()["events"][-1]["kind"] == "added"


def test_fed_batches_drained_together_leave_the_controller_as_observing_each_would() -> None:
    """The compute thread only queues a batch's feedback; drained, batches in a row with the same ramps are
    observed at once. The window, the counts, the errors and the measured costs end as one `observe` a batch
    leaves them, and `due` drains first."""
    rng = np.random.default_rng(3)
    batches = []
    for layers in ((2, 4), (2, 4), (4,), (2, 4), (2, 4), (2, 4)):
        n = int(rng.integers(1, 4))
        conf = rng.uniform(0.5, 1.0, (n, len(layers)))
        preds = rng.integers(0, 2, (n, len(layers)))
        exit_at = rng.integers(0, len(layers) + 1, n)
        batches.append((layers, ExitSignals(conf, preds, np.zeros(conf.shape)), rng.integers(0, 2, n), exit_at,
                        tuple(rng.uniform(1e-4, 5e-4, len(layers))), float(rng.uniform(0.01, 0.03))))
    each = ExitController(candidates(), settings(min_texts=1, retune_every=4), clock=fake_clock()[1])
    queued = ExitController(candidates(), settings(min_texts=1, retune_every=4), clock=fake_clock()[1])
    for layers, sig, final, exit_at, ramp_s, batch_s in batches:
        each.observe(layers, sig, final, exit_at, ramp_seconds=ramp_s, batch_s=batch_s)
        queued.feed(layers, sig, final, exit_at, ramp_seconds=ramp_s, batch_s=batch_s)
    assert queued.seen == 0 and queued.window.conf == deque()
    assert queued.due() == each.due() != ""
    assert queued.drain() == 0   # `due` drained all six
    assert (queued.seen, queued.exits, queued._errors_since) == (each.seen, each.exits, each._errors_since)
    np.testing.assert_array_equal(np.array(queued.window.conf), np.array(each.window.conf))
    np.testing.assert_array_equal(np.array(queued.window.agree), np.array(each.window.agree))
    assert list(queued.window.released_ok) == list(each.window.released_ok)
    assert queued.cost == pytest.approx(each.cost, rel=1e-12)
