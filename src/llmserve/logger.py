"""One logger configuration for the package."""

from __future__ import annotations

import logging

from llmserve import envs

_configured = False


def get_logger(name: str) -> logging.Logger:
    global _configured
    if not _configured:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s",
                                               datefmt="%H:%M:%S"))
        root = logging.getLogger("llmserve")
        root.addHandler(handler)
        root.setLevel(envs.LLMSERVE_LOG_LEVEL.upper())
        root.propagate = False
        _configured = True
    return logging.getLogger(name)
