"""Prove that a saved build is what it claims to be, before hours are spent measuring it.

Reload the saved checkpoint, check that its quantization_config declares the precision's format and
bit width, and compare its next-token distributions with the baseline's on fixed prompts: the mean
KL divergence KL(baseline || build) per token and the top-1 agreement. Logits equal to the
baseline's mean the quantization never happened (an "8-bit equals 4-bit" result); an agreement
below `min_agreement` means the build is broken.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from quant.nvfp4_dtype import decompress_nvfp4_in
from quant.precisions import get_precision

# Fixed probe text: plain English of several registers, so that every model sees the same inputs.
PROMPTS = [
    "In the beginning God created the heaven and the earth. And the earth was without form, and void;",
    "And it came to pass, when the king heard the words of the book of the law, that he rent his clothes.",
    "The committee met on Tuesday to review the budget, and after a long debate it approved the plan.",
    "To make bread, mix the flour with water, salt and yeast, knead the dough and let it rise for an hour.",
    "Blessed are the meek: for they shall inherit the earth. Blessed are they which do hunger and thirst",
    "The river flowed slowly past the old mill, where children used to play on summer evenings.",
    "He that keepeth the commandment keepeth his own soul; but he that despiseth his ways shall die.",
    "Write a function that returns the largest number in a list, and explain how it handles ties.",
]


class VerifyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    base: str = Field(description="baseline checkpoint folder")
    checkpoint: str = Field(description="saved build to check")
    precision: str
    max_tokens: int = Field(128, gt=1, description="prompt tokens compared, at most")
    min_agreement: float = Field(0.5, ge=0, le=1, description="top-1 agreement below this fails the build")
    trust_remote_code: bool = False
    dtype: str = Field("bfloat16", description="dtype both models compute in (quant.execution.compute_dtype)")
    device: str = Field("auto", description="where both models run; auto: the GPU where there is one, else the CPU")
    layer_formats: dict[str, str] = Field(
        {}, description="a mixed build: the format each linear layer must be stored in, by full module name"
    )


class VerifyResult(BaseModel):
    format: str
    weight_bits: int
    kl_vs_baseline: float = Field(description="mean KL(baseline || build) per token, nats")
    top1_agreement: float = Field(description="share of positions whose argmax token agrees")
    max_abs_logit_diff: float
    positions: int
    layers: dict[str, int] = Field({}, description="a mixed build: its layers as stored, counted by format")


def check_quantization_config(config: dict, precision: str) -> tuple[str, int]:
    """The declared (format, narrowest weight bits); ValueError when they do not match the precision (a mixed
    build: both its precisions' bit widths)."""
    want = get_precision(precision)
    qc = config.get("quantization_config")
    if qc is None or qc.get("quant_method") != "compressed-tensors":
        raise ValueError(f"the saved {precision} checkpoint declares no compressed-tensors quantization_config")
    bits = {g["weights"]["num_bits"] for g in qc.get("config_groups", {}).values() if g.get("weights")}
    widths = {want.weight_bits}
    if want.mix and (fallback := get_precision(want.mix.fallback)).checkpoint_format:
        widths.add(fallback.weight_bits)
    fmt = qc.get("format")
    if fmt != want.checkpoint_format or bits != widths:
        raise ValueError(
            f"the saved {precision} checkpoint declares format {fmt} with {sorted(bits)}-bit weights; "
            f"expected {want.checkpoint_format} with {sorted(widths)}-bit weights"
        )
    return fmt, want.weight_bits


STORED = {"I8": "int-quantized", "F8_E4M3": "float-quantized"}
"""A linear layer's format by its `weight`'s safetensors dtype (else dense); a packed one has `weight_packed`."""


def stored_formats(checkpoint: Path, modules: list[str]) -> dict[str, str]:
    """The format each named layer's weight is stored in, read from the checkpoint's safetensors headers:
    nvfp4-pack-quantized (`<layer>.weight_packed` beside a `weight_global_scale`), pack-quantized
    (`<layer>.weight_packed`), int-quantized or float-quantized (its `weight`'s dtype), dense."""
    from safetensors import safe_open

    dtypes = {}
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            dtypes |= {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (a reader, not a dict)
    out = {}
    for m in modules:
        if f"{m}.weight_packed" in dtypes:
            out[m] = "nvfp4-pack-quantized" if f"{m}.weight_global_scale" in dtypes else "pack-quantized"
        elif f"{m}.weight" in dtypes:
            out[m] = STORED.get(dtypes[f"{m}.weight"], "dense")
        else:
            out[m] = "missing"
    return out


def check_layers(checkpoint: Path, want: dict[str, str]) -> dict[str, int]:
    """Every layer stored as `want` says (module -> format); its layers counted by format, ValueError otherwise."""
    got = stored_formats(checkpoint, list(want))
    if wrong := [f"{m} ({got[m]}, not {w})" for m, w in want.items() if got[m] != w]:
        raise ValueError(
            f"{len(wrong)} of {len(want)} layers are not stored as the mix says: {', '.join(wrong[:4])}"
            f"{' ...' if len(wrong) > 4 else ''}"
        )
    counts: dict[str, int] = {}
    for f in got.values():
        counts[f] = counts.get(f, 0) + 1
    return counts


def compare_logits(base_logits, build_logits) -> tuple[float, float, float, int]:
    """(mean KL(base || build), top-1 agreement, max |difference|, positions) over [positions, vocab]."""
    import torch

    p = torch.log_softmax(base_logits.float(), dim=-1)
    q = torch.log_softmax(build_logits.float(), dim=-1)
    kl = torch.sum(p.exp() * (p - q), dim=-1).mean().item()
    agree = (p.argmax(-1) == q.argmax(-1)).float().mean().item()
    diff = (base_logits.float() - build_logits.float()).abs().max().item()
    return kl, agree, diff, p.shape[0]


def verify_checkpoint(cfg: VerifyConfig, out_dir: Path) -> VerifyResult:
    """Check the saved build against its precision and the baseline; ValueError when it is not real."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((Path(cfg.checkpoint) / "config.json").read_text())
    fmt, bits = check_quantization_config(config, cfg.precision)
    layers = check_layers(Path(cfg.checkpoint), cfg.layer_formats) if cfg.layer_formats else {}
    tokenizer = AutoTokenizer.from_pretrained(cfg.base)
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    load = {"trust_remote_code": cfg.trust_remote_code, "use_safetensors": True, "dtype": getattr(torch, cfg.dtype)}
    if device != "cpu":  # straight onto the GPU: an 8B model's two copies are 32 GB that host memory need not hold
        load["device_map"] = device
    base = AutoModelForCausalLM.from_pretrained(cfg.base, **load).eval()
    decompress_nvfp4_in(cfg.dtype)  # NVFP4 weights in the dtype both models compute in (quant/nvfp4_dtype.py)
    build = AutoModelForCausalLM.from_pretrained(cfg.checkpoint, **load).eval()
    base_rows, build_rows = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids[:, : cfg.max_tokens].to(device)
            base_rows.append(base(input_ids=ids).logits[0].float().cpu())
            build_rows.append(build(input_ids=ids).logits[0].float().cpu())
    kl, agree, diff, n = compare_logits(torch.cat(base_rows), torch.cat(build_rows))
    if diff == 0.0:
        raise ValueError(f"the {cfg.precision} build's logits equal the baseline's: it was not quantized")
    if agree < cfg.min_agreement:
        raise ValueError(
            f"the {cfg.precision} build's top-1 agreement with the baseline collapsed to {agree:.3f} "
            f"(< {cfg.min_agreement}); KL {kl:.3f} nats/token"
        )
    return VerifyResult(
        format=fmt,
        weight_bits=bits,
        kl_vs_baseline=kl,
        top1_agreement=agree,
        max_abs_logit_diff=diff,
        positions=n,
        layers=layers,
    )
