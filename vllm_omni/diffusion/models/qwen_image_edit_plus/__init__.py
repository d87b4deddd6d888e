"""Qwen-Image-Edit-2509 / 2511 (diffusers' `QwenImageEditPlusPipeline`): edits of 1 to N input images."""
