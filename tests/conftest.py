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


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server on loopback (moto), one for the session (moto's state is the process's),
    with the bucket ``kvz-test``: its endpoint URL."""
    pytest.importorskip("s3fs")
    import contextlib

    import s3fs
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    fs = s3fs.S3FileSystem(key="test", secret="test", client_kwargs={"endpoint_url": endpoint})
    with contextlib.suppress(FileExistsError):
        fs.mkdir("kvz-test")
    yield endpoint
    server.stop()
