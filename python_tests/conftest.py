import os

import pytest
import torch

from dllm_fast.testing import emulation

# Without a GPU the Triton LM-head kernels run in triton's interpreter (python_tests/test_triton_head.py), which
# must be switched on before anything imports triton: triton builds its own library functions in one mode or the
# other when it is imported. With a GPU they compile, and the interpreter's CPU cases skip.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# "emulated_cuda": CPU tensors, with the dllm_fast ops running their CUDA implementations in the host emulator
# (dllm_fast.testing.emulation); those cases carry the emulated_cuda marker and run when DLLM_FAST_EMULATED_CUDA is set.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else []) + [
    pytest.param("emulated_cuda", marks=pytest.mark.emulated_cuda)]


def pytest_configure(config):
    # Under pytest-xdist (the README's `-n auto`) each worker is a process: one intra-op thread each keeps N
    # workers on N cores, not N times torch's default (the tiny presets gain nothing from a second thread).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


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


@pytest.fixture
def generate_recording_unmask_step():
    """`dllm_fast.generate` that also fills `unmask_step` when asked (record_unmask_step=True), recorded from the
    outside: a proxy model keeps the canvas each denoising forward receives, and position i was unmasked by the
    first forward after which it holds a token. For tests of the TraceRL wiring while generate cannot record it
    itself; full-recompute rollouts (cache="none") only, as the proxy needs whole canvases."""
    import dllm_fast

    class CanvasRecorder(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model, self.canvases = model, []

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.model, name)

        @property
        def lm_head_weight(self):
            return self.model.lm_head_weight

        def forward(self, input_ids, *args, **kwargs):
            self.canvases.append(input_ids.clone())
            return self.model(input_ids, *args, **kwargs)

    def generate(model, input_ids, attention_mask=None, config=None, *, record_unmask_step=False, **options):
        settings = {**(vars(config) if config is not None else {}), **options}  # a GenerateConfig, keywords over it
        assert settings.get("cache", "none") == "none" and not settings.get("cfg_scale"), "whole canvases only"
        recorder = CanvasRecorder(model)
        result = dllm_fast.generate(recorder, input_ids, attention_mask, config, **options)
        if record_unmask_step:
            P = result.prompt_length
            canvases = torch.stack([c[:, P:] for c in recorder.canvases[1:]] + [result.completion_ids])
            decoded = canvases != model.mask_token_id  # [forwards, B, G]: after forward k
            result.unmask_step = decoded.long().argmax(0)  # the first forward after which a position holds a token
        return result

    return generate
