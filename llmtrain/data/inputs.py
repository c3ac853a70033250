"""The files a run's data section names, checked before any work: prefixes, weights, tokenizer, side files, lexicon.

    python llmtrain/pretrain.py data.prefixes=[missing] data.weights=[0.5,0.5]   # exit 2, both problems listed
    problems = data_input_problems(cfg.data, tokenizer, family)     # llmtrain.resolve gathers them
    path = open_prefix(p, tokenizer, cfg.tokenizer)                 # the loaders: the same checks, raised

`llmtrain.resolve` calls `data_input_problems` on every rank before any process group starts;
the loaders (`PretrainData`, `MLMData`, `SFTData`) run the same checks (`open_prefix`,
`check_made_with`) when they are built without it. What is checked: each `data.prefixes` entry has
its `.bin` and `.idx` (and the index is a readable MMIDIDX), their train split holds at least one sample (an
empty or all-bad corpus), `data.weights` has one weight per prefix,
a prefix preprocessed by us with another tokenizer (its `.meta.json`) is refused, masked-LM data
has the `.wbd` word-boundary side file its masking strategy needs and the lexicon file
`data.masking.lexicon` exists; fine-tuning `data.files` / `data.valid_files` exist and hold a usable example.
"""
from __future__ import annotations

import json
import os

from llmtrain.data.indexed import IndexedDataset
from llmtrain.utils.paths import resolve_path

CREATE_HINT = ("create it with `python -m llmtrain.data.preprocess --input CORPUS --tokenizer DIR "
               "--output-prefix PREFIX` (the default corpus: `scripts/prepare_default_corpus.sh`)")


def open_prefix(prefix: str) -> IndexedDataset:
    """The MMIDIDX dataset of one `data.prefixes` entry; FileNotFoundError naming the missing file and how to make
    it, ValueError for an unreadable index."""
    path = resolve_path(prefix)
    for ext in (".bin", ".idx"):
        if not os.path.isfile(path + ext):
            raise FileNotFoundError(f"data prefix {prefix!r}: {path + ext} does not exist; {CREATE_HINT}")
    return IndexedDataset(path)


def check_made_with(prefix_path: str, tokenizer, tokenizer_field: str) -> None:
    """ValueError when `prefix_path.meta.json` (our preprocess) records another tokenizer than `tokenizer` (the
    one `data.tokenizer=tokenizer_field` loads). Foreign data (Megatron, PaddleNLP) records none: not checked."""
    meta_path = prefix_path + ".meta.json"
    if not os.path.isfile(meta_path):
        return
    with open(meta_path, encoding="utf-8") as f:
        made_with = json.load(f).get("tokenizer", {})
    if made_with.get("sha256") and made_with["sha256"] != tokenizer.sha256:
        raise ValueError(f"{prefix_path} was preprocessed with tokenizer {made_with.get('name')!r} "
                         f"(sha256 {made_with['sha256'][:12]}), but data.tokenizer={tokenizer_field!r} "
                         f"is {tokenizer.name!r} (sha256 {tokenizer.sha256[:12]}): give data.tokenizer the "
                         "tokenizer the data was made with, or preprocess the corpus again with this one")


def weights_problem(prefixes, weights):
    """The problem of a `data.weights` whose length differs from `data.prefixes` (None: fine)."""
    if weights is not None and len(weights) != len(prefixes):
        return (f"data.weights has {len(weights)} entries for {len(prefixes)} data.prefixes: give one weight per "
                "prefix, or data.weights=null (proportional to each prefix's tokens)")
    return None


