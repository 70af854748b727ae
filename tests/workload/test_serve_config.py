"""The RayService's Serve config is what Ray 2.60 itself accepts: each rendered LLMConfig is parsed by
Ray Serve LLM's own model (imported without vLLM from ray.llm's internal module, see
shared facts section 11), and the slice placement Ray derives from it is one whole slice."""
import pytest
import yaml

from tests.factories import MINIMUM, with_
from tpuft import builders
from tpuft.spec import parse

pytestmark = pytest.mark.slow

SHAPES = [({"accelerator": "v6e", "topology": "4x4"}, 16), ({"accelerator": "tpu7x", "topology": "2x2x2"}, 16),
          ({"accelerator": "v6e", "topology": "2x4"}, 8)]


def llm_config(serve: dict) -> dict:
    doc = with_("spec.serve", {"enabled": True, "image": "vllm-tpu:1", "maxModelLength": 2048, **serve}, MINIMUM)
    svc = builders.build_rayservice(parse(doc))
    return yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"][0]["args"]["llm_configs"][0]


@pytest.mark.parametrize("serve,devices", SHAPES, ids=[s["topology"] for s, _ in SHAPES])
def test_ray_serve_llm_accepts_the_rendered_llm_config(serve, devices):
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig

    cfg = LLMConfig.model_validate(llm_config(serve))
    assert cfg.accelerator_type == llm_config(serve)["accelerator_type"]
    assert cfg.accelerator_config.kind == "tpu" and cfg.accelerator_config.topology == serve["topology"]
    assert cfg.engine_kwargs["tensor_parallel_size"] == devices
    assert cfg.model_loading_config.model_id == MINIMUM["metadata"]["name"]


def test_ray_serve_llm_refuses_a_topology_without_an_accelerator_type():
    """The guard above can fail: Ray's own model refuses the half-written slice line."""
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig

    bad = llm_config({"topology": "4x4"})
    bad.pop("accelerator_type")
    with pytest.raises(Exception, match="accelerator_type"):
        LLMConfig.model_validate(bad)
