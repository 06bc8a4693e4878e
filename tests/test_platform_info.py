"""Platform report: versions and device facts, None with a reason for what is missing."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from edge.runtime.platform_info import driver_version, probe_platform


def test_report_on_this_machine() -> None:
    info = probe_platform()
    assert info.torch == torch.__version__ and info.torch_cuda == torch.version.cuda
    bindings = pytest.importorskip("cuda.bindings")
    assert info.cuda_bindings == bindings.__version__
    assert info.cuda_core == pytest.importorskip("cuda.core").__version__
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    assert info.nvrtc == f"{major}.{minor}"
    if not torch.cuda.is_available():
        assert info.device is info.arch is info.sm_count is info.integrated is None
        assert "device" in info.missing and "sm_count" in info.missing
    d = info.as_dict()
    assert set(d) >= {"torch", "cuda_bindings", "cuda_core", "nvrtc", "driver", "arch", "sm_count", "integrated"}


def test_missing_pieces_are_none_with_a_reason() -> None:
    def no_dist(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    def no_driver() -> str:
        return driver_version("libcuda-that-does-not-exist.so.1")

    def broken_nvrtc() -> str:
        raise RuntimeError("the NVRTC library (libnvrtc) could not be loaded")

    info = probe_platform(version=no_dist, driver=no_driver, nvrtc=broken_nvrtc)
    assert info.cuda_bindings is info.cuda_core is info.nvrtc is info.driver is None
    assert info.missing["cuda_bindings"] == "not installed (cuda-bindings or cuda-python)"
    assert info.missing["cuda_core"] == "not installed (cuda-core)"
    assert "libnvrtc" in info.missing["nvrtc"]
    assert "libcuda-that-does-not-exist" in info.missing["driver"]
    assert info.torch == torch.__version__  # the rest still comes out


def test_old_cuda_python_counts_as_bindings() -> None:
    def only_cuda_python(name: str) -> str:
        if name == "cuda-python":
            return "12.4.0"
        raise importlib.metadata.PackageNotFoundError(name)

    assert probe_platform(version=only_cuda_python).cuda_bindings == "12.4.0"


@pytest.mark.cuda
def test_report_on_a_gpu() -> None:
    from cuda.bindings import driver

    info = probe_platform()
    props = torch.cuda.get_device_properties(0)
    assert info.arch == f"sm_{props.major}{props.minor}" and info.sm_count == props.multi_processor_count
    assert info.integrated == bool(props.is_integrated) and info.device == props.name
    err, v = driver.cuDriverGetVersion()
    assert int(err) == 0 and info.driver == f"{v // 1000}.{v % 1000 // 10}"
