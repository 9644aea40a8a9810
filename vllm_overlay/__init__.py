"""vllm-moriio-overlay: a maintained patch series for vLLM's MoRIIO connector."""

__version__ = "0.1.0"
