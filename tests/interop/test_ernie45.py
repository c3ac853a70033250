"""ERNIE 4.5 dense and MoE in and out, against the real PaddleFormers 1.2.0 and tests/ernie45_ref.py's numpy forward.

    python -m pytest tests/interop/test_ernie45.py -q

The tiny checkpoints are made by PaddleFormers itself (`Ernie4_5ForCausalLM` / `Ernie4_5_MoeForCausalLM` with
fuse_rms_norm=False, `save_pretrained`) in its own environment (scripts/paddleformers_env.sh builds it once). The dense
one is read back by PaddleFormers' forward; its MoE forward needs GPU-only kernels (`expand_modality_expert_id`), so
the MoE reference is the numpy forward, whose attention and RoPE are checked here against PaddleFormers on the dense
model.
"""
from __future__ import annotations

import json

import numpy as np
import paddle
import pytest
from ernie45_ref import ernie_logits
from interop_helpers import TOL
from paddleformers_ref import pf_encode, pf_logits, pf_lora_logits, pf_make

from llmtrain.interop import read_paddlenlp_checkpoint
from llmtrain.interop.ernie45 import config_from_hf, config_to_hf
from llmtrain.interop.hf_format import write_hf_checkpoint
from llmtrain.interop.keys import UnsupportedConfig

DENSE = dict(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, rope_theta=500000,
             max_position_embeddings=64, rms_norm_eps=1e-5)
MOE = dict(DENSE, num_hidden_layers=3, tie_word_embeddings=False, moe_num_experts=4, moe_k=2,
           moe_intermediate_size=16, moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_interval=1)
"""PaddleFormers 1.2.0's save_pretrained fails for a moe_layer_end_index below the last block (its key mapping assumes
experts in every block from the start index on): the end index is tested on configs alone (test_placement_fields)."""
PT_DENSE = {"architectures", "bos_token_id", "eos_token_id", "hidden_act", "hidden_size", "intermediate_size",
            "max_position_embeddings", "model_type", "num_attention_heads", "num_key_value_heads", "head_dim",
            "num_hidden_layers", "pad_token_id", "rms_norm_eps", "use_cache", "vocab_size", "rope_theta", "use_bias",
            "tie_word_embeddings", "torch_dtype"}
PT_MOE = PT_DENSE | {"moe_num_experts", "moe_num_shared_experts", "moe_layer_start_index", "moe_layer_end_index",
                     "moe_intermediate_size", "moe_capacity", "moe_gate", "moe_k", "moe_layer_interval",
                     "moe_use_aux_free"}
"""config.json keys of the published baidu/ERNIE-4.5-0.3B-PT and ERNIE-4.5-21B-A3B-PT."""
READ_TOO = {"initializer_range", "moe_norm_gate_logits", "scoring_func", "router_aux_loss_coef", "router_z_loss_coef",
            "moe_orthogonal_loss_lambda", "num_nextn_predict_layers"}
"""PaddleFormers config fields we write beyond the published ones (its defaults otherwise: we state our choice)."""


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tiny_corpus):
    root = tmp_path_factory.mktemp("ernie45")
    made = {"dense": pf_make(root / "dense", "dense", DENSE, seed=1,
                             tokenizer=f"{tiny_corpus['tokenizer']}/tokenizer.model"),
            "moe": pf_make(root / "moe", "moe", MOE, seed=2)}
    return root, made


def close(ours, ref, what):
    assert np.abs(ref).max() > 0.1, what
    diff = float(np.abs(ours - ref).max())
    assert diff <= TOL, f"{what}: max abs logit difference {diff:.3g} > {TOL}"
    return diff


IDS = np.random.default_rng(0).integers(0, 320, (2, 24))


def our_logits(cfg, state, ids):
    from interop_helpers import our_logits as logits

    return logits(cfg, state, paddle.to_tensor(ids))


def test_dense_import_equals_paddleformers_and_the_numpy_forward(sources):
    root, made = sources
    assert {"config.json", "model.safetensors.index.json", "model-00001-of-00001.safetensors"} <= set(
        made["dense"]["files"])
    cfg, state, meta = read_paddlenlp_checkpoint(str(root / "dense"))
    assert meta["layout"] == "paddleformers" and meta["family"] == "ernie4_5"
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.tie_embeddings, cfg.rope_theta) == (2, 16, True, 500000.0)
    ref = pf_logits(root / "dense", IDS)
    close(ernie_logits(root / "dense", IDS), ref, "numpy forward vs PaddleFormers")  # the MoE reference's attention
    close(our_logits(cfg, state, IDS), ref, "import vs PaddleFormers")


