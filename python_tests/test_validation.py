"""The shared boundary checks of dllm_fast.validation."""

import pytest
import torch

from dllm_fast.validation import (GREEDY_BELOW_TEMPERATURE, check_binary_mask, check_same_device, check_temperature,
                                  check_threshold)


def test_check_same_device_names_meta_and_strays():
    cpu = torch.zeros(2)
    assert check_same_device("op", a=cpu, b=None, c=cpu) == torch.device("cpu")
    with pytest.raises(ValueError, match="op: b is on the meta device and holds no data"):
        check_same_device("op", a=cpu, b=cpu.to("meta"))
    with pytest.raises(TypeError, match="op: b must be a torch.Tensor, got list"):
        check_same_device("op", a=cpu, b=[1])
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"op: b is on cuda:0 but a on cpu; move it with .to\(a.device\)"):
            check_same_device("op", a=cpu, b=cpu.cuda())


def test_check_temperature_defines_the_extremes():
    assert check_temperature("T", 0) == 0.0 and check_temperature("T", 0.7) == 0.7
    assert check_temperature("T", GREEDY_BELOW_TEMPERATURE / 2) == 0.0 == check_temperature("T", 5e-324)
    assert check_temperature("T", GREEDY_BELOW_TEMPERATURE) == GREEDY_BELOW_TEMPERATURE
    for bad in (float("inf"), float("nan"), -0.5, True):
        with pytest.raises(ValueError, match="T=.* must be"):
            check_temperature("T", bad)


def test_check_threshold_is_a_half_open_unit_interval():
    assert check_threshold("t", 1) == 1.0
    for bad in (0.0, 1.01, float("nan")):
        with pytest.raises(ValueError, match=r"t=.* must be .*in \(0.0, 1.0\]"):
            check_threshold("t", bad)


def test_check_binary_mask_takes_bool_or_integer_zero_one():
    mask = torch.tensor([[0, 1, 1]])
    assert check_binary_mask("m", mask, shape=(1, 3), device=torch.device("cpu")).dtype == torch.bool
    assert check_binary_mask("m", mask.bool(), shape=(1, 3), device="cpu").tolist() == [[False, True, True]]
    with pytest.raises(TypeError, match="m has dtype torch.float32; it must be bool or an integer dtype"):
        check_binary_mask("m", mask.float(), shape=(1, 3), device="cpu")
    with pytest.raises(ValueError, match=r"m\[0, 2\] = -1; a mask holds only 0"):
        check_binary_mask("m", torch.tensor([[0, 1, -1]]), shape=(1, 3), device="cpu")
    with pytest.raises(ValueError, match=r"m has shape \(1, 3\), expected \(3,\)"):
        check_binary_mask("m", mask, shape=(3,), device="cpu")
