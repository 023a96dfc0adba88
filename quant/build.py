"""Build one quantized checkpoint with llm-compressor's `oneshot` and save it compressed.

The pipeline runs build_and_prove() in a fresh process (pipelines/core/system/child.py): quantize_checkpoint(),
then quant/verify.py's proof of the folder it saved, a compressed-tensors checkpoint with its recipe.yaml,
loadable by transformers and servable by vLLM.
"""

from __future__ import annotations

import errno
import json
import resource
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from quant import calibration
from quant.calibration import CalibrationSpec
from quant.precisions import build_recipe, get_precision
from quant.recipes import RecipeOptions
from quant.verify import VerifyConfig, VerifyResult, verify_checkpoint

WARM_IMPORTS = ("torch", "transformers", "datasets", "llmcompressor")
"""What every build imports: pipelines/core/system/warm.py imports them once for the builds it makes."""

CHECKPOINT_DIR = "checkpoint"  # inside the stage folder
SAVED_DTYPE = "bfloat16"  # what a build's unquantized tensors and scales are saved in, whatever it computed in


class QuantizeConfig(BaseModel):
    """One build: which base, which precision, with which calibration."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base: str = Field(description="local folder of the base checkpoint")
    precision: str
    group_size: int = Field(gt=0, description="input channels per weight scale (grouped precisions)")
    ignore: list[str] = Field(description="modules left unquantized")
    calibration: CalibrationSpec | None = Field(
        None, description="calibration text (a local dataset as an absolute path); None if not needed"
    )
    trust_remote_code: bool = False
    target_modules: list[str] = Field([], description="a mixed build: the layers at its target precision")
    fallback_modules: list[str] = Field([], description="a mixed build: the layers kept at its fallback precision")
    seed: int = 0
    dtype: str = Field(
        SAVED_DTYPE,
        description="dtype calibration computes in (quant.execution.compute_dtype); the checkpoint is saved in "
        "bfloat16 either way",
    )


class QuantizeResult(BaseModel):
    precision: str
    seconds: float = Field(description="wall time of oneshot and saving")
    peak_rss_mb: float = Field(description="peak resident memory of the quantizing process")
    checkpoint_bytes: int = Field(description="bytes of the saved weight files")
    calibration_samples: int = 0
    calibration_tokens: int = 0
    calibration_dropped: int = 0
    calibration_sha256: str | None = None
    awq_cpu_workaround: bool = False


def misaligned_layers(model, group_size: int, ignore: list[str]) -> list[str]:
    """Linear layers (not ignored) whose input width is not a multiple of `group_size`."""
    import torch

    return [
        f"{name} ({module.in_features})"
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and not any(name == i or name.endswith(f".{i}") for i in ignore)
        and module.in_features % group_size
    ]


def weight_bytes(folder: Path) -> int:
    """Bytes of a checkpoint's weight files (tokenizer and configs left out), for size comparisons."""
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def drop_remote_code(checkpoint: Path) -> list[str]:
    """Leave the model's own code out of a build whose card does not trust it: its `*.py` files and the
    `auto_map` entries of its configs, which would make a loader that trusts remote code run them. What
    went, for the log."""
    dropped = []
    for path in sorted(checkpoint.glob("*.py")):
        path.unlink()
        dropped.append(path.name)
    for path in sorted(checkpoint.glob("*config.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and data.pop("auto_map", None) is not None:
            path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
            dropped.append(f"{path.name}:auto_map")
    return dropped


def quantize_checkpoint(cfg: QuantizeConfig, out_dir: Path) -> QuantizeResult:
    """Quantize `cfg.base` to `cfg.precision`; the checkpoint goes to `out_dir/checkpoint`."""
    import torch
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quant.cpu_awq import skip_pinning_without_accelerator

    precision = get_precision(cfg.precision)
    torch.manual_seed(cfg.seed)
    patched = cfg.precision == "awq" and skip_pinning_without_accelerator()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            cfg.base, dtype=getattr(torch, cfg.dtype), trust_remote_code=cfg.trust_remote_code, use_safetensors=True
        )
        tokenizer = AutoTokenizer.from_pretrained(cfg.base, trust_remote_code=cfg.trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise ValueError(
            f"{cfg.base}: transformers knows this architecture only through the model's own code, which qeval "
            f"runs only where the card sets source.trust_remote_code: true (read that code first)"
        ) from None
    if precision.grouped and (bad := misaligned_layers(model, cfg.group_size, cfg.ignore)):
        raise ValueError(
            f"{len(bad)} layer(s) have an input width not divisible by quantization.group_size={cfg.group_size}: "
            f"{', '.join(bad[:6])}{' ...' if len(bad) > 6 else ''}; set quantization.group_size to a divisor of "
            f"these widths or add the layers to quantization.ignore in the card"
        )
    calib = None
    dataset = None
    if precision.needs_calibration:
        if cfg.calibration is None:
            raise ValueError(f"{cfg.precision} needs calibration data: add a 'calibration' section to the card")
        spec = cfg.calibration
        texts = calibration.read_texts(spec)
        calib = calibration.prepare(spec, texts, lambda t: tokenizer.encode(t, add_special_tokens=False))
        from datasets import Dataset

        dataset = Dataset.from_dict(
            {"input_ids": calib.input_ids, "attention_mask": [[1] * len(ids) for ids in calib.input_ids]}
        )

    t0 = time.perf_counter()
    opts = RecipeOptions(cfg.group_size, cfg.ignore, tuple(cfg.target_modules), tuple(cfg.fallback_modules))
    recipe = build_recipe(cfg.precision, opts)
    oneshot(
        model=model,
        recipe=recipe,
        dataset=dataset,
        num_calibration_samples=len(calib.input_ids) if calib else 0,
        max_seq_length=cfg.calibration.max_seq_length if calib else None,
        shuffle_calibration_samples=False,
    )
    # Calibrated in float32 on a CPU without bf16 units: saved as a GPU build is, in bf16. The compressor
    # quantizes each weight with its (now bf16) scale at save, as it does after a bf16 calibration.
    model.to(getattr(torch, SAVED_DTYPE))
    checkpoint = out_dir / CHECKPOINT_DIR
    try:
        # the precision's format, not the one compressed-tensors infers (W4A8's INT4 weights, packed, not int8)
        fmt = {} if precision.mix else {"quantization_format": precision.checkpoint_format}
        model.save_pretrained(checkpoint, save_compressed=True, **fmt)
        tokenizer.save_pretrained(checkpoint)
    except Exception as e:  # safetensors reports a full disk as its own error type, not OSError
        if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(e):
            raise OSError(
                errno.ENOSPC, f"disk full while saving the checkpoint to {checkpoint}: free space or set QEVAL_WORKDIR"
            ) from None
        raise
    if not cfg.trust_remote_code:
        drop_remote_code(checkpoint)
    return QuantizeResult(
        precision=cfg.precision,
        seconds=round(time.perf_counter() - t0, 2),
        peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        checkpoint_bytes=weight_bytes(checkpoint),
        calibration_samples=len(calib.input_ids) if calib else 0,
        calibration_tokens=calib.tokens if calib else 0,
        calibration_dropped=calib.dropped if calib else 0,
        calibration_sha256=calib.sha256 if calib else None,
        awq_cpu_workaround=patched,
    )


class BuildConfig(BaseModel):
    """A build and the proof of its saved checkpoint (`verify.checkpoint` is filled in: out_dir/checkpoint)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    quantize: QuantizeConfig
    verify: VerifyConfig


class BuildResult(BaseModel):
    build: QuantizeResult
    proof: VerifyResult


def build_and_prove(cfg: BuildConfig, out_dir: Path) -> BuildResult:
    """Quantize, then prove the checkpoint as saved, read back from disk, in the same process: torch,
    transformers and compressed-tensors are imported once per build, not twice. The quantized model is
    gone by then (it lived in `quantize_checkpoint`); the proof loads both models afresh."""
    import gc

    made = quantize_checkpoint(cfg.quantize, out_dir)
    gc.collect()
    here = cfg.verify.model_copy(update={"checkpoint": str(out_dir / CHECKPOINT_DIR)})
    return BuildResult(build=made, proof=verify_checkpoint(here, out_dir))
