"""qwen_image."""
