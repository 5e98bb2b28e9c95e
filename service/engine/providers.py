"""The execution providers a model runs on, named once: the settings' short names (`Provider`) as ONNX Runtime
spells them, which of them are GPUs, and OpenVINO's name for itself on the CPU.

A loaded model's `provider` is one of these names: the one ONNX Runtime ran it on (after any fallback), or
`OpenVINO/CPU/<precision>`. The engine, its supervisor, the pixel transport and the model configuration that
/v2 serves (`KIND_GPU` or `KIND_CPU`) all decide by them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pydantic's settings stay out of the runtimes: the peers' venvs compile models without them
    from vitserve.service.ground.settings import Provider

TENSORRT, CUDA, CPU = "TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"
ORT_PROVIDERS: dict[Provider, str] = {"tensorrt": TENSORRT, "cuda": CUDA, "cpu": CPU}
GPU_PROVIDERS = (CUDA, TENSORRT)
OPENVINO_CPU = "OpenVINO/CPU"


def openvino_provider(precision: str) -> str:
    """OpenVINO on the CPU computing in `precision` (fp32, bf16): `OpenVINO/CPU/bf16`."""
    return f"{OPENVINO_CPU}/{precision}"


def runs_on_cpu(provider: str) -> bool:
    """The model computes on the CPU: ONNX Runtime's CPU provider or OpenVINO's CPU plugin."""
    return provider == CPU or provider.startswith(OPENVINO_CPU)
