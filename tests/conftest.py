import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # the brute-force oracles in tests/reference.py
os.environ.setdefault("HF_HUB_OFFLINE", "1")
