"""PaddleNLP ERNIE (`ErnieForMaskedLM` / `ErnieForPretraining` / `ErnieModel`, 2.8.1) <-> our encoder.

    python -m pytest tests/interop -q -k ernie
    cfg, state, meta = read_paddlenlp_checkpoint("ernie-dir/")          # family "ernie" from config.json
    write_paddlenlp_checkpoint(cfg, state, "out/", tokenizer_dir="ernie-dir/")  # copies vocab.txt & co.

What PaddleNLP's ERNIE computes, read from `paddlenlp/transformers/ernie/modeling.py` and
measured, and the ModelConfig (`family="encoder"`) that reproduces it:
  - embeddings: word + position (0..s-1) + token type (if type_vocab_size > 0) + task type
    (if use_task_id; every position gets `task_id`), then LayerNorm. The word table is an
    `nn.Embedding(padding_idx=pad_token_id)`, and Paddle's lookup returns *zeros* at the
    padding id whatever that row holds (the row still feeds the tied output projection);
    our `EncoderEmbedding` does the same;
  - blocks: `paddle.nn.TransformerEncoderLayer(normalize_before=False)`: post-norm,
    norm1 after attention + residual, norm2 after the FFN + residual; q scaled by d^-1/2;
    FFN linear1 -> gelu -> linear2; biases everywhere;
  - gelu is the exact erf form (`F.gelu` default) in the FFN and in the MLM transform;
    `hidden_act` other than "gelu" is rejected (our encoder has no other exact match);
  - LayerNorm epsilon: every LayerNorm is built with Paddle's default 1e-5 and then set to
    1e-12 by `ErniePretrainedModel._init_weights`. `layer_norm_eps` in config.json is never
    read. `from_pretrained` runs `_init_weights` (so 1e-12) except with
    `low_cpu_mem_usage=True`, which skips it and leaves 1e-5 (max logit change ~1e-3 on a
    tiny model: above our 1e-4 tolerance). We reproduce the normal path: 1e-12;
  - attention mask: a [b, s] 1/0 mask becomes additive (1 - m) * -1e4 on the keys; with no
    mask PaddleNLP builds one from `input_ids == pad_token_id`. Our encoder masks only when
    given a mask (it must compute the same under every layout, and pipeline stages after
    the embedding do not see the ids): pass `paddlenlp_default_mask(ids, pad_token_id)`
    to get PaddleNLP's default;
  - MLM head: transform (dense h->h), gelu, layer_norm, then the word table transposed
    plus `decoder_bias`. `tie_word_embeddings` (default true) ties `cls.predictions.decoder`
    to the word table; false gives a separate [vocab, hidden] decoder weight.
Name mapping (all weights [in, out] on both sides, so no transposes except an untied decoder):
  ernie.embeddings.{word,position,token_type,task_type}_embeddings -> embed.{word,pos,token_type,task_type}
  ernie.embeddings.layer_norm -> embed.norm;  ernie.encoder.layers.N.self_attn.{q,k,v,out}_proj ->
  layers.N.attn.{q,k,v,o}_proj;  norm1 -> attn_norm;  linear1/linear2 -> mlp.up_proj/down_proj;
  norm2 -> mlp_norm;  cls.predictions.transform -> mlm_head.dense;  cls.predictions.layer_norm ->
  mlm_head.norm;  cls.predictions.decoder_bias (= decoder.bias) -> mlm_bias.bias.
Not part of our model, reported by name in `meta["ignored"]` and the notes: `ernie.pooler.dense`
(tanh(dense(h[:, 0])), feeds sentence-level heads only) and `cls.seq_relationship`
(ErnieForPretraining's next-sentence head). Export writes no pooler: PaddleNLP then initialises
it randomly and lists it as newly initialised; it never enters the MLM logits.

A base `ErnieModel` checkpoint (architectures ["ErnieModel"], or no `cls.` tensor and no
architectures) has no MLM head: we initialise it, as PaddleNLP's `ErnieForMaskedLM.from_pretrained`
does, and say so in the notes: dense weight N(0, initializer_range^2), LayerNorm 1/0, output
bias 0, drawn from a fixed seed by canonical name (`HEAD_INIT_SEED`), so every rank of every
layout gets the same head. A checkpoint that declares a head (ErnieForMaskedLM /
ErnieForPretraining) but lacks part of it is an error listing the missing keys.
"""
from __future__ import annotations

