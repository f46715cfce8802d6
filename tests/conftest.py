import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # the brute-force oracles in tests/reference.py
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """The tiny models gain nothing from intra-op threads, and on a busy 2-core machine spinning threads slow them
    down many times over."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