def data_input_problems(data, tokenizer, family: str) -> list[str]:
    """Every problem of the files `data` names (one line each, with the path); `tokenizer`: the loaded
    `data.tokenizer` (None when it failed to load: its own problem is reported by resolve)."""
    if hasattr(data, "files"):  # fine-tuning records (SFTDataConfig)
        missing = [f"data.{key}: {path} does not exist" for key in ("files", "valid_files")
                   for path in (getattr(data, key) or []) if not os.path.isfile(path)]
        if missing or tokenizer is None:
            return missing
        from llmtrain.data.sft import first_usable_problem

        found = [first_usable_problem(key, list(getattr(data, key)), tokenizer, data)
                 for key in ("files", "valid_files") if getattr(data, key)]
        return [p for p in found if p is not None]
    prefixes = list(data.prefixes)
    problems = [] if prefixes else ["data.prefixes is empty: give at least one MMIDIDX prefix"]
    bad_weights = weights_problem(prefixes, data.weights)
    if bad_weights:
        problems.append(bad_weights)
    opened, datasets = [], []
    for p in prefixes:
        try:
            ds = open_prefix(p)
            if tokenizer is not None:
                check_made_with(ds.prefix, tokenizer, data.tokenizer)
            opened.append(ds.prefix)
            datasets.append((p, ds))
        except (OSError, ValueError) as e:
            problems.append(str(e))
    if datasets and len(datasets) == len(prefixes):
        problems += train_sample_problems(data, datasets)
    if family == "encoder":
        problems += _masking_input_problems(data.masking, opened)
    return problems


def train_sample_problems(data, datasets) -> list[str]:
    """The problem of prefixes whose train split (`data.split`) holds no sample of `data.seq_len` + 1 tokens (as the
    loader packs them, `llmtrain.data.packing.PackedSplit`); an empty or all-bad corpus is found here, before any
    work, not when the first batch is drawn."""
    from llmtrain.data.packing import parse_split

    counts = []
    for p, ds in datasets:
        try:
            d0, d1 = parse_split(data.split, len(ds))["train"]
        except ValueError as e:
            return [str(e)]
        tokens = int(ds.sizes[d0:d1].sum(dtype=int))
        counts.append((p, len(ds), d1 - d0, tokens))
    if any((tokens - 1) // data.seq_len > 0 for _, _, _, tokens in counts):
        return []
    return [f"no training sample: a sample takes data.seq_len + 1 = {data.seq_len + 1} tokens, and the train split "
            f"(data.split={data.split!r}) of " + "; ".join(f"{p} holds {n_train} of its {n} documents, {tokens} tokens"
                                                          for p, n, n_train, tokens in counts)
            + ". Preprocess a corpus with text in it (an empty or all-bad one is reported by "
              "`python -m llmtrain.data.preprocess`), lower data.seq_len, or change data.split"]


def missing_word_boundaries(strategy: str, prefixes: list[str]):
    """The problem of word-level masking (`strategy`) on prefixes without their `.wbd` side file (None: fine)."""
    missing = [p + ".wbd" for p in prefixes if not os.path.isfile(p + ".wbd")]
    if not missing:
        return None
    return (f"data.masking.strategy={strategy} needs word boundaries, but {', '.join(missing)} does not exist: "
            "preprocess with `python -m llmtrain.data.preprocess ... --word-boundaries jieba` (or `gold --words-key "
            "words` for pre-segmented text), or set data.masking.strategy=token")


def _masking_input_problems(masking, prefixes: list[str]) -> list[str]:
    """Masked-LM inputs: the masking settings, the `.wbd` side files of word-level strategies, the lexicon file."""
    from llmtrain.data.masking import check_masking_config

    problems = check_masking_config(masking)
    if masking.strategy != "token":
        missing = missing_word_boundaries(masking.strategy, prefixes)
        if missing:
            problems.append(missing)
    if masking.strategy == "entity" and masking.entity_source in ("lexicon", "both") and masking.lexicon:
        full = resolve_path(masking.lexicon)
        if not os.path.isfile(full):
            problems.append(f"data.masking.lexicon={masking.lexicon}: {full} does not exist; build one with "
                            "`python -m llmtrain.data.lexicon --input CORPUS --output FILE` (the default corpus: "
                            "`--input work/pd1998/pd1998.jsonl --pos-key pos --output work/pd1998/entities.txt`), "
                            "or set data.masking.entity_source=jieba")
    return problems
