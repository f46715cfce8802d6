"""Importing the library has no global effects: no plotting library, no task library, no backend switch."""

import subprocess
import sys


def test_import_loads_neither_matplotlib_nor_reasoning_gym():
    code = ("import sys, oblr_trl; "
            "print(sorted(m for m in ('matplotlib', 'matplotlib.pyplot', 'reasoning_gym') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
