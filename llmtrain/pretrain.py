"""Pretrain a language model with any data/tensor/pipeline/sharding layout.

    python -m paddle.distributed.launch --nproc_per_node 2 llmtrain/pretrain.py +parallel=dp2
    python llmtrain/pretrain.py model=llama-tiny train.max_steps=50       # one device
    python -m paddle.distributed.launch --nproc_per_node 2 llmtrain/pretrain.py model=ernie-tiny +parallel=tp2  # masked LM

The recipe, top to bottom: config -> layout check -> tokenizer -> distributed
-> data -> model + parallel plan + optimizer -> resume -> loop (step, metrics,
eval, checkpoints) -> final checkpoint and loss curve.
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a file: import the repo's package, not siblings of this file
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    sys.path.insert(0, os.path.dirname(_here))

import hydra

from llmtrain.config import check_config, register_configs, to_config

register_configs()


def pretrain(dcfg) -> dict:
    """Run pretraining for a composed Hydra config; returns the last metrics record.

    The objective follows `model.family`: next-token batches (`PretrainData`) for decoders,
    masked-LM batches (`MLMData`, `data.masking`: whole-word by default) for encoders."""
    from llmtrain.data.loader import PretrainData
    from llmtrain.data.mlm import MLMData

    return run(dcfg, MLMData if dcfg.model.family == "encoder" else PretrainData)


def run(dcfg, data_cls) -> dict:
    """The recipe, shared with `llmtrain/finetune.py` (which passes `SFTData`)."""
    import paddle

    from llmtrain.checkpoint.manager import Checkpointer
    from llmtrain.models.size import flops_per_token
    from llmtrain.parallel.layout import check_model_fits, resolve_layout
    from llmtrain.parallel.plan import build_for_layout
    from llmtrain.parallel.strategy import init_distributed, world_size_from_env
    from llmtrain.run_setup import fit_vocab, import_initial_state, prepare_run_dir
    from llmtrain.tokenizer import load_tokenizer
    from llmtrain.train.amp import AmpPlan
    from llmtrain.train.loop import train_loop
    from llmtrain.train.peak import peak_flops

    cfg = to_config(dcfg)
    # 1. values, degrees and batch arithmetic: checked before any work
    check_config(cfg)
    layout = resolve_layout(cfg.parallel, cfg.train, world_size_from_env())
    # 2. tokenizer fixes the vocabulary; the model must fit the layout
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    fit_vocab(cfg.model, tokenizer)
    family = cfg.model.family  # the objective (data_cls) follows it
    initial_state = import_initial_state(cfg)  # PaddleNLP checkpoint given by model.init_from, or None
    check_same_family(cfg.model, family)
    check_model_fits(layout, cfg.model)
    amp = AmpPlan.from_config(cfg.train.amp)
    # 3. processes, groups, CPU stand-ins
    topo = init_distributed(layout, cfg.seed)
    paddle.seed(cfg.seed)
    prepare_run_dir(cfg, dcfg, topo)
    # 4. this data rank's batches of the layout-independent global order
    data = data_cls(
        cfg.data, seed=cfg.seed, global_batch_size=layout.global_batch, micro_batch_size=layout.micro_batch,
        dp_rank=topo.data_rank, dp_world=topo.data_world, tokenizer=tokenizer,
    )
    # 5. model, parallel plan, optimizer
    built = build_for_layout(cfg, layout, topo, amp, initial_state)
    # 6. resume from the newest complete checkpoint (any layout)
    ckpt = Checkpointer(cfg, layout, topo, built, data, tokenizer)
    state = ckpt.resume()
    # 7. the loop
    return train_loop(
        cfg, layout, topo, built, data, ckpt, amp, state,
        flops_per_token=flops_per_token(cfg.model, cfg.data.seq_len),
        peak=peak_flops(cfg.train.peak_tflops),
    )


def check_same_family(model_cfg, family: str) -> None:
    """A checkpoint imported by model.init_from must be of the preset's family (which chose the objective)."""
    if model_cfg.family != family:
        from llmtrain.parallel.layout import ConfigError

        example = "ernie-tiny" if model_cfg.family == "encoder" else "gpt-tiny"
        raise ConfigError([f"model.init_from={model_cfg.init_from} is a {model_cfg.family} checkpoint but the model "
                           f"preset is a {family}: choose a {model_cfg.family} preset (e.g. model={example}) so "
                           "the objective matches"])


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(dcfg) -> None:
    pretrain(dcfg)
    from llmtrain.parallel import cpu_backend

    cpu_backend.exit_process(0)  # CPU gloo jobs: skip a teardown that can crash after the work is done


if __name__ == "__main__":
    main()
