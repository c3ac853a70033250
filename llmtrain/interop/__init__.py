"""Interoperability with PaddleNLP checkpoints (GPT, Llama, Qwen, Mixtral, ERNIE) and Hugging Face-layout
Llama / Qwen2 / Qwen3 / Qwen3-MoE / DeepSeek-V2/V3 ones (`hf_format.py`, `hf_config.py`; `read_paddlenlp_checkpoint`
reads both).

    from llmtrain.interop import read_paddlenlp_checkpoint, write_paddlenlp_checkpoint, write_hf_checkpoint

Reading and writing need only paddle, numpy and safetensors; `paddlenlp` itself is
used by the tests (tests/interop) to prove that the numbers agree.
"""
from llmtrain.interop.hf_format import write_hf_checkpoint
from llmtrain.interop.keys import CheckpointMismatch, UnsupportedConfig
from llmtrain.interop.paddlenlp_format import read_paddlenlp_checkpoint, write_paddlenlp_checkpoint
from llmtrain.interop.tensor_files import CheckpointFileError

__all__ = ["read_paddlenlp_checkpoint", "write_paddlenlp_checkpoint", "write_hf_checkpoint", "CheckpointMismatch",
           "UnsupportedConfig", "CheckpointFileError"]
