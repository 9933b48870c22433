"""vLLM v1's sampling names (`vllm.v1.sample`)."""
