"""The ship card: a Markdown model card for the build the gate chose, after the manner of published
quantized-model cards: what it is (base, scheme, calibration, proof against the baseline), its accuracy
recovery per task with paired intervals, its speed per concurrency as measured (device, engine, kernels,
native or emulated, the real checkpoint or random weights), memory, the capacity and cost of the card's
traffic, library versions, and the command that serves it; for a mixed build, which layers are at which
precision and why. The gate makes it the registered version's
description and an artifact beside the checkpoint; `qeval card` prints it, `qeval pull` writes it as
README.md next to the weights.
"""

from __future__ import annotations

import eval.load.serving as serving
from pipelines.core.card.cards import ModelCard
from pipelines.core.store import formats
from pipelines.core.store.manifests import finished, result_of
from pipelines.core.store.results import AtShape, Quantized, Served
from pipelines.core.store.results.ranked import Ranked
from pipelines.core.store.verdicts import BuildVerdict, Decision
from pipelines.present import capacity
from pipelines.present.report_tables import STOP_TEXT, users_range
from quant.precisions import get_precision, kv_cache_dtype


def _what(card: ModelCard, precision: str) -> list[str]:
    done = finished(card.name, precision, Quantized)
    src = card.source
    base = f"{formats.literal(src.hub_id)} (revision {formats.literal(src.revision)})" if src.hub_id else None
    base = base or formats.literal(src.path or "")
    lines = ["## What it is", "", f"- Base model: {base}", f"- Precision: {precision}"]
    if done is None:
        return lines
    q = done.result
    lines.append(
        f"- Scheme: {q.scheme}; weights {formats.size(q.checkpoint_bytes / 1e9)} in safetensors "
        "(compressed-tensors format, built with llm-compressor)"
    )
    cal = q.config.calibration if q.config else None
    if cal is not None and q.build is not None:
        lines.append(
            f"- Calibration: {formats.literal(card.calibration.dataset if card.calibration else cal)}, "
            f"{q.build.calibration_samples} samples, {q.build.calibration_tokens:,} tokens "
            f"(sha256 {(q.build.calibration_sha256 or '?')[:12]})"
        )
    if q.proof is not None:
        lines.append(
            f"- Checked against the baseline after reloading: KL {q.proof.kl_vs_baseline:.4f} nats per "
            f"token, top-1 agreement {q.proof.top1_agreement:.3f}"
        )
    lines.append("- Library versions: " + ", ".join(f"{k} {v}" for k, v in sorted(done.versions.items())))
    return lines


def _layers(card: ModelCard, precision: str) -> list[str]:
    """A mixed build's layers at each precision, and why those were kept wider (the search's ranking)."""
    mix = get_precision(precision).mix
    built = result_of(card.name, precision, Quantized)
    ranked = result_of(card.name, mix.target, Ranked) if mix else None
    if mix is None or built is None or built.config is None or ranked is None:
        return []
    kept = ranked.ranked[: mix.kept]
    return [
        "",
        "## Layers at each precision",
        "",
        f"- {len(built.config.target_modules)} linear layers at {mix.target}, {len(built.config.fallback_modules)} at "
        f"{mix.fallback} ({', '.join(card.quantization.ignore)} left at 16 bits, as in every build)",
        f"- Kept at {mix.fallback}: the {mix.kept} of {len(ranked.ranked)} layer groups whose quantizing alone to "
        f"{mix.target} cost most (KL divergence from the baseline on the calibration text, round to nearest), the "
        'fewest the search found to pass (`qeval search`; the report\'s "Mixed precision" section):',
        *(f"  - {g.group}: {g.kl:.3g} nats per token alone" for g in kept),
    ]


