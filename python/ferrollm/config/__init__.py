"""Engine configuration under vLLM's names."""

from ferrollm.config.compilation import CompilationConfig, CompilationLevel
from ferrollm.config.vllm import VllmConfig

__all__ = ["CompilationConfig", "CompilationLevel", "VllmConfig"]
