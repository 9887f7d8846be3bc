"""tokpack and the application that calls it share loguru's one logger. datatrove calls
`logger.remove()` (every sink) when it is imported and around each task; an application that
logs with loguru and calls tokpack must keep its sinks. Inside `app_sinks_kept()` a
`logger.remove()` that names no sink removes only the sinks added inside the block, and those
are removed when it ends, so tokpack (and datatrove under it) add and remove only their own.

It lives in the lowest layer that imports datatrove (shuffle/steps.py; packer/ imports it from
here): the format layer imports neither datatrove nor loguru (tests/test_layout.py)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def app_sinks_kept():
    from loguru import logger
    from loguru._logger import Logger  # noqa: PLC2701 (loguru has no public hook to wrap remove)

    # loguru has no public list of sink ids; its core's dict is the one source of truth.
    kept = set(logger._core.handlers)
    original = Logger.remove

    def remove(self, handler_id=None):
        if handler_id is None:
            for hid in list(self._core.handlers):
                if hid not in kept:
                    original(self, hid)
        elif handler_id not in kept:
            original(self, handler_id)

    Logger.remove = remove
    try:
        yield
    finally:
        Logger.remove = original
        for hid in list(logger._core.handlers):
            if hid not in kept:
                with contextlib.suppress(ValueError):
                    logger.remove(hid)
