"""Progress bars on stderr (tqdm), for import, the demo and compaction.

Shown when stderr is a terminal, or when forced (``--progress``); otherwise
a bar that draws nothing, so callers update it the same way either way.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO


def progress_bar(total: int, desc: str, unit: str, force: bool = False, file: TextIO | None = None) -> Any:
    """A ``tqdm`` bar of ``total`` ``unit``; call ``update(n)`` and ``close()``."""
    from tqdm import tqdm

    stream = file if file is not None else sys.stderr
    shown = force or stream.isatty()
    return tqdm(total=total, desc=desc, unit=unit, file=stream, disable=not shown, mininterval=0.1, dynamic_ncols=True)
