"""furnace-trio: an OpenAI-compatible LLM inference server on Trio."""

__version__ = "0.1.0"
