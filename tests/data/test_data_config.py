"""DataConfig: a docstring under every field, required values MISSING, conf/data/pd1998.yaml loads."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import os

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue

from llmtrain.data import config as data_config
from llmtrain.data.config import DataConfig, load_data_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_field_has_a_docstring():
    tree = ast.parse(inspect.getsource(data_config))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DataConfig")
    documented = set()
    for a, b in zip(cls.body, cls.body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            documented.add(a.target.id)
    assert documented == {f.name for f in dataclasses.fields(DataConfig)}


def test_required_values_are_missing():
    cfg = OmegaConf.structured(DataConfig)
    assert OmegaConf.is_missing(cfg, "prefixes") and OmegaConf.is_missing(cfg, "tokenizer")
    with pytest.raises(MissingMandatoryValue):
        _ = cfg.prefixes


def test_default_group_file_loads_with_overrides():
    cfg = load_data_config(os.path.join(REPO, "conf", "data", "pd1998.yaml"), ["seq_len=256", "weights=[1.0]"])
    assert cfg.prefixes == ["work/pd1998/pd1998_text_document"]
    assert cfg.tokenizer == "work/pd1998/tokenizer"
    assert cfg.seq_len == 256 and cfg.weights == [1.0] and cfg.split == "98,2,0"
    with pytest.raises(Exception, match="seq_len"):
        load_data_config(None, ["seq_len=abc"])
