"""Names at vLLM's `vllm.v1` paths, so scripts written against vLLM v1 import them unchanged."""
