"""dbMethod.TDEngine: refused with a reason (nothing here to test a writer against), never silently dropped."""

from __future__ import annotations

import pytest

from mapper.edge.push import tdengine as push_tdengine
from mapper.errors import PermanentError, UnsupportedError
from mapper.shared.push import DbTdengine, PushSecrets


def test_tdengine_is_refused_with_a_reason_that_names_it() -> None:
    method = DbTdengine(addr="127.0.0.1:6041", db_name="gpu")
    with pytest.raises(PermanentError) as caught:
        push_tdengine.make_writer(method, PushSecrets(username="root", password="taosdata"), timeout_s=1.0)
    assert isinstance(caught.value, UnsupportedError)
    assert caught.value.reason == "not-supported"
    message = str(caught.value)
    assert "TDEngine" in message and "no server to test against" in message and "'127.0.0.1:6041'" in message
    assert "taosdata" not in message
