"""The divergence guard's rewind: back to a healthy checkpoint, then past the data that diverged.

    python -m pytest -q tests/train/test_guard_fast.py -k rewind
    rewinder = Rewinder(cfg.train.anomaly, windows)      # windows: SkipWindows, a component of every checkpoint
    target = rewinder.find_target(verdict, ckpt)          # every rank: rank 0 chooses, all verify, older fallback
    step = rewinder.rewind(verdict, target, ckpt, data, meter)
    windows.before_next_step(data)                        # before every step: jump over a skipped window

The target is the newest healthy checkpoint at least `rewind_back_steps` before the anomalous step. Rank 0
alone lists the checkpoint directory and broadcasts its choice (with asynchronous saves and pruning, the ranks'
own listings can differ); every rank verifies its share of the chosen checkpoint's files and all agree; one
that fails is reported and the next older healthy one is tried (`Checkpointer.rewind_target`).

The skipped window is the consumed-sample range [from, to) of the last `skip_batches` global batches ending with
the anomalous one (the ones before the checkpoint were already trained on). Windows are positions in the
layout-free sample order, so they hold under any layout. They are saved in every checkpoint's manifest
(`skip_windows`), and a rewind also writes its window into the target's manifest, so a restart from that or
any older checkpoint of the run directory skips them too (`Trainer.fit` merges the windows every manifest
records).
"""
from __future__ import annotations

from typing import Optional

from llmtrain.train.anomaly import AnomalyConfig, Verdict
from llmtrain.train.anomaly_report import rewind_line, window_skipped_line, windows_waived_line


class SkipWindows:
    """The data windows this run skips (a checkpoint manifest component: `skip_windows`), and those a resume under
    a changed learning rate waived (`skip_windows_waived`: never skipped again by this run)."""

    def __init__(self):
        self.windows: list[tuple[int, int]] = []
        """Sorted [from, to) consumed-sample windows."""
        self.waived: set[tuple[int, int]] = set()

    def state_dict(self) -> dict:
        return {"skip_windows": [list(w) for w in self.windows],
                "skip_windows_waived": [list(w) for w in sorted(self.waived)]}

    def load_state_dict(self, manifest: dict) -> None:
        """Merge the windows a checkpoint recorded (those this process already knows stay)."""
        self.waive(manifest.get("skip_windows_waived") or [])
        self.merge(manifest.get("skip_windows") or [])

    def merge(self, windows) -> None:
        self.windows = sorted({(int(a), int(b)) for a, b in [*self.windows, *windows]} - self.waived)

    def waive(self, windows) -> None:
        self.waived |= {(int(a), int(b)) for a, b in windows}
        self.windows = [w for w in self.windows if w not in self.waived]

    def waive_after_lr_change(self, manifest: dict, lr_now: float, position: int) -> None:
        """A resume whose learning rate in force differs from the checkpoint's takes the divergence for the learning
        rate's, not the data's: the recorded windows are trained on, not skipped (said in the log)."""
        lr_then = ((manifest.get("schedule_in_force") or {}).get("optim") or {}).get("lr")
        if not self.windows or lr_then is None or float(lr_then) == float(lr_now):
            return
        ahead = [w for w in self.windows if w[1] > position]
        self.waive(self.windows)
        if ahead:
            windows_waived_line(lr_then, lr_now, ahead)

    def before_next_step(self, data) -> None:
        """When the data position is inside a window, jump to its end (windows in order: adjacent ones chain)."""
        for start, end in self.windows:
            if start <= data.consumed_samples < end:
                data.load_state_dict(dict(data.state_dict(), consumed_samples=end))
                window_skipped_line(start, end)


class Rewinder:
    """Finds the rewind target, reloads it, and records the window to skip."""

    def __init__(self, cfg: AnomalyConfig, windows: SkipWindows):
        self.cfg, self.windows = cfg, windows
        self.positions: dict = {}
        """step -> (consumed samples before, after) its batch, for the last `skip_batches` steps."""

    def track(self, step: int, samples: tuple[int, int]) -> None:
        """Before each step: where its batch lies in the sample order."""
        self.positions[step] = samples
        for old in [s for s in self.positions if s <= step - self.cfg.skip_batches]:
            del self.positions[old]

    def latest_target_step(self, v: Verdict) -> int:
        """The newest step a rewind for `v` may go back to."""
        return v.step - 1 - self.cfg.rewind_back_steps

    def find_target(self, v: Verdict, ckpt) -> Optional[tuple[int, str]]:
        """(step, path) of the verified rewind target, the same on every rank, or None (a collective)."""
        ckpt.wait()  # async saves: the checkpoint being written counts
        return ckpt.rewind_target(self.latest_target_step(v))

    def window(self, v: Verdict, to_step: int, to_samples: int) -> tuple[int, int]:
        """The samples to skip after reloading the checkpoint of `to_step` (whose data position is `to_samples`)."""
        first = max(v.step - self.cfg.skip_batches + 1, to_step + 1)
        start = self.positions[first][0] if first in self.positions else to_samples
        return max(start, to_samples), self.positions[v.step][1]

    def rewind(self, v: Verdict, target: tuple[int, str], ckpt, data, meter, counts: dict) -> tuple[int, tuple]:
        """Reload `target`, record the window to skip, restart the meter there; returns (its step, the window).
        `counts`: the policy's counters after this rewind (for the log line)."""
        _, path = target
        state = ckpt.load(path)
        window = self.window(v, state.step, data.consumed_samples)
        self.windows.merge([window])
        ckpt.amend_manifest(path, self.windows.state_dict())  # a restart from it skips the window too
        meter.rewind(state.step, state.tokens_total)
        rewind_line(v, state.step, counts["rewinds"], self.cfg.max_rewinds, window)
        return state.step, window
