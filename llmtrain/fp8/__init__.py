"""FP8 training (`train.fp8` = none | blockwise | tensorwise): recipes, the FP8 GEMMs, their health check.

    python llmtrain/pretrain.py model=llama-tiny train.fp8=blockwise
    python -m pytest tests/fp8 -q

- `recipe.py`: tiles, formats, scales and the quantisation (Paddle's casts to float8_e4m3fn / float8_e5m2);
- `linear.py`: `FP8Gemm`, the forward and both backward GEMMs of a linear or of the stacked experts, emulated on
  CPU (quantise, dequantise, fp32 GEMM) or through Paddle's FP8 kernels on a GPU (`paddle_compat/fp8_kernels.py`);
- `health.py`: `FP8Health`, non-finite amaxes caught before the saturating cast (the divergence guard reads it);
- `apply.py`: `apply_fp8(model, recipe)`, which layers compute in FP8 (the transformer's linears and experts);
- `emulate.py`: `train.fp8_emulate`, one process quantising as the ranks of a tp / sp / cp layout do;
- `cache.py`: `WeightCache`, each weight's FP8 copies made once per optimizer step (`train.fp8_weight_cache`).
"""
