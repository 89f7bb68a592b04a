"""The one grammar of device names (`maxsim_cli.devices.parse_device_name`) and what each option takes."""

from __future__ import annotations

import pytest

from maxsim_cli.cuda_early import ordinals
from maxsim_cli.devices import DeviceName, parse_device_name, parse_serve_devices, rank_device
from maxsim_cli.errors import UsageError


def test_every_spelling_parses_once() -> None:
    assert parse_device_name(" CUDA:1 ") == DeviceName("cuda", 1)
    assert parse_device_name("2") == DeviceName("cuda", 2, bare=True)
    assert parse_device_name("cpu:3") == DeviceName("cpu", 3)
    assert parse_device_name("auto") == DeviceName("auto")
    for bad in ("", "gpu", "cuda:x", "cuda:-1", "cuda: 1", "²", "cpu:"):
        assert parse_device_name(bad) is None, bad


def test_each_option_takes_its_part_of_the_grammar() -> None:
    assert parse_serve_devices("0, cuda:1,cpu") == ["cuda:0", "cuda:1", "cpu"]
    with pytest.raises(UsageError, match=r"^--devices gpu: 'gpu' is not a device"):
        parse_serve_devices("gpu")
    assert rank_device("cpu", 3) == "cpu"
    with pytest.raises(UsageError, match="under torchrun each rank uses cuda:LOCAL_RANK"):
        rank_device("cuda:1", 0)
    assert ordinals("cuda:2") == [2] and ordinals("auto", "1,0") == [0, 1]
    assert ordinals("3") == [] and ordinals("auto", "cuda:0") == [] and ordinals("cpu") == []
