"""Import: real PaddleNLP ERNIE checkpoints (save_pretrained) give the same MLM logits in our encoder.

    python -m pytest tests/interop/test_ernie_import.py -q

Compared on the same ids, in eval mode, max abs logit difference <= 1e-4: without padding
(no mask on either side), with padding (PaddleNLP's default mask from pad_token_id against
ours given the same mask), and with an explicit mask that leaves a padding id attended.
"""
from __future__ import annotations

import numpy as np
import paddle
import pytest
from interop_helpers import assert_close, randomize_paddlenlp

from llmtrain.interop import CheckpointMismatch, UnsupportedConfig, read_paddlenlp_checkpoint
from llmtrain.interop.ernie import HEAD_INIT_SEED, paddlenlp_default_mask
from llmtrain.interop.tensor_files import read_safetensors, write_safetensors
from llmtrain.models import build_model
from llmtrain.models.stages import canonical_parameters
from llmtrain.models.init import load_full_state

# the real package (dev extra); a missing paddlenlp fails these tests rather than skipping them
from paddlenlp.transformers import ErnieConfig, ErnieForMaskedLM, ErnieForPretraining, ErnieModel  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, type_vocab_size=4)
PAD = 0

CASES = {
    "mlm": {},
    "mlm-task-id": dict(use_task_id=True, task_type_vocab_size=3, task_id=2),
    "mlm-no-token-type-pad5": dict(type_vocab_size=0, pad_token_id=5),
    "mlm-untied": dict(tie_word_embeddings=False, use_task_id=True, task_type_vocab_size=16, task_id=0),
}


def ernie_config(**kw) -> ErnieConfig:
    return ErnieConfig(**{**TINY, **kw})


def inputs(cfg, seed: int = 0, batch: int = 2, seq: int = 16):
    """ids without the padding id, token types, and a padded copy (tail of row 0, one id inside row 1)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg.vocab_size, (batch, seq))
    ids[ids == cfg.pad_token_id] = (cfg.pad_token_id + 1) % cfg.vocab_size
    types = rng.integers(0, max(cfg.type_vocab_size, 1), (batch, seq))
    padded = ids.copy()
    padded[0, seq - 5:] = cfg.pad_token_id
    padded[1, 3] = cfg.pad_token_id
    tensor = lambda a: paddle.to_tensor(a, dtype="int64")  # noqa: E731
    return tensor(ids), (tensor(types) if cfg.type_vocab_size else None), tensor(padded)


def ours_from(cfg, state):
    model = build_model(cfg)
    load_full_state(canonical_parameters(model), state, source="imported state")
    model.eval()
    return model


@paddle.no_grad()
def ours_logits(model, ids, types=None, mask=None) -> np.ndarray:
    return model(ids, types, attention_mask=mask).numpy()


@paddle.no_grad()
def theirs_logits(model, ids, types=None, mask=None) -> np.ndarray:
    model.eval()
    out = model(ids, token_type_ids=types, attention_mask=mask)
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out.astype("float32").numpy()


def compare_all(cfg, state, ref, what: str) -> None:
    """Our logits equal PaddleNLP's: no padding; padding under its default mask; an explicit mask."""
    ours = ours_from(cfg, state)
    ids, types, padded = inputs(cfg)
    assert_close(ours_logits(ours, ids, types), theirs_logits(ref, ids, types), f"{what}, no padding")
    mask = paddlenlp_default_mask(padded, cfg.pad_token_id)
    assert_close(ours_logits(ours, padded, types, mask), theirs_logits(ref, padded, types), f"{what}, padded")
    explicit = mask.numpy().copy()
    explicit[1, :] = 1  # row 1 attends to its padding id: only the zeroed embedding makes this match
    explicit = paddle.to_tensor(explicit)
    assert_close(ours_logits(ours, padded, types, explicit), theirs_logits(ref, padded, types, explicit),
                 f"{what}, explicit mask")


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pdparams"])
@pytest.mark.parametrize("case", list(CASES))
def test_import_masked_lm_matches_paddlenlp(case, safe, tmp_path):
    ref = ErnieForMaskedLM(ernie_config(**CASES[case]))
    randomize_paddlenlp(ref, seed=len(case))
    ref.save_pretrained(str(tmp_path), safe_serialization=safe)
    cfg, state, meta = read_paddlenlp_checkpoint(str(tmp_path), trusted=True)
    assert meta["family"] == "ernie" and meta["format"] == ("safetensors" if safe else "pdparams")
    assert (cfg.family, cfg.norm_position, cfg.activation, cfg.norm_eps) == ("encoder", "post", "gelu", 1e-12)
    kw = CASES[case]
    assert cfg.task_type_vocab_size == (kw["task_type_vocab_size"] if kw.get("use_task_id") else 0)
    assert cfg.tie_embeddings == kw.get("tie_word_embeddings", True)
    assert sorted(meta["ignored"]) == ["ernie.pooler.dense.bias", "ernie.pooler.dense.weight"]
    compare_all(cfg, state, ref, case)


