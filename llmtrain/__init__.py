"""llmtrain: hybrid-parallel LLM pretraining on PaddlePaddle."""
