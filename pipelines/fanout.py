"""`qeval run --ray ADDRESS`: each build's chain of stages as one task on a Ray cluster.

The driver (this process) submits one task per build, the baseline's first; each task runs its build's
stages in order on whichever node Ray picks, in that node's own artifacts/ cache, and logs every stage
to the tracking server, whose URI (and credentials, never printed) the driver passes down. A quantized
build's evaluate and bench compare with the baseline's: before them, the task waits until the
baseline's task has finished that stage in this fan-out (a small actor holds the milestones), then reads
it from the tracking store (pipelines/tracking/readback.py). A KV-cache variant (`int8+kv-fp8`) serves its
precision's checkpoint, which stays on the node that built it: its chain runs in that precision's task, after
it. A task that fails returns its error and leaves the others running; the driver gates and reports the
builds that finished once every task has ended.

A task asks Ray for what its build's stages use (task_resources()): on a cluster with GPUs, for a card with
target GPUs, the build's GPUs (its tensor- and pipeline-parallel degrees) and the cluster's share of CPUs
that comes with them; else for `cpus` CPUs. Ray sets the task's OMP_NUM_THREADS to its CPUs, and qeval's child
processes inherit it.
Ray is an optional extra: `pip install -e '.[ray]'`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from pipelines.core.card.cards import ModelCard
from pipelines.core.framework.registry import STAGES
from pipelines.core.store.manifests import StageRecord
from pipelines.core.system import logs
from pipelines.core.system.errors import QevalError
from pipelines.core.system.progress import duration, every_s
from pipelines.tracking.readback import fetch_stage
from quant.precisions import get_precision

log = logging.getLogger(__name__)

CREDENTIALS = ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


@dataclass
class ChainOutcome:
    """What one build's task did: its stages, in order, and the error that stopped it (None: all done)."""

    precision: str
    records: list[StageRecord] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0
    node: str = ""


def _ray():
    try:
        import ray
    except ImportError:
        raise QevalError("--ray needs Ray, an optional extra: pip install -e '.[ray]' (or: make team)") from None
    return ray


def _milestones_actor(ray):
    """An actor that records which of the baseline's stages have finished in this fan-out."""

    @ray.remote(num_cpus=0)
    class Milestones:
        def __init__(self) -> None:
            import asyncio

            self.reached: set[str] = set()
            self.error: str | None = None
            self.changed = asyncio.Condition()

        async def mark(self, stage: str | None, error: str | None = None) -> None:
            async with self.changed:
                if stage:
                    self.reached.add(stage)
                self.error = error or self.error
                self.changed.notify_all()

        async def wait(self, stage: str) -> str | None:
            """None once `stage` has finished; the baseline's error if its task ended without it."""
            async with self.changed:
                await self.changed.wait_for(lambda: stage in self.reached or self.error is not None)
                return None if stage in self.reached else self.error

    return Milestones


def tasks_of(builds: list[str]) -> dict[str, list[str]]:
    """Per Ray task (named by its first build), the builds it runs in turn: a precision, then its KV-cache
    variants, which need its checkpoint on their node."""
    tasks: dict[str, list[str]] = {}
    for p in builds:
        tasks.setdefault(get_precision(p).shares or p, []).append(p)
    return tasks


def chains(
    card: ModelCard, precisions: list[str], stages: list[str], force: bool, env: dict[str, str], milestones
) -> list[ChainOutcome]:
    """Builds' chains in turn, in one Ray worker; once one fails, the rest (its variants) are not started."""
    outcomes = [chain(card, precisions[0], stages, force, env, milestones)]
    for p in precisions[1:]:
        failed = outcomes[0].error
        outcomes.append(
            ChainOutcome(p, error=f"{precisions[0]} failed: {failed}")
            if failed
            else chain(card, p, stages, force, env, milestones)
        )
    return outcomes


def chain(
    card: ModelCard, precision: str, stages: list[str], force: bool, env: dict[str, str], milestones
) -> ChainOutcome:
    """One build's stages, in a Ray worker. Returns (never raises) what was done and what stopped it."""
    import platform

    from pipelines.tracking.mlflow_tracker import MlflowTracker

    os.environ.update(env)
    logs.quiet_environment()
    logs.setup()  # qeval's INFO lines to stderr, which Ray forwards to the driver with the task's name
    baseline = precision == card.gate.baseline
    outcome, t0 = ChainOutcome(precision, node=platform.node()), time.perf_counter()
    stage = None
    try:
        tracker = MlflowTracker(card.name)
        for stage in stages:
            if not baseline and STAGES[stage].needs_baseline:
                _wait_for_baseline(card, precision, tracker, stage, milestones)
            outcome.records.append(STAGES[stage].load()(card, precision, tracker, force=force))
            if baseline:
                milestones.mark.remote(stage)
    except BaseException as e:  # everything a stage can raise ends this build, not the fan-out
        outcome.error = str(e) if isinstance(e, QevalError) else f"{type(e).__name__}: {e}"
        if baseline:
            milestones.mark.remote(None, f"the baseline's {stage} failed: {outcome.error}")
    outcome.seconds = time.perf_counter() - t0
    return outcome