import functools

import json
import os
import shutil

import numpy as np

from llmtrain.interop.keys import SourceTensors, UnsupportedConfig, switch_mismatches
from llmtrain.models.config import ModelConfig

MODEL_TYPE = "ernie"
PREFIX = "ernie."
LN_EPS = 1e-12  # what ErniePretrainedModel._init_weights sets on every LayerNorm
HEAD_INIT_SEED = 1234  # head of a base ErnieModel: drawn per canonical name from this seed
WITH_HEAD = ("ErnieForMaskedLM", "ErnieForPretraining")
ARCHITECTURES = ("ErnieModel",) + WITH_HEAD

# ErnieConfig defaults of PaddleNLP 2.8.1 for the fields we read (used when config.json omits them).
DEFAULTS = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                intermediate_size=3072, hidden_act="gelu", max_position_embeddings=512, type_vocab_size=16,
                task_type_vocab_size=3, use_task_id=False, task_id=0, pad_token_id=0, initializer_range=0.02,
                tie_word_embeddings=True)

POOLER = "ErnieModel pooler tanh(dense(h[:, 0])): feeds sentence-level heads only, not the MLM logits; " \
         "not part of our model"
NSP = "ErnieForPretraining next-sentence head (on the pooler): not part of our MLM model"

# Files a PaddleNLP ERNIE tokenizer directory holds (ErnieTokenizer.save_pretrained writes the first three).
VOCAB_FILE = "vocab.txt"
TOKENIZER_FILES = ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
WORDPIECE_CLASSES = ("ErnieTokenizer", "ErnieFastTokenizer", "BertTokenizer")


def config_from_paddlenlp(c: dict, name: str, source: str) -> tuple[ModelConfig, list[str]]:
    """ModelConfig reproducing PaddleNLP's ERNIE for config.json dict `c`, and notes on what was decided."""
    g = {k: c.get(k, v) for k, v in DEFAULTS.items()}
    notes = [f"{k} absent from config.json: PaddleNLP default {v!r} used" for k, v in DEFAULTS.items() if k not in c]
    bad = []
    archs = c.get("architectures") or []
    other = [a for a in archs if a not in ARCHITECTURES]
    if other:
        bad.append(f"architectures={archs!r} (we read {', '.join(ARCHITECTURES)}; a fine-tuned task head is not "
                   "part of our model)")
    if g["hidden_act"] != "gelu":
        bad.append(f"hidden_act={g['hidden_act']!r} (our encoder reproduces only 'gelu', the exact erf form)")
    if g["hidden_size"] % g["num_attention_heads"]:
        bad.append(f"hidden_size={g['hidden_size']} not divisible by num_attention_heads={g['num_attention_heads']}")
    if g["use_task_id"] and not 0 <= g["task_id"] < g["task_type_vocab_size"]:
        bad.append(f"task_id={g['task_id']} outside the task-type table of {g['task_type_vocab_size']} rows")
    pad = g["pad_token_id"]
    if not isinstance(pad, int) or not 0 <= pad < g["vocab_size"]:
        bad.append(f"pad_token_id={pad!r} (we support a padding id inside the vocabulary, 0..{g['vocab_size'] - 1})")
    if bad:
        raise UnsupportedConfig(f"{source}: ERNIE config not supported: " + "; ".join(bad))
    if c.get("layer_norm_eps", LN_EPS) != LN_EPS:
        notes.append(f"layer_norm_eps={c['layer_norm_eps']} in config.json is not read by PaddleNLP's ERNIE "
                     f"(_init_weights sets {LN_EPS}); we use {LN_EPS} to match it")
    use_task = bool(g["use_task_id"])
    cfg = ModelConfig(
        name=name, family="encoder", hidden_size=g["hidden_size"], num_layers=g["num_hidden_layers"],
        num_heads=g["num_attention_heads"], num_kv_heads=None, ffn_hidden_size=g["intermediate_size"],
        vocab_size=g["vocab_size"], max_position_embeddings=g["max_position_embeddings"], position="learned",
        norm="layernorm", norm_eps=LN_EPS, norm_position="post", activation="gelu", bias=True,
        type_vocab_size=int(g["type_vocab_size"]),
        task_type_vocab_size=int(g["task_type_vocab_size"]) if use_task else 0,
        task_id=int(g["task_id"]) if use_task else 0, pad_token_id=pad,
        tie_embeddings=bool(g["tie_word_embeddings"]), init_std=float(g["initializer_range"]))
    return cfg, notes


