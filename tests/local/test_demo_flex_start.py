"""`tpuft demo --rehearse-tpu --flex-start`, pure: the rehearsal's v6e 4x4 object queued to the
local cluster's flex-start LocalQueue with provisioning flexStart, and refused without --rehearse-tpu."""
from __future__ import annotations

import argparse

import pytest

from tpuft.api import kueue
from tpuft.api.spec import parse
from tpuft_local import demo
from tpuft_local.demo_objects import DemoError
from tpuft_local.kueue import FLEX_START


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    demo.add_demo_arguments(p)
    return p.parse_args(list(argv))


def test_flex_start_rehearsal_queues_the_v6e_slice_for_a_provisioning_request():
    manifest = demo._manifest(_args("--rehearse-tpu", "--flex-start"))
    assert manifest["metadata"]["labels"][kueue.KUEUE_QUEUE_LABEL] == FLEX_START
    tft = parse({**manifest, "metadata": {**manifest["metadata"], "namespace": "tpuft-demo"}})
    assert tft.spec.scheduling.flex_start and tft.spec.slice.topology == "4x4" and tft.spec.slice.hosts == 4
    assert "labels" not in (demo._manifest(_args("--rehearse-tpu")).get("metadata") or {})


def test_flex_start_without_the_tpu_rehearsal_is_refused():
    with pytest.raises(DemoError, match="--rehearse-tpu"):
        demo._manifest(_args("--flex-start"))
