"""Progress bars on stderr (tqdm), for import, the demo and compaction.

Shown when stderr is a terminal, or when forced (``--progress``); otherwise
a bar that draws nothing, so callers update it the same way either way.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO


def bar_shown(force: bool = False, file: TextIO | None = None) -> bool:
    """Whether ``progress_bar`` with these arguments draws (a total that
    costs a pass over the input is worth reading only then)."""
    return force or (file if file is not None else sys.stderr).isatty()


def progress_bar(total: int | None, desc: str, unit: str, force: bool = False, file: TextIO | None = None) -> Any:
    """A ``tqdm`` bar of ``total`` ``unit`` (None: unknown); call ``update(n)`` and ``close()``."""
    from tqdm import tqdm

    stream = file if file is not None else sys.stderr
    shown = bar_shown(force, stream)
    return tqdm(total=total, desc=desc, unit=unit, file=stream, disable=not shown, mininterval=0.1, dynamic_ncols=True)
