"""The packages of oblr-trl's ``demo`` extra (reasoning-gym, matplotlib, gguf), imported where used.

``pip install oblr-trl`` installs what the trainer needs; the demo's tasks, plots and the real model's GGUF file need
``pip install -e ".[demo]"`` from a clone (the package is not on PyPI). A helper used without them says so, naming
the extra.
"""

from __future__ import annotations

import importlib


def require(module: str, package: str, what: str):
    """``module`` imported, or an ImportError saying that ``what`` needs ``package`` and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{what} needs {package}, in oblr-trl's demo extra: pip install -e \".[demo]\" from your clone of "
            f"oblr-trl, or pip install {package}."
        ) from e