def test_dense_export_is_read_by_paddleformers_in_both_layouts(sources, tmp_path):
    root, _ = sources
    cfg, state, _ = read_paddlenlp_checkpoint(str(root / "dense"))
    state = {k: np.asarray(v) * (1.01 if k.endswith("proj.weight") else 1.0) for k, v in state.items()}
    ours = our_logits(cfg, state, IDS)
    for layout in ("paddleformers", "huggingface"):
        out = tmp_path / layout
        write_hf_checkpoint(cfg, state, str(out), family="ernie4_5", layout=layout, tokenizer_dir=str(root / "dense"))
        c = json.loads((out / "config.json").read_text())
        assert ("paddleformers_version" in c) == (layout == "paddleformers")
        if layout == "huggingface":
            assert set(c) <= PT_DENSE | READ_TOO, set(c) - PT_DENSE - READ_TOO
        close(pf_logits(out, IDS), ours, f"PaddleFormers reading our {layout} export")
        again, state2, meta = read_paddlenlp_checkpoint(str(out))
        assert meta["layout"] == layout
        close(our_logits(again, state2, IDS), ours, f"our {layout} export read back")


def test_lora_adapters_in_paddleformers_format(sources, tmp_path):
    """Our q/k/v/o/gate/up/down adapters (rank 2, q and v only on block 1) written as PaddleFormers adapters on its
    fused qkv_proj / up_gate_proj: LoRAModel.from_pretrained gives our merged model's logits."""
    from types import SimpleNamespace

    from llmtrain.interop.ernie45_lora import write_paddleformers_lora
    from llmtrain.interop.keys import model_shapes
    from llmtrain.interop.lora_format import merge_adapters

    root, _ = sources
    cfg, base, _ = read_paddlenlp_checkpoint(str(root / "dense"))
    base = {k: np.asarray(v) for k, v in base.items()}
    shapes, rng, adapters = model_shapes(cfg), np.random.default_rng(4), {}
    for i in range(2):
        for n in ["attn.q_proj", "attn.v_proj"] + (["attn.k_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                    "mlp.down_proj"] if i == 0 else []):
            fan_in, fan_out = shapes[f"layers.{i}.{n}.weight"]
            adapters[f"layers.{i}.{n}.lora_A"] = (0.3 * rng.standard_normal([fan_in, 2])).astype(np.float32)
            adapters[f"layers.{i}.{n}.lora_B"] = (0.3 * rng.standard_normal([2, fan_out])).astype(np.float32)
    lora = SimpleNamespace(rank=2, alpha=4.0, dropout=0.0)
    info = write_paddleformers_lora(cfg, lora, adapters, str(tmp_path / "adapters"), base=str(root / "dense"))
    assert info["rank"] == 6 and {"lora_config.json", "peft_model.safetensors.index.json"} <= set(info["files"])
    merged = merge_adapters(base, adapters, lora.alpha / lora.rank)
    ours = our_logits(cfg, merged, IDS)
    assert np.abs(ours - our_logits(cfg, base, IDS)).max() > 0.1  # the adapters matter
    before = pf_logits(root / "dense", IDS)  # the worker's cached base model
    close(pf_lora_logits(root / "dense", tmp_path / "adapters", IDS), ours, "PaddleFormers LoRAModel on our adapters")
    # the base reference is still the base (LoRAModel rewrites the model it wraps in place: once the worker's cached
    # one, which made a later pp2 run's reference loss the adapted model's)
    assert np.array_equal(pf_logits(root / "dense", IDS), before)


def test_tokenizer_files_load_in_both(sources):
    from llmtrain.tokenizer import load_tokenizer

    root, _ = sources
    texts = ["人民日报社位于北京。", "长江是中国最长的河流，全长6300公里。"]
    theirs = pf_encode(root / "dense", texts)
    ours = load_tokenizer(str(root / "dense"))
    assert theirs["class"] == "LlamaTokenizer", theirs  # PaddleFormers' Ernie4_5Tokenizer is its LlamaTokenizer
    assert theirs["ids"] == [ours.encode(t) for t in texts] and all(theirs["ids"])


def test_moe_import_placement_router_and_export(sources, tmp_path):
    root, made = sources
    saved = set(made["moe"]["params"])
    assert any(k.startswith("model.mtp_") for k in saved)  # PaddleFormers' default num_nextn_predict_layers=1
    cfg, state, meta = read_paddlenlp_checkpoint(str(root / "moe"))
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert cfg.moe_aux_counts == "unbiased" and cfg.moe_aux_loss_coef == pytest.approx(0.02)
    assert cfg.moe_z_loss_coef == pytest.approx(2e-4) and cfg.moe_num_shared_experts == 1
    assert any("mtp" in n for n in meta["ignored"]) and any("orthogonal" in n for n in meta["notes"])
    bias = np.asarray(state["layers.1.mlp.expert_bias"])
    assert np.abs(bias).max() > 0.1  # the correction bias is read and takes part in the choice
    from ernie45_ref import _softmax, ernie_forward, router_loss

    _, routers = ernie_forward(root / "moe", IDS)
    c = json.loads((root / "moe" / "config.json").read_text())
    chosen = [(lg, np.argsort(-(_softmax(lg) + np.asarray(state[f"layers.{i + 1}.mlp.expert_bias"])), axis=-1,
                              kind="stable")[:, :2]) for i, (lg, _) in enumerate(routers)]
    assert abs(router_loss(c, routers) - router_loss(c, chosen)) > 10 * TOL  # counting matters to the step-1 check
    ids = IDS[:1, :12]
    ours = our_logits(cfg, state, ids)
    close(ours, ernie_logits(root / "moe", ids), "MoE import vs numpy forward")
    out = tmp_path / "moe_out"
    write_hf_checkpoint(cfg, state, str(out), family="ernie4_5_moe", layout="paddleformers")
    c = json.loads((out / "config.json").read_text())
    assert (c["moe_layer_start_index"], c["moe_layer_end_index"], c["num_nextn_predict_layers"]) == (1, 2, 0)
    assert c["router_aux_loss_coef"] == pytest.approx(0.01)
    close(ernie_logits(out, ids), ours, "MoE export read by the numpy forward")
    from safetensors.numpy import load_file

    written = set(load_file(str(out / "model-00001-of-00001.safetensors")))
    pf_names = {k for k in json.loads((root / "moe" / "model.safetensors.index.json").read_text())["weight_map"]
                if not k.startswith("model.mtp_")}
    assert written == pf_names  # exactly the tensors PaddleFormers' save_pretrained writes, MTP aside


def test_placement_fields():
    base = dict(MOE, model_type="ernie4_5_moe", num_nextn_predict_layers=0)
    cfg, _ = config_from_hf(dict(base, num_hidden_layers=6, moe_layer_start_index=0, moe_layer_interval=2),
                            "ernie4_5_moe", "t", "config.json")
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, False, True, False, True]
    cfg, _ = config_from_hf(dict(base, num_hidden_layers=6, moe_layer_end_index=3), "ernie4_5_moe", "t", "c")
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, True, True, False, False]
    back = config_to_hf(cfg)
    assert (back["moe_layer_start_index"], back["moe_layer_end_index"], back["moe_layer_interval"]) == (1, 3, 1)


