"""compressed-tensors' emulated activation quantization, clamped with number bounds: the same values, faster.

compressed-tensors 0.19 quantizes and dequantizes a W8A8 or FP8 layer's activations at every forward in
transformers. Its `_process_quantization` (quantization/lifecycle/forward.py) takes the quantized range
from `calculate_range` as two 0-d tensors, which reach `torch.clamp` (quant_args.py,
`round_to_quantized_type_args`); torch's clamp with tensor bounds takes a slow path (bf16 [8,192 x 1,024]
on 2 threads: 16.5 ms, against 2.65 ms with number bounds), and on a CPU with AMX it was 29 % of a ref-lm
INT8 forward (docs/toolchain.md, "transformers"). The range's ends (-128 and 127 for INT8, ±448 for FP8
E4M3) are exact in every float dtype, so clamping with them as numbers gives the same tensor:
tests/test_evaluate.py checks that bit for bit, and that upstream still hands tensors (the patch goes once
it does not).
"""

from __future__ import annotations


def clamp_with_number_bounds() -> bool:
    """In this process, give compressed-tensors' fake quantization its range as Python numbers; True if this
    call patched it (False when already patched).

    The numbers are read off the range's tensors once per (type, bits), which is all the range depends on
    (upstream memoizes its tensors on those and the device): reading a CUDA tensor's value waits for the GPU,
    twice per fake-quantized linear layer and forward if done at every call."""
    from compressed_tensors.quantization.lifecycle import forward

    upstream = forward.calculate_range
    if getattr(upstream, "number_bounds", False):
        return False
    ends: dict[tuple[str, int], tuple[float, float]] = {}

    def calculate_range(quantization_args, device):
        if str(device).startswith("meta"):  # loading, with no values to clamp (and none to read)
            return upstream(quantization_args, device)
        key = (str(quantization_args.type), quantization_args.num_bits)
        if key not in ends:
            q_min, q_max = upstream(quantization_args, device)
            ends[key] = (q_min.item(), q_max.item())
        return ends[key]

    calculate_range.number_bounds = True
    forward.calculate_range = calculate_range
    return True
