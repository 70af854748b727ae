"""Fixtures for code that keeps files in gs://: a real GCS API (fake-gcs-server, built once per machine
through tpuft_local.toolchain: a missing Go toolchain fails the test, never skips it) and the GKE
metadata server's token endpoint, both on loopback (tpuft_local.gcs).

  fake_gcs      session   tpuft_local.gcs.FakeGcs (filesystem backend, in a temporary folder)
  gcs_metadata  session   tpuft_local.gcs.MetadataServer (its .identity.grant: tokens or none)
  gcs           function  GcsBucket: a fresh bucket, and this process's env pointing pyarrow's GCS
                          client at both stand-ins (restored afterwards; tokens granted again)
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class GcsBucket:
    uri: str            # gs://<bucket>
    name: str
    server: object      # tpuft_local.gcs.FakeGcs
    metadata: object    # tpuft_local.gcs.MetadataServer
    env: dict           # what a child process needs (tpuft_local.gcs.workload_env)

    def path(self, *parts: str) -> str:
        return "/".join([self.uri, *parts])

    def local(self, *parts: str):
        """Where the filesystem backend keeps an object (to read what was written without the client)."""
        return self.server.data_dir.joinpath(self.name, *parts)


@pytest.fixture(scope="session")
def fake_gcs(tmp_path_factory):
    from tpuft_local import gcs

    server = gcs.start_fake_gcs(tmp_path_factory.mktemp("fake-gcs") / "data")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def gcs_metadata():
    from tpuft_local import gcs

    server = gcs.MetadataServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def gcs(fake_gcs, gcs_metadata, monkeypatch) -> GcsBucket:
    from tpuft_local import gcs as standins

    env = standins.workload_env(fake_gcs.endpoint, gcs_metadata.root)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    name = f"tpuft-test-{uuid.uuid4().hex[:10]}"
    uri = fake_gcs.bucket(name)
    gcs_metadata.identity.grant = True
    try:
        yield GcsBucket(uri, name, fake_gcs, gcs_metadata, env)
    finally:
        gcs_metadata.identity.grant = True
