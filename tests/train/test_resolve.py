"""The configuration is resolved once (every derived value, every problem in one message) and then frozen.

    python -m pytest tests/train/test_resolve.py -q
"""
from __future__ import annotations

import dataclasses
import os

import pytest

from llmtest import REPO, compose
from llmtrain.config import ConfigError, FrozenConfigError, to_config
from llmtrain.resolve import resolve

SHIPPED_TOKENIZER = os.path.join(REPO, "tokenizers", "pd1998-bpe16k")


def test_every_problem_in_one_message():
    """Values, batch arithmetic, the tokenizer and model-fits-layout problems come together, with their numbers."""
    cfg = to_config(compose(["+parallel=tp2", "model.num_heads=3", "optim.lr=-1", "train.global_batch_size=10",
                             "train.micro_batch_size=4", "data.tokenizer=/nonexistent/tok"]))
    with pytest.raises(ConfigError) as e:
        resolve(cfg, world_size=2)
    msg = str(e.value)
    for needle in ("optim.lr=-1.0: must be >= 0",
                   "global batch 10 is not divisible by micro x data-parallel = 4 x 1 = 4",
                   "data.tokenizer=/nonexistent/tok",
                   "model.num_heads=3 is not divisible by parallel.tp=2",
                   "model.hidden_size=128 is not divisible by model.num_heads=3"):
        assert needle in msg, (needle, msg)


def test_model_fit_problems_reported_even_when_the_world_size_is_wrong():
    cfg = to_config(compose(["+parallel=pp2", "model.num_layers=3", "parallel.pp_layers=[1,1]",
                             f"data.tokenizer={SHIPPED_TOKENIZER}"]))
    with pytest.raises(ConfigError) as e:
        resolve(cfg, world_size=4)
    assert "= 2 processes, but the job has 4" in str(e.value)
    assert "parallel.pp_layers=[1, 1] holds 2 blocks, but model.num_layers=3" in str(e.value)


def test_derived_values_and_frozen_result(tiny_corpus, tmp_path):
    cfg = to_config(compose([f"data.tokenizer={tiny_corpus['tokenizer']}", f"data.prefixes=[{tiny_corpus['prefix']}]",
                             f"run.dir={tmp_path}", "+parallel=dp2", "train.global_batch_size=8",
                             "train.micro_batch_size=2"]))
    run = resolve(cfg, world_size=2)
    assert cfg.model.vocab_size is None  # the composed config is not mutated
    assert run.cfg.model.vocab_size == run.tokenizer.vocab_size and run.cfg.model.vocab_size % 128 == 0
    assert (run.layout.global_batch, run.layout.micro_batch, run.layout.grad_accum) == (8, 2, 2)
    assert run.objective == "decoder" and run.initial_state is None and run.flops_per_token > 0
    with pytest.raises(FrozenConfigError, match="ModelConfig.hidden_size"):
        run.cfg.model.hidden_size = 64
    with pytest.raises(FrozenConfigError):
        run.cfg.train.max_steps = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.layout.tp = 2
    assert isinstance(run.cfg.data.prefixes, tuple)


def test_vocabulary_smaller_than_the_tokenizer_is_refused():
    cfg = to_config(compose([f"data.tokenizer={SHIPPED_TOKENIZER}", "model.vocab_size=1000"]))
    with pytest.raises(ConfigError, match=r"model.vocab_size=1000 is smaller than the tokenizer's vocabulary"):
        resolve(cfg, world_size=1)


def test_every_data_input_error_up_front(tiny_corpus, tmp_path):
    """Issue 38 §4: a missing data.prefixes file, a data.weights count that does not match, data preprocessed with
    another tokenizer, a missing lexicon: problems of resolve (exit 2 before any process group), each with its
    path and numbers, not a traceback once the data loads."""
    missing = str(tmp_path / "nope" / "corpus_text_document")
    cfg = to_config(compose([f"data.tokenizer={SHIPPED_TOKENIZER}", f"data.prefixes=[{tiny_corpus['prefix']},{missing}]",
                             "data.weights=[0.5,0.3,0.2]", f"run.dir={tmp_path / 'run'}"]))
    with pytest.raises(ConfigError) as e:
        resolve(cfg, world_size=1)
    msg = str(e.value)
    for needle in (f"data prefix {missing!r}: {missing}.bin does not exist; create it with `python -m "
                   "llmtrain.data.preprocess",
                   "data.weights has 3 entries for 2 data.prefixes",
                   f"{tiny_corpus['prefix']} was preprocessed with tokenizer 'tokenizer'",
                   f"but data.tokenizer={SHIPPED_TOKENIZER!r} is 'pd1998-bpe16k'"):
        assert needle in msg, (needle, msg)
    lexicon = str(tmp_path / "entities.txt")
    ernie = to_config(compose(["model=ernie-tiny", "model.max_position_embeddings=64", "data.seq_len=32",
                               f"data.tokenizer={tiny_corpus['tokenizer']}", f"data.prefixes=[{tiny_corpus['prefix']}]",
                               "data.masking.strategy=entity", "data.masking.entity_source=lexicon",
                               f"data.masking.lexicon={lexicon}", f"run.dir={tmp_path / 'run'}"]))
    with pytest.raises(ConfigError, match=rf"data.masking.lexicon={lexicon}: {lexicon} does not exist; build one with"):
        resolve(ernie, world_size=1)


