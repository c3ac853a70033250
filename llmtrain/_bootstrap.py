"""Run an entry script as a file (`python llmtrain/pretrain.py ...`, as `paddle.distributed.launch` does).

    if __package__ in (None, ""):
        import _bootstrap  # noqa: F401  (first import of the script)

Python puts the script's directory (`llmtrain/`) first on sys.path, where the
package's own modules (`config`, `data`, `tokenizer`, ...) would shadow libraries
and the `llmtrain` package itself would not be importable. Importing this module
(found there) replaces that entry with the repository root.
"""
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
sys.path.insert(0, os.path.dirname(_here))
