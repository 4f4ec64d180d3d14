"""The training script's path, checked before any rank starts (and before the command line imports torch)."""

from __future__ import annotations

import os

from gradsync.core.settings import ConfigError


def check_script(script: str) -> None:
    """Refuse a script path that names no file, before any rank starts (python would fail in every rank)."""
    if not os.path.isfile(script):
        raise ConfigError(f"{script}: no such file: give the path of the training script")
