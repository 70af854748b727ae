"""The images built for real (buildah, from the repo's Dockerfiles), once per session; the
second and later sessions hit the cache under ${TPUFT_CACHE:-~/.cache/tpuft}/images."""
from __future__ import annotations

import shutil
import sys

import pytest


@pytest.fixture(scope="session")
def built_images():
    if not shutil.which("buildah"):
        pytest.skip("buildah is not installed (`apt-get install buildah`): the image tests build the images with it")
    from tpuft_local.images import ensure_images

    # A cold build takes many minutes (PyPI's torch is ~4.5 GB): progress goes to stderr.
    return ensure_images(progress=lambda msg: print(f"[images] {msg}", file=sys.stderr, flush=True))
