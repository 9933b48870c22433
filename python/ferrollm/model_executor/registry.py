"""Which class implements which HF architecture name (``config.architectures``).

Model modules are imported on first use, so importing the registry costs nothing and a broken
optional model cannot break the others.
"""

from __future__ import annotations

import importlib

from torch import nn

from ferrollm.exceptions import UnsupportedModelError

__all__ = ["ModelRegistry"]

# architecture -> (module under ferrollm.model_executor.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "FuyuForCausalLM": ("fuyu", "FuyuForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "GPTNeoXForCausalLM": ("gpt_neox", "GPTNeoXForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("gemma3_mm", "Gemma3ForConditionalGeneration"),
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM"),
    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
    "InternLM2ForCausalLM": ("internlm2", "InternLM2ForCausalLM"),
    "InternVLChatModel": ("internvl_chat", "InternVLChatModel"),
    "InternVLForConditionalGeneration": ("internvl", "InternVLForConditionalGeneration"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
    "PersimmonForCausalLM": ("persimmon", "PersimmonForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
}

# Encoder-only architectures: they run only as pooling (embedding) models.
_POOLING_MODELS: dict[str, tuple[str, str]] = {
    "BertModel": ("bert", "BertModel"),
    "BertForMaskedLM": ("bert", "BertModel"),
}


class ModelRegistry:
    """The architectures ferrollm can run, resolved lazily to their classes."""

    _models: dict[str, tuple[str, str] | type[nn.Module]] = {**_MODELS, **_POOLING_MODELS}

    @classmethod
    def get_supported_archs(cls) -> list[str]:
        """Architecture names that resolve, sorted."""
        return sorted(cls._models)

    @classmethod
    def register_model(cls, architecture: str, model_cls: type[nn.Module] | str) -> None:
        """Adds (or replaces) an architecture.

        Args:
            architecture: the name configs use, e.g. ``"MyLlamaForCausalLM"``.
            model_cls: the class, or ``"package.module:ClassName"`` to import lazily.
        """
        if isinstance(model_cls, str):
            module, _, name = model_cls.partition(":")
            cls._models[architecture] = (module, name)
        else:
            cls._models[architecture] = model_cls

    @classmethod
    def resolve_name(cls, architectures: list[str]) -> str:
        """The first supported name in ``architectures`` (same errors as :meth:`resolve`)."""
        for arch in architectures or []:
            if arch in cls._models:
                return arch
        cls.resolve(architectures)  # raises the error naming them
        raise AssertionError("unreachable")

    @classmethod
    def is_pooling_only(cls, architectures: list[str]) -> bool:
        """Whether the resolved class is an encoder that can only pool (``is_pooling_model``)."""
        return bool(getattr(cls.resolve(architectures), "is_pooling_model", False))

    @classmethod
    def resolve(cls, architectures: list[str]) -> type[nn.Module]:
        """The class for the first supported name in ``architectures``.

        Args:
            architectures: ``config.architectures`` (after any ``hf_overrides``).

        Returns:
            The model class.

        Raises:
            UnsupportedModelError: if none of the names is supported; the message lists the
                supported ones and how to override the checkpoint's architecture.
        """
        for arch in architectures or []:
            entry = cls._models.get(arch)
            if entry is not None:
                return entry if isinstance(entry, type) else _import(entry)
        raise UnsupportedModelError(
            f"Model architectures {list(architectures or [])} are not supported. Supported "
            f"architectures: {cls.get_supported_archs()}. If the checkpoint has one of these "
            'layouts under another name, pass hf_overrides={"architectures": ["<name>"]}, e.g. '
            'hf_overrides={"architectures": ["LlamaForCausalLM"]}.'
        )


def _import(entry: tuple[str, str]) -> type[nn.Module]:
    module, name = entry
    if "." not in module:
        module = f"ferrollm.model_executor.models.{module}"
    return getattr(importlib.import_module(module), name)


def architectures_markdown() -> str:
    """The README's list of supported architectures, generated from the registry."""
    generative = ", ".join(f"`{a}`" for a in sorted(_MODELS))
    pooling = ", ".join(f"`{a}`" for a in sorted(_POOLING_MODELS))
    return f"- Generative: {generative}.\n- Pooling only: {pooling}.\n"


def update_readme(path: str) -> bool:
    """Rewrites the block between the README's architecture markers; returns whether it changed."""
    with open(path) as f:
        text = f.read()
    start, end = "<!-- architectures:start -->\n", "<!-- architectures:end -->"
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    new = head + start + architectures_markdown() + end + tail
    if new != text:
        with open(path, "w") as f:
            f.write(new)
    return new != text


if __name__ == "__main__":
    import sys

    print("README.md updated" if update_readme(sys.argv[1] if len(sys.argv) > 1 else "README.md") else "up to date")
