"""The one Paddle release llmtrain's uses of Paddle internals were read against, and the check that enforces it.

    from llmtrain.paddle_compat.version import check_paddle_version
    check_paddle_version()          # raises RuntimeError on any other Paddle version

Every private Paddle name llmtrain touches (listed in `llmtrain.paddle_compat.AUDIT`)
was read in exactly this release. Another release may move, rename or fix them; using
them there would silently change semantics, so llmtrain refuses instead.
"""

from __future__ import annotations

import paddle

TESTED_PADDLE_VERSION = "3.3.1"


def check_paddle_version(version: str | None = None) -> None:
    """Raise RuntimeError unless `version` (default: `paddle.__version__`) is the tested one."""
    found = paddle.__version__ if version is None else version
    if found != TESTED_PADDLE_VERSION:
        raise RuntimeError(
            f"llmtrain uses Paddle internals read in paddlepaddle=={TESTED_PADDLE_VERSION}, but "
            f"paddle.__version__ is {found!r}. The CPU stand-ins (fleet mp_ops, pipeline p2p, gloo group "
            f"creation, group-sharded constructors) and the GPU path's private accesses (optimizer "
            f"_grad_clip, ZeRO-3 _param2buffer, mp_ops._c_identity, is_firstly_shared) differ between "
            f"releases. Install paddlepaddle(-gpu)=={TESTED_PADDLE_VERSION}, or re-audit every entry of "
            f"llmtrain.paddle_compat.AUDIT against {found} and update TESTED_PADDLE_VERSION."
        )


_CHECKED = False


def require_tested_paddle() -> None:
    """`check_paddle_version()` once per process (every accessor of a Paddle internal calls it)."""
    global _CHECKED
    if not _CHECKED:
        check_paddle_version()
        _CHECKED = True
