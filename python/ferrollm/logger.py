"""The ``ferrollm`` logger's default set-up, as vLLM does for ``vllm``: INFO and above to stderr,
so start-up reports (where the time went, the memory held) are seen without configuring logging.

``FERROLLM_LOGGING_LEVEL`` (or vLLM's ``VLLM_LOGGING_LEVEL``) sets the level;
``FERROLLM_CONFIGURE_LOGGING=0`` (or ``VLLM_CONFIGURE_LOGGING=0``) leaves logging to the
application.
"""

from __future__ import annotations

import logging
import os

__all__ = ["configure_logging", "init_logger"]


def _env(name: str, default: str) -> str:
    return os.environ.get(f"FERROLLM_{name}") or os.environ.get(f"VLLM_{name}") or default


def configure_logging() -> None:
    """Gives the ``ferrollm`` logger a stderr handler, once, unless told not to."""
    if _env("CONFIGURE_LOGGING", "1") == "0":
        return
    logger = logging.getLogger("ferrollm")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(_env("LOGGING_LEVEL", "INFO").upper())
    logger.propagate = False


def init_logger(name: str) -> logging.Logger:
    """The logger `name`, under vLLM's helper name (`vllm.logger.init_logger`) for scripts and
    plugins written against vLLM."""
    return logging.getLogger(name)
