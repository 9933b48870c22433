"""vLLM v1's engine path: `ferrollm.v1.engine.async_llm.AsyncLLM`."""
