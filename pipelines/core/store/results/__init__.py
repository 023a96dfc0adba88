"""The typed results the stages leave (the manifest that holds each one: pipelines/core/store/manifests.py), one
module each, and how each reaches MLflow, declared beside it (its `LOGS`: logs.py).

The stages hand each other these types, never MLflow names or each other's files: a stage reads
another's result with finished() (pipelines/core/store/manifests.py) or require()
(pipelines/core/framework/registry.py), and a build's weights with checkpoint_for()
(pipelines/core/framework/weights.py). pipelines/tracking/ writes what a result's `LOGS` declares to the store;
where each file lies is pipelines/core/store/layout.py's.
"""

from pipelines.core.store.results.base import Record, StageResult
from pipelines.core.store.results.benched import Benched, Speedup
from pipelines.core.store.results.evaluated import Evaluated, evaluation_settings
from pipelines.core.store.results.quantized import Quantized
from pipelines.core.store.results.ranked import Candidate, Ranked, RankedGroup
from pipelines.core.store.results.served import (
    GeneratorCeiling,
    LinearKernel,
    Served,
    ServedAccuracy,
    ServedOn,
    ServedVsOffline,
    VllmSettings,
)
from pipelines.core.store.results.shaped import AtShape, DecodeCeiling, Probe, ScenarioSweep
from pipelines.core.store.results.sized import BenchCheck, Sized

__all__ = [
    "AtShape",
    "BenchCheck",
    "Benched",
    "Candidate",
    "DecodeCeiling",
    "Evaluated",
    "GeneratorCeiling",
    "LinearKernel",
    "Probe",
    "Quantized",
    "Ranked",
    "RankedGroup",
    "Record",
    "ScenarioSweep",
    "Served",
    "ServedAccuracy",
    "ServedOn",
    "ServedVsOffline",
    "Sized",
    "Speedup",
    "StageResult",
    "VllmSettings",
    "evaluation_settings",
]
