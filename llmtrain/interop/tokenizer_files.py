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
`<eod>`), so PaddleNLP's `encode` gives the ids our `encode` gives. The same files are
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
    """Copy our tokenizer into `out_dir` with PaddleNLP's tokenizer files; returns the special ids for config.json."""
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

    def piece(i):
        return None if i is None else tok.id_to_piece(i)

    special = {"bos_token": piece(tok.bos_id), "eos_token": piece(tok.eos_id), "unk_token": piece(tok.unk_id),
               "pad_token": piece(tok.pad_id)}
    special = {k: v for k, v in special.items() if v is not None}
    tokenizer_config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False,
                        **special}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config, f, indent=2, ensure_ascii=False)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump(special, f, indent=2, ensure_ascii=False)
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    return {k: v for k, v in ids.items() if v is not None}


def find_tokenizer_model(ckpt_dir: str) -> str | None:
    """The SentencePiece model of a checkpoint directory, if it has one (ours or PaddleNLP's name)."""
    for name in ("tokenizer.model", PADDLENLP_SP_FILE):
        path = os.path.join(ckpt_dir, name)
        if os.path.isfile(path):
            return path
    return None
