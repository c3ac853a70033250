"""Bookkeeping for the CPU stand-ins: every replaced Paddle attribute goes through `replace()`.

Use (inside a stand-in module):

    from .patching import original, replace
    replace(paddle_module_or_class, "name", my_function)
    original(paddle_module_or_class, "name")   # the Paddle object we replaced

`replace` refuses to patch the same attribute twice (install() is idempotent one level up),
keeps the original so a stand-in can delegate to it (static-graph branches, GPU-only
options), and `installed()` lists what was replaced, e.g. for a startup log line.
"""

from __future__ import annotations

from typing import Any

# (id(owner), name) -> (owner, name, original object)
_PATCHES: dict[tuple[int, str], tuple[Any, str, Any]] = {}


def _qualname(owner: Any, name: str) -> str:
    prefix = getattr(owner, "__module__", None)
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}.{name}"
    return f"{getattr(owner, '__name__', prefix)}.{name}"


def replace(owner: Any, name: str, new: Any) -> None:
    """Set `owner.name = new`, remembering the previous value."""
    key = (id(owner), name)
    if key in _PATCHES:
        raise RuntimeError(f"{_qualname(owner, name)} is already patched")
    # For classes read the raw __dict__ entry so properties/staticmethods are kept as is.
    if isinstance(owner, type) and name in owner.__dict__:
        old = owner.__dict__[name]
    else:
        old = getattr(owner, name)
    _PATCHES[key] = (owner, name, old)
    setattr(owner, name, new)


def original(owner: Any, name: str) -> Any:
    """The object `replace(owner, name, ...)` replaced."""
    return _PATCHES[(id(owner), name)][2]


def installed() -> list[str]:
    """Fully qualified names of every replaced attribute, in installation order."""
    return [_qualname(owner, name) for owner, name, _ in _PATCHES.values()]
