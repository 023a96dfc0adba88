"""`qeval ui`: the MLflow UI over the store, and the address of each model's runs table (the page to open)."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import subprocess

from rich.console import Console

from pipelines.core.system.errors import QevalError
from pipelines.core.system.net import redact
from pipelines.core.system.procs import stop_process_group
from pipelines.tracking.mlflow_tracker import experiment_ids
from pipelines.tracking.store import UI_ENV, tracking_uri, ui_command
from pipelines.tracking.view import view_url


def _checked_host(host: str) -> str:
    """`host` as a URL shows it ('[::1]' for an IPv6 address); a QevalError for an empty or malformed one (an empty
    host binds every interface, as 0.0.0.0 does, which must be asked for by name)."""
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        if not re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9.\-]{0,251}[A-Za-z0-9])?", host):
            raise QevalError(
                "--host is not an address or a host name; give one (127.0.0.1, or 0.0.0.0 to share on every interface)"
            ) from None
        try:
            socket.getaddrinfo(host, None)
        except OSError:
            raise QevalError(f"--host {host} does not resolve to an address of this machine") from None
        return host
    return f"[{literal}]" if literal.version == 6 else str(literal)


def serve_ui(host: str, port: int, model: str | None, out: Console, err: Console) -> None:
    """Print each model's address, then run the MLflow UI on host:port until it exits or Ctrl-C."""
    shown = _checked_host(host)
    with socket.socket(
        socket.AF_INET6 if ":" in host else socket.AF_INET
    ) as probe:  # uvicorn would only log "address in use" and exit 0
        try:
            probe.bind((host, port))
        except OSError as e:
            raise QevalError(f"cannot listen on {host}:{port} ({e.strerror}); pick another with --port") from None
    base = f"http://{shown}:{port}"
    if ipaddress.ip_address(socket.getaddrinfo(host, port)[0][4][0]).is_unspecified:
        err.print(f"listening on every interface of this machine ({host}): anyone who can reach it sees the store")
    err.print(f"MLflow UI on {base} (store: {redact(tracking_uri())})", highlight=False)
    ids = experiment_ids()
    if model is not None and model not in ids:
        raise QevalError(f"no runs of '{model}' in {redact(tracking_uri())}; run: qeval run --model {model}")
    for name, experiment in ids.items():
        if model in (None, name):  # the address a user opens: the runs table, with qeval's columns and charts
            out.print(f"{name}: {view_url(base, experiment)}", highlight=False, soft_wrap=True)
    if not ids:
        err.print("the store has no qeval runs yet: run `make run` first", highlight=False)
    proc = subprocess.Popen(ui_command(host, port), env={**os.environ, **UI_ENV}, start_new_session=True)
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        stop_process_group(proc)
        code = 0
    if code != 0:
        raise QevalError(f"the MLflow UI exited with status {code} (is port {port} free? try --port)")
