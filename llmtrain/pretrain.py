"""Pretrain a language model with any data/tensor/pipeline/sharding layout.

    python -m paddle.distributed.launch --nproc_per_node 2 llmtrain/pretrain.py +parallel=dp2
    python llmtrain/pretrain.py model=llama-tiny train.max_steps=50       # one device
    python -m paddle.distributed.launch --nproc_per_node 2 llmtrain/pretrain.py model=ernie-tiny +parallel=tp2  # masked LM

The recipe: config -> distributed -> tokenizer and data -> model, plan, optimizer -> loop.
The objective follows the model preset's family: next-token batches (`PretrainData`) for
decoders, masked-LM batches (`MLMData`, `data.masking`: whole-word by default) for encoders.
"""
from __future__ import annotations

if __package__ in (None, ""):
    import _bootstrap  # noqa: F401  (run as a file: the repository's package, not this folder's modules)

import hydra

from llmtrain.config import model_preset_named, refuse_unknown_keys, register_configs, to_config
from llmtrain.train.entry import run_entry

register_configs()


def pretrain(dcfg) -> dict:
    """Run pretraining for a composed Hydra config; returns the last metrics record."""
    from llmtrain.data.loader import PretrainData
    from llmtrain.data.mlm import MLMData
    from llmtrain.parallel.strategy import init_distributed
    from llmtrain.plan.auto import choose_layout
    from llmtrain.resolve import resolve
    from llmtrain.train.rundir import claim_run_dir
    from llmtrain.train.trainer import Trainer, build_data
    from llmtrain.utils.log import run_log

    with run_log() as log:  # rank 0's log lines, also in <run.dir>/llmtrain.log once it is claimed
        # +parallel=auto -> the planner's layout; then every derived value and every problem, before any work; frozen
        run = resolve(choose_layout(to_config(dcfg)), model_named=model_preset_named())
        claim_run_dir(run)  # run.overwrite=true: rank 0 moves the old run aside (never deletes it) before any work
        log.open(run.cfg.run.dir)
        topo = init_distributed(run.layout, run.cfg.seed)  # process groups (CPU stand-ins on CPU)
        data = build_data(MLMData if run.objective == "encoder" else PretrainData, run, topo)  # tokenizer from resolve
        return Trainer(run, topo, data).fit()  # model + plan + optimizer + AMP + checkpoints -> the loop


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(dcfg) -> None:
    run_entry(pretrain, dcfg)


if __name__ == "__main__":
    refuse_unknown_keys("config")  # train.max_step=10 or +train.max_step=10: exit 2 naming train.max_steps
    main()
