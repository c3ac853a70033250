"""Loaded by every process of a `benchmarks/collective_trace.py` launch (this folder goes first on PYTHONPATH):
times each collective a rank calls through Paddle's Python process-group methods and each `Tensor.backward`,
and writes them to $LLMTRAIN_TRACE_OUT/rank<r>_<pid>.json when the process ends (also through `os._exit`,
which a finished CPU job uses). Collectives issued from C++ (DataParallel's gradient reducer) are not seen.
Inactive unless LLMTRAIN_TRACE_OUT is set and the process is a launched rank (PADDLE_TRAINER_ID)."""
import os

if os.environ.get("LLMTRAIN_TRACE_OUT") and os.environ.get("PADDLE_TRAINER_ID") is not None:
    import atexit
    import json
    import time

    EVENTS: list = []  # ("collective", method, elements, t0, t1) / ("backward", "", None, t0, t1), perf_counter s
    METHODS = ("all_reduce", "reduce", "broadcast", "all_gather", "barrier", "reduce_scatter", "send", "recv",
               "all_gather_into_tensor", "reduce_scatter_tensor", "scatter", "gather")

    def _timed(kind, name, orig):
        def call(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = orig(self, *args, **kwargs)
            first = args[0] if args else None
            n = int(first.numel()) if kind == "collective" and hasattr(first, "numel") else None
            EVENTS.append((kind, name, n, t0, time.perf_counter()))
            return out
        return call

    def _install():
        import paddle
        from paddle.base import core

        for cls in (core.ProcessGroup, core.ProcessGroupGloo):
            for name in METHODS:
                if name in cls.__dict__:
                    setattr(cls, name, _timed("collective", name, cls.__dict__[name]))
        paddle.Tensor.backward = _timed("backward", "", paddle.Tensor.backward)

    def _dump():
        path = os.path.join(os.environ["LLMTRAIN_TRACE_OUT"],
                            f"rank{os.environ['PADDLE_TRAINER_ID']}_{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump(EVENTS, f)

    _install()
    atexit.register(_dump)
    _os_exit = os._exit

    def _exit(code):
        try:
            _dump()
        finally:
            _os_exit(code)

    os._exit = _exit