def _wait_for_baseline(card: ModelCard, precision: str, tracker, stage: str, milestones) -> None:
    import ray

    base = card.gate.baseline
    log.info("%s@%s %s: waiting for the baseline's (%s@%s)", card.name, precision, stage, card.name, base)
    error = ray.get(milestones.wait.remote(stage))
    if error is not None:
        raise QevalError(error)
    run_id = tracker.find_run(base)
    if run_id is None or not fetch_stage(tracker, run_id, base, stage):
        raise QevalError(f"the baseline's {stage} finished but its MLflow run does not hold it")


def run_on_ray(
    card: ModelCard, builds: list[str], stages: list[str], address: str, *, force: bool = False, cpus: float = 1.0
) -> list[ChainOutcome]:
    """Every build's chain as a Ray task on the cluster at `address`; their outcomes, in `builds`' order."""
    ray = _ray()
    from pipelines.tracking.store import tracking_uri

    env = {k: os.environ[k] for k in CREDENTIALS if os.environ.get(k)}
    env["MLFLOW_TRACKING_URI"] = tracking_uri()
    if env["MLFLOW_TRACKING_URI"].startswith("sqlite:"):
        log.warning(
            "--ray with a local SQLite store: every node must see %s (set MLFLOW_TRACKING_URI to a "
            "tracking server for a cluster of several machines)",
            env["MLFLOW_TRACKING_URI"],
        )
    if not sys.stderr.isatty():  # Ray colours the task prefix of forwarded lines; a log file gets plain text
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True, configure_logging=False)
    except Exception as e:  # Ray raises ConnectionError, RuntimeError, ValueError for a bad address
        raise QevalError(f"cannot join the Ray cluster at {address}: {str(e).splitlines()[0][:300]}") from None
    try:
        need = task_resources(ray.cluster_resources(), card, cpus)
        log.info(
            "Ray cluster %s: %s; one task per build, each asking for %s",
            address,
            _resources(ray.cluster_resources()),
            _resources(need),
        )
        milestones = _milestones_actor(ray).remote()
        task = ray.remote(chains)
        pending = {  # the baseline first: Ray starts tasks in the order they were submitted
            task.options(name=f"{card.name}@{','.join(ps) if len(ps) > 1 else p}", max_retries=0, **need).remote(
                card, ps, stages, force, env, milestones
            ): ps
            for p, ps in tasks_of(builds).items()
        }
        try:
            return _collect(ray, card, pending, builds)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the builds' tasks stop too, not only this driver
            for ref in pending:
                ray.cancel(ref, force=True)
            raise
    finally:
        ray.shutdown()


def task_resources(cluster: dict[str, float], card: ModelCard, cpus: float) -> dict[str, float]:
    """What one build's task asks Ray for, given the cluster's resources.

    On a cluster with GPUs, for a card with target GPUs: the GPUs a build is served on (server.tensor_parallel
    times pipeline_parallel; 1 where the card leaves it to the size stage), so that vLLM's parallel degrees
    see them, and the cluster's CPUs per GPU for each: loading, saving, calibration and lm-eval's data run on
    them, and a task of one CPU gets one thread. Without GPUs, `cpus` CPUs. QevalError where the cluster has
    fewer GPUs than a build needs (Ray would wait for them forever)."""
    gpus = cluster.get("GPU", 0)
    if not gpus or not card.target_gpus:
        return {"num_cpus": cpus}
    degree = (card.server.tensor_parallel or 1) * card.server.pipeline_parallel
    if degree > gpus:
        raise QevalError(
            f"{card.name}: a build is served on {degree} GPUs (server.tensor_parallel x "
            f"pipeline_parallel) and the Ray cluster has {gpus:g}"
        )
    per_gpu = max(1, int(cluster.get("CPU", 1) // gpus))
    return {"num_gpus": degree, "num_cpus": per_gpu * degree}


def _resources(r: dict[str, Any]) -> str:
    """'2 CPU, 1 GPU' from Ray's cluster resources or a task's options (num_cpus, num_gpus)."""
    named = {k.removeprefix("num_").removesuffix("s").upper(): v for k, v in r.items()}
    return ", ".join(f"{named[k]:g} {k}" for k in ("CPU", "GPU") if named.get(k))


def _collect(ray, card: ModelCard, pending: dict, builds: list[str]) -> list[ChainOutcome]:
    """Wait for every task; say when each ends, and every 30 s which are still running."""
    done: dict[str, ChainOutcome] = {}
    t0 = time.perf_counter()
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=every_s())
        for ref in ready:
            precisions = pending.pop(ref)
            try:
                outcomes = ray.get(ref)
            except Exception as e:  # the worker died (out of memory, node lost)
                died = f"the Ray task died: {str(e).splitlines()[0][:300]}"
                outcomes = [ChainOutcome(p, error=died) for p in precisions]
            for outcome in outcomes:
                done[outcome.precision] = outcome
                _said(card, outcome)
        if pending and not ready:
            running = ", ".join(sorted(p for ps in pending.values() for p in ps))
            log.info("%s: %s not finished on Ray, %s elapsed", card.name, running, duration(time.perf_counter() - t0))
    return [done[p] for p in builds]


def _said(card: ModelCard, outcome: ChainOutcome) -> None:
    p = outcome.precision
    if outcome.error:
        log.error("%s@%s: failed after %s: %s", card.name, p, duration(outcome.seconds), outcome.error)
    else:
        log.info(
            "%s@%s: %d stages done in %s on %s",
            card.name,
            p,
            len(outcome.records),
            duration(outcome.seconds),
            outcome.node,
        )
