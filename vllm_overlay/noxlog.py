"""What the noxfile leaves out of nox's log (standard library only).

nox looks for uv before every session and, when there is none, logs
``uv binary not found.``. No session here uses uv (the CPU environment is a
plain pip virtualenv, the others use venv), so that line says nothing a
user can act on.
"""

from __future__ import annotations

import logging

UV_NOTE = "uv binary not found."


class _DropUvNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != UV_NOTE


def drop_uv_note(logger: logging.Logger) -> None:
    """Leave nox's ``uv binary not found.`` out of ``logger`` (nox's own
    logger, ``logging.getLogger("nox")``); every other line stays."""
    if not any(isinstance(f, _DropUvNote) for f in logger.filters):
        logger.addFilter(_DropUvNote())
