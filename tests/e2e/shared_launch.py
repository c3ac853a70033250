"""One launch per fleet layout for the end-to-end runs of several test files.

    from shared_launch import join, shared
    join("tp2", "ernie", build)      # at import; build(dir, tiny_corpus) -> (run_many entries, info)
    info = shared("tp2", "ernie", tiny_corpus, tmp_path_factory)      # in a fixture: after the launch

Every run of one launch shares its fleet topology and batch layout (global and micro batch: llmtrain's
`init_distributed` refuses a second layout in one process). Pytest imports every collected test module before it
runs any test, so the first fixture that asks for a layout builds the inputs of every module that joined it and
runs all their entries in one `run_many` launch (tests/e2e/multirun_worker.py); the others read their results. A
file run alone launches only its own runs. A failed launch fails every participant with the same error, without
launching again. Each participant still checks its own run in its own test. A participant that joins with
`last=True` (at most one per layout) has its entries run after every other's: an entry script run in place
(tests/e2e/run_script.py) ends the process.
"""
from __future__ import annotations

from typing import Callable

from launch import run_many

NPROC = {"tp2": 2, "dp2": 2, "pp2": 2, "ep2": 2}
_JOINED: dict[str, dict[str, Callable]] = {}
_LAST: dict[str, str] = {}
_DONE: dict[str, dict | Exception] = {}


def join(layout: str, name: str, build: Callable, last: bool = False) -> None:
    """Take part in `layout`'s launch: build(directory, tiny_corpus) -> (entries for run_many, info for `shared`);
    last=True: these entries run after every other participant's."""
    assert layout in NPROC, f"no shared launch for layout {layout!r} (known: {sorted(NPROC)})"
    if last:
        assert _LAST.setdefault(layout, name) == name, f"{layout}: both {_LAST[layout]} and {name} must run last"
    _JOINED.setdefault(layout, {})[name] = build


def shared(layout: str, name: str, tiny_corpus: dict, tmp_path_factory):
    """`name`'s info once `layout`'s launch (of every participant collected) has finished."""
    if layout not in _DONE:
        root = tmp_path_factory.mktemp(f"shared_{layout}")
        infos, entries = {}, []
        try:
            for who, build in sorted(_JOINED[layout].items(), key=lambda item: item[0] == _LAST.get(layout)):
                runs, infos[who] = build(root / who, tiny_corpus)
                entries += runs
            run_many(entries, nproc=NPROC[layout], workdir=root)
        except Exception as e:  # every participant fails with it, without building or launching again
            _DONE[layout] = e
            raise
        _DONE[layout] = infos
    if isinstance(_DONE[layout], Exception):
        raise _DONE[layout]
    return _DONE[layout][name]
