"""edge: LLM inference for NVIDIA Jetson Orin."""

__version__ = "0.1.0"
