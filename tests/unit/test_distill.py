"""`academus distill` building blocks: losses, α, sampling, batching, prefix scores, the artifact round trip
and its bad inputs, on a tiny randomly initialised student group (fast; no teacher needed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from academus.shared.models.students import StudentGroup, student_config
from academus.shared.state.artifacts import MANIFEST, ArtifactError
from academus.shared.training.distill import (
    best_prefix,
    boost_loss,
    cosine_loss,
    head_loss,
    prefix_scores,
    prefix_sums,
    residual_sample,
    soft_cross_entropy,
    stack_loss,
)
from academus.shared.training.distill_data import DistillData, Split, token_batches
from academus.shared.training.student_artifacts import (
    STUDENT_KIND,
    load_student_group,
    students_dir,
    write_student_catalogue,
    write_student_group,
)

TINY = {"vocab_size": 50, "hidden_size": 16, "num_attention_heads": 2, "intermediate_size": 32,
        "hidden_act": "gelu", "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
        "max_position_embeddings": 32, "type_vocab_size": 2, "layer_norm_eps": 1e-12, "pad_token_id": 0}


def tiny_group(students: int = 3, labels: tuple[str, ...] = ("neg", "pos"), seed: int = 0) -> StudentGroup:
    torch.manual_seed(seed)
    group = StudentGroup(student_config(TINY, 2), 1, labels)
    for i in range(1, students):
        group.add_student(alpha=0.5 / i)
        for p in group.students[i].parameters():      # distinct students, as after training
            p.data.add_(0.01 * torch.randn_like(p))
    return group.eval()


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[1, 5, 7, 2, 0], [1, 9, 2, 0, 0]])
    mask = (ids != 0).long()
    return ids, mask, torch.zeros_like(ids)


# --- losses ------------------------------------------------------------------------------------

def test_boost_loss_is_half_the_squared_residual() -> None:
    target = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    previous = torch.tensor([[0.5, 0.0], [0.0, 0.0]])
    current = torch.tensor([[0.25, 0.5], [0.0, 1.0]])
    # row 1: residual (0.25, -0.5) -> ½·0.3125; row 2: residual 0 -> 0; batch mean
    assert boost_loss(target, previous, current).item() == pytest.approx(0.3125 / 4)


def test_stack_loss_pulls_the_middle_layer_to_the_previous_ensemble() -> None:
    previous = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    middle = torch.tensor([[0.0, 0.0], [3.0, 1.0]])
    assert stack_loss(previous, middle).item() == pytest.approx((0.5 * 5 + 0.5 * 1) / 2)
    assert stack_loss(previous, previous).item() == 0.0


def test_soft_cross_entropy_and_cosine_loss_by_hand() -> None:
    logits = torch.tensor([[0.0, math.log(3.0)]])          # softmax: (0.25, 0.75)
    soft = torch.tensor([[0.5, 0.5]])
    expected = -(0.5 * math.log(0.25) + 0.5 * math.log(0.75))
    assert soft_cross_entropy(logits, soft).item() == pytest.approx(expected, rel=1e-6)
    a = torch.tensor([[1.0, 0.0], [2.0, 2.0]])
    b = torch.tensor([[0.0, 3.0], [1.0, 1.0]])
    assert cosine_loss(a, b).item() == pytest.approx(0.5)    # (1 − 0 + 1 − 1) / 2


def test_the_head_loss_mixes_the_gold_labels_in_by_their_weight() -> None:
    logits = torch.tensor([[0.0, math.log(3.0)]])          # softmax: (0.25, 0.75)
    soft, gold = torch.tensor([[0.5, 0.5]]), torch.tensor([0])
    teacher = soft_cross_entropy(logits, soft).item()
    assert head_loss(logits, soft, gold, 0.0).item() == pytest.approx(teacher, rel=1e-6)
    mixed = 0.75 * teacher + 0.25 * -math.log(0.25)
    assert head_loss(logits, soft, gold, 0.25).item() == pytest.approx(mixed, rel=1e-6)
    assert head_loss(logits, soft, gold, 1.0).item() == pytest.approx(-math.log(0.25), rel=1e-6)


# --- α and the group -------------------------------------------------------------------------------

def test_alpha_zero_is_pinned_and_forward_is_the_weighted_sum() -> None:
    group = tiny_group(3)
    with torch.no_grad():
        group.alpha[0] = 7.0                   # ignored: α_0 is always 1
    assert group.alphas().tolist() == pytest.approx([1.0, 0.5, 0.25])
    ids, mask, types = inputs()
    finals = torch.stack([f for f, _ in group.student_outputs(ids, mask, types, 3)])
    for k in (1, 2, 3):
        expected = sum(group.alphas()[m] * finals[m] for m in range(k))
        assert torch.allclose(group(ids, mask, types, num_students=k), expected, atol=1e-6)
    assert torch.allclose(prefix_sums(finals, group.alphas())[1], group(ids, mask, types, num_students=2), atol=1e-6)
    group.train()
    group(ids, mask, types, num_students=3).sum().backward()
    assert group.alpha.grad[0].item() == 0.0 and group.alpha.grad[1:].abs().sum().item() > 0
    assert all(p.grad is None for p in group.embeddings.parameters())   # the shared table is frozen


def test_add_student_copies_the_last_and_drop_last_undoes_it() -> None:
    group = tiny_group(2)
    new = group.add_student(alpha=0.3)
    for a, b in zip(group.students[1].parameters(), new.parameters(), strict=True):
        assert torch.equal(a, b) and a is not b
    assert group.max_students == 3 and group.alphas()[2].item() == pytest.approx(0.3)
    group.drop_last()
    assert group.max_students == 2 and len(group.alpha) == 2


def test_student_count_is_checked() -> None:
    group = tiny_group(2)
    ids, mask, types = inputs()
    group.best_k = 1
    assert torch.equal(group(ids, mask, types), group(ids, mask, types, num_students=1))
    for bad in (3, -1):
        with pytest.raises(ValueError, match="holds 2 students"):
            group(ids, mask, types, num_students=bad)


# --- data sampling and batching --------------------------------------------------------------------

def test_residual_sample_takes_the_top_errors_plus_random_others() -> None:
    errors = torch.arange(100.0).flip(0)                 # index i has error 99 − i: the top 20 are 0..19
    picked = residual_sample(errors, 20, 20, torch.Generator().manual_seed(0))
    assert len(picked) == 40 == len(set(picked))
    assert set(range(20)) <= set(picked)
    assert sum(i >= 20 for i in picked) == 20
    again = residual_sample(errors, 20, 20, torch.Generator().manual_seed(0))
    other = residual_sample(errors, 20, 20, torch.Generator().manual_seed(1))
    assert picked == again and picked != other


def test_token_batches_cover_the_indices_within_the_budget() -> None:
    lengths = [3, 50, 7, 20, 20, 1, 64, 9] * 10
    chosen = list(range(0, 80, 2))
    batches = token_batches(lengths, chosen, tokens_per_batch=128, max_rows=6)
    assert sorted(i for b in batches for i in b) == chosen
    for batch in batches:
        assert len(batch) <= 6 and max(lengths[i] for i in batch) * len(batch) <= max(128, max(lengths))


# --- prefix evaluation -----------------------------------------------------------------------------

def test_prefix_scores_and_best_prefix() -> None:
    head = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(2))                   # predicts the larger coordinate
    target = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    split = Split([], target, torch.tensor([0, 1, 0, 1]))
    data = DistillData("t", ["a", "b"], {}, head)
    prefixes = torch.stack([torch.tensor([[1.0, 0.0]] * 4),                 # k=1: always "a": 50 %
                            target.clone(),                                 # k=2: all right
                            target + torch.tensor([0.0, 0.1])])             # k=3: also all right
    scores = prefix_scores(prefixes, data, split, head)
    assert [s["accuracy"] for s in scores] == [0.5, 1.0, 1.0]
    assert scores[1]["cosine"] == 1.0 and scores[0]["agreement"] == 0.5
    assert best_prefix(scores) == 2                      # a tie keeps fewer students
    assert best_prefix([{"cosine": 0.8}, {"cosine": 0.9}, {"cosine": 0.85}]) == 2


# --- artifact round trip and bad input -------------------------------------------------------------

def test_round_trip_catalogue_and_bad_manifests(tmp_path: Path) -> None:
    group = tiny_group(3)
    group.best_k = 2
    write_student_group(tmp_path, "sentiment", group, {"validation": []})
    loaded = load_student_group(tmp_path, "sentiment")
    ids, mask, types = inputs()
    assert (loaded.best_k, loaded.max_students, loaded.labels) == (2, 3, ["neg", "pos"])
    for k in (1, 2, 3):
        assert torch.allclose(loaded(ids, mask, types, num_students=k), group(ids, mask, types, num_students=k))
    with pytest.raises(ValueError, match="holds 3 students"):
        loaded(ids, mask, types, num_students=4)
    entry = write_student_catalogue(tmp_path)["sentiment-students"]
    assert entry == {"kind": "classification", "task": "sentiment", "students": "students/sentiment",
                     "labels": ["neg", "pos"], "teacher": "all-MiniLM-L6-v2", "max_students": 3, "best_k": 2}
    assert "spam-students" not in json.loads((tmp_path / "models.json").read_text())

    manifest_path = students_dir(tmp_path, "sentiment") / MANIFEST
    original = json.loads(manifest_path.read_text())
    for change, message in (({"format_version": 99}, "format_version 99"),
                            ({"teacher": "bert-base"}, "distilled from 'bert-base'"),
                            ({"kind": "teacher-head"}, STUDENT_KIND),
                            ({"task": "spam"}, "is for task 'spam'")):
        manifest_path.write_text(json.dumps({**original, **change}))
        with pytest.raises(ArtifactError, match=message):
            load_student_group(tmp_path, "sentiment")
    manifest_path.write_text(json.dumps({**original, "extra": {**original["extra"], "best_k": 5}}))
    with pytest.raises(ArtifactError, match="do not fit"):
        load_student_group(tmp_path, "sentiment")
    with pytest.raises(ArtifactError, match=r"no manifest\.json"):
        load_student_group(tmp_path, "spam")


def test_extra_sotu_grows_the_training_text_and_leaves_validation_and_test_alone(dataset_dir: Path) -> None:
    from academus.shared.training.distill_data import DistillConfig, _general_texts

    default = _general_texts(dataset_dir, DistillConfig())
    more = _general_texts(dataset_dir, DistillConfig(extra_sotu=500))
    for split in ("validation", "test", "heldout"):
        assert more[split] == default[split]
    n = len(default["train"])
    assert more["train"][:n] == default["train"] and len(more["train"]) == n + 500
    assert not set(more["train"]) & set(default["validation"] + default["test"])


def test_each_general_training_set_has_its_own_embedding_cache() -> None:
    from academus.shared.training.distill_data import DistillConfig, general_cache_name

    names = {general_cache_name(DistillConfig()), general_cache_name(DistillConfig(extra_sotu=500)),
             general_cache_name(DistillConfig(extra_sotu=900)),
             general_cache_name(DistillConfig(limits={"train": 10}))}
    assert len(names) == 4 and general_cache_name(DistillConfig()) == "embedding-general"


# --- narrow students: feed-forward width cut from the teacher ---------------------------------------

def tiny_teacher(layers: int = 3, seed: int = 0):
    from transformers import BertModel

    torch.manual_seed(seed)
    return BertModel(student_config(TINY, layers), add_pooling_layer=False).eval()


def test_a_student_narrowed_to_the_live_neurons_computes_what_the_full_width_one_does() -> None:
    from academus.shared.models.students import from_teacher

    teacher = tiny_teacher()
    live = torch.arange(0, 32, 2)                       # the odd neurons add nothing to the layers' outputs
    with torch.no_grad():
        for layer in teacher.encoder.layer:
            layer.output.dense.weight[:, 1::2] = 0.0
    full = from_teacher(teacher, 2, ("neg", "pos")).eval()
    narrow = from_teacher(teacher, 2, ("neg", "pos"), ffn_keep=[live, live]).eval()
    assert narrow.config.intermediate_size == 16 and full.config.intermediate_size == 32
    assert narrow.students[0].encoder.layer[1].intermediate.dense.weight.shape == (16, 16)
    assert narrow.add_student().encoder.layer[0].output.dense.weight.shape == (16, 16)   # copies stay narrow
    narrow.drop_last()
    ids, mask, types = inputs()
    assert torch.allclose(narrow(ids, mask, types), full(ids, mask, types), atol=1e-6)
    other = torch.arange(1, 32, 2)                      # keeping the dead ones instead changes the answer
    wrong = from_teacher(teacher, 2, ("neg", "pos"), ffn_keep=[other, other]).eval()
    assert not torch.allclose(wrong(ids, mask, types), full(ids, mask, types), atol=1e-3)


def test_ffn_keep_ranks_neurons_by_their_contribution_on_the_training_texts() -> None:
    from academus.shared.models.tokenization import Encoded
    from academus.shared.training.distill import ffn_keep
    from academus.shared.training.distill_data import DistillConfig

    teacher = tiny_teacher()
    with torch.no_grad():
        teacher.encoder.layer[0].output.dense.weight[:, 8:] = 0.0      # layer 0: only neurons 0..7 matter
        teacher.encoder.layer[1].output.dense.weight[:, :24] *= 1e-3   # layer 1: 24..31 dominate
    split = Split([Encoded([1, 4 + i % 40, 7, 2], [0, 0, 0, 0]) for i in range(20)], torch.zeros(20, 16),
                  torch.zeros(20, dtype=torch.long))
    keep = ffn_keep(teacher, split, DistillConfig(layers=2, intermediate_size=8))
    assert [k.tolist() for k in keep] == [list(range(8)), list(range(24, 32))]
    assert ffn_keep(teacher, split, DistillConfig(layers=2)) == []                      # 0: full width
    assert ffn_keep(teacher, split, DistillConfig(layers=2, intermediate_size=32)) == []


def test_spread_cuts_a_student_from_layers_spaced_over_the_teachers_depth_bottom_and_top_kept() -> None:
    from academus.shared.models.students import source_layers

    assert source_layers(12, 3, spread=True) == [0, 6, 11]
    assert source_layers(12, 2, spread=True) == [0, 11]
    assert source_layers(6, 3, spread=True) == [0, 2, 5]
    assert source_layers(12, 3) == [0, 1, 2]                        # the default: the bottom layers
    assert source_layers(5, 1, spread=True) == [0]
    assert source_layers(4, 4, spread=True) == [0, 1, 2, 3]         # as deep as the teacher: every layer
    with pytest.raises(ValueError, match=r"within 1\.\.6"):
        source_layers(6, 7, spread=True)


def test_a_spread_student_holds_the_teachers_chosen_layers_and_their_most_important_neurons() -> None:
    from academus.shared.models.students import from_teacher
    from academus.shared.models.tokenization import Encoded
    from academus.shared.training.distill import ffn_keep, student_sources
    from academus.shared.training.distill_data import DistillConfig

    teacher = tiny_teacher(layers=5)
    with torch.no_grad():
        teacher.encoder.layer[4].output.dense.weight[:, :24] *= 1e-3   # the top layer: neurons 24..31 dominate
    cfg = DistillConfig(layers=2, intermediate_size=8, init="spread")
    assert student_sources(teacher, cfg) == [0, 4]
    split = Split([Encoded([1, 4 + i % 40, 7, 2], [0, 0, 0, 0]) for i in range(20)], torch.zeros(20, 16),
                  torch.zeros(20, dtype=torch.long))
    keep = ffn_keep(teacher, split, cfg)
    assert keep[1].tolist() == list(range(24, 32))                  # ranked on layer 4, not on layer 1
    group = from_teacher(teacher, 2, ("neg", "pos"), ffn_keep=keep, sources=student_sources(teacher, cfg))
    top = group.students[0].encoder.layer[1]
    assert torch.equal(top.attention.self.query.weight, teacher.encoder.layer[4].attention.self.query.weight)
    assert torch.equal(top.intermediate.dense.weight, teacher.encoder.layer[4].intermediate.dense.weight[24:32])
    assert torch.equal(group.students[0].encoder.layer[0].attention.output.dense.weight,
                       teacher.encoder.layer[0].attention.output.dense.weight)
    with pytest.raises(ValueError, match="cut from 2 teacher layers"):
        from_teacher(teacher, 2, ("neg", "pos"), sources=[0, 2, 4])


def test_a_narrow_group_round_trips_through_its_artifact(tmp_path: Path) -> None:
    from academus.shared.models.students import from_teacher

    keep = torch.arange(12)
    group = from_teacher(tiny_teacher(), 2, ("neg", "pos"), ffn_keep=[keep, keep]).eval()
    write_student_group(tmp_path, "sentiment", group, {"validation": []})
    loaded = load_student_group(tmp_path, "sentiment")
    ids, mask, types = inputs()
    assert loaded.config.intermediate_size == 12
    assert torch.allclose(loaded(ids, mask, types), group(ids, mask, types))


def test_bad_intermediate_sizes_are_refused_by_name() -> None:
    from academus.shared.training.distill import check_args
    from academus.shared.training.distill_data import DistillConfig

    with pytest.raises(ValueError, match="--intermediate-size must be >= 0"):
        check_args("sentiment", DistillConfig(intermediate_size=-1))
    with pytest.raises(ValueError, match="--init minilm-l3"):
        check_args("sentiment", DistillConfig(intermediate_size=384, init="minilm-l3"))
    check_args("sentiment", DistillConfig(intermediate_size=384))
    check_args("sentiment", DistillConfig(intermediate_size=384, init="spread"))   # cut from the teacher too


def test_bad_epochs_and_gold_weights_are_refused_by_name() -> None:
    from academus.shared.training.distill import check_args
    from academus.shared.training.distill_cli import _parser, config_from_args
    from academus.shared.training.distill_data import DistillConfig

    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=f"--gold-weight must be in \\[0, 1\\].* not {bad} on 'sentiment'"):
            check_args("sentiment", DistillConfig(gold_weight=bad))
    with pytest.raises(ValueError, match=r"gold labels only for a labelled task, not 0.5 on 'embedding'"):
        check_args("embedding", DistillConfig(gold_weight=0.5))
    with pytest.raises(ValueError, match=r"--boost-epochs must be > 0 and --prune-epochs >= 0, not 0.0 and 1.0"):
        check_args("sentiment", DistillConfig(boost_epochs=0.0))
    args = _parser().parse_args(["--task", "spam", "--prune-epochs", "3", "--gold-weight", "0.5", "--layers", "3"])
    cfg = config_from_args(args)
    assert (cfg.prune_epochs, cfg.gold_weight, cfg.layers, cfg.boost_epochs) == (3.0, 0.5, 3, 2.0)
    check_args("spam", cfg)
