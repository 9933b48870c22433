"""The engine: the Rust core, the model runner and the tokenizers, wired together."""
