"""Multimodal inputs: what `LLM.generate` accepts in ``multi_modal_data``, the processing of
images through the checkpoint's image processor, and the processed-input cache (held in the
Rust core)."""

from ferrollm.multimodal.inputs import MultiModalInputs, MultiModalItem

__all__ = ["MultiModalInputs", "MultiModalItem"]