def _accuracy(b: BuildVerdict, decision: Decision) -> list[str]:
    lines = [
        "## Accuracy against the baseline",
        "",
        f"Recovery = this build's score / the baseline's ({decision.policy.baseline}) on the same documents, with its "
        f"interval. {formats.guarantee(decision)}",
        "",
        "| task | metric | baseline | this build | recovery | interval | verdict | documents |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for task, c in b.tasks.items():
        rec, lo, hi = c.recovery
        lines.append(
            f"| {task} | {c.metric} | {c.baseline:.4g} | {c.build:.4g} | {rec:.4f} | [{lo:.4f}, {hi:.4f}] "
            f"| {c.verdict} | {formats.documents(c)} |"
        )
    if (stop := decision.policy.stop_scoring) != "never":
        stopped = [
            f"{o.precision} ({len(o.not_scored)} of {len(o.not_scored) + len(o.tasks)} tasks not scored)"
            for o in decision.builds
            if o.not_scored
        ]
        lines += [
            "",
            f"Scoring: {STOP_TEXT[stop]}; "
            + (f"stopped early: {', '.join(stopped)}." if stopped else "no build stopped early."),
        ]
    return lines


def _speed(card: ModelCard, precision: str) -> list[str]:
    served = result_of(card.name, precision, Served)
    shaped = result_of(card.name, precision, AtShape)
    lines = ["## Speed, as measured"]
    if served is not None and not served.per_level:
        lines += ["", f"Not served here: {served.not_run}."]
    elif served is not None:
        device = served.device_words
        lines += [
            "",
            f"This checkpoint on {served.engine_version or served.engine} on {device} ({served.execution}: "
            f"{served.kernel_names}), {served.load.input_len} tokens in and {served.load.output_len} out, "
            f"closed-loop, {served.load.requests_per_user} requests per user; objective TTFT p95 <= "
            f"{served.slo.ttft_ms:g} ms, TPOT p95 <= {served.slo.tpot_ms:g} ms.",
            "",
            "| users | requests | TTFT p50 / p95 ms | TPOT p50 / p95 ms | output tok/s [95 % interval] | within the "
            "objective | on the p95s' intervals | the server's view |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for c, m in served.per_level.items():
            view = serving.what_broke(m) if not m.meets_slo else ""
            lines.append(
                f"| {c} | {m.requests} | {_pair(m.ttft_ms_p50, m.ttft_ms_p95)} | {_pair(m.tpot_ms_p50, m.tpot_ms_p95)} "
                f"| {formats.tps_with_interval(m)} | {'yes' if m.meets_slo else 'no'} | {m.slo_verdict or ''} "
                f"| {view} |"
            )
        if within := users_range(served):
            held = formats.users_count(served.max_users_at_slo, served.users_bound)
            lines += ["", f"Users within the objective: {held} by the p95s themselves; {within}."]
    if shaped is not None:
        for name, sw in shaped.scenarios.items():
            within = f"{formats.users_count(sw.max_users_at_slo, sw.users_bound)} within the objective"
            held = "probed, too slow to sweep" if sw.probe else within
            lines += [
                "",
                f"- {shaped.weights}, scenario {name} ({sw.load.input_len} in, {sw.load.output_len} out): "
                f"{held} ({shaped.engine_version}, {formats.arithmetic(shaped.vllm.dtype)}, {shaped.execution}: "
                f"{shaped.kernel_names})",
            ]
    if len(lines) == 1:
        lines += ["", "Not measured on a server."]
    return lines


def _pair(a: float | None, b: float | None) -> str:
    return f"{formats.ms(a) if a is not None else '-'} / {formats.ms(b) if b is not None else '-'}"


def _serve(card: ModelCard, precision: str) -> list[str]:
    served = result_of(card.name, precision, Served)
    length = f" --max-model-len {served.vllm.max_model_len}" if served and served.vllm else ""
    kv_dtype = kv_cache_dtype(precision, card.server.kv_cache_dtype)
    kv = f" --kv-cache-dtype {kv_dtype}" if kv_dtype != "auto" else ""
    dtype = f" --dtype {served.vllm.dtype}" if served and served.vllm and served.vllm.dtype != "auto" else ""
    return [
        "## Serving it",
        "",
        f"From the folder `qeval pull --model {card.name} <folder>` writes (this file is its README.md):",
        "",
        "```",
        f"vllm serve <folder> --host 127.0.0.1 --port 8000{length}{kv}{dtype}",
        "```",
    ]


def ship_card(card: ModelCard, decision: Decision, tab: capacity.Table | None = None) -> str | None:
    """The chosen build's card as Markdown, or None where nothing ships; `tab`: the capacity table where the
    caller has it (else it is made here)."""
    b = next((b for b in decision.builds if b.precision == decision.chosen), None)
    if b is None:
        return None
    p = b.precision
    lines = [
        f"# {card.name} {p}: the build qeval ships",
        "",
        f"Chosen by `qeval gate` on {decision.decided} at commit {decision.code.commit[:12]}: {decision.why}.",
        "",
        *_what(card, p),
        *_layers(card, p),
        "",
        *_accuracy(b, decision),
        "",
        "## Memory",
        "",
        f"- Weights {formats.size(b.speed.weights_gb)} resident; peak {formats.size(b.speed.peak_gb)} in the engine "
        f"bench (transformers) at batch {decision.policy.speed_batch}",
        "",
        *_speed(card, p),
    ]
    tab = tab or capacity.table(card, decision)
    row = next((r for r in tab.rows if r.precision == p), None) if tab else None
    if row is not None:
        lines += ["", f"## Capacity and cost: {tab.load}, scenario {tab.scenario}", ""]
        lines += [f"- {d}: {capacity.cell_text(cell)}" for d, cell in row.cells.items()]
    lines += ["", *_serve(card, p), "", "## Every rule the gate applied", "", *[f"- {r}" for r in b.reasons], ""]
    return "\n".join(lines)
