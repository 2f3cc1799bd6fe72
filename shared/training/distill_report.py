"""`academus distill report`: the quality table of every student group, with its ablations' rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from academus.shared.runtime.config import artifacts_dir as default_artifacts_dir
from academus.shared.state.artifacts import ArtifactError, load_artifact
from academus.shared.training.distill_data import DISTILL_TASKS, EMBEDDING_TASK
from academus.shared.training.student_artifacts import students_dir

# --- report --------------------------------------------------------------------------------------

def _metric_cells(row: dict[str, float], teacher: dict[str, float]) -> str:
    if "accuracy" not in row:
        return f"cosine {row['cosine']:.4f}"
    return (f"acc {row['accuracy']:.4f} ({row['accuracy'] / teacher['accuracy']:.1%})  "
            f"F1 {row['f1']:.4f} ({row['f1'] / max(teacher['f1'], 1e-9):.1%})")


def _report_task(task: str, manifest: Any) -> dict[str, Any]:
    m, split = manifest.metrics, "heldout" if task == EMBEDDING_TASK else "test"
    k = manifest.extra["best_k"]
    rows = {f"students k={i + 1}": r for i, r in enumerate(m[split])}
    if task == EMBEDDING_TASK:
        rows = {f"students k={i + 1} (in-domain test)": r for i, r in enumerate(m["test"])} | rows
        rows["best-pruned"] = m[split][k - 1]
    else:
        rows = {"teacher": m["teacher"]["test"], **rows, "best-pruned": m[split][k - 1]}
    return {"split": split, "best_k": k, "alpha": manifest.extra["alpha"], "rows": rows,
            "quick": manifest.extra.get("quick"), "seconds": manifest.extra.get("seconds")}


ABLATION_LABELS = {"reference": "Student Parallelism (same run)", "bert-2l": "BERT-2L (CE on labels)",
                   "no-stacking": "w/o stacking (λ=0)", "bagging": "bagging, not boosting",
                   "no-pruning": "w/o pruning"}


def _ablation_rows(artifacts: Path, task: str) -> dict[str, Any]:
    """Rows of `academus distill ablations` for `task` (students/ablations/<task>[-quick].json) where it ran."""
    rows, teacher = {}, None
    for suffix, mode in (("", "default"), ("-quick", "quick")):
        path = Path(artifacts) / "students" / "ablations" / f"{task}{suffix}.json"
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        teacher = teacher or data["teacher"]
        for name, label in ABLATION_LABELS.items():
            if (v := data.get("variants", {}).get(name)) is not None:
                rows[f"{label} [k={v['k']}/{v['students']}, {mode}, {v['seconds']:.0f} s]"] = v["row"]
    return {"teacher": teacher, "rows": rows} if rows else {}


def _print_task(task: str, entry: dict[str, Any]) -> None:
    if "rows" in entry:
        print(f"\n{task} ({entry['split']} split; best k = {entry['best_k']}; "
              f"{'quick' if entry['quick'] else 'default'} run, {(entry['seconds'] or {}).get('total')} s)")
    else:
        print(f"\n{task}: no student group ({entry.get('status')})")
    ablations = entry.get("ablations", {})
    teacher = entry.get("rows", {}).get("teacher") or ablations.get("teacher", {})
    for name, row in {**entry.get("rows", {}), **ablations.get("rows", {})}.items():
        print(f"  {name:<54} {_metric_cells(row, teacher)}")


def report(artifacts: Path | None = None) -> dict[str, Any]:
    """The quality table of every student group on its test split (held-out WordNet text for embeddings),
    with the rows of `academus distill ablations` where it ran."""
    artifacts = Path(artifacts or default_artifacts_dir())
    out: dict[str, Any] = {}
    for task in DISTILL_TASKS:
        try:
            out[task] = _report_task(task, load_artifact(students_dir(artifacts, task))[0])
        except ArtifactError as e:
            out[task] = {"status": "missing", "error": str(e)}
        except (KeyError, IndexError, TypeError) as e:
            out[task] = {"status": "incomplete", "error": f"the manifest's metrics lack {e}"}
        if ablations := _ablation_rows(artifacts, task):
            out[task]["ablations"] = ablations
        if "rows" in out[task] or ablations:
            _print_task(task, out[task])
    path = artifacts / "students" / "report.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    return out
