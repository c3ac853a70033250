"""The real PaddleFormers 1.2.0, as a worker process that the tests talk to (it runs in the environment of
scripts/paddleformers_env.sh, whose numpy 1.26 / transformers 5.3 cannot be imported next to llmtrain's).

    "$(bash scripts/paddleformers_env.sh)" tests/paddleformers_worker.py   # one JSON request per stdin line, one reply each
    # driven by tests/paddleformers_ref.py: pf_make(...), pf_logits(dir, ids), pf_encode(dir, texts)

Requests (`op`):
- `make`: a random `Ernie4_5ForCausalLM` (kind dense) or `Ernie4_5_MoeForCausalLM` (kind moe) of `config` (fields of
  PaddleFormers' Ernie4_5Config / Ernie4_5_MoeConfig; fuse_rms_norm false, the math attention), its RMSNorm weights
  moved off 1 and the MoE correction bias off 0 (`seed`), written with `save_pretrained(dir)` (its default format);
  with `tokenizer` (a SentencePiece .model) also an `Ernie4_5Tokenizer` made from it (`from_pretrained` of a
  directory holding it as tokenizer.model), written with its save_pretrained.
- `logits`: `from_pretrained(dir)` (fuse_rms_norm false, math attention), eval, logits of the ids in the .npy file
  `ids` written to the .npy file `out` (float32). Models are cached per directory.
- `lora_logits`: as `logits`, with `LoRAModel.from_pretrained(model, lora)` (PaddleFormers' adapter directory) on a
  model loaded for this request alone (LoRAModel rewrites the model it wraps; the cached one stays the base).
- `encode`: `AutoTokenizer.from_pretrained(dir)` ids of each text, without special tokens.
Every reply is one JSON line on the real stdout ({"ok": true, ...} or {"ok": false, "error": traceback}); whatever
PaddleFormers prints goes to stderr.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import traceback

REPLY = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # library prints go to stderr, replies alone to the real stdout

import numpy as np  # noqa: E402
import paddle  # noqa: E402

_MODELS: dict = {}


def _quiet():
    from paddleformers.utils.log import logger

    logger.set_level("ERROR")


def make(req: dict) -> dict:
    from paddleformers.transformers import (Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM, Ernie4_5Config,
                                            Ernie4_5ForCausalLM)

    moe = req["kind"] == "moe"
    conf = dict(fuse_rms_norm=False, use_flash_attention=False, **req["config"])
    cfg = (Ernie4_5_MoeConfig if moe else Ernie4_5Config)(**conf)
    paddle.seed(req.get("seed", 0))
    model = (Ernie4_5_MoeForCausalLM if moe else Ernie4_5ForCausalLM)(cfg)
    rng = np.random.default_rng(req.get("seed", 0))
    with paddle.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.set_value((1.0 + 0.2 * rng.standard_normal(p.shape)).astype("float32"))
            elif name.endswith("e_score_correction_bias"):
                p.set_value((0.15 * rng.standard_normal(p.shape)).astype("float32"))
            elif req.get("scale"):
                p.set_value(p.numpy() * float(req["scale"]))
    model.save_pretrained(req["dir"])
    files = sorted(os.listdir(req["dir"]))
    if req.get("tokenizer"):
        from paddleformers.transformers import Ernie4_5Tokenizer

        with tempfile.TemporaryDirectory() as tmp:  # from a bare tokenizer.model, as a -PT release could ship it
            shutil.copyfile(req["tokenizer"], os.path.join(tmp, "tokenizer.model"))
            tok = Ernie4_5Tokenizer.from_pretrained(tmp, add_bos_token=False, add_eos_token=False)
            tok.save_pretrained(req["dir"])  # tokenizer.json + tokenizer.model + tokenizer_config.json
    return {"files": files, "params": {n: list(p.shape) for n, p in model.named_parameters()}}


def _load(directory: str):
    """A new `from_pretrained(directory)` model (fuse_rms_norm false, math attention), in eval mode."""
    from paddleformers.transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory)
    config.fuse_rms_norm, config.use_flash_attention = False, False  # the CPU path (the fused norm is GPU-only)
    model = AutoModelForCausalLM.from_pretrained(directory, config=config, dtype="float32")
    model.eval()
    return model


def _model(directory: str):
    """The cached model of `directory` (never handed to LoRAModel, which rewrites its layers in place)."""
    key = (directory, os.path.getmtime(os.path.join(directory, "config.json")))
    if key not in _MODELS:
        _MODELS[key] = _load(directory)
    return _MODELS[key]


def logits(req: dict) -> dict:
    ids = np.load(req["ids"])
    with paddle.no_grad():
        out = _model(req["dir"])(paddle.to_tensor(ids.astype("int64")))
    np.save(req["out"], out.logits.astype("float32").numpy())
    return {"shape": list(out.logits.shape)}


def lora_logits(req: dict) -> dict:
    from paddleformers.peft import LoRAModel

    with paddle.no_grad():
        # a model of its own: LoRAModel swaps the base's linears for LoRA layers in place, so a cached base would
        # give every later `logits` request of this directory the adapted model
        model = LoRAModel.from_pretrained(_load(req["dir"]), req["lora"])
        model.eval()
        out = model(paddle.to_tensor(np.load(req["ids"]).astype("int64")))
    np.save(req["out"], out.logits.astype("float32").numpy())
    return {"shape": list(out.logits.shape)}


def encode(req: dict) -> dict:
    from paddleformers.transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(req["dir"])
    return {"ids": [tok(t, add_special_tokens=False)["input_ids"] for t in req["texts"]],
            "class": type(tok).__name__}


def main() -> None:
    paddle.set_device("cpu")
    _quiet()
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            reply = {"ok": True, **{"make": make, "logits": logits, "lora_logits": lora_logits,
                                    "encode": encode}[req["op"]](req)}
        except Exception:  # the client raises it with the traceback
            reply = {"ok": False, "error": traceback.format_exc()}
        REPLY.write(json.dumps(reply) + "\n")
        REPLY.flush()


if __name__ == "__main__":
    main()
