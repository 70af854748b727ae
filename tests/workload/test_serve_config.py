"""The RayService's Serve config is what Ray 2.60 itself accepts: each rendered LLMConfig is parsed by
Ray Serve LLM's own model (imported without vLLM from ray.llm's internal module, see
shared facts section 11), and the slice placement Ray derives from it is one whole slice."""
import pytest
import yaml

from tests.factories import MINIMUM, with_
from tpuft.controller import builders
from tpuft.api.spec import parse

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


@pytest.mark.parametrize("serve", [
    {"replicas": 2},
    {"replicas": {"min": 1, "max": 3}},
    {"engine": "transformers", "replicas": 2},
    {"engine": "transformers", "replicas": {"min": 2, "max": 4}},
], ids=["vllm-fixed", "vllm-autoscaled", "transformers-fixed", "transformers-autoscaled"])
def test_ray_serve_accepts_the_replica_counts_as_rendered(serve):
    """The whole serveConfigV2 through Serve's own deploy schema, and the autoscaled LLMConfig's
    deployment_config through Serve LLM's model: an autoscaling_config, never beside num_replicas."""
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
    from ray.serve.schema import ServeDeploySchema

    doc = with_("spec.serve", {"enabled": True, "image": "vllm-tpu:1", **serve}, MINIMUM)
    config = yaml.safe_load(builders.build_rayservice(parse(doc))["spec"]["serveConfigV2"])
    (app,) = ServeDeploySchema.model_validate(config).applications
    if serve.get("engine") == "transformers":
        (deployment,) = app.deployments
        given = deployment.model_dump(exclude_unset=True)   # unset fields hold Serve's DEFAULT sentinel
    else:
        given = LLMConfig.model_validate(app.args["llm_configs"][0]).deployment_config
    replicas = serve["replicas"]
    if isinstance(replicas, int):
        assert given["num_replicas"] == replicas and "autoscaling_config" not in given
    else:
        scaling = given["autoscaling_config"]
        assert (scaling["min_replicas"], scaling["max_replicas"]) == (replicas["min"], replicas["max"])
        assert "num_replicas" not in given
