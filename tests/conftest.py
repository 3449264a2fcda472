import os

# Triton kernels run on CPU tensors through Triton's interpreter unless a GPU is present (checked without
# importing torch.cuda here: the variable must be set before Triton is first imported).
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("default", max_examples=40, deadline=None)
settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("expensive", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded model (fp32) and tokenizer; converted once per machine."""
    from kvcodec import load_model

    return load_model("smollm2")
