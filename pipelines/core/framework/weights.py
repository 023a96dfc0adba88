"""A build's weights: the base model's (a local folder, or the hub's cache, safetensors only), or a
quantized build's checkpoint; what identifies them in cache keys; and the files a card names (its calibration
text among them).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from eval.devices.sizing import Shape
from pipelines.core.card.cards import ModelCard
from pipelines.core.store.layout import CHECKPOINT_DIR, stage_dir
from pipelines.core.store.manifests import finished
from pipelines.core.store.results import Quantized
from pipelines.core.system.errors import QevalError
from pipelines.core.system.files import file_digest
from pipelines.core.system.integrity import Tampered, check_safetensors
from pipelines.core.system.net import Unreachable, probe
from pipelines.core.system.paths import resolve_repo_path
from quant.calibration import CalibrationSpec
from quant.precisions import get_precision

log = logging.getLogger(__name__)

HUB_TIMEOUT_S = 10.0  # the hub must answer a revision lookup within this
# safetensors only: a *.bin pickle can run code when loaded.
_WEIGHT_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]


def resolve_weights(card: ModelCard) -> str:
    """A local folder holding the base model's safetensors weights, or a clear error when it cannot be had.

    From the hub: the local cache first (no network), else one quick look at the hub endpoint before
    downloading, since huggingface_hub's revision lookup has no timeout and waited minutes on an
    endpoint that accepted the connection and never answered."""
    src = card.source
    if src.path is not None:
        folder = resolve_repo_path(src.path)
        if not (folder / "config.json").is_file():
            raise QevalError(f"model '{card.name}': no checkpoint at {folder} (source.path in its card)")
        return require_safetensors(card, folder)
    from huggingface_hub import snapshot_download

    try:
        cached = snapshot_download(
            src.hub_id, revision=src.revision, allow_patterns=_WEIGHT_FILES, local_files_only=True
        )
        return require_safetensors(card, Path(cached))
    except QevalError:
        raise
    except Exception:  # not in the cache: fetch it, where the hub is allowed and answers
        pass
    unavailable = f"model '{card.name}': weights for {src.location} are not in the local cache"
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise QevalError(
            f"{unavailable} and the hub is off (HF_HUB_OFFLINE=1); download them where it is "
            f"reachable or set source.path to a local copy"
        )
    _check_hub(card, unavailable)
    try:
        folder = snapshot_download(src.hub_id, revision=src.revision, allow_patterns=_WEIGHT_FILES)
    except Exception as e:  # httpx, requests and the hub's own errors alike: one line, the fix
        if refused := _refusal(e):
            raise WeightsRefused(f"model '{card.name}': the hub refused {src.location} ({refused})") from None
        raise QevalError(
            f"{unavailable} and the download failed ({type(e).__name__}); download them where the "
            f"hub is reachable or set source.path to a local copy"
        ) from None
    return require_safetensors(card, Path(folder))


class WeightsRefused(QevalError):
    """The hub answered and will not give these weights: a gated or private repository without access, or an id
    or revision it does not have. An error for any run, never a reason to run the speed half alone."""


def _refusal(e: Exception) -> str | None:
    """Why the hub refused a download, in words with the fix; None where it did not answer with a refusal."""
    name = type(e).__name__
    status = getattr(getattr(e, "response", None), "status_code", None)
    if name == "GatedRepoError" or status in (401, 403):
        return (
            f"HTTP {status or 403}: gated or private, and this machine has no access; accept its licence on the "
            f"hub, then log in (`hf auth login`, or HF_TOKEN)"
        )
    if name in ("RepositoryNotFoundError", "RevisionNotFoundError") or status == 404:
        return f"HTTP {status or 404}: no such repository or revision; check source.hub_id and source.revision"
    return None


def _check_hub(card: ModelCard, unavailable: str) -> None:
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    url = f"{endpoint}/api/models/{card.source.hub_id}/revision/{card.source.revision}"
    try:
        probe(url, HUB_TIMEOUT_S, ok_only=False)  # any answer: the hub is there (a 404 is the download's to say)
    except Unreachable as e:
        raise QevalError(
            f"{unavailable} and the hub at {endpoint} did not answer within {HUB_TIMEOUT_S:g} s ({e.why}); check "
            f"the network or HF_ENDPOINT, or set source.path to a local copy"
        ) from None


def require_safetensors(card: ModelCard, folder: Path) -> str:
    """The folder, if its weights are whole safetensors files; a pickle (`*.bin`, `*.pt`) can run code when
    loaded, and a truncated file or one that never ends (a FIFO, /dev/zero) is refused before it is read."""
    if weights := sorted(folder.glob("*.safetensors")):
        for path in weights:
            try:
                check_safetensors(path)
            except QevalError as e:
                raise QevalError(f"model '{card.name}': {e}") from None
        _warn_custom_code(card, folder)
        return str(folder)
    pickles = sorted(p.name for p in (*folder.glob("*.bin"), *folder.glob("*.pt"), *folder.glob("*.pth")))
    found = f" (it has {', '.join(pickles[:3])})" if pickles else ""
    raise QevalError(
        f"model '{card.name}': {folder} has no *.safetensors weights{found}; qeval loads safetensors only, "
        f"as a pickle can run code when loaded: convert them (from_pretrained, then save_pretrained with "
        f"safe_serialization=True) where you trust the file, and point the card at the result"
    )


def _warn_custom_code(card: ModelCard, folder: Path) -> None:
    """One line where the model ships code of its own that the card does not trust: it is not run, and its
    builds leave it out (quant/build.py's drop_remote_code)."""
    try:
        names_code = "auto_map" in json.loads((folder / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return
    code = sorted(p.name for p in folder.glob("*.py"))
    if (names_code or code) and not card.source.trust_remote_code:
        shown = f" ({', '.join(code[:3])})" if code else ""
        log.warning(
            "model '%s': its checkpoint names code of its own%s, which qeval neither runs nor copies into "
            "builds (source.trust_remote_code is off)",
            card.name,
            shown,
        )


def missing_files(card: ModelCard) -> list[str]:
    """The local files a card names that are not there (weights, architecture, calibration text, task
    folder), each as one line: `qeval models` says so before a stage fails on it minutes later."""
    problems = []
    if card.source.path is not None:
        try:
            resolve_weights(card)
        except QevalError as e:
            problems.append(str(e))
    named = [("source.config", card.source.config), ("accuracy.include_path", card.accuracy.include_path)]
    if card.calibration is not None and card.calibration.dataset.endswith(".jsonl"):
        named.append(("calibration.dataset", card.calibration.dataset))
    for key, value in named:
        if value is not None and not resolve_repo_path(value).exists():
            problems.append(f"model '{card.name}': {key} {resolve_repo_path(value)} does not exist")
    return problems


def weights_identity(card: ModelCard, folder: str) -> str:
    """What identifies the base weights in cache keys: file digests locally, hub id and revision otherwise."""
    if card.source.path is None:
        return card.source.location
    return file_digest([*sorted(Path(folder).glob("*.safetensors")), Path(folder) / "config.json"])


def model_config(checkpoint: str) -> dict:
    """A checkpoint's config.json ({} where it has none that reads)."""
    try:
        cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def model_positions(checkpoint: str) -> int | None:
    """The context a checkpoint's model was built for (its config.json's positions), where it says."""
    cfg = model_config(checkpoint)
    cfg = cfg.get("text_config", cfg)
    return (cfg.get("max_position_embeddings") or cfg.get("n_positions")) if isinstance(cfg, dict) else None


def architecture_config(card: ModelCard, purpose: str) -> Path:
    """The config.json that gives the model's architecture: `source.config`, else the local checkpoint's."""
    if card.source.config:
        path = resolve_repo_path(card.source.config)
    elif card.source.path:
        path = resolve_repo_path(card.source.path) / "config.json"
    else:
        raise QevalError(f"model '{card.name}': {purpose} needs source.config (a config.json) in its card")
    if not path.is_file():
        raise QevalError(f"model '{card.name}': no architecture config at {path}")
    return path


def architecture(card: ModelCard, purpose: str) -> tuple[Shape, Path, int | None]:
    """The model's shape (eval/devices/sizing.py), the config.json it comes from and the positions it was built for;
    QevalError naming the file where it cannot be read."""
    path = architecture_config(card, purpose)
    try:
        cfg = json.loads(path.read_text())
        return Shape.from_config(cfg), path, cfg.get("text_config", cfg).get("max_position_embeddings")
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise QevalError(f"model '{card.name}': cannot read the architecture from {path}: {e}") from None


def offline_env(card: ModelCard) -> dict[str, str]:
    """Environment for the children: a card with local weights runs without the hub (nothing is fetched,
    nothing waits on a network), unless QEVAL_ALLOW_HUB=1 (for a local model with hub tasks)."""
    if card.source.path is None or os.environ.get("QEVAL_ALLOW_HUB") == "1":
        return {}
    return {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def checkpoint_for(card: ModelCard, precision: str) -> tuple[str, str]:
    """The folder holding a build's weights, and a digest that identifies them (a KV-cache variant's are its
    precision's)."""
    card.require_precision(precision)
    if shared := get_precision(precision).shares:
        return checkpoint_for(card, shared)
    if precision == card.gate.baseline:
        folder = resolve_weights(card)
        return folder, weights_identity(card, folder)
    built = finished(card.name, precision, Quantized)
    folder = stage_dir(card.name, precision, Quantized.STAGE) / CHECKPOINT_DIR
    if built is None or not folder.is_dir():
        raise QevalError(
            f"{card.name}@{precision} has no quantized checkpoint at {folder}; "
            f"build it first: qeval quantize --model {card.name} --precision {precision}"
        )
    if altered := built.result.altered(folder.parent):
        raise Tampered(
            f"{card.name}@{precision}: {altered}, since it was built and checked; not used: rebuild it with "
            f"qeval quantize --model {card.name} --precision {precision} --force"
        )
    return str(folder), built.inputs_digest


def calibration_spec(card: ModelCard, num_samples: int | None) -> tuple[CalibrationSpec | None, str | None]:
    """The calibration spec for the child (a local file made absolute) and what identifies its data."""
    c = card.calibration
    if c is None:
        return None, None
    dataset, identity = c.dataset, f"{c.dataset}:{c.split}"
    if c.dataset.endswith(".jsonl"):
        path = resolve_repo_path(c.dataset)
        dataset, identity = str(path), file_digest([path]) if path.is_file() else "missing"
    spec = CalibrationSpec(dataset, c.split, c.text_field, num_samples or c.num_samples, c.max_seq_length)
    return spec, identity
