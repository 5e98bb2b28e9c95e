"""Logging for every process the server starts (the CLI, uvicorn's workers, the engine processes): one format."""
from __future__ import annotations

import logging


def configure_logging(level: str) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