def test_an_empty_dataset_is_refused_up_front(tiny_corpus, tmp_path):
    """An empty MMIDIDX prefix passed the up-front check and failed with a traceback once data loaded, and so did
    fine-tuning on an empty file; now both are problems of resolve, with the counts and the file."""
    import numpy as np

    from llmtrain.config import compose_config
    from llmtrain.data.indexed import IndexedWriter

    empty = str(tmp_path / "empty_text_document")
    writer = IndexedWriter(empty, np.uint16)
    writer.finalize()
    cfg = to_config(compose([f"data.tokenizer={tiny_corpus['tokenizer']}", f"data.prefixes=[{empty}]",
                             "data.seq_len=32", f"run.dir={tmp_path / 'run'}"]))
    with pytest.raises(ConfigError, match=rf"no training sample: a sample takes data.seq_len \+ 1 = 33 tokens, and the "
                                          rf"train split \(data.split='98,2,0'\) of {empty} holds 0 of its 0 documents, "
                                          r"0 tokens\. Preprocess a corpus with text in it"):
        resolve(cfg, world_size=1)
    records = tmp_path / "chat.jsonl"
    records.write_text('{"prompt": "你好", "response": ""}\n', encoding="utf-8")
    sft = to_config(compose_config([f"data.tokenizer={tiny_corpus['tokenizer']}", f"data.files=[{records}]",
                                    f"run.dir={tmp_path / 'ft'}"], config_name="finetune"))
    with pytest.raises(ConfigError, match=rf"data.files=\['{records}'\]: no usable example \(a prompt and a response "
                                          r"within data.seq_len=\d+\): bad records: 1\n +no_response +1 .*\n +at .*chat.jsonl:1"):
        resolve(sft, world_size=1)


def test_init_from_takes_the_architecture_and_name_of_the_checkpoint(tiny_corpus, tmp_path):
    """`model=qwen3-0.6b model.init_from=DIR` (a Qwen3-shaped DIR) was refused against the preset's 151936-row
    vocabulary, and without `model=` the run was named after the default gpt-tiny. Now: the architecture, model name
    and run name are DIR's, a named preset is checked to be of DIR's kind, and the vocabulary is compared with the
    tokenizer's."""
    import sys

    sys.path.insert(0, os.path.join(REPO, "tests"))
    from hf_tiny import make_hf_checkpoint

    from llmtrain.tokenizer import load_tokenizer

    rows = load_tokenizer(tiny_corpus["tokenizer"]).vocab_size
    src, small = tmp_path / "Qwen3-tiny", tmp_path / "Qwen3-small-vocab"
    make_hf_checkpoint(src, "qwen3", vocab_size=rows)
    make_hf_checkpoint(small, "qwen3", vocab_size=rows - 128)
    data = [f"data.prefixes=[{tiny_corpus['prefix']}]", f"data.tokenizer={tiny_corpus['tokenizer']}",
            "data.seq_len=32", "checkpoint.resume=none"]

    def run(*extra, named=None):
        cfg = to_config(compose([*extra, *data]))
        return cfg.run.name, resolve(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(tmp_path / "r"))),
                                     world_size=1, model_named=named)

    for extra, named in ((["model=qwen3-0.6b"], True), ([], False), ([], None)):
        name, got = run(*extra, f"model.init_from={src}", named=named)
        assert name == "Qwen3-tiny-single" and got.cfg.model.name == "Qwen3-tiny", (extra, name)
        assert (got.cfg.model.hidden_size, got.cfg.model.vocab_size, got.cfg.model.qk_norm) == (32, rows, True)
    with pytest.raises(ConfigError) as e:
        run("model=gpt-tiny", f"model.init_from={src}", named=True)
    assert f"model=gpt-tiny is not the kind of model model.init_from={src} holds (position learned vs rope, norm " \
           "layernorm vs rmsnorm, activation gelu_tanh vs swiglu, qk_norm False vs True): the architecture is the " \
           "checkpoint's, so drop model=" in str(e.value), str(e.value)
    with pytest.raises(ConfigError) as e:
        run(f"model.init_from={small}")
    assert f"model.init_from={small}: the checkpoint's vocabulary has {rows - 128} rows, but data.tokenizer=" \
           f"{tiny_corpus['tokenizer']} has {rows} ids" in str(e.value), str(e.value)
