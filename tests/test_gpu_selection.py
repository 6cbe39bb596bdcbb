"""Which architecture's tables and paths a CUDA device gets, with its capability and torch.version.hip
mocked: Hopper paths (TMA, wgmma, Gluon) only on NVIDIA sm_90, a clear NotImplementedError naming
the GPU for ROCm devices and NVIDIA GPUs before Ampere, never a silent fallback."""

import pytest
import torch

import flashattn2
from cases import randn
from conftest import ON_GPU
from flashattn2.ops.request import modes
from flashattn2.ops import planning

CUDA = torch.device("cuda", 0)


@pytest.fixture
def gpu(monkeypatch):
    """mock(name, capability, hip=None): device 0 reports these from now on (caches emptied)."""

    def mock(name, capability, hip=None):
        monkeypatch.setattr(modes, "_ARCH", {})
        monkeypatch.setattr(modes, "_WGMMA", {})
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.version, "hip", hip)

    return mock


@pytest.mark.parametrize(
    "name, capability, arch, wgmma",
    [
        ("NVIDIA A100-SXM4-80GB", (8, 0), "sm80", False),
        ("NVIDIA Jetson AGX Orin", (8, 7), "sm80", False),
        ("NVIDIA GeForce RTX 3090", (8, 6), "sm86", False),
        ("NVIDIA L40S", (8, 9), "sm86", False),
        ("NVIDIA H200", (9, 0), "sm90", True),
        ("NVIDIA B200", (10, 0), "sm90", False),
        ("NVIDIA GeForce RTX 5090", (12, 0), "sm86", False),
    ],
)
def test_nvidia_gpus(gpu, name, capability, arch, wgmma):
    gpu(name, capability)
    assert planning.arch_of(CUDA) == arch
    assert planning.wgmma(CUDA) is wgmma  # the Gluon (wgmma) kernels: sm_90 only


@pytest.mark.parametrize(
    "name, capability", [("Tesla T4", (7, 5)), ("Tesla V100-SXM2-32GB", (7, 0)), ("Tesla P100-PCIE-16GB", (6, 0))]
)
def test_nvidia_gpus_before_ampere_are_refused(gpu, name, capability):
    gpu(name, capability)
    sm = f"sm_{capability[0]}{capability[1]}"
    for select in (planning.arch_of, planning.wgmma):
        with pytest.raises(NotImplementedError, match=f"8.0 or newer.*{name} is {sm}"):
            select(CUDA)


@pytest.mark.parametrize(
    "name, capability",
    [("AMD Instinct MI300X", (9, 4)), ("AMD Instinct MI250X", (9, 0)), ("AMD Radeon RX 7900 XTX", (11, 0))],
)
def test_rocm_devices_are_refused(gpu, name, capability):
    """MI200/MI300 report a capability that reads like sm_9x: it must not pick the Hopper paths."""
    gpu(name, capability, hip="6.2.41133")
    for select in (planning.arch_of, planning.wgmma):
        with pytest.raises(NotImplementedError, match=f"NVIDIA GPUs.*{name} is a ROCm device"):
            select(CUDA)


def test_override_cannot_bring_back_a_refused_gpu(gpu):
    gpu("Tesla T4", (7, 5))
    with planning.force(arch="sm86"):
        with pytest.raises(NotImplementedError, match="sm_75"):
            planning.arch_of(CUDA)


@pytest.mark.skipif(not ON_GPU, reason="the calls need a CUDA device (the selection is mocked on it)")
@pytest.mark.parametrize(
    "mocked", [("Tesla T4", (7, 5), None), ("AMD Instinct MI300X", (9, 4), "6.2")], ids=["sm75", "rocm"]
)
def test_calls_on_a_refused_gpu_raise_before_any_kernel(gpu, mocked):
    gpu(*mocked)
    # a shape no other test runs: no plan remembered from an earlier call of this process
    q, k, v = (randn(2, 63, 4, 72, dtype=torch.float16, requires_grad=True) for _ in range(3))
    with pytest.raises(NotImplementedError, match=mocked[0]):
        flashattn2.flash_attn_func(q, k, v, causal=True)
    k_cache, v_cache = (torch.zeros(2, 128, 4, 72, device=CUDA, dtype=torch.float16) for _ in range(2))
    with pytest.raises(NotImplementedError, match=mocked[0]):
        flashattn2.flash_attn_with_kvcache(
            q[:, :1].detach(), k_cache, v_cache, k[:, :1].detach(), v[:, :1].detach(), cache_seqlens=3
        )
    assert not k_cache.any() and not v_cache.any()  # nothing was written
