"""Supervised fine-tuning (loss on response tokens only), any parallel layout, from a PaddleNLP
checkpoint or one of ours.

    python -m paddle.distributed.launch --nproc_per_node 2 llmtrain/finetune.py +parallel=dp2 \
        model.init_from=PADDLENLP_OR_STEP_DIR data.files=[chat.jsonl] data.tokenizer=TOKENIZER_DIR

The recipe is pretraining's with `conf/finetune.yaml` as the root config and `SFTData` batches.
"""
from __future__ import annotations

if __package__ in (None, ""):
    import _bootstrap  # noqa: F401  (run as a file: the repository's package, not this folder's modules)

import hydra

from llmtrain.config import model_preset_named, refuse_unknown_keys, register_configs, to_config
from llmtrain.train.entry import run_entry

register_configs()


def finetune(dcfg) -> dict:
    """Run fine-tuning for a composed Hydra config; returns the last metrics record."""
    from llmtrain.data.sft import SFTData
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
        data = build_data(SFTData, run, topo)  # prompt/response records, loss on responses only
        return Trainer(run, topo, data).fit()  # model + plan + optimizer + AMP + checkpoints -> the loop


@hydra.main(version_base="1.3", config_path="../conf", config_name="finetune")
def main(dcfg) -> None:
    run_entry(finetune, dcfg)


if __name__ == "__main__":
    refuse_unknown_keys("finetune")  # train.max_step=10 or +train.max_step=10: exit 2 naming train.max_steps
    main()
