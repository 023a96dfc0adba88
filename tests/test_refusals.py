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
