import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Every process a test starts (a script, the notebook's kernel, a launched run) gets one intra-op thread, as this one
# (`one_thread`): two threads on two cores that something else is also using run the real model's matmuls several
# times slower than one.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


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
