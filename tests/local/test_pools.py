"""Simulated GKE node pools: shapes from the catalog, GKE's allocatable, the TPU taint."""
import pytest

from tpuft.api import catalog
from tpuft_local import pools


def test_default_pools_are_two_v6e_4x4_slices_and_one_tpu7x_2x2x2():
    nodes = pools.all_nodes(pools.DEFAULT_POOLS)
    shapes = [(n["metadata"]["labels"].get("cloud.google.com/gke-tpu-topology"),
               n["metadata"]["labels"]["node.kubernetes.io/instance-type"]) for n in nodes]
    assert shapes.count(("4x4", "ct6e-standard-4t")) == 8
    v6e = [n["metadata"]["labels"][pools.POOL_LABEL] for n in nodes if n["metadata"]["name"].startswith("gke-v6e")]
    assert sorted(set(v6e)) == ["v6e-4x4-0", "v6e-4x4-1"] and v6e.count("v6e-4x4-0") == 4   # one pool per slice
    assert shapes.count(("2x2x2", "tpu7x-standard-4t")) == 2
    assert shapes.count((None, pools.CPU_POOL_MACHINE)) == 1


@pytest.mark.parametrize("accel,topology", [("v6e", "4x4"), ("tpu7x", "2x2x2"), ("v5e", "4x4"), ("v5p", "2x2x2")])
def test_tpu_node_labels_are_the_operators_node_selectors(accel, topology):
    s = catalog.resolve_slice(accel, topology)
    nodes = pools.tpu_nodes(pools.TpuPool(accel, topology))
    assert len(nodes) == s.hosts
    for n in nodes:
        labels = n["metadata"]["labels"]
        assert s.node_selector.items() <= labels.items()  # what the RayCluster's workers select
        assert n["status"]["capacity"]["google.com/tpu"] == str(s.chips_per_host)
        assert n["spec"]["taints"] == [{"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"}]
        assert n["metadata"]["annotations"][pools.KWOK_ANNOTATION] == "fake"
    assert len({n["metadata"]["labels"][pools.POOL_LABEL] for n in nodes}) == 1  # one slice, one node pool


def test_the_gke_tutorials_worker_requests_fit_a_simulated_host():
    """GKE's Ray-on-TPU tutorial's v6e worker asks for 64 CPU and 250Gi: it fits a ct6e-standard-4t as on GKE."""
    node = pools.tpu_nodes(pools.TpuPool("v6e", "4x4"))[0]
    cpu_m = int(node["status"]["allocatable"]["cpu"].rstrip("m"))
    mem_mi = int(node["status"]["allocatable"]["memory"].rstrip("Mi"))
    assert cpu_m >= 64_000 and mem_mi >= 250 * 1024


@pytest.mark.parametrize("machine,cpu,memory", [
    (pools.Machine(180, 720), "179480m", f"{int((720 - 21.16) * 1024) - 100}Mi"),  # 6%+1%+0.5%x2+0.25%x176; 25/20/10/6/2 %
    (pools.Machine(16, 64), "15890m", f"{int((64 - (1 + 0.8 + 0.8 + 48 * 0.06)) * 1024) - 100}Mi"),
])
def test_allocatable_is_capacity_minus_gkes_reservations(machine, cpu, memory):
    assert pools.gke_allocatable(machine) == (cpu, memory)


@pytest.mark.parametrize("text,message", [
    ("v6e", "expected ACCEL:TOPOLOGY"), ("v6e:4x4:0", "SLICES must be a positive integer"),
    ("v6e:3x3", "not a v6e slice shape"), ("h100:8", "h100"),
])
def test_tpu_pool_flag_errors_name_the_flag(text, message):
    with pytest.raises(ValueError, match="--tpu-pool") as err:
        pools.TpuPool.parse(text)
    assert message in str(err.value)


def test_tpu_pool_flag_with_slices():
    pool = pools.TpuPool.parse("tpu7x:2x2x2:2")
    assert (pool.accelerator, pool.topology, pool.slices) == ("tpu7x", "2x2x2", 2)
    assert len(pools.tpu_nodes(pool)) == 4


def test_the_simulated_cpu_pool_is_only_where_nothing_real_fits():
    """Soft-tainted: the scheduler places a pod there only when the real node cannot take it (a
    KubeRay submitter there would be marked Completed by KWOK without running: issue 34)."""
    node = pools.cpu_node()
    assert node["spec"]["taints"] == [{"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "PreferNoSchedule"}]
