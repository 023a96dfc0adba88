"""compressed-tensors' emulated activation quantization, the same values, faster: three patches for a process.

compressed-tensors 0.19 quantizes and dequantizes a W8A8 or FP8 layer's activations at every forward in
transformers (quantization/lifecycle/forward_helpers.py, `_quantize_dequantize`, through quant_args.py's
`round_to_quantized_type_args`). Two of its steps take a slow path of torch's on a CPU and a third is a pass
that changes no value; each patch below gives the same tensor faster; tests/test_evaluate.py checks each bit for
bit, and docs/toolchain.md says when each can go ("Every workaround") and what each saves ("transformers"):

- `clamp_with_number_bounds`: the quantized range reaches `torch.clamp` as two 0-d tensors (`calculate_range`);
  torch's clamp with tensor bounds is the slow path. The range's ends (-128 and 127 for INT8, ±448 for FP8
  E4M3) are exact in every float dtype, so clamping with them as numbers gives the same tensor.
- `fp8_back_by_lookup`: FP8's rounding casts to float8 E4M3 and back to the activations' dtype, and torch's
  CPU cast back is the slow half. Every E4M3 value is exact in bfloat16, float16 and float32, so a table of
  the 256 codes cast once by torch itself, indexed by each value's code, gives the cast's bits (`from_fp8`,
  which eval/quality/kvcache.py's emulated FP8 cache uses too).
- `zero_point_not_subtracted`: the fused quantize-dequantize (`_quantize_dequantize`) adds the zero point before
  rounding and subtracts it after, a pass over the whole tensor each; a symmetric scheme's zero point is +0.0,
  and x - (+0.0) is x for every x (-0.0 included), so where every zero point's bits are 0 the subtraction is
  left out. The addition stays: it turns -0.0 into +0.0.
"""

from __future__ import annotations


def same_values_faster() -> None:
    """The three patches, in this process (each once)."""
    clamp_with_number_bounds()
    fp8_back_by_lookup()
    zero_point_not_subtracted()


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


_TABLES: dict = {}  # dtype -> the 256 float8 E4M3 codes cast to it by torch


def from_fp8(rounded, dtype):
    """A float8 E4M3 tensor cast to `dtype`: on a CPU by a table of the 256 codes, which torch cast once (every
    E4M3 value is exact in bfloat16, float16 and float32, so the table holds the cast's bits); elsewhere
    torch's cast."""
    import torch

    if rounded.device.type != "cpu" or not rounded.is_contiguous():  # the cast keeps a layout; the table not
        return rounded.to(dtype)
    table = _TABLES.get(dtype)
    if table is None:
        codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn)
        table = _TABLES[dtype] = codes.to(dtype)
    # index_select with 32-bit indices: the fastest of the lookups timed (docs/toolchain.md, "transformers")
    return table.index_select(0, rounded.view(torch.uint8).view(-1).to(torch.int32)).view(rounded.shape)


def fp8_back_by_lookup() -> bool:
    """In this process, let compressed-tensors' FP8 rounding cast back through `from_fp8`; True if this call
    patched it (False when already patched). Other types, and a rounding that keeps the float8 tensor, go to
    upstream's function unchanged."""
    import torch
    from compressed_tensors.quantization import FP8_E4M3_DATA, QuantizationType
    from compressed_tensors.quantization.lifecycle import forward_helpers

    upstream = forward_helpers.round_to_quantized_type_args
    if getattr(upstream, "fp8_lookup", False):
        return False
    fp8 = FP8_E4M3_DATA.dtype

    def round_to_quantized_type_args(tensor, args, min, max, cast_to_original_dtype=True):
        if not (cast_to_original_dtype and args.type == QuantizationType.FLOAT and args.num_bits == 8):
            return upstream(tensor, args, min, max, cast_to_original_dtype)
        return from_fp8(torch.clamp(tensor, min, max).to(fp8), tensor.dtype)

    round_to_quantized_type_args.fp8_lookup = True
    forward_helpers.round_to_quantized_type_args = round_to_quantized_type_args
    return True


def zero_point_not_subtracted() -> bool:
    """In this process, let compressed-tensors' fused quantize-dequantize leave out subtracting a zero point of
    +0.0 on a CPU; True if this call patched it (False when already patched). Any other zero point, or none, or
    a tensor elsewhere (where reading the zero point's bits would wait for the device), goes to upstream."""
    import torch
    from compressed_tensors.quantization.lifecycle import forward_helpers

    upstream = forward_helpers._quantize_dequantize
    if getattr(upstream, "zero_kept", False):
        return False
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

    def _quantize_dequantize(x, scale, zero_point, q_min, q_max, args, global_scale=None):
        if zero_point is None or x.device.type != "cpu" or not scale.is_floating_point():
            return upstream(x, scale, zero_point, q_min, q_max, args, global_scale)
        # upstream's steps (compressed-tensors 0.19, forward_helpers.py) but the subtraction
        effective = scale / global_scale if global_scale is not None else scale
        zero = zero_point.to(effective.dtype)
        if zero.view(bits[zero.element_size()]).any():  # not +0.0 throughout
            return upstream(x, scale, zero_point, q_min, q_max, args, global_scale)
        scaled = x / effective
        scaled += zero_point.to(x.dtype)
        quantized = forward_helpers.round_to_quantized_type_args(tensor=scaled, args=args, min=q_min, max=q_max)
        return quantized.to(effective.dtype) * effective

    _quantize_dequantize.zero_kept = True
    _quantize_dequantize.upstream = upstream
    forward_helpers._quantize_dequantize = _quantize_dequantize
    return True
