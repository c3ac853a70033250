"""Train a SentencePiece tokenizer for Chinese pretraining.

    python -m llmtrain.tokenizer.train --input PATH [PATH ...] --vocab-size N --output DIR \\
        [--model-type bpe|unigram] [--pre-segment jieba] [--json-key text]

Inputs are anything :mod:`llmtrain.corpus.sources` reads (jsonl/txt/parquet, .gz/.zst,
folders, globs, HF datasets); bad records are counted and reported, never fatal
(unless ``--strict``). Writes ``DIR/tokenizer.model``, ``DIR/tokenizer.vocab``
(piece and score per line, for reading) and ``DIR/tokenizer_meta.json`` (how it was
made: command, inputs with sizes and sha256, every trainer option, sizes, time). Inputs without a usable line
(empty, or every record bad) stop it with status 1, naming the files and the bad records, writing nothing.

Trainer settings: byte fallback (no ``<unk>`` ever: emoji and rare CJK become UTF-8
byte pieces), digits split one per token, character coverage 0.9995 (the value
SentencePiece recommends for CJK), identity normalisation with no dummy prefix and
no whitespace collapsing (so decode(encode(t)) == t), the space symbol always in
the vocabulary, special pieces ``<pad>``=0 ``<unk>``=1 ``<s>``=2 ``</s>``=3 and the
control pieces ``<mask>``=4 ``<eod>``=5 (control pieces never come out of
``encode``, so a literal "<eod>" in a document cannot split it). The vocabulary
the model sees is padded to a multiple of 128 (``Tokenizer.vocab_size``).

Large inputs: at most ``--max-sentences`` lines (default 2M) are kept by
SentencePiece's reservoir sampling over the whole stream, lines longer than
``--max-sentence-bytes`` are cut at sentence ends. ``--pre-segment jieba`` segments
each line with jieba and forbids pieces that cross a word boundary (SentencePiece's
``pretokenization_delimiter``; encoding needs no segmentation afterwards).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path

from llmtrain.corpus.badrecords import BadRecords
from llmtrain.corpus.documents import iter_documents
from llmtrain.corpus.parse import ParseOptions
from llmtrain.corpus.sources import expand_inputs
from llmtrain.tokenizer import META_FILE, MODEL_FILE, PAD_MULTIPLE, SPECIAL_PIECES, load_tokenizer
from llmtrain.utils.files import sha256_file

_SENT_END = re.compile(r"(?<=[。！？!?；;])")
_DELIM = "\x1f"  # pre-segmentation word delimiter (ASCII unit separator)


def split_long(line: str, max_bytes: int) -> list[str]:
    """Cut a line into pieces of at most ``max_bytes`` UTF-8 bytes, preferring sentence ends."""
    if len(line.encode("utf-8")) <= max_bytes:
        return [line]
    out, cur, cur_n = [], [], 0
    for sent in _SENT_END.split(line):
        n = len(sent.encode("utf-8"))
        if cur and cur_n + n > max_bytes:
            out.append("".join(cur))
            cur, cur_n = [], 0
        while n > max_bytes:  # one sentence too long: cut by characters (max 4 bytes each)
            k = max_bytes // 4
            out.append(sent[:k])
            sent = sent[k:]
            n = len(sent.encode("utf-8"))
        cur.append(sent)
        cur_n += n
    if cur:
        out.append("".join(cur))
    return [s for s in out if s]




def _no_documents(inputs, sources, stats: dict, bad: BadRecords) -> str:
    """The error of a corpus without a usable line: the files, what was read, the bad records by kind."""
    files = ", ".join(s.path for s in sources) or ", ".join(inputs)
    return (f"tokenizer training failed: no text to train on in {files} ({stats['documents']} documents, "
            f"{stats['lines']} non-blank lines); nothing was written\n{bad.report()}")


def train(inputs: list[str], vocab_size: int, output: str, model_type: str = "bpe",
          pre_segment: str | None = None, json_key: str = "text", text_mode: str = "line",
          character_coverage: float = 0.9995, max_sentences: int = 2_000_000,
          max_sentence_bytes: int = 8192, threads: int | None = None, seed: int = 0,
          strict: bool = False, name: str | None = None, command: str | None = None) -> dict:
    """Train and write a tokenizer directory; return its metadata."""
    import sentencepiece as spm

    out = Path(output)  # created once a model is trained: a failed training leaves no empty directory
    sources, skipped = expand_inputs(inputs)
    bad = BadRecords(strict=strict)
    stats = {"documents": 0, "lines": 0, "bytes": 0}
    if pre_segment not in (None, "jieba"):
        raise ValueError(f"--pre-segment {pre_segment!r}: only 'jieba' is supported")
    if pre_segment == "jieba":
        import jieba

        jieba.setLogLevel(60)

    def sentences():
        for doc in iter_documents(inputs, ParseOptions(json_key, text_mode), bad):
            stats["documents"] += 1
            for line in doc.text.split("\n"):
                if not line.strip():
                    continue
                for piece in split_long(line, max_sentence_bytes):
                    stats["lines"] += 1
                    stats["bytes"] += len(piece.encode("utf-8"))
                    if pre_segment == "jieba":
                        piece = _DELIM.join(w for w in jieba.lcut(piece.replace(_DELIM, " ")) if w)
                    yield piece

    options = dict(
        model_type=model_type, vocab_size=vocab_size, character_coverage=character_coverage,
        byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        add_dummy_prefix=False, remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        required_chars="\u2581", pad_id=0, unk_id=1, bos_id=2, eos_id=3,
        pad_piece=SPECIAL_PIECES["pad"], unk_piece=SPECIAL_PIECES["unk"], bos_piece=SPECIAL_PIECES["bos"],
        eos_piece=SPECIAL_PIECES["eos"], control_symbols=[SPECIAL_PIECES["mask"], SPECIAL_PIECES["eod"]],
        input_sentence_size=max_sentences, shuffle_input_sentence=True,
        max_sentence_length=max_sentence_bytes, num_threads=threads or os.cpu_count() or 1,
        pretokenization_delimiter=_DELIM if pre_segment else "",
    )
    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    t0 = time.time()
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=sentences(), model_writer=model, minloglevel=2,
                                       **options)
    except RuntimeError as e:
        msg = str(e)
        if stats["documents"] == 0 or "sentences_.empty()" in msg:
            raise SystemExit(_no_documents(inputs, sources, stats, bad)) from None
        if "too high" in msg:
            raise SystemExit(f"tokenizer training failed: {msg.split(']')[-1].strip()}\n"
                             f"The corpus is too small for --vocab-size {vocab_size} {model_type} pieces: "
                             f"lower --vocab-size or give more text.") from None
        if "required_chars" in msg or "Vocabulary size" in msg:
            raise SystemExit(f"tokenizer training failed: {msg.split(']')[-1].strip()}\n"
                             f"The corpus needs more distinct characters than --vocab-size {vocab_size} "
                             f"leaves room for (256 byte pieces and 6 special pieces are included): raise "
                             f"--vocab-size or lower --character-coverage ({character_coverage}).") from None
        raise
    seconds = time.time() - t0
    if stats["documents"] == 0:
        raise SystemExit(_no_documents(inputs, sources, stats, bad))
    out.mkdir(parents=True, exist_ok=True)
    (out / MODEL_FILE).write_bytes(model.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    with open(out / "tokenizer.vocab", "w", encoding="utf-8") as f:
        for i in range(sp.get_piece_size()):
            f.write(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n")
    n = sp.get_piece_size()
    meta = {
        "format": "llmtrain-tokenizer/1",
        "name": name or out.resolve().name,
        "model_file": MODEL_FILE,
        "model_type": model_type,
        "sp_vocab_size": n,
        "pad_multiple": PAD_MULTIPLE,
        "vocab_size": -(-n // PAD_MULTIPLE) * PAD_MULTIPLE,
        "special_pieces": {k: [p, sp.piece_to_id(p)] for k, p in SPECIAL_PIECES.items()},
        "pre_segment": pre_segment,
        "json_key": json_key,
        "text_mode": text_mode,
        "inputs": [{"path": s.path, "format": s.fmt, "compression": s.compression,
                    **({"bytes": os.path.getsize(s.path), "sha256": sha256_file(s.path)}
                       if os.path.isfile(s.path) else {})} for s in sources],
        "skipped_files": skipped,
        "training_data": {**stats, "bad_records": bad.to_dict()},
        "trainer": {k: v for k, v in options.items() if k != "num_threads"},
        "seed": seed,
        "sentencepiece_version": spm.__version__,
        "train_seconds": round(seconds, 2),
        "command": command,
    }
    (out / META_FILE).write_text(json.dumps(meta, ensure_ascii=False, indent=2) + "\n")
    # fertility on a sample of the training documents (what one token is worth)
    tok = load_tokenizer(out)
    sample = [d.text for _, d in zip(range(1000), iter_documents(inputs, ParseOptions(json_key, text_mode)))]
    ids = tok.encode_batch(sample)
    ntok = sum(map(len, ids))
    meta["chars_per_token"] = round(sum(map(len, sample)) / max(ntok, 1), 4)
    meta["unk_tokens_in_sample"] = sum(i.count(tok.unk_id) for i in ids)
    (out / META_FILE).write_text(json.dumps(meta, ensure_ascii=False, indent=2) + "\n")
    meta["bad_report"] = bad.report()
    return meta


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="corpus files, folders, globs or hf:BUILDER:GLOB")
    p.add_argument("--vocab-size", type=int, required=True, help="number of SentencePiece pieces to learn")
    p.add_argument("--output", required=True, help="tokenizer directory to write")
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--pre-segment", choices=["jieba"], default=None,
                   help="segment lines with jieba; pieces never cross a word boundary")
    p.add_argument("--json-key", default="text", help="text field of jsonl / column of parquet and HF datasets")
    p.add_argument("--text-mode", choices=["line", "para"], default="line",
                   help="plain text: one document per line, or blank-line separated")
    p.add_argument("--character-coverage", type=float, default=0.9995)
    p.add_argument("--max-sentences", type=int, default=2_000_000,
                   help="lines kept by reservoir sampling (0 = all)")
    p.add_argument("--max-sentence-bytes", type=int, default=8192)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default=None, help="tokenizer name (default: the output folder name)")
    p.add_argument("--strict", action="store_true", help="stop at the first bad record")
    a = p.parse_args(argv)
    if a.vocab_size < 300:
        p.error(f"--vocab-size {a.vocab_size}: must be at least 300 (256 byte pieces + specials + characters)")
    command = "python -m llmtrain.tokenizer.train " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))
    meta = train(a.input, a.vocab_size, a.output, a.model_type, a.pre_segment, a.json_key, a.text_mode,
                 a.character_coverage, a.max_sentences, a.max_sentence_bytes, a.threads, a.seed, a.strict,
                 a.name, command)
    td = meta["training_data"]
    print(f"{a.output}: {meta['model_type']} tokenizer, {meta['sp_vocab_size']} pieces, vocab_size "
          f"{meta['vocab_size']} (padded to {PAD_MULTIPLE}); trained on {td['documents']} documents, "
          f"{td['lines']} lines, {td['bytes'] / 1e6:.1f} MB in {meta['train_seconds']:.1f} s; "
          f"{meta['chars_per_token']} characters/token\n{meta['bad_report']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
