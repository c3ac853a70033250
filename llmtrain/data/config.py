"""Schema of the ``data`` config group (``conf/data/*.yaml``).

    python llmtrain/pretrain.py data=pd1998 data.seq_len=256 data.prefixes=[a,b] data.weights=[0.7,0.3]

The root ``llmtrain/config.py`` registers :class:`DataConfig` in Hydra's ConfigStore
under the group ``data``; this module only defines it (and a loader for the data
tools that run without Hydra: :func:`load_data_config`).
Relative paths are resolved against the directory the run was started from, then
against the repository root.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from omegaconf import MISSING, OmegaConf


@dataclass
class MaskingConfig:
    """Masked-LM corruption of encoder (ERNIE/BERT) batches: ``data.masking.*``; read by
    :mod:`llmtrain.data.masking` only when ``model.family=encoder`` (decoders ignore it)."""

    strategy: str = "whole_word"
    """What is masked together: ``token`` (BERT: single tokens), ``whole_word`` (all tokens of a
    word, words from the ``PREFIX.wbd`` side file of ``preprocess --word-boundaries gold|jieba``),
    ``ngram`` (spans of 1..``max_ngram`` consecutive words, P(n) proportional to 1/n) or ``entity``
    (phrases and named entities of the lexicon, ``entity_source``, as one unit each; other words as
    in ``whole_word``)."""

    prob: float = 0.15
    """Target fraction of each sample's maskable tokens (special tokens excluded) that bear the loss.
    Each sample gets round(prob x maskable) of them (at least 1), so a batch is within
    0.5 / (mean maskable tokens per sample) of the target (under 1 point from 50 tokens per sample)."""

    mask_token_prob: float = 0.8
    """Share of the selected tokens replaced by the mask token (BERT's 80%)."""

    random_token_prob: float = 0.1
    """Share of the selected tokens replaced by a random ordinary token (BERT's 10%); the remaining
    ``1 - mask_token_prob - random_token_prob`` keep their token and still bear the loss."""

    max_ngram: int = 3
    """Longest span in words for ``strategy=ngram``."""

    entity_source: str = "jieba"
    """Lexicon of ``strategy=entity``: ``jieba`` (the words of jieba's dictionary tagged with
    ``entity_tags``, the names ``jieba.posseg`` tags by lookup), ``lexicon`` (the file ``lexicon``), or
    ``both``."""

    lexicon: Optional[str] = None
    """A user file of phrases / entities, one per line (the first whitespace-separated field; jieba's
    ``word freq tag`` format works; a line starting with ``#`` is a comment). Build one from tagged text with
    ``python -m llmtrain.data.lexicon``. Needed by ``entity_source=lexicon|both``."""

    entity_tags: List[str] = field(default_factory=lambda: ["nr", "ns", "nt"])
    """jieba part-of-speech tags taken as entities (person, place, organisation names)."""

    max_entity_tokens: int = 16
    """Lexicon entries longer than this many tokens are not matched."""


@dataclass
class DataConfig:
    prefixes: List[str] = MISSING
    """MMIDIDX data prefixes (paths without ``.bin``/``.idx``) made by
    ``python -m llmtrain.data.preprocess``, by Megatron-LM or by PaddleNLP."""

    weights: Optional[List[float]] = None
    """Blending weight of each prefix (normalised to sum to 1). ``null``: proportional
    to each prefix's number of training samples (i.e. its tokens)."""

    tokenizer: str = MISSING
    """Tokenizer directory (``tokenizer.model`` + ``tokenizer_meta.json``, or a PaddleNLP
    WordPiece directory with ``vocab.txt`` such as an ERNIE checkpoint's) the data was
    preprocessed with; checked against each prefix's ``.meta.json`` when present. Its
    padded ``vocab_size`` is the model's embedding rows."""

    seq_len: int = 128
    """Tokens per training sample fed to the model; samples are packed across documents
    from ``seq_len + 1`` consecutive tokens (inputs and shifted labels)."""

    split: str = "98,2,0"
    """Train/valid/test shares of each prefix's documents, as contiguous document ranges
    (Megatron's convention). The valid part feeds ``PretrainData.valid_batches``."""

    cache_dir: Optional[str] = None
    """Where packing indices are cached; ``null``: ``index-cache/`` beside each prefix.
    Build them ahead of time with ``python -m llmtrain.data.loader --data FILE.yaml``."""

    num_workers: int = 1
    """Background preparation of batches: 0 builds each step's batches in the training
    loop; N >= 1 lets one background thread keep up to N future steps ready."""

    eod_mask_loss: bool = False
    """Exclude from the loss the positions whose input token is the end-of-document
    token (the prediction of the next document's first token), as Megatron's
    ``--eod-mask-loss``."""

    document_mask: bool = False
    """Decoder pretraining: attention stays inside each document of a packed sample (documents end at the EOD
    token; a position after an EOD starts the next one), so every document gets the loss and gradients it would get
    alone; token counts and the loss mask are unchanged. Batches carry ``segment_ids`` (the document index in the
    row); on GPU the mask goes through flashmask attention, on CPU through the math path; works under context
    parallelism (each rank gets its chunks' slice) and pipeline parallelism (the stages pass the ids along)."""

    reset_position_ids: bool = False
    """Positions (RoPE angles, learned position embeddings) restart at 0 in every document of a packed sample
    (batches carry ``position_ids``). With ``document_mask`` a document then sees exactly what it would alone; RoPE
    attention depends on relative positions only, so it matters most for learned (GPT-2) position tables."""

    masking: MaskingConfig = field(default_factory=MaskingConfig)
    """Masked-LM corruption for encoder models (the objective follows ``model.family``); whole-word by
    default."""


def load_data_config(path: str | None = None, overrides: list[str] | None = None) -> DataConfig:
    """``DataConfig`` from a yaml file of the ``data`` group plus ``key=value`` overrides (validated)."""
    cfg = OmegaConf.structured(DataConfig)
    if path:
        group = OmegaConf.load(path)
        group.pop("defaults", None)  # Hydra's `defaults: [base]` names this very schema
        cfg = OmegaConf.merge(cfg, group)
    if overrides:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    return cfg
