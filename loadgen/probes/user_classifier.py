"""A real sequence classifier to serve as a user's: the bundled MiniLM's body under BERT's pooler and a linear
classifier, both fitted (the body frozen) on Rotten Tomatoes reviews' first-token states, saved as transformers
saves a fine-tuned `BertForSequenceClassification`. Benches of what Academus does with a user's classifier (its
shards, its students) start from it.

    python -m academus.loadgen.probes.user_classifier DIR [--train 3000]

Prints the classifier's accuracy on the sentiment test split as JSON; then `academus models add NAME --from DIR`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
import transformers

from academus.shared.models.model import pad_batch
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.runtime.config import offline_hub
from academus.shared.training.data import load_task
from academus.shared.training.prepare import padded_batches, subsample


def sentiment_classifier(directory: Path, examples: list[tuple[str, str]], steps: int = 300) -> Path:
    """Writes the classifier fitted on `examples` ((text, label) pairs) into `directory`."""
    labels = sorted({label for _, label in examples})
    model = transformers.BertForSequenceClassification.from_pretrained(
        str(teacher_dir()), num_labels=len(labels), id2label=dict(enumerate(labels)),
        label2id={k: i for i, k in enumerate(labels)})
    model.eval()
    tokenizer = TeacherTokenizer(teacher_dir())
    encoded = tokenizer.encode([text for text, _ in examples], truncate=True)
    with torch.no_grad():
        first = torch.cat([model.bert(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state[:, 0]
                           for ids, mask, types in (pad_batch([e.input_ids for e in encoded[i:i + 64]],
                                                              [e.token_type_ids for e in encoded[i:i + 64]])
                                                    for i in range(0, len(encoded), 64))])
    gold = torch.tensor([labels.index(label) for _, label in examples])
    head = [*model.bert.pooler.parameters(), *model.classifier.parameters()]
    optimizer = torch.optim.Adam(head, lr=1e-3)
    torch.manual_seed(0)
    for _ in range(steps):
        logits = model.classifier(model.bert.pooler.activation(model.bert.pooler.dense(first)))
        loss = torch.nn.functional.cross_entropy(logits, gold)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.config.architectures = ["BertForSequenceClassification"]
    model.save_pretrained(directory)
    shutil.copyfile(teacher_dir() / "tokenizer.json", Path(directory) / "tokenizer.json")
    return Path(directory)


@torch.inference_mode()
def test_accuracy(directory: Path) -> float:
    model = transformers.BertForSequenceClassification.from_pretrained(str(directory)).eval()
    data = load_task("sentiment")
    tokenizer = TeacherTokenizer(directory)
    correct = 0
    for rows, ids, mask, types in padded_batches(tokenizer, [e.text for e in data.test], 64):
        predicted = model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits.argmax(1)
        labels = [model.config.id2label[int(p)] for p in predicted]
        correct += sum(label == data.labels[data.test[r].label] for r, label in zip(rows, labels, strict=True))
    return correct / len(data.test)


def main(argv: list[str] | None = None) -> int:
    offline_hub()
    p = argparse.ArgumentParser(prog="user_classifier", description=__doc__.split("\n")[0])
    p.add_argument("directory", type=Path)
    p.add_argument("--train", type=int, default=3000, help="Rotten Tomatoes training reviews the head is fitted on")
    args = p.parse_args(argv)
    data = load_task("sentiment")
    examples = [(e.text, data.labels[e.label]) for e in subsample(data.train, args.train)]
    sentiment_classifier(args.directory, examples)
    print(json.dumps({"directory": str(args.directory), "train": len(examples),
                      "test_accuracy": round(test_accuracy(args.directory), 4)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
