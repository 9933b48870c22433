"""`ferrollm bench throughput` and `ferrollm bench latency`, with vLLM's flags and output lines."""
