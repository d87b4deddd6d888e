"""qwen_image_edit: Qwen-Image-Edit (image + instruction -> image) on the Qwen-Image transformer."""
