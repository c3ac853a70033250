"""Supervised fine-tuning (loss on response tokens only), any parallel layout, from a PaddleNLP
checkpoint or one of ours.

    python -m paddle.distributed.launch --nproc_per_node 2 llmtrain/finetune.py +parallel=dp2 \
        model.init_from=PADDLENLP_OR_STEP_DIR data.files=[chat.jsonl] data.tokenizer=TOKENIZER_DIR

Same config groups and launch as `llmtrain/pretrain.py`; the root is
`conf/finetune.yaml`, whose `data` group is `llmtrain.data.sft.SFTDataConfig`.
The recipe is pretraining's (`llmtrain.pretrain.run`) with `SFTData` batches.
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a file: import the repo's package, not siblings of this file
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    sys.path.insert(0, os.path.dirname(_here))

import hydra

from llmtrain.config import register_configs

register_configs()


def finetune(dcfg) -> dict:
    """Run fine-tuning for a composed Hydra config; returns the last metrics record."""
    from llmtrain.data.sft import SFTData
    from llmtrain.pretrain import run

    return run(dcfg, SFTData)


@hydra.main(version_base="1.3", config_path="../conf", config_name="finetune")
def main(dcfg) -> None:
    finetune(dcfg)
    from llmtrain.parallel import cpu_backend

    cpu_backend.exit_process(0)  # CPU gloo jobs: skip a teardown that can crash after the work is done


if __name__ == "__main__":
    main()
