"""Vision-language models (Qwen3-VL, Qwen2.5-VL): images in, text out (see README)."""
