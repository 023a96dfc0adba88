"""The quantize stage: build a precision's checkpoint, then prove it is real, in fresh processes.

For the baseline precision nothing is built: the stage records the base checkpoint's size, so that
every build has `size/checkpoint_gb` to compare with.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import quant.build as build_mod
import quant.verify as verify
from pipelines.cards import ModelCard, offline_env, resolve_weights, weights_identity
from pipelines.child import run_child
from pipelines.errors import QevalError
from pipelines.paths import resolve_repo_path
from pipelines.stages import StageOutput, StageRecord, file_digest, read_manifest, run_stage, stage_dir
from pipelines.tracking import Tracker
from quant.precisions import PRECISIONS

STAGE = "quantize"


def _calibration(card: ModelCard, num_samples: int | None) -> tuple[dict | None, str | None]:
    """The calibration spec for the child (local files made absolute) and what identifies its data."""
    c = card.calibration
    if c is None:
        return None, None
    spec = c.model_dump()
    if num_samples is not None:
        spec["num_samples"] = num_samples
    if c.dataset.endswith(".jsonl"):
        path = resolve_repo_path(c.dataset)
        spec["dataset"] = str(path)
        return spec, file_digest([path]) if path.is_file() else "missing"
    return spec, f"{c.dataset}:{c.split}"


def checkpoint_for(card: ModelCard, precision: str) -> tuple[str, str]:
    """The folder holding a build's weights, and a digest that identifies them."""
    card.require_precision(precision)
    if precision == card.gate.baseline:
        folder = resolve_weights(card)
        return folder, weights_identity(card, folder)
    build = stage_dir(card.name, precision, STAGE)
    folder = build / build_mod.CHECKPOINT_DIR
    done = read_manifest(build)
    if not done or done.get("status") != "done" or not folder.is_dir():
        raise QevalError(
            f"{card.name}@{precision} has no quantized checkpoint at {folder}; "
            f"build it first: qeval quantize --model {card.name} --precision {precision}"
        )
    return str(folder), done["inputs_digest"]


def quantize(
    card: ModelCard, precision: str, tracker: Tracker, *, force: bool = False, num_samples: int | None = None
) -> StageRecord:
    """Build `precision` of the card's model, check it, and log it to the build's MLflow run."""
    card.require_precision(precision)
    base = resolve_weights(card)
    offline = offline_env(card)
    spec, calib_id = _calibration(card, num_samples) if PRECISIONS[precision].needs_calibration else (None, None)
    cfg = build_mod.QuantizeConfig(
        base=base,
        precision=precision,
        group_size=card.quantization.group_size,
        ignore=card.quantization.ignore,
        calibration=spec,
        trust_remote_code=card.source.trust_remote_code,
    )
    inputs = {
        "base": weights_identity(card, base),
        "config": cfg.model_dump(exclude={"base", "calibration"}),
        "calibration": {**(spec or {}), "dataset": calib_id} if spec else None,
    }

    def baseline(out: Path) -> StageOutput:
        size = build_mod.weight_bytes(Path(base))
        return StageOutput(
            metrics={"size/checkpoint_gb": size / 1e9},
            params={
                "quant.scheme": "none",
                "quant.base": card.source.path or f"{card.source.hub_id}@{card.source.revision}",
            },
            summary={"checkpoint_bytes": size, "checkpoint": base},
        )

    def work(out: Path) -> StageOutput:
        made = run_child(
            "quant.build:quantize_checkpoint", cfg, out, build_mod.QuantizeResult, out / "quantize.log", offline
        )
        check = verify.VerifyConfig(
            base=base,
            checkpoint=str(out / build_mod.CHECKPOINT_DIR),
            precision=precision,
            trust_remote_code=cfg.trust_remote_code,
        )
        shutil.copy(out / build_mod.CHECKPOINT_DIR / "recipe.yaml", out / "recipe.yaml")  # logged; the weights are not
        proof = run_child(
            "quant.verify:verify_checkpoint", check, out, verify.VerifyResult, out / "verify.log", offline
        )
        metrics = {
            "size/checkpoint_gb": made.checkpoint_bytes / 1e9,
            "quant/kl_vs_baseline": proof.kl_vs_baseline,
            "quant/top1_agreement": proof.top1_agreement,
            "quant/seconds": made.seconds,
            "quant/peak_rss_gb": made.peak_rss_mb * 2**20 / 1e9,
        }
        params = {
            "quant.scheme": PRECISIONS[precision].description,
            "quant.format": proof.format,
            "quant.weight_bits": str(proof.weight_bits),
            "quant.group_size": str(cfg.group_size) if PRECISIONS[precision].group_size else "per-channel",
            "quant.ignore": ",".join(cfg.ignore),
        }
        if spec:
            params |= {
                "quant.calibration": card.calibration.dataset,
                "quant.calibration_samples": str(made.calibration_samples),
                "quant.calibration_tokens": str(made.calibration_tokens),
                "quant.calibration_sha256": str(made.calibration_sha256),
            }
        return StageOutput(
            metrics=metrics,
            params=params,
            summary={**made.model_dump(), **proof.model_dump()},
            unlogged=[build_mod.CHECKPOINT_DIR],
        )

    body = baseline if precision == card.gate.baseline else work
    code = [*sorted(Path(build_mod.__file__).parent.glob("*.py")), Path(__file__), Path(run_child.__code__.co_filename)]
    return run_stage(tracker, precision, STAGE, inputs, code, body, force=force)
