"""The shared kernel of the FedPer edge toolkit (README.md, "Layout")."""

import logging

from fedper.web import web_root  # the web agent's page folder, which fedper-coordinator --web-port serves

# onnxruntime-training imports torch.utils.cpp_extension, which warns "No CUDA runtime is found" on any machine with
# a CUDA build of torch and an nvcc but no GPU: true, not ours to say, and it came first on every command's output.
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)

__all__ = ["web_root"]