def config_to_paddlenlp(cfg: ModelConfig) -> tuple[dict, list[str]]:
    """config.json fields for `ErnieForMaskedLM` computing what `cfg` computes, and notes."""
    wants = (
        ("position", "learned"),
        ("norm", "layernorm"),
        ("activation", "gelu"),
        ("norm_position", "post"),
    )
    bad = switch_mismatches(cfg, "encoder", "ErnieForMaskedLM", "ERNIE", wants)
    if cfg.norm_eps != LN_EPS:
        bad.append(f"model.norm_eps={cfg.norm_eps} (PaddleNLP's ERNIE sets {LN_EPS} on every LayerNorm)")
    if cfg.kv_heads() != cfg.num_heads:
        bad.append(f"model.num_kv_heads={cfg.num_kv_heads} (PaddleNLP's ERNIE has no grouped-query attention)")
    if cfg.task_type_vocab_size and not 0 <= cfg.task_id < cfg.task_type_vocab_size:
        bad.append(f"model.task_id={cfg.task_id} outside the task-type table of {cfg.task_type_vocab_size} rows")
    if bad:
        raise UnsupportedConfig(f"model {cfg.name!r} cannot be written as a PaddleNLP ERNIE: " + "; ".join(bad))
    notes = ["no ernie.pooler.dense written (our model has none): PaddleNLP initialises it when loading; it does "
             "not enter the MLM logits"]
    if not cfg.bias:
        notes.append("model.bias=false: PaddleNLP's ERNIE always has biases; written as zeros (exact)")
    use_task = cfg.task_type_vocab_size > 0
    out = dict(
        architectures=["ErnieForMaskedLM"], model_type=MODEL_TYPE, vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.ffn_hidden_size, hidden_act="gelu", max_position_embeddings=cfg.max_position_embeddings,
        type_vocab_size=cfg.type_vocab_size, use_task_id=use_task,
        task_type_vocab_size=cfg.task_type_vocab_size if use_task else DEFAULTS["task_type_vocab_size"],
        task_id=cfg.task_id, pad_token_id=cfg.pad_token_id, layer_norm_eps=LN_EPS, initializer_range=cfg.init_std,
        tie_word_embeddings=cfg.tie_embeddings,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # our model has no dropout
    return out, notes


def paddlenlp_default_mask(input_ids, pad_token_id: int):
    """What PaddleNLP's ErnieModel uses when given no attention_mask: 1 keep / 0 at `pad_token_id`, [b, s]."""
    return (input_ids != pad_token_id).astype("int64")


def _base_model(src: SourceTensors, meta_archs: list) -> bool:
    """True if the checkpoint is a bare ErnieModel (no MLM head to read)."""
    if any(a in WITH_HEAD for a in meta_archs):
        return False
    return not any(k.startswith("cls.") for k in src.tensors)


def _init_head(shapes: dict[str, list[int]], std: float) -> dict[str, np.ndarray]:
    """Initial values of the MLM head parameters (canonical name -> shape), deterministic per name."""
    from llmtrain.models.init import name_rng

    out = {}
    for name, shape in shapes.items():
        if len(shape) == 2:
            out[name] = name_rng(HEAD_INIT_SEED, name).standard_normal(shape, dtype=np.float32) * np.float32(std)
        elif name.endswith("norm.weight"):
            out[name] = np.ones(shape, np.float32)
        else:
            out[name] = np.zeros(shape, np.float32)
    return out


def to_canonical(src: SourceTensors, cfg: ModelConfig, architectures=None) -> tuple[dict, ModelConfig, list[str]]:
    """Our canonical state from PaddleNLP ERNIE tensors, the config (unchanged), and notes.

    Problems (missing, mis-shaped, inconsistent tied keys) are recorded in `src`."""
    h, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    state: dict[str, np.ndarray] = {}
    notes: list[str] = []

    put = functools.partial(src.take_into, state)  # put(canon, key, shape)

    e = PREFIX + "embeddings."
    put("embed.word.weight", e + "word_embeddings.weight", [v, h])
    put("embed.pos.weight", e + "position_embeddings.weight", [cfg.max_position_embeddings, h])
    for ours, theirs, rows, why in (
            ("token_type", "token_type_embeddings", cfg.type_vocab_size, "type_vocab_size=0"),
            ("task_type", "task_type_embeddings", cfg.task_type_vocab_size, "use_task_id=false")):
        if rows > 0:
            put(f"embed.{ours}.weight", f"{e}{theirs}.weight", [rows, h])
        elif src.has(f"{e}{theirs}.weight"):
            src.ignore(f"{e}{theirs}.weight", f"{why} in config.json: PaddleNLP does not add this table either")
    put("embed.norm.weight", e + "layer_norm.weight", [h])
    put("embed.norm.bias", e + "layer_norm.bias", [h])
    for i in range(cfg.num_layers):
        p, c = f"{PREFIX}encoder.layers.{i}.", f"layers.{i}."
        for ours, theirs, shape_w, width in (
                ("attn.q_proj", "self_attn.q_proj", [h, h], h), ("attn.k_proj", "self_attn.k_proj", [h, h], h),
                ("attn.v_proj", "self_attn.v_proj", [h, h], h), ("attn.o_proj", "self_attn.out_proj", [h, h], h),
                ("mlp.up_proj", "linear1", [h, f], f), ("mlp.down_proj", "linear2", [f, h], h)):
            put(f"{c}{ours}.weight", f"{p}{theirs}.weight", shape_w)
            put(f"{c}{ours}.bias", f"{p}{theirs}.bias", [width])
        for ours, theirs in (("attn_norm", "norm1"), ("mlp_norm", "norm2")):
            put(f"{c}{ours}.weight", f"{p}{theirs}.weight", [h])
            put(f"{c}{ours}.bias", f"{p}{theirs}.bias", [h])
    for key in (PREFIX + "pooler.dense.weight", PREFIX + "pooler.dense.bias"):
        if src.has(key):
            src.ignore(key, POOLER)
    for key in ("cls.seq_relationship.weight", "cls.seq_relationship.bias"):
        if src.has(key):
            src.ignore(key, NSP)

    if _base_model(src, architectures or []):
        head = {"mlm_head.dense.weight": [h, h], "mlm_head.dense.bias": [h], "mlm_head.norm.weight": [h],
                "mlm_head.norm.bias": [h], "mlm_bias.bias": [v]}
        if not cfg.tie_embeddings:
            head["lm_head.proj.weight"] = [h, v]
        state.update(_init_head(head, cfg.init_std))
        notes.append(f"base ErnieModel checkpoint, no MLM head: initialised {', '.join(head)} (dense N(0, "
                     f"{cfg.init_std}^2), LayerNorm 1/0, bias 0; seed {HEAD_INIT_SEED} by name, the same on every "
                     "rank) as PaddleNLP's ErnieForMaskedLM.from_pretrained would initialise them")
    else:
        _head_to_canonical(src, cfg, state)
    ignored = sorted(k for k in src.ignored)
    if ignored:
        notes.append(f"ignored (not part of our model): {', '.join(ignored)}")
    return state, cfg, notes


def _head_to_canonical(src: SourceTensors, cfg: ModelConfig, state: dict) -> None:
    """The MLM head of an ErnieForMaskedLM / ErnieForPretraining checkpoint into `state`."""
    h, v = cfg.hidden_size, cfg.vocab_size
    for ours, theirs, shape_w in (("mlm_head.dense", "cls.predictions.transform", [h, h]),
                                  ("mlm_head.norm", "cls.predictions.layer_norm", [h])):
        for part, shape in (("weight", shape_w), ("bias", [h])):
            arr = src.take(f"{theirs}.{part}", shape)
            if arr is not None:
                state[f"{ours}.{part}"] = arr

    # the output bias is one parameter saved under two names; either may be alone (older files: decoder_bias)
    names = [k for k in ("cls.predictions.decoder_bias", "cls.predictions.decoder.bias") if src.has(k)]
    biases = [src.take(k, [v]) for k in names] if names else [src.take("cls.predictions.decoder_bias", [v])]
    if len(names) == 2 and biases[0] is not None and biases[1] is not None and \
            not np.array_equal(np.asarray(biases[0]), np.asarray(biases[1])):
        src.problem(f"cls.predictions.decoder_bias ({src.where(names[0])}) differs from cls.predictions.decoder.bias "
                    f"({src.where(names[1])}): they are one parameter in PaddleNLP (which silently keeps the "
                    "later one): inconsistent checkpoint")
    if biases[0] is not None:
        state["mlm_bias.bias"] = biases[0]

    dec = "cls.predictions.decoder.weight"
    if cfg.tie_embeddings:
        if src.has(dec):  # the tied word table saved a second time
            head = src.take(dec, [v, h])
            word = state.get("embed.word.weight")
            if head is not None and word is not None and not np.array_equal(np.asarray(head), np.asarray(word)):
                src.problem(f"{dec} ({src.where(dec)}) differs from {PREFIX}embeddings.word_embeddings.weight, but "
                            "tie_word_embeddings is true (PaddleNLP would silently use the decoder copy as the input "
                            "embedding too): inconsistent checkpoint")
    else:
        head = src.take(dec, [v, h])  # TransposedLinear: [vocab, hidden], logits = x @ W^T
        if head is not None:
            state["lm_head.proj.weight"] = np.ascontiguousarray(np.asarray(head).T)


def from_canonical(state: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """PaddleNLP ErnieForMaskedLM tensors from our canonical state (already checked against `cfg`)."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size

    def bias(canon, width):
        return state[canon] if cfg.bias else np.zeros([width], np.float32)

    e = PREFIX + "embeddings."
    out = {e + "word_embeddings.weight": state["embed.word.weight"],
           e + "position_embeddings.weight": state["embed.pos.weight"],
           e + "layer_norm.weight": state["embed.norm.weight"], e + "layer_norm.bias": state["embed.norm.bias"]}
    if cfg.type_vocab_size > 0:
        out[e + "token_type_embeddings.weight"] = state["embed.token_type.weight"]
    if cfg.task_type_vocab_size > 0:
        out[e + "task_type_embeddings.weight"] = state["embed.task_type.weight"]
    for i in range(cfg.num_layers):
        p, c = f"{PREFIX}encoder.layers.{i}.", f"layers.{i}."
        for ours, theirs, width in (("attn.q_proj", "self_attn.q_proj", h), ("attn.k_proj", "self_attn.k_proj", h),
                                    ("attn.v_proj", "self_attn.v_proj", h), ("attn.o_proj", "self_attn.out_proj", h),
                                    ("mlp.up_proj", "linear1", f), ("mlp.down_proj", "linear2", h)):
            out[f"{p}{theirs}.weight"] = state[f"{c}{ours}.weight"]
            out[f"{p}{theirs}.bias"] = bias(f"{c}{ours}.bias", width)
        for ours, theirs in (("attn_norm", "norm1"), ("mlp_norm", "norm2")):
            out[f"{p}{theirs}.weight"] = state[f"{c}{ours}.weight"]
            out[f"{p}{theirs}.bias"] = state[f"{c}{ours}.bias"]
    out["cls.predictions.transform.weight"] = state["mlm_head.dense.weight"]
    out["cls.predictions.transform.bias"] = state["mlm_head.dense.bias"]
    out["cls.predictions.layer_norm.weight"] = state["mlm_head.norm.weight"]
    out["cls.predictions.layer_norm.bias"] = state["mlm_head.norm.bias"]
    out["cls.predictions.decoder_bias"] = state["mlm_bias.bias"]  # both names, as save_pretrained writes them
    out["cls.predictions.decoder.bias"] = state["mlm_bias.bias"]
    out["cls.predictions.decoder.weight"] = (state["embed.word.weight"] if cfg.tie_embeddings
                                             else np.ascontiguousarray(state["lm_head.proj.weight"].T))
    return out


def find_wordpiece_vocab(ckpt_dir: str) -> str | None:
    """The WordPiece `vocab.txt` of a PaddleNLP (ERNIE/BERT) directory, if it has one."""
    path = os.path.join(ckpt_dir, VOCAB_FILE)
    return path if os.path.isfile(path) else None


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except ValueError as err:
        raise UnsupportedConfig(f"{path}: not valid JSON ({err})") from err


def write_tokenizer(tokenizer_dir: str, out_dir: str, cfg: ModelConfig) -> dict:
    """Put a tokenizer beside an exported ERNIE; returns config.json fields (the special ids).

    A directory with `vocab.txt` is a PaddleNLP WordPiece tokenizer (an imported ERNIE's own):
    its files are copied as they are. Anything else is our SentencePiece tokenizer, written as
    `tokenizer_files.py` does (PaddleNLP loads it as a plain SentencePiece `LlamaTokenizer`,
    without ERNIE's [CLS]/[SEP] wrapping). Either way the tokenizer's padding id must be the
    model's `pad_token_id` (it decides the zeroed embedding and PaddleNLP's default mask)."""
    if not find_wordpiece_vocab(tokenizer_dir):
        from llmtrain.interop.tokenizer_files import write_tokenizer_files

        ids = write_tokenizer_files(tokenizer_dir, out_dir, cfg.vocab_size)
        if ids.get("pad_token_id", cfg.pad_token_id) != cfg.pad_token_id:
            raise UnsupportedConfig(f"tokenizer {tokenizer_dir}: padding id {ids['pad_token_id']} but "
                                    f"model.pad_token_id={cfg.pad_token_id}")
        ids["pad_token_id"] = cfg.pad_token_id
        return ids
    tok_cfg = _read_json(os.path.join(tokenizer_dir, "tokenizer_config.json"))
    cls_name = tok_cfg.get("tokenizer_class")
    if cls_name is not None and cls_name not in WORDPIECE_CLASSES:
        raise UnsupportedConfig(f"{tokenizer_dir}/tokenizer_config.json: tokenizer_class={cls_name!r}; we copy "
                                f"WordPiece tokenizers only ({', '.join(WORDPIECE_CLASSES)})")
    with open(os.path.join(tokenizer_dir, VOCAB_FILE), encoding="utf-8") as fh:
        vocab = [line.rstrip("\n") for line in fh]  # id = line number, as PaddleNLP's load_vocabulary
    added = _read_json(os.path.join(tokenizer_dir, "added_tokens.json"))
    size = max([len(vocab) - 1, *added.values()]) + 1
    if size > cfg.vocab_size:
        raise UnsupportedConfig(f"{tokenizer_dir}/{VOCAB_FILE}: {size} tokens but the model's embedding has only "
                                f"{cfg.vocab_size} rows")
    specials = {**_read_json(os.path.join(tokenizer_dir, "special_tokens_map.json")), **tok_cfg}
    pad = specials.get("pad_token", "[PAD]")
    pad = pad.get("content") if isinstance(pad, dict) else pad
    token_ids = {tok: i for i, tok in enumerate(vocab)}  # a repeated token keeps its last line, as PaddleNLP's
    pad_id = token_ids.get(pad, added.get(pad))
    if pad_id != cfg.pad_token_id:
        raise UnsupportedConfig(f"{tokenizer_dir}/{VOCAB_FILE}: padding token {pad!r} has id {pad_id} but "
                                f"model.pad_token_id={cfg.pad_token_id}")
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(tokenizer_dir, name)):
            shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(out_dir, name))
    if cls_name is None:  # AutoTokenizer needs the class; an old directory may not name it
        tok_cfg["tokenizer_class"] = "ErnieTokenizer"
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
            json.dump(tok_cfg, fh, indent=2, ensure_ascii=False)
    return {"pad_token_id": pad_id}
