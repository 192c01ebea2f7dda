import pytest
import torch

from dllm_fast.ops import emulation

# "emulated_cuda": CPU tensors, with the dllm_fast ops running their CUDA implementations in the host emulator
# (dllm_fast.ops.emulation); those cases carry the emulated_cuda marker and run when DLLM_FAST_EMULATED_CUDA is set.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else []) + [
    pytest.param("emulated_cuda", marks=pytest.mark.emulated_cuda)]


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    skip_emulated = pytest.mark.skip(reason=f"emulated CUDA tests are off: set {emulation.ENABLE_VARIABLE}=1 "
                                            "(.ci/emulated_cuda runs them)")
    emulated = emulation.enabled()
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
        if "emulated_cuda" in item.keywords and not emulated:
            item.add_marker(skip_emulated)
        if "emulated_cuda" in item.keywords and "slow_to_emulate" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="too many kernel launches to emulate; a smaller case covers it"))


@pytest.fixture(params=DEVICES)
def device(request):
    if request.param != "emulated_cuda":
        yield torch.device(request.param)
        return
    with emulation.emulated_cuda():
        yield torch.device("cpu")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Tiny shapes run faster on one thread, and do not stall when another process holds a core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
