import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """The tiny models gain nothing from intra-op threads, and on a busy 2-core machine spinning threads slow them
    down many times over."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """Each test's trainers start from a fresh Accelerate state. transformers 4.x's TrainingArguments export their
    mixed precision as ACCELERATE_MIXED_PRECISION and never take it back, so one test's bf16 autocast (the CPU
    default) would carry into the next test's bf16=False trainers."""
    saved = os.environ.get("ACCELERATE_MIXED_PRECISION")
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    if saved is None:
        os.environ.pop("ACCELERATE_MIXED_PRECISION", None)
    else:
        os.environ["ACCELERATE_MIXED_PRECISION"] = saved


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test`: two workers, ``--dist loadgroup``) a test module runs whole on one worker, so
    its module fixtures are built once; the modules that launch several processes (marker ``distributed``) run
    together on one worker, one launch at a time, so two launched runs never compete for the cores. Those go first,
    then the modules with end-to-end (``slow``) tests, so that no long module is left for the end of the run."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    group, rank = {}, {}
    for item in items:
        module = item.nodeid.split("::")[0]
        group[item] = "launched" if item.get_closest_marker("distributed") else module
        order = 0 if item.get_closest_marker("distributed") else 1 if item.get_closest_marker("slow") else 2
        rank[group[item]] = min(rank.get(group[item], 2), order)
    items.sort(key=lambda item: rank[group[item]])  # stable: the collection's order within each rank
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group[item]))
