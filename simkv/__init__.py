"""simkv: trace-driven simulator of vLLM-style LLM serving."""
__version__ = "0.1.0"
