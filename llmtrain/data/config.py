"""Schema of the ``data`` config group (``conf/data/*.yaml``).

    python llmtrain/pretrain.py data=pd1998 data.seq_len=256 data.prefixes=[a,b] data.weights=[0.7,0.3]

The root ``llmtrain/config.py`` registers :class:`DataConfig` in Hydra's ConfigStore
under the group ``data``; this module only defines it (and a loader for the data
tools that run without Hydra: :func:`load_data_config`).
Relative paths are resolved against the directory the run was started from, then
against the repository root.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from omegaconf import MISSING, OmegaConf


@dataclass
class DataConfig:
    prefixes: List[str] = MISSING
    """MMIDIDX data prefixes (paths without ``.bin``/``.idx``) made by
    ``python -m llmtrain.data.preprocess``, by Megatron-LM or by PaddleNLP."""

    weights: Optional[List[float]] = None
    """Blending weight of each prefix (normalised to sum to 1). ``null``: proportional
    to each prefix's number of training samples (i.e. its tokens)."""

    tokenizer: str = MISSING
    """Tokenizer directory (``tokenizer.model`` + ``tokenizer_meta.json``) the data was
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
