"""A stand-in for the three Hub downloads Accelerate's `external_deps` test scripts make, built
locally so those scripts run unmodified on a machine without the Hub (HF_HUB_OFFLINE=1):

- the model (`--model_name_or_path`): a tiny BERT sequence classifier with its WordPiece tokenizer;
- the data set `nyu-mll/glue`, config `mrpc`: sentence pairs with GLUE's MRPC features, written
  into `HF_DATASETS_CACHE` in the layout `datasets`' offline fallback reads
  (`CachedDatasetModuleFactory` + `packaged_modules/cache`: <namespace>___<name>/<config>/<version>/<hash>);
- the metric `evaluate.load("glue", "mrpc")`: accuracy and F1, written where `evaluate`'s offline
  fallback (`CachedEvaluationModuleFactory`) imports a cached metric module from
  (`HF_MODULES_CACHE/evaluate_modules/metrics/evaluate-metric--glue/<64-hex hash>/glue.py`).

The pairs are made so that the task is learnable: "equivalent" pairs are the same sentence with two
words swapped, the others two unrelated sentences."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("the a company said shares stock market year percent million bank new president government "
         "court police report sales quarter price rose fell week officials people city state today").split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

GLUE_METRIC = '''"""GLUE MRPC metric stand-in: accuracy and F1 of the "equivalent" class (as the Hub's glue metric)."""
import datasets
import evaluate
import numpy as np


class Glue(evaluate.Metric):
    def _info(self):
        if self.config_name != "mrpc":
            raise KeyError(f"only the mrpc configuration is built offline, not {self.config_name!r}")
        return evaluate.MetricInfo(
            description="accuracy and F1 for GLUE MRPC", citation="", inputs_description="predictions, references",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}))

    def _compute(self, predictions, references):
        p, r = np.asarray(predictions), np.asarray(references)
        tp, fp, fn = int(((p == 1) & (r == 1)).sum()), int(((p == 1) & (r == 0)).sum()), int(((p == 0) & (r == 1)).sum())
        return {"accuracy": float((p == r).mean()), "f1": 2 * tp / (2 * tp + fp + fn) if tp else 0.0}
'''


def _pairs(rng: random.Random, n: int) -> dict:
    rows = {"sentence1": [], "sentence2": [], "label": [], "idx": []}
    for i in range(n):
        first = rng.choices(WORDS, k=rng.randint(6, 12))
        equivalent = i % 2
        if equivalent:
            second = list(first)
            a, b = rng.sample(range(len(second)), 2)
            second[a], second[b] = second[b], second[a]
        else:
            second = rng.choices(WORDS, k=rng.randint(6, 12))
        rows["sentence1"].append(" ".join(first))
        rows["sentence2"].append(" ".join(second))
        rows["label"].append(equivalent)
        rows["idx"].append(i)
    return rows


def build_model(directory: Path, calibration: dict) -> Path:
    """A tiny BertForSequenceClassification and its tokenizer, saved by stock save_pretrained. Its
    classifier bias is set so that half of the `calibration` pairs fall on each side: a freshly
    initialised BERT puts every pair in one class, and then a few optimizer steps change no prediction,
    so an accuracy could not tell a trained model from an untrained one."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.txt").write_text("\n".join(SPECIAL + WORDS) + "\n")
    tokenizer = BertTokenizer(vocab_file=str(directory / "vocab.txt"), do_lower_case=True, model_max_length=64)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(SPECIAL) + len(WORDS), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64, num_labels=2)
    model = BertForSequenceClassification(config).eval()
    batch = tokenizer(calibration["sentence1"], calibration["sentence2"], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
        model.classifier.bias[1] -= (logits[:, 1] - logits[:, 0]).median()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


SPLITS = (("train", 320), ("validation", 160), ("test", 16))


def glue_mrpc_rows() -> dict:
    rng = random.Random(0)
    return {split: _pairs(rng, n) for split, n in SPLITS}


def build_glue_mrpc(cache: Path, splits: dict) -> None:
    """Write the prepared `nyu-mll/glue` `mrpc` data set into the datasets cache `cache`."""
    from datasets import ClassLabel, Dataset, Features, Value
    from datasets.packaged_modules.parquet.parquet import Parquet

    features = Features({"sentence1": Value("string"), "sentence2": Value("string"),
                         "label": ClassLabel(names=["not_equivalent", "equivalent"]), "idx": Value("int32")})
    source = cache / "source"
    files = {}
    for split, rows in splits.items():
        files[split] = str(source / f"{split}.parquet")
        Dataset.from_dict(rows, features=features).to_parquet(files[split])
    build = cache / "build"
    builder = Parquet(cache_dir=str(build), dataset_name="glue", config_name="mrpc", hash="0" * 16,
                      data_files=files, features=features)
    builder.download_and_prepare()
    # The builder names its directory after the data files; the offline reader looks for the repo's name.
    prepared = Path(builder.cache_dir)
    target = cache / "nyu-mll___glue" / "mrpc" / "0.0.0" / prepared.name
    target.parent.mkdir(parents=True)
    prepared.rename(target)
    info = json.loads((target / "dataset_info.json").read_text())
    assert info["config_name"] == "mrpc", info


def build_glue_metric(modules_cache: Path) -> None:
    module = modules_cache / "evaluate_modules" / "metrics" / "evaluate-metric--glue" / ("0" * 64)
    module.mkdir(parents=True)
    for package in (modules_cache / "evaluate_modules", module.parent.parent, module.parent, module):
        (package / "__init__.py").touch()
    (module / "glue.py").write_text(GLUE_METRIC)


def build(root: Path) -> dict:
    """Everything under `root`; returns the environment variables that point the libraries at it."""
    splits = glue_mrpc_rows()
    model = build_model(root / "tiny-bert", splits["validation"])
    build_glue_mrpc(root / "datasets", splits)
    build_glue_metric(root / "modules")
    return {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1",
            "HF_DATASETS_CACHE": str(root / "datasets"), "HF_MODULES_CACHE": str(root / "modules"),
            "TINY_BERT": str(model)}


if __name__ == "__main__":
    import sys

    for key, value in build(Path(sys.argv[1])).items():
        print(f"export {key}={value}")
