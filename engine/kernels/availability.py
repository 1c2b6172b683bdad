"""Whether a kernel is usable here: the callers' test before they pick it over their PyTorch fallback."""

from __future__ import annotations

import warnings
from collections.abc import Callable


def builds(load: Callable[[], object], unusable: str) -> bool:
    """Whether `load()` builds and loads its op (or compiles and self-tests its kernel) here; where not, a warning
    (`unusable`, then why) and False."""
    try:
        load()
    except Exception as e:  # no compiler, no ninja, a failed build or self-test: any reason is a reason to fall back
        warnings.warn(f"{unusable}: {e}", stacklevel=3)
        return False
    return True
