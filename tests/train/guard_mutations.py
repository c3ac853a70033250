"""Plant each fault the guard's fast tests exist to catch, run them, restore the file (not a test: run by hand).

    PYTHONPATH=$PWD python tests/train/guard_mutations.py          # every mutation
    PYTHONPATH=$PWD python tests/train/guard_mutations.py M3       # those whose name starts with M3

Each line printed names a mutation and the fast tests that failed under it; an empty list is a mutation the
tests miss. The source file is restored after each run, also when the run is interrupted.
"""
import subprocess
import sys

M = {
 "M1b AnomalyGuard.before_next_step no-op": ("llmtrain/train/anomaly_guard.py", "        self.windows.before_next_step(data)\n", "        pass\n"),
 "M1 before_next_step no-op": ("llmtrain/train/anomaly_rewind.py", '''        """When the data position is inside a window, jump to its end (windows in order: adjacent ones chain)."""
''', '''        """When the data position is inside a window, jump to its end (windows in order: adjacent ones chain)."""
        return
'''),
 "M2 Meter.rewind keeps tokens": ("llmtrain/train/metrics.py", "        self.tokens_total, self._pending_tokens = tokens_total, 0\n", "        self._pending_tokens = 0\n"),
 "M3 rank-local rewind target": ("llmtrain/checkpoint/resume.py", "            path = self._agree(proposal)\n", "            self._agree(proposal)\n            path = proposal\n"),
 "M4 no fallback on a corrupt target": ("llmtrain/checkpoint/resume.py", "            if on_failure is not None:\n                on_failure(path)\n", "            if on_failure is not None:\n                on_failure(path)\n            return None\n"),
 "M5 abandon_step a no-op": ("llmtrain/paddle_compat/amp.py", "    scaler._optimizer_states = defaultdict(_refresh_optimizer_state)\n", "    pass\n"),
 "M6 overflow rejected as nonfinite grad norm": ("llmtrain/train/anomaly_detect.py", "not math.isfinite(v.grad_norm) and not v.overflow:", "not math.isfinite(v.grad_norm):"),
}
only = sys.argv[1:]
for name, (path, old, new) in M.items():
    if only and not any(name.startswith(o) for o in only): continue
    src = open(path).read()
    assert src.count(old) == 1, (name, src.count(old))
    if name.startswith("M3"):  # rank-local: every rank uses its own listing
        src2 = src.replace("ordered = list(candidates()) if self.topo.rank == 0 else []", "ordered = list(candidates())")
    else:
        src2 = src
    open(path, "w").write(src2.replace(old, new))
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "tests/train/test_guard_fast.py", "-p", "no:cacheprovider"], capture_output=True, text=True)
        failed = [l.split("::")[1].split(" ")[0] for l in r.stdout.splitlines() if l.startswith("FAILED")]
        print(f"{name}: exit {r.returncode}; failed: {failed}", flush=True)
    finally:
        open(path, "w").write(src)
