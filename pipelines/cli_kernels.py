"""`qeval kernels`: the kernel table (quant/kernels.py) for precisions, on every device class it knows: the kernel
that runs each, how, and where none does, why. Registered on the command line by pipelines/cli.py.
"""

from __future__ import annotations

from itertools import groupby

from rich.table import Table

from pipelines.cli_common import JsonOpt, PrecisionsOpt, emit_json, guarded, out
from pipelines.core.system.errors import QevalError
from quant.execution import runs_on
from quant.kernels import CLASSES, CPU_CLASSES, GPU_CLASSES, NATIVE
from quant.precisions import PRECISIONS, get_precision

CAPABILITY = {"sm80": "8.0", "sm89": "8.9", "sm90": "9.0", "sm100": "10.x", "sm120": "12.x"}


def table_rows(precisions: list[str]) -> list[dict]:
    """One row per precision and device class: the kernel (empty for the baseline's own dtype), how it runs, why."""
    rows = []
    for name in precisions:
        for cls in CLASSES:
            row = runs_on(name, cls)
            rows.append(
                {"precision": name, "device": cls, "kernel": row.kernel, "runs": str(row.execution), "why": row.why}
            )
    return rows


def natively(precision: str) -> str:
    """Where the table runs `precision` on its own units, in a few words: "CPUs, 8.0-9.0", "from 10.x", "none"."""
    native = [c for c in CLASSES if runs_on(precision, c).execution == NATIVE]
    cpus = [c for c in CPU_CLASSES if c in native]
    parts = ["CPUs"] if len(cpus) == len(CPU_CLASSES) else [f"{c.removeprefix('cpu-').upper()} CPUs" for c in cpus]
    for inside, run in groupby(GPU_CLASSES, key=lambda c: c in native):  # contiguous runs of capabilities
        if inside:
            parts.append(_span(list(run)))
    return ", ".join(parts) or "none"


def _span(run: list[str]) -> str:
    if run[-1] == GPU_CLASSES[-1] and len(run) > 1:
        return f"from {CAPABILITY[run[0]]}"
    return CAPABILITY[run[0]] if len(run) == 1 else f"{CAPABILITY[run[0]]}-{CAPABILITY[run[-1]]}"


@guarded
def kernels(precision: PrecisionsOpt = None, as_json: JsonOpt = False) -> None:
    """Which kernel of vLLM runs each precision on each device class, how, and where none does, why."""
    names = precision or list(PRECISIONS)
    for name in names:
        try:
            get_precision(name)
        except ValueError as e:
            raise QevalError(str(e)) from None
    rows = table_rows(names)
    table = Table(title="kernels (vLLM 0.32; quant/kernels.py)")
    for col in ("precision", "device", "kernel", "runs", "why"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(r["precision"], r["device"], r["kernel"] or "", r["runs"], r["why"])
    out.print(table)
    emit_json({"kernels": rows}, as_json)