@pytest.mark.parametrize("field,value,message", [
    ("use_bias", True, "use_bias=true"), ("moe_num_experts", [4, 4], "per modality"),
    ("scoring_func", "sigmoid", "scoring_func"), ("moe_group_experts", True, "moe_group_experts"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}, "rope scaling"), ("hidden_act", "gelu", "hidden_act")])
def test_refused_configs_name_the_field(field, value, message):
    c = dict(MOE, model_type="ernie4_5_moe", **{field: value})
    with pytest.raises(UnsupportedConfig, match=message):
        config_from_hf(c, "ernie4_5_moe", "t", "dir/config.json")


def test_export_refuses_what_ernie_cannot_compute():
    cfg, _ = config_from_hf(dict(MOE, model_type="ernie4_5_moe"), "ernie4_5_moe", "t", "c")
    import dataclasses

    for change, message in ((dict(moe_router="sigmoid"), "moe_router"), (dict(qk_norm=True), "qk_norm"),
                            (dict(moe_aux_counts="chosen"), "moe_aux_counts"), (dict(bias=True), "bias")):
        with pytest.raises(UnsupportedConfig, match=message):
            config_to_hf(dataclasses.replace(cfg, **change))


PRESETS = {"ernie-4.5-0.3b": (360_748_032, None), "ernie-4.5-21b-a3b": (21_825_437_888, 3_352_148_480),
           "ernie-4.5-300b-a47b": (299_484_163_264, 47_079_333_888)}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_presets_counts_and_what_they_import_as(preset):
    from llmtest import compose

    from llmtrain.config import to_config
    from llmtrain.models.size import flops_parameters, parameter_count
    from llmtrain.plan.memory import param_specs

    cfg = to_config(compose([f"model={preset}"])).model
    total, active = PRESETS[preset]
    assert parameter_count(cfg) == total == sum(s.numel for s in param_specs(cfg))
    if active:
        assert flops_parameters(cfg) == active
        c = config_to_hf(cfg)  # the preset written as ERNIE and read back is itself
        again, _ = config_from_hf(c, c["model_type"], cfg.name, "c")
        for f in ("moe_first_dense_layers", "moe_last_layer", "moe_layer_interval", "moe_top_k", "moe_aux_counts"):
            assert getattr(again, f) == getattr(cfg, f), f
        assert again.moe_aux_loss_coef == pytest.approx(cfg.moe_aux_loss_coef)