def test_loaded_paddlenlp_model_really_uses_eps_1e12(tmp_path):
    """config.json's layer_norm_eps is not read; from_pretrained's _init_weights sets 1e-12, except
    with low_cpu_mem_usage=True (1e-5), which moves logits beyond our tolerance."""
    ref = ErnieForMaskedLM(ernie_config(layer_norm_eps=1e-5))
    randomize_paddlenlp(ref, seed=4)
    ref.save_pretrained(str(tmp_path), safe_serialization=True)
    cfg, state, meta = read_paddlenlp_checkpoint(str(tmp_path))
    assert cfg.norm_eps == 1e-12 and any("layer_norm_eps=1e-05" in n for n in meta["notes"])

    loaded = ErnieForMaskedLM.from_pretrained(str(tmp_path))
    norms = [m for m in loaded.sublayers() if isinstance(m, paddle.nn.LayerNorm)]
    assert len(norms) == 1 + 2 * TINY["num_hidden_layers"] + 1 and {m._epsilon for m in norms} == {1e-12}
    ids, types, _ = inputs(cfg)
    ours = ours_logits(ours_from(cfg, state), ids, types)
    assert_close(ours, theirs_logits(loaded, ids, types), "from_pretrained")

    lazy = ErnieForMaskedLM.from_pretrained(str(tmp_path), low_cpu_mem_usage=True)
    assert {m._epsilon for m in lazy.sublayers() if isinstance(m, paddle.nn.LayerNorm)} == {1e-5}
    assert np.abs(ours - theirs_logits(lazy, ids, types)).max() > 1e-4


def test_pretraining_checkpoint_imports_and_reports_nsp_and_pooler_as_ignored(tmp_path):
    ref = ErnieForPretraining(ernie_config(use_task_id=True, task_type_vocab_size=3, task_id=1))
    randomize_paddlenlp(ref, seed=7)
    ref.save_pretrained(str(tmp_path), safe_serialization=True)
    cfg, state, meta = read_paddlenlp_checkpoint(str(tmp_path))
    assert sorted(meta["ignored"]) == ["cls.seq_relationship.bias", "cls.seq_relationship.weight",
                                       "ernie.pooler.dense.bias", "ernie.pooler.dense.weight"]
    assert "next-sentence" in meta["ignored"]["cls.seq_relationship.weight"]
    assert any("cls.seq_relationship.weight" in n and "ignored" in n for n in meta["notes"])
    compare_all(cfg, state, ref, "ErnieForPretraining")


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_base_model_gets_an_initialised_head_and_equal_hidden_states(tied, tmp_path):
    base = ErnieModel(ernie_config(use_task_id=True, task_type_vocab_size=3, task_id=1, tie_word_embeddings=tied))
    randomize_paddlenlp(base, seed=8)
    base.save_pretrained(str(tmp_path), safe_serialization=True)
    cfg, state, meta = read_paddlenlp_checkpoint(str(tmp_path))
    head = ["mlm_head.dense.weight", "mlm_head.dense.bias", "mlm_head.norm.weight", "mlm_head.norm.bias",
            "mlm_bias.bias"] + ([] if tied else ["lm_head.proj.weight"])
    note = next(n for n in meta["notes"] if n.startswith("base ErnieModel"))
    assert all(k in note for k in head) and str(HEAD_INIT_SEED) in note
    assert np.array_equal(state["mlm_head.norm.weight"], np.ones([32], np.float32))
    assert not state["mlm_bias.bias"].any() and not state["mlm_head.dense.bias"].any()
    assert 0.01 < state["mlm_head.dense.weight"].std() < 0.03  # N(0, initializer_range=0.02)
    _, again, _ = read_paddlenlp_checkpoint(str(tmp_path))
    assert all(np.array_equal(again[k], state[k]) for k in head)  # the same on every read (every rank)

    ours = ours_from(cfg, state)
    ids, types, padded = inputs(cfg)
    for x, mask in ((ids, None), (padded, paddlenlp_default_mask(padded, PAD))):
        with paddle.no_grad():
            h = ours.embed(x, types)
            for block in ours.layers:
                h = block(h, None if mask is None else ((1.0 - mask.astype("float32")) * -1e4)[:, None, None, :])
            base.eval()
            want = base(x, token_type_ids=types)[0]
        assert_close(h.numpy(), want.numpy(), "ErnieModel sequence output")


