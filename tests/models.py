"""Tiny randomly initialised BERT, RoBERTa and MPNet models, saved as transformers directories: every family
and path is checked on them without a download."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers
from torch import nn

from academus.shared.models.architectures import read_architecture
from academus.shared.models.teacher_files import teacher_dir

# Odd sizes on purpose: nothing may assume the teacher's 384 wide, 6 deep, 12 heads.
SHAPE = dict(vocab_size=101, hidden_size=36, num_hidden_layers=3, num_attention_heads=3, intermediate_size=52,
             max_position_embeddings=48)
CONFIGS = {
    "bert": lambda: transformers.BertConfig(**SHAPE, type_vocab_size=2),
    "roberta": lambda: transformers.RobertaConfig(**SHAPE, type_vocab_size=1, pad_token_id=1, bos_token_id=0,
                                                  eos_token_id=2),
    "mpnet": lambda: transformers.MPNetConfig(**SHAPE, relative_attention_num_buckets=32, pad_token_id=1),
}
LABELS = ["neg", "neu", "pos"]


def tiny_model(family: str, classifier: bool, directory: Path, seed: int = 0, labels: list[str] = LABELS,
               **shape: int) -> nn.Module:
    """A randomly initialised model of the family, saved as a transformers directory (safetensors); `shape`
    overrides SHAPE; a classifier answers `labels`."""
    config = CONFIGS[family]()
    for key, value in shape.items():
        setattr(config, key, value)
    return _save(family, classifier, config, directory, seed, labels)


def _save(family: str, classifier: bool, config: transformers.PretrainedConfig, directory: Path,
          seed: int, labels: list[str] = LABELS) -> nn.Module:
    torch.manual_seed(seed)
    if classifier:
        config.id2label = dict(enumerate(labels))
        config.label2id = {label: i for i, label in enumerate(labels)}
        config.architectures = [read_architecture(config.to_dict()).family.classifier]
        model = getattr(transformers, config.architectures[0])(config)
    else:
        model = getattr(transformers, read_architecture(config.to_dict()).family.body)(config, add_pooling_layer=False)
    model.eval()
    model.save_pretrained(directory)
    return model


def tiny_model_dir(family: str, classifier: bool, directory: Path, seed: int = 0, labels: list[str] = LABELS,
                   **shape: int) -> nn.Module:
    """A tiny model with the bundled teacher's tokenizer.json (its vocabulary as the model's), ready for
    `academus models add`; returns the transformers model for reference outputs."""
    model = tiny_model(family, classifier, directory, seed, labels, **{**shape, "vocab_size": json_vocab_size()})
    shutil.copyfile(teacher_dir() / "tokenizer.json", Path(directory) / "tokenizer.json")
    return model


def json_vocab_size() -> int:
    return len(json.loads((teacher_dir() / "tokenizer.json").read_text())["model"]["vocab"])


def permute_vocabulary(directory: Path, first: int = 1000) -> None:
    """Renumbers the ordinary tokens of the directory's tokenizer.json (ids from `first` on, in reverse; the special
    tokens below keep theirs): a text's ids then differ from the bundled teacher's tokenizer, so a path that
    tokenized with the teacher's would be caught."""
    path = Path(directory) / "tokenizer.json"
    raw = json.loads(path.read_text())
    vocab = raw["model"]["vocab"]
    top = max(vocab.values())
    raw["model"]["vocab"] = {token: i if i < first else first + top - i for token, i in vocab.items()}
    path.write_text(json.dumps(raw))


ROBERTA_SPECIALS = {"[CLS]": ("<s>", 0), "[PAD]": ("<pad>", 1), "[SEP]": ("</s>", 2), "[UNK]": ("<unk>", 3)}


def roberta_specials(directory: Path) -> None:
    """Renames the framing, padding and unknown tokens of the directory's tokenizer.json as RoBERTa's and MPNet's
    (`<s>` 0, `<pad>` 1, `</s>` 2, `<unk>` 3; the tokens those ids held take the old ones): a path that assumed
    BERT's [CLS] 101 / [SEP] 102 would be caught."""
    path = Path(directory) / "tokenizer.json"
    raw = json.loads(path.read_text())
    vocab = raw["model"]["vocab"]
    for old, (new, new_id) in ROBERTA_SPECIALS.items():
        old_id = vocab.pop(old)
        displaced = next(t for t, i in vocab.items() if i == new_id)
        vocab[displaced], vocab[new] = old_id, new_id
    names = {old: new for old, (new, _) in ROBERTA_SPECIALS.items()}
    text = json.dumps(raw)
    for old, new in names.items():
        text = text.replace(f'"{old}"', f'"{new}"')
    raw = json.loads(text)
    ids = {new: i for new, i in ROBERTA_SPECIALS.values()}
    for token in raw["added_tokens"]:
        token["id"] = ids.get(token["content"], token["id"])
    for name, special in raw["post_processor"]["special_tokens"].items():
        special["ids"] = [ids[name]]
    raw["padding"] = None
    path.write_text(json.dumps(raw))
