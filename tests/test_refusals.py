"""Inputs refused where they are read, in one line that says what is expected (integrity, round four: issue 67):
addresses to listen on, credentials in a server's address, card values that would be printed back."""

from __future__ import annotations

import pytest

from pipelines.core.system.errors import QevalError


@pytest.mark.parametrize("host", ["", " ", "bad host", "a;b", "-h"])
def test_the_ui_listens_only_on_an_address_asked_for_by_name(host):
    from pipelines.ui import _checked_host

    with pytest.raises(QevalError, match=r"--host is not an address or a host name; give one \(127\.0\.0\.1"):
        _checked_host(host)


def test_the_ui_shows_its_address_as_a_url_writes_it():
    from pipelines.ui import _checked_host

    assert _checked_host("127.0.0.1") == "127.0.0.1" and _checked_host("::1") == "[::1]"
    assert _checked_host("localhost") == "localhost"


def test_a_servers_address_is_recorded_without_its_credentials():
    from pipelines.core.system.net import Unreachable, redact

    url = "http://user:PASSWORD@127.0.0.1:8000/v1?api_key=SECRET#frag"
    shown = redact(url)
    assert shown == "http://***@127.0.0.1:8000/v1?***" and "PASSWORD" not in str(Unreachable(url, "refused"))
    assert redact("http://127.0.0.1:8000") == "http://127.0.0.1:8000"


def _rewritten(path, change) -> None:
    """`path`'s JSON changed by `change`, in a new file (the session's stage folders are hard-linked into
    own_root: writing in place would change the original)."""
    import json

    data = json.loads(path.read_text())
    change(data)
    path.unlink()
    path.write_text(json.dumps(data))


@pytest.mark.integration
def test_a_stage_not_as_it_finished_is_named_by_the_gate_and_runs_again(own_root):
    """Issue 67: one per-document record removed, the gate said "rerun evaluate" and `qeval evaluate` skipped the
    stage as unchanged; a checkpoint built again was judged on the evaluation of the old one; another build's
    evaluation copied into a build's folder passed."""
    import shutil

    from memory_tracker import MemoryTracker

    from pipelines.core.card.cards import load_card
    from pipelines.decision.gate import gate
    from pipelines.present.shipcard import ship_card
    from pipelines.stages.evaluate import evaluate

    card, tracker = load_card("ref-small"), MemoryTracker("ref-small")
    folder = own_root / "artifacts/ref-small/int8/evaluate"
    record = next(folder.glob("samples_*.jsonl"))
    record.unlink()
    with pytest.raises(QevalError, match=rf"int8 evaluate: {record.name} is missing since it finished; rerun: qeval "):
        gate(card, tracker, ship_card=ship_card)
    again = evaluate(card, "int8", tracker)  # the command the gate names does what it says
    assert again.status == "done" and record.is_file()

    # a checkpoint built again (its quantize stage's key changed): the evaluation measured other weights
    _rewritten(own_root / "artifacts/ref-small/int8/quantize/manifest.json", lambda m: m.update(inputs_digest="0" * 64))
    with pytest.raises(
        QevalError,
        match=r"int8 evaluate: it measured other weights than the checkpoint holds now \(built again since\); rerun",
    ):
        gate(card, tracker, ship_card=ship_card)

    # fp8's evaluation copied into awq's folder is not awq's: there is none
    shutil.rmtree(own_root / "artifacts/ref-small/awq/evaluate")
    shutil.copytree(own_root / "artifacts/ref-small/fp8/evaluate", own_root / "artifacts/ref-small/awq/evaluate")
    from pipelines.core.store.manifests import finished
    from pipelines.core.store.results import Evaluated

    assert finished("ref-small", "awq", Evaluated) is None


@pytest.mark.parametrize("value", ["1e-9", "inf", "nan", "-3", "abc"])
def test_progress_lines_come_at_a_sane_interval_or_the_setting_is_refused(monkeypatch, value):
    """A progress interval of a nanosecond floods the log; infinity is no progress at all (issue 67)."""
    from pipelines.core.system.progress import every_s

    monkeypatch.setenv("QEVAL_PROGRESS_S", value)
    with pytest.raises(QevalError, match=r"^QEVAL_PROGRESS_S is not a number of seconds from 1 to 86400"):
        every_s()
    monkeypatch.setenv("QEVAL_PROGRESS_S", "5")
    assert every_s() == 5
