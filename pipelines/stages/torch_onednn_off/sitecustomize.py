"""Turns torch's oneDNN off in every Python process of a vLLM server that qeval starts with this folder on
PYTHONPATH: an FP8 build on an x86 CPU with AMX-INT8 (pipelines/stages/engines.py, `torch_onednn_off`).

There torch's CPU `_scaled_mm` (aten/src/ATen/native/Blas.cpp, `_scaled_mm_out_cpu`) hands FP8 products to
oneDNN, which runs them with its reference matmul (ONEDNN_VERBOSE: `ref:any`); off, torch dequantizes and
multiplies, its path on every other CPU (docs/toolchain.md, "vLLM on a CPU").
"""

import torch

torch.backends.mkldnn.enabled = False
