"""vllm_omni: a diffusion serving engine with step-wise continuous batching of heterogeneous requests."""

from vllm_omni.inputs import OmniDiffusionSamplingParams

__version__ = "0.1.0"

__all__ = ["Omni", "OmniDiffusionSamplingParams", "__version__"]


def __getattr__(name: str):
    # Omni pulls in torch, diffusers and transformers; import it only when asked for.
    if name == "Omni":
        from vllm_omni.entrypoints.omni import Omni

        return Omni
    raise AttributeError(name)
