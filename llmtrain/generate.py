"""Generate text from one of our checkpoints or a PaddleNLP directory: greedy or top-p, KV cache, one device.

    python -m llmtrain.generate --model outputs/RUN/checkpoints/step_100 --prompt "人民日报的总部在哪里？"
    python -m llmtrain.generate --model PADDLENLP_DIR --tokenizer TOKENIZER_DIR --prompt "..." \\
        --top-p 0.9 --temperature 0.8 --seed 1 --max-new-tokens 64 [--chat]

--model takes a `step_<N>` directory or a run directory (the newest complete checkpoint;
a LoRA checkpoint is merged with its base, see `llmtrain.export`), or a PaddleNLP GPT/Llama
directory. The tokenizer is ours (SentencePiece; the run's `data.tokenizer`, or --tokenizer,
or the one exported into a PaddleNLP directory). `--chat` renders the prompt as fine-tuning
does (`<bos><|user|>\\n...<|assistant|>\\n`) so a fine-tuned model sees what it learned from.

Decoding: the prompt runs once (prefill), filling each block's key/value cache; then one
position per step attends to the cache. Greedy takes the arg-max; top-p samples from the
smallest set of tokens whose probability reaches p (after `--temperature`), with a seeded
generator. Stops at the tokenizer's eos or after --max-new-tokens. One device only: tensor or
pipeline parallel generation is not implemented.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Optional

import numpy as np
import paddle

from llmtrain.utils.cli import ArgumentParser
from llmtrain.utils.log import log0


def load_model(path: str, trusted: bool = False):
    """(model in eval mode, ModelConfig, tokenizer path or None) from our checkpoint or a PaddleNLP directory
    (`llmtrain.checkpoint.reader.read_model`; a LoRA checkpoint's adapters merged into its base)."""
    from llmtrain.checkpoint.reader import read_model
    from llmtrain.models import build_model
    from llmtrain.models.init import load_full_state
    from llmtrain.models.stages import canonical_parameters

    ckpt = read_model(path, trusted=trusted)
    log0(f"generate: reading {ckpt.manifest.describe()} from {ckpt.manifest.path}" if ckpt.manifest is not None
         else f"generate: reading the PaddleNLP model {path}")
    cfg = ckpt.config
    if cfg.family != "decoder":
        raise ValueError(f"{path}: a {cfg.family} model; generation needs a decoder (GPT, Llama)")
    model = build_model(cfg)
    load_full_state(canonical_parameters(model), ckpt.state, source=path)
    model.eval()
    return model, cfg, ckpt.tokenizer


def _top_p(logits: np.ndarray, top_p: float, temperature: float, rng: np.random.Generator) -> int:
    z = logits.astype(np.float64) / max(temperature, 1e-6)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    cum = np.cumsum(probs[order])
    keep = order[: int(np.searchsorted(cum, top_p) + 1)]  # the smallest prefix whose mass reaches top_p
    return int(rng.choice(keep, p=probs[keep] / probs[keep].sum()))


@paddle.no_grad()
def generate(model, prompt_ids: list[int], max_new_tokens: int, eos_id: Optional[int] = None, top_p: float = 0.0,
             temperature: float = 1.0, seed: int = 0, use_cache: bool = True) -> list[int]:
    """The generated token ids (without the prompt). top_p == 0: greedy. use_cache=False recomputes the
    whole sequence every step (a reference for the cache)."""
    rng = np.random.default_rng(seed)
    limit = model.cfg.max_position_embeddings
    if len(prompt_ids) + max_new_tokens > limit:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) > the model's "
                         f"max_position_embeddings ({limit})")
    ids = list(prompt_ids)
    cache = [dict() for _ in model.layers] if use_cache else None
    inp = paddle.to_tensor([ids], dtype="int64")  # [1, s]
    pos = paddle.arange(len(ids), dtype="int64")[None]  # [1, s]
    out = []
    for _ in range(max_new_tokens):
        logits = model(inp, position_ids=pos, cache=cache)  # [1, s, V]
        last = logits[0, -1].astype("float32").numpy()  # [V]
        nxt = int(last.argmax()) if top_p <= 0 else _top_p(last, top_p, temperature, rng)
        out.append(nxt)
        ids.append(nxt)
        if eos_id is not None and nxt == eos_id:
            break
        if use_cache:
            inp = paddle.to_tensor([[nxt]], dtype="int64")  # [1, 1]
            pos = paddle.to_tensor([[len(ids) - 1]], dtype="int64")
        else:
            inp = paddle.to_tensor([ids], dtype="int64")
            pos = paddle.arange(len(ids), dtype="int64")[None]
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = ArgumentParser(prog="python -m llmtrain.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="step_<N> or run directory, or a PaddleNLP directory")
    parser.add_argument("--prompt", default=None, help="text (needs a tokenizer)")
    parser.add_argument("--ids", default=None, help="prompt as comma-separated token ids instead of text")
    parser.add_argument("--tokenizer", default=None, help="our tokenizer directory (default: the model's)")
    parser.add_argument("--chat", action="store_true", help="render the prompt as a user turn, as fine-tuning does")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling mass; 0: greedy (default)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print {prompt_ids, ids, text} as JSON")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.model):
        print(f"generate: --model {args.model}: no such directory (give a step_<N> or run directory of ours, or a "
              "PaddleNLP model directory)", file=sys.stderr)
        return 2
    from llmtrain.errors import CheckpointReadError
    from llmtrain.interop import CheckpointMismatch, UnsupportedConfig

    try:
        model, cfg, tok_path = load_model(args.model)
        tok = None
        if args.tokenizer or tok_path:
            from llmtrain.tokenizer import load_tokenizer

            tok = load_tokenizer(args.tokenizer or tok_path)
    except (CheckpointReadError, UnsupportedConfig, CheckpointMismatch, OSError, ValueError) as e:
        print(f"generate: {e}", file=sys.stderr)  # one message, no traceback
        return 2
    if args.ids is not None:
        prompt_ids = [int(x) for x in args.ids.split(",") if x.strip()]
    elif args.prompt is not None:
        if tok is None:
            print("generate: --prompt needs a tokenizer (--tokenizer DIR)", file=sys.stderr)
            return 2
        if args.chat:
            from llmtrain.data.sft import render

            prompt_ids = render([("user", args.prompt)], tok)[0] + tok.encode("<|assistant|>\n")
        else:
            prompt_ids = [tok.bos_id] + tok.encode(args.prompt)
    else:
        print("generate: give --prompt or --ids", file=sys.stderr)
        return 2
    out = generate(model, prompt_ids, args.max_new_tokens, eos_id=tok.eos_id if tok is not None else None,
                   top_p=args.top_p, temperature=args.temperature, seed=args.seed)
    text = tok.decode([t for t in out if tok is None or t != tok.eos_id]) if tok is not None else None
    if args.json:
        print(json.dumps({"prompt_ids": prompt_ids, "ids": out, "text": text}, ensure_ascii=False))
    else:
        print(text if text is not None else " ".join(map(str, out)))
    log0(f"generated {len(out)} tokens ({'greedy' if args.top_p <= 0 else f'top-p {args.top_p}'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
