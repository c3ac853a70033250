"""The Paddle version the CPU backend was written against, and the check that enforces it.

Use:

    from llmtrain.parallel.cpu_backend.version import check_paddle_version
    check_paddle_version()          # raises RuntimeError on any other Paddle version

Every stand-in in this package replaces a private Paddle function whose signature,
call sites and module layout we read in exactly this release. A different release may
move or rename them, or fix the GPU-only pieces itself; running our replacements there
would silently change semantics, so we refuse instead.
"""

from __future__ import annotations

import paddle

TESTED_PADDLE_VERSION = "3.3.1"


def check_paddle_version(version: str | None = None) -> None:
    """Raise RuntimeError unless `version` (default: `paddle.__version__`) is the tested one."""
    found = paddle.__version__ if version is None else version
    if found != TESTED_PADDLE_VERSION:
        raise RuntimeError(
            f"llmtrain.parallel.cpu_backend was written and tested against "
            f"paddlepaddle=={TESTED_PADDLE_VERSION}, but paddle.__version__ is {found!r}. "
            f"Its stand-ins replace private Paddle functions (fleet mp_ops, pipeline p2p, "
            f"gloo group creation, group-sharded constructors) whose code differs between "
            f"releases. Install paddlepaddle=={TESTED_PADDLE_VERSION} to train on CPU, or "
            f"re-audit every patch in llmtrain/parallel/cpu_backend/ against {found} and "
            f"update TESTED_PADDLE_VERSION."
        )
