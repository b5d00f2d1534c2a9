"""What every command module of the command line shares: JSON output and the
error a person can fix."""

from __future__ import annotations

import json
import sys
from typing import Any


def emit(obj: Any) -> None:
    """Print ``obj`` as one JSON line on stdout."""
    sys.stdout.write(json.dumps(obj, sort_keys=True, ensure_ascii=False) + "\n")
    sys.stdout.flush()


class CliError(Exception):
    """A problem the operator can fix; printed without a traceback."""
