"""Engine configuration under vLLM's names."""

from ferrollm.config.compilation import CompilationConfig, CompilationLevel

__all__ = ["CompilationConfig", "CompilationLevel"]
