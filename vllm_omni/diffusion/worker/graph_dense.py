"""One dense CUDA graph: exact shapes `[B, S, C]`, no padding, captured on first use (cuda_graphs.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_omni.diffusion.models.interface import DenseInputs
from vllm_omni.diffusion.worker.graph_packed import lora_scope
from vllm_omni.lora.batch import LoRABatch
from vllm_omni.lora.layers import LoRAStepState


@dataclass(frozen=True)
class DenseKey:
    """Exact shapes of a dense graph."""

    batch: int
    num_img: int
    num_txt: int
    img_shape: tuple[int, int, int]
    masked: bool

    @classmethod
    def of(cls, inputs: DenseInputs, img_shape: tuple[int, int, int]) -> DenseKey:
        """The key of `inputs`, whose one image grid is `img_shape` (`check_dense`'s answer)."""
        batch, num_img = inputs.hidden_states.shape[:2]
        num_txt = inputs.encoder_hidden_states.shape[1]
        return cls(batch, num_img, num_txt, img_shape, inputs.encoder_hidden_states_mask is not None)


class DenseGraph:
    """One dense shape: static inputs and its captured graph (with LoRA tables: see `PackedGraph`)."""

    def __init__(
        self,
        transformer,
        key: DenseKey,
        device,
        dtype,
        lora_state: LoRAStepState | None = None,
        with_lora: bool = False,
    ):
        cfg = transformer.config
        self.transformer, self.key, self.lora_state = transformer, key, lora_state
        self.img = torch.zeros(key.batch, key.num_img, cfg.in_channels, device=device, dtype=dtype)
        self.txt = torch.zeros(key.batch, key.num_txt, cfg.joint_attention_dim, device=device, dtype=dtype)
        self.mask = (
            torch.ones(key.batch, key.num_txt, dtype=torch.long, device=device) if key.masked else None
        )
        self.timestep = torch.zeros(key.batch, device=device, dtype=dtype)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        self.lora: LoRABatch | None = None
        if with_lora:
            rows = {"img": key.batch * key.num_img, "txt": key.batch * key.num_txt, "seq": key.batch}
            self.lora = LoRABatch.static(rows, key.batch, device)

    def load(self, inputs: DenseInputs, lora: LoRABatch | None = None) -> None:
        """Copy `inputs` (of this graph's key) and the forward's LoRA batch into the static buffers."""
        self.img.copy_(inputs.hidden_states)
        self.txt.copy_(inputs.encoder_hidden_states)
        self.timestep.copy_(inputs.timestep)
        if self.mask is not None:
            self.mask.copy_(inputs.encoder_hidden_states_mask)
        if self.lora is not None:
            self.lora.load(lora)

    def run_eager(self) -> torch.Tensor:
        shapes = [self.key.img_shape] * self.key.batch
        with lora_scope(self.lora_state, self.lora):
            return self.transformer(self.img, self.txt, self.mask, self.timestep, shapes)

    def run(self) -> torch.Tensor:
        if self.graph is None:
            return self.run_eager()
        self.graph.replay()
        return self.out
