"""tpuft_workload.metrics_log.Prometheus with a stand-in for ray.util.metrics.Gauge: rank 0 sets one
gauge per TrainMetric from a report, tagged with the TPUFinetune's name; a value it does not have
(MFU on CPU) is never set; other ranks create nothing; a failing gauge turns it off, never the run.
That Ray exports them is the workload tier's (tests/workload/test_train.py)."""
from __future__ import annotations

import pytest

from tpuft.api.constants import TRAIN_METRIC_TAG, TrainMetric
from tpuft_workload.metrics_log import Prometheus


class _Gauges:
    """Records every gauge made and every value set."""

    def __init__(self, fail: bool = False):
        self.made, self.set, self.fail = {}, [], fail

    def __call__(self, name, description, tag_keys):
        assert description and tag_keys == (TRAIN_METRIC_TAG,)
        self.made[name] = description
        gauges = self

        class Gauge:
            def set(self, value, tags):
                if gauges.fail:
                    raise RuntimeError("no metrics agent")
                gauges.set.append((name, value, tags))

        return Gauge()


REPORT = {"loss": 1.5, "tokens_per_s": 1234.0, "step_time_s": 0.25, "padded_tokens_per_s": 1300.0}


@pytest.mark.parametrize("mfu,expected", [
    (None, {"tpuft_train_loss": 1.5, "tpuft_train_tokens_per_second": 1234.0, "tpuft_train_step_time_seconds": 0.25,
            "tpuft_train_step": 7.0}),                                          # CPU: no MFU series at all
    (0.41, {"tpuft_train_loss": 1.5, "tpuft_train_tokens_per_second": 1234.0, "tpuft_train_step_time_seconds": 0.25,
            "tpuft_train_step": 7.0, "tpuft_train_mfu": 0.41}),
])
def test_rank_0_sets_one_gauge_per_metric(mfu, expected):
    gauges = _Gauges()
    Prometheus(True, "tiny", gauge=gauges).add(7, {**REPORT, "mfu": mfu})
    assert set(gauges.made) == {m.value for m in TrainMetric}
    assert {name: value for name, value, _ in gauges.set} == expected
    assert {tuple(tags.items()) for _, _, tags in gauges.set} == {((TRAIN_METRIC_TAG, "tiny"),)}


def test_other_ranks_make_no_gauges():
    gauges = _Gauges()
    Prometheus(False, "tiny", gauge=gauges).add(7, REPORT)
    assert gauges.made == {} and gauges.set == []


def test_a_failing_gauge_turns_it_off(caplog):
    gauges = _Gauges(fail=True)
    prom = Prometheus(True, "tiny", gauge=gauges)
    prom.add(7, REPORT)
    prom.add(8, REPORT)   # off: no second warning
    assert not prom.enabled and caplog.text.count("Prometheus gauges are off") == 1


def test_exported_names_carry_rays_prefix():
    assert TrainMetric.LOSS.exported == "ray_tpuft_train_loss"
