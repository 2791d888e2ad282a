"""``pushMethod.http``: the framework's form POST, one per sample, to ``hostName:port/requestPath``.

Wire-compatible with KubeEdge's mapper framework (docs/push.md): ``POST <hostName>:<port><requestPath>`` with
``Content-Type: application/x-www-form-urlencoded`` and the body ``<property>=<value>&time=<YYYY-MM-DD HH:MM:SS>``
(``mapper.edge.push.wire.http_body``; the time is the sample's). Unlike the framework: https with the CA bundle of
the mapper's config (``push.caFile``), a timeout on every request (the spec's ``timeout`` in ms, else
``push.timeout``), and the answer counts: 2xx is delivered; 408, 425, 429 and 5xx are kept and sent again later
(``TransientError``, honouring ``Retry-After``); any other status is a refusal (``PermanentError``), counted and
dropped. One sample per request, so a sample is never sent twice because another one failed.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence

from mapper.edge.push.spec import destination_key, http_url
from mapper.edge.push.wire import check_answer, http_body
from mapper.net.httpclient import HttpClient
from mapper.shared.push import PushHttp, PushSample

FORM = {"Content-Type": "application/x-www-form-urlencoded"}


class HttpWriter:
    """Writes samples to one http destination (``PushHttp``), in order, one POST each."""

    #: Samples a destination hands to one ``write``: one, so that a failure never sends another one twice.
    max_batch = 1

    def __init__(self, method: PushHttp, *, timeout_s: float, tls: ssl.SSLContext | None = None) -> None:
        self.method = method
        self.key = destination_key(method)
        self.url = http_url(method)
        base, _, path = self.url.partition("://")
        host, slash, rest = path.partition("/")
        self.target = slash + rest if slash else "/"
        wait_s = method.timeout_ms / 1000 if method.timeout_ms > 0 else timeout_s
        self.client = HttpClient(f"{base}://{host}", timeout_s=wait_s, tls=tls)

    async def write(self, samples: Sequence[PushSample]) -> None:
        for sample in samples:
            answer = await self.client.post(self.target, http_body(sample), FORM)
            check_answer(answer, f"http {self.url}")

    async def aclose(self) -> None:
        await self.client.aclose()
