"""tpuft_local.gcs's metadata stand-in answers as the GKE metadata server does: the Metadata-Flavor
header required (403 without it) and echoed, the token's three fields, the project's id and number,
and no token at all when told to refuse (a Kubernetes service account without a binding)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tpuft_local import gcs


@pytest.fixture
def metadata():
    server = gcs.MetadataServer().start()
    try:
        yield server
    finally:
        server.stop()


def _get(server: gcs.MetadataServer, path: str, flavor: bool = True):
    headers = {"Metadata-Flavor": "Google"} if flavor else {}
    request = urllib.request.Request(f"http://{server.root}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.headers.get("Metadata-Flavor"), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Metadata-Flavor"), e.read().decode()


def test_a_token_has_the_real_endpoints_fields(metadata):
    status, flavor, body = _get(metadata, gcs.TOKEN_PATH)
    token = json.loads(body)
    assert (status, flavor) == (200, "Google")
    assert set(token) == {"access_token", "expires_in", "token_type"} and token["token_type"] == "Bearer"
    assert metadata.identity.tokens_served == [token["access_token"]]
    assert _get(metadata, gcs.PROJECT_ID_PATH)[2] == gcs.DEFAULT_PROJECT_ID
    assert _get(metadata, gcs.PROJECT_NUMBER_PATH)[2] == gcs.DEFAULT_PROJECT_NUMBER


def test_no_flavor_header_or_a_refusing_identity_gets_no_token(metadata):
    assert _get(metadata, gcs.TOKEN_PATH, flavor=False)[0] == 403
    metadata.identity.grant = False
    status, _, body = _get(metadata, gcs.TOKEN_PATH)
    assert status == 403 and "access_token" not in body and metadata.identity.tokens_served == []
