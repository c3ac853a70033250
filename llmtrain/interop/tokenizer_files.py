"""Our SentencePiece tokenizer, written so that PaddleNLP's `AutoTokenizer` loads it too.

    from llmtrain.interop.tokenizer_files import write_tokenizer_files
    ids = write_tokenizer_files("tokenizers/zh-32k", "out/", model_vocab_size=32768)
    # then: paddlenlp.transformers.AutoTokenizer.from_pretrained("out/")

Our tokenizer directory is `tokenizer.model` (SentencePiece) + `tokenizer_meta.json`
(`llmtrain/tokenizer`). PaddleNLP's `LlamaTokenizer` is a plain SentencePiece tokenizer
that reads `sentencepiece.bpe.model`, and `AutoTokenizer` picks it from
`tokenizer_class` in `tokenizer_config.json`; so we write both our files (our
`load_tokenizer` keeps working on the output) and PaddleNLP's. `add_bos_token` is
false because our pretraining never prepends `<s>` (documents are separated by
`<eod>`), so PaddleNLP's `encode` gives the ids our `encode` gives. config.json's bos/eos/pad ids are the
shipped tokenizer's (or, when none is shipped, the ones the checkpoint recorded), the tokenizer files name its
bos/eos/pad/unk pieces, and every export checks the two against each other (`special_id_problems`). The same
files are
written for GPT exports: PaddleNLP's GPT tokenizers are byte-level BPE (vocab.json +
merges.txt) and cannot hold a SentencePiece model, so a GPT export also names
`LlamaTokenizer`, which is only a SentencePiece wrapper.
"""
from __future__ import annotations

import json
import os
import shutil

from llmtrain.interop.keys import UnsupportedConfig

PADDLENLP_SP_FILE = "sentencepiece.bpe.model"  # LlamaTokenizer.resource_files_names["vocab_file"]


def write_tokenizer_files(tokenizer_path: str, out_dir: str, model_vocab_size: int) -> dict:
    """Copy our tokenizer into `out_dir` with PaddleNLP's tokenizer files; returns the special ids for config.json
    (`special_token_ids`)."""
    from llmtrain.tokenizer import META_FILE, MODEL_FILE, Tokenizer, load_tokenizer

    tok = load_tokenizer(tokenizer_path)
    if not isinstance(tok, Tokenizer):
        raise UnsupportedConfig(f"tokenizer {tokenizer_path} is not SentencePiece ({type(tok).__name__}): a PaddleNLP "
                                "directory carries a SentencePiece model here; export with --format hf (which copies "
                                "tokenizer.json) or pass --tokenizer with a SentencePiece directory")
    if tok.sp_vocab_size > model_vocab_size:
        raise UnsupportedConfig(f"tokenizer {tok.model_file} has {tok.sp_vocab_size} pieces but the model's "
                                f"embedding has only {model_vocab_size} rows")
    shutil.copyfile(tok.model_file, os.path.join(out_dir, MODEL_FILE))
    shutil.copyfile(tok.model_file, os.path.join(out_dir, PADDLENLP_SP_FILE))
    src_dir = os.path.dirname(str(tok.model_file))
    for extra in (META_FILE, "tokenizer.vocab"):
        if os.path.isfile(os.path.join(src_dir, extra)):
            shutil.copyfile(os.path.join(src_dir, extra), os.path.join(out_dir, extra))

    write_special_token_files(out_dir, tok, "LlamaTokenizer")
    return special_token_ids(tok)


SPECIAL = ("bos", "eos", "pad", "unk")
"""The special tokens an export names in the tokenizer files (`<k>_token`)."""
CONFIG_IDS = ("bos", "eos", "pad")
"""Those whose id config.json carries (`<k>_token_id`, the fields models and generation read; published configs
carry no unk id: the tokenizer files name it)."""


def special_token_ids(tok) -> dict:
    """{`bos_token_id`, `eos_token_id`, `pad_token_id`} of a loaded tokenizer (those it has)."""
    ids = {f"{k}_token_id": getattr(tok, f"{k}_id", None) for k in CONFIG_IDS}
    return {k: int(v) for k, v in ids.items() if v is not None}


def recorded_token_ids(identity: dict | None) -> dict:
    """The same ids from a checkpoint's recorded tokenizer identity (its manifest's `tokenizer.special_ids`): the
    tokenizer the run trained with, when no tokenizer directory is shipped."""
    recorded = (identity or {}).get("special_ids") or {}
    return {f"{k}_token_id": int(recorded[k]) for k in CONFIG_IDS if recorded.get(k) is not None}


def write_special_token_files(out_dir: str, tok, tokenizer_class: str) -> list[str]:
    """tokenizer_config.json (naming `tokenizer_class`, no bos/eos added by encode: our pretraining prepends none)
    and special_tokens_map.json with the pieces of `tok`'s special ids; returns the files written."""
    special = {f"{k}_token": tok.id_to_piece(getattr(tok, f"{k}_id")) for k in SPECIAL
               if getattr(tok, f"{k}_id", None) is not None}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": tokenizer_class, "add_bos_token": False, "add_eos_token": False, **special},
                  f, indent=2, ensure_ascii=False)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump(special, f, indent=2, ensure_ascii=False)
    return ["tokenizer_config.json", "special_tokens_map.json"]


def special_id_problems(out_dir: str, config: dict) -> list[str]:
    """Where config.json's `<k>_token_id` disagree with the tokenizer shipped in `out_dir`: the tokenizer's own ids
    and the pieces its tokenizer_config.json / special_tokens_map.json name (empty: they agree, or no tokenizer)."""
    from llmtrain.tokenizer import load_tokenizer

    names = {}
    for fname in ("special_tokens_map.json", "tokenizer_config.json"):
        path = os.path.join(out_dir, fname)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                names.update({k: v.get("content") if isinstance(v, dict) else v for k, v in json.load(f).items()})
    try:
        tok = load_tokenizer(out_dir)
    except (OSError, ValueError):
        return []  # no tokenizer shipped: the ids came from the checkpoint's record
    problems = []
    for k in SPECIAL:
        have, want = getattr(tok, f"{k}_id", None), config.get(f"{k}_token_id")
        if want is not None and have is not None and have != want:
            problems.append(f"config.json {k}_token_id={want} but the shipped tokenizer's {k} id is {have}")
        i, where = (want, f"config.json {k}_token_id={want}") if want is not None else (have, f"its {k} id {have}")
        piece = names.get(f"{k}_token")
        if i is not None and isinstance(piece, str) and tok.id_to_piece(i) != piece:
            problems.append(f"{where} is {tok.id_to_piece(i)!r} in the shipped tokenizer, but its tokenizer files "
                            f"name {piece!r} as {k}_token")
    return problems


def find_tokenizer_model(ckpt_dir: str) -> str | None:
    """The SentencePiece model of a checkpoint directory, if it has one (ours or PaddleNLP's name)."""
    for name in ("tokenizer.model", PADDLENLP_SP_FILE):
        path = os.path.join(ckpt_dir, name)
        if os.path.isfile(path):
            return path
    return None
