"""The client-server API's errors: an HTTP status and the spec's
``{"errcode", "error"}`` body. Handlers raise :class:`MatrixError`; the
resource (``http.py``) turns it into the response."""

from __future__ import annotations

from typing import Any

__all__ = ["MatrixError", "bad_json", "forbidden", "not_found"]


class MatrixError(Exception):
    """A client's mistake, or a refusal, as the spec names it."""

    def __init__(self, status: int, errcode: str, error: str, **extra: Any):
        super().__init__(error)
        self.status = status
        self.errcode = errcode
        self.error = " ".join(str(error).split())  # one line
        self.extra = extra

    def to_json(self) -> dict:
        return {"errcode": self.errcode, "error": self.error, **self.extra}


def forbidden(error: str) -> MatrixError:
    return MatrixError(403, "M_FORBIDDEN", error)


def not_found(error: str) -> MatrixError:
    return MatrixError(404, "M_NOT_FOUND", error)


def bad_json(error: str) -> MatrixError:
    return MatrixError(400, "M_BAD_JSON", error)
