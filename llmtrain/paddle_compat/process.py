"""End a finished job's process the way the installed backend needs.

    exit_process(0)      # last call of an entry script, after every output is closed

On CPU with the stand-ins installed, Paddle 3.3.1 occasionally crashes with SIGSEGV
while the interpreter tears down gloo process groups and the pipeline channel threads
(seen in about 1 of 30 four-process tp2 x pp2 launches: the launcher then reports exit
code 245 for a run that finished and wrote everything), so such a process ends with
`os._exit` after flushing. Anywhere else (GPU jobs) this is a no-op and Python exits
normally.
"""
from __future__ import annotations


def exit_process(code: int = 0) -> None:
    from llmtrain.paddle_compat import cpu_backend

    if not cpu_backend.is_installed():
        return
    import logging
    import os
    import sys

    cpu_backend.stop_pipeline_channels()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