def test_masked_lm_without_its_head_is_an_error_not_an_init(tmp_path):
    ref = ErnieForMaskedLM(ernie_config())
    ref.save_pretrained(str(tmp_path), safe_serialization=True)
    path = str(tmp_path / "model.safetensors")
    t = read_safetensors(path, bf16_bits=False)
    write_safetensors({k: v for k, v in t.items() if not k.startswith("cls.")}, path)
    with pytest.raises(CheckpointMismatch, match="missing keys") as e:
        read_paddlenlp_checkpoint(str(tmp_path))
    assert "cls.predictions.transform.weight" in str(e.value) and "cls.predictions.decoder_bias" in str(e.value)


def test_key_report_lists_missing_unexpected_misshaped_and_inconsistent_ties(tmp_path):
    ref = ErnieForMaskedLM(ernie_config())
    randomize_paddlenlp(ref, seed=2)
    ref.save_pretrained(str(tmp_path), safe_serialization=True)
    path = str(tmp_path / "model.safetensors")
    t = read_safetensors(path, bf16_bits=False)
    del t["ernie.encoder.layers.1.linear1.weight"], t["cls.predictions.layer_norm.bias"]
    t["ernie.embeddings.token_type_embeddings.weight"] = np.zeros([16, 32], np.float32)
    t["classifier.weight"] = np.zeros([32, 2], np.float32)
    t["cls.predictions.decoder.weight"] = t["cls.predictions.decoder.weight"] + 1.0
    t["cls.predictions.decoder.bias"] = t["cls.predictions.decoder.bias"] + 1.0
    write_safetensors(t, path)
    with pytest.raises(CheckpointMismatch) as e:
        read_paddlenlp_checkpoint(str(tmp_path))
    msg = str(e.value)
    assert "missing keys (2): ernie.encoder.layers.1.linear1.weight, cls.predictions.layer_norm.bias" in msg
    assert "ernie.embeddings.token_type_embeddings.weight" in msg and "has [16, 32], config needs [4, 32]" in msg
    assert "unexpected keys (1)" in msg and "classifier.weight" in msg and "model.safetensors" in msg
    assert "cls.predictions.decoder.weight" in msg and "tie_word_embeddings is true" in msg
    assert "cls.predictions.decoder_bias" in msg and "inconsistent checkpoint" in msg
    assert "pooler" not in msg  # understood and reported as ignored, not unexpected


def test_unused_tables_are_ignored_by_name_as_paddlenlp_ignores_them(tmp_path):
    """A task-type table with use_task_id=false is not used by PaddleNLP; we say so instead of failing."""
    ref = ErnieForMaskedLM(ernie_config(use_task_id=True, task_type_vocab_size=3))
    randomize_paddlenlp(ref, seed=6)
    ref.save_pretrained(str(tmp_path), safe_serialization=True)
    import json

    c = json.load(open(tmp_path / "config.json"))
    c["use_task_id"] = False
    json.dump(c, open(tmp_path / "config.json", "w"))
    cfg, state, meta = read_paddlenlp_checkpoint(str(tmp_path))
    assert cfg.task_type_vocab_size == 0 and "embed.task_type.weight" not in state
    assert "use_task_id=false" in meta["ignored"]["ernie.embeddings.task_type_embeddings.weight"]
    compare_all(cfg, state, ErnieForMaskedLM.from_pretrained(str(tmp_path)), "use_task_id off")


@pytest.mark.parametrize("change, field", [
    (dict(hidden_act="relu"), "hidden_act"),
    (dict(use_task_id=True, task_type_vocab_size=3, task_id=3), "task_id"),
    (dict(architectures=["ErnieForSequenceClassification"]), "architectures"),
    (dict(pad_token_id=None), "pad_token_id"),
])
def test_unsupported_configs_are_refused_by_field(change, field, tmp_path):
    import json

    ErnieForMaskedLM(ernie_config()).save_pretrained(str(tmp_path), safe_serialization=True)
    c = json.load(open(tmp_path / "config.json"))
    c.update(change)
    json.dump(c, open(tmp_path / "config.json", "w"))
    with pytest.raises(UnsupportedConfig, match=field) as e:
        read_paddlenlp_checkpoint(str(tmp_path))
    assert "config.json" in str(e.value)


def test_lazy_read_for_init_from(tmp_path):
    """init_from reads lazily (memory-mapped); the untied decoder transpose must still be right."""
    ref = ErnieForMaskedLM(ernie_config(tie_word_embeddings=False))
    randomize_paddlenlp(ref, seed=12)
    ref.save_pretrained(str(tmp_path), safe_serialization=True)
    cfg, lazy, _ = read_paddlenlp_checkpoint(str(tmp_path), lazy=True)
    assert not isinstance(lazy["layers.0.mlp.up_proj.weight"], np.ndarray)
    compare_all(cfg, lazy, ref, "lazy untied")
