"""NVFP4 weights decompressed in the dtype the model computes in, for a process.

compressed-tensors 0.19 unpacks an NVFP4 weight to bf16 whatever the model's dtype (compressors/nvfp4/base.py,
`decompress`: `unpack_fp4_from_uint8`'s default), so a build loaded in float32, as a CPU without bf16 units
computes (quant/execution.py, `compute_dtype`), fails its first forward ("expected m1 and m2 to have the same
dtype"). The weight is cast to the model's dtype once decompressed: the same values (each an FP4 value times its
FP8 scale over the global scale, rounded to bf16 as upstream computes it, which float32 holds exactly), so that the
build computes as the baseline does. docs/toolchain.md, "llm-compressor", says when this can go.
"""

from __future__ import annotations

_TARGET: dict[str, object] = {}


def decompress_nvfp4_in(dtype: str) -> None:
    """Every NVFP4 weight this process decompresses from now on, in `dtype` (a torch dtype's name)."""
    import torch
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    _TARGET["dtype"] = getattr(torch, dtype)
    if getattr(NVFP4PackedCompressor.decompress, "_in_model_dtype", False):
        return
    upstream = NVFP4PackedCompressor.decompress.__func__

    def decompress(cls, state_dict, scheme):
        out = upstream(cls, state_dict, scheme)
        out["weight"] = out["weight"].to(_TARGET["dtype"])
        return out

    decompress._in_model_dtype = True
    NVFP4PackedCompressor.decompress = classmethod(decompress)
