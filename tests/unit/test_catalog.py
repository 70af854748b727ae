"""The TPU catalog: every generation's facts, valid and invalid shapes (table-driven)."""
import pytest

from tpuft.api import catalog

VALID = [
    # accelerator, topology, generation, hosts, chips/host, devices/host, devices, machine, ray type, per-chip, torch topo
    ("v6e", "4x4", "v6e", 4, 4, 4, 16, "ct6e-standard-4t", "TPU-V6E", 1, "4,4,1"),
    ("v6e", "16x16", "v6e", 64, 4, 4, 256, "ct6e-standard-4t", "TPU-V6E", 1, "16,16,1"),
    ("v6e", "1x1", "v6e", 1, 1, 1, 1, "ct6e-standard-1t", "TPU-V6E", 1, "1,1,1"),
    ("v6e", "2x2", "v6e", 1, 4, 4, 4, "ct6e-standard-4t", "TPU-V6E", 1, "2,2,1"),
    # 2x4 resolved as Ray does: one 8-chip VM (see catalog docstring).
    ("v6e", "2x4", "v6e", 1, 8, 8, 8, "ct6e-standard-8t", "TPU-V6E", 1, "2,4,1"),
    ("TPU-V6E", "4x8", "v6e", 8, 4, 4, 32, "ct6e-standard-4t", "TPU-V6E", 1, "4,8,1"),
    ("tpu-v6e-slice", "8x8", "v6e", 16, 4, 4, 64, "ct6e-standard-4t", "TPU-V6E", 1, "8,8,1"),
    ("tpu7x", "2x2x1", "tpu7x", 1, 4, 8, 8, "tpu7x-standard-4t", "TPU-V7X", 2, "2,2,1,2"),
    ("tpu7x", "2x2x2", "tpu7x", 2, 4, 8, 16, "tpu7x-standard-4t", "TPU-V7X", 2, "2,2,2,2"),
    ("TPU-V7X", "2x2x4", "tpu7x", 4, 4, 8, 32, "tpu7x-standard-4t", "TPU-V7X", 2, "2,2,4,2"),
    ("v7x", "2x4x4", "tpu7x", 8, 4, 8, 64, "tpu7x-standard-4t", "TPU-V7X", 2, "2,4,4,2"),
    ("ironwood", "4x4x4", "tpu7x", 16, 4, 8, 128, "tpu7x-standard-4t", "TPU-V7X", 2, "4,4,4,2"),
    ("v4", "2x2x4", "v4", 4, 4, 4, 16, "ct4p-hightpu-4t", "TPU-V4", 1, "2,2,4"),
    ("TPU-V4", "2x2x1", "v4", 1, 4, 4, 4, "ct4p-hightpu-4t", "TPU-V4", 1, "2,2,1"),
    ("v5p", "2x2x2", "v5p", 2, 4, 4, 8, "ct5p-hightpu-4t", "TPU-V5P", 1, "2,2,2"),
    ("tpu-v5p-slice", "4x4x4", "v5p", 16, 4, 4, 64, "ct5p-hightpu-4t", "TPU-V5P", 1, "4,4,4"),
    ("v5e", "4x4", "v5e", 4, 4, 4, 16, "ct5lp-hightpu-4t", "TPU-V5LITEPOD", 1, "4,4,1"),
    ("v5litepod", "2x4", "v5e", 1, 8, 8, 8, "ct5lp-hightpu-8t", "TPU-V5LITEPOD", 1, "2,4,1"),
    ("tpu-v5-lite-podslice", "16x16", "v5e", 64, 4, 4, 256, "ct5lp-hightpu-4t", "TPU-V5LITEPOD", 1, "16,16,1"),
]


@pytest.mark.parametrize("acc,topo,gen,hosts,cph,dph,devices,machine,ray_type,per_chip,torch_topo", VALID)
def test_valid_shapes(acc, topo, gen, hosts, cph, dph, devices, machine, ray_type, per_chip, torch_topo):
    s = catalog.resolve_slice(acc, topo)
    assert (s.generation, s.hosts, s.chips_per_host, s.devices_per_host, s.devices) == (gen, hosts, cph, dph, devices)
    assert s.machine_type == machine
    assert s.ray_accelerator_type == ray_type
    assert s.tpu_resource_per_chip == per_chip
    assert s.torch_tpu_topology == torch_topo
    assert s.chips == s.hosts * s.chips_per_host  # every chip on exactly one host
    assert s.node_selector == {"cloud.google.com/gke-tpu-accelerator": catalog.generation(gen).gke_accelerator,
                               "cloud.google.com/gke-tpu-topology": topo}


INVALID = [
    # accelerator, topology, field at fault, words the message must contain
    ("v6e", "2x2x2", "spec.topology", ["2D", "4x4"]),           # 3D on a 2D generation
    ("tpu7x", "4x4", "spec.topology", ["3D", "2x2x2"]),         # 2D on TPU7x
    ("v5p", "4x4", "spec.topology", ["3D"]),
    ("v6e", "3x3", "spec.topology", ["not a v6e slice shape", "4x4"]),  # a shape GKE does not offer
    ("v6e", "4x4x", "spec.topology", ["not a shape"]),
    ("v6e", "16", "spec.topology", ["2D"]),                     # a chip count is not a shape
    ("v6e", "4X4.5", "spec.topology", ["not a shape"]),
    ("v6e", "0x4", "spec.topology", ["not a shape"]),
    ("v6e", "04x4", "spec.topology", ["not a shape"]),
    ("v6e", "", "spec.topology", ["must be a string"]),
    ("v6e", None, "spec.topology", ["must be a string"]),
    ("v6e", 16, "spec.topology", ["must be a string"]),
    ("tpu7x", "3x3x3", "spec.topology", ["allowed"]),
    ("v4", "2x2", "spec.topology", ["3D"]),
    ("v9", "4x4", "spec.accelerator", ["unknown accelerator", "v6e", "tpu7x"]),
    ("gpu", "4x4", "spec.accelerator", ["unknown accelerator"]),
    ("", "4x4", "spec.accelerator", ["must be one of"]),
    (None, "4x4", "spec.accelerator", ["must be one of"]),
    ("cpu", "2x2", "spec.topology", ["worker count"]),
    ("cpu", "0", "spec.topology", ["between 1 and"]),
    ("cpu", "65", "spec.topology", ["between 1 and"]),
    ("cpu", "-1", "spec.topology", ["worker count"]),
]


@pytest.mark.parametrize("acc,topo,field,words", INVALID)
def test_invalid_shapes_name_the_field_and_the_fix(acc, topo, field, words):
    with pytest.raises(catalog.CatalogError) as err:
        catalog.resolve_slice(acc, topo)
    assert err.value.field == field
    for w in words:
        assert w in str(err.value)


def test_cpu_mode_is_one_device_per_worker():
    s = catalog.resolve_slice("cpu", "3")
    assert (s.is_tpu, s.hosts, s.devices, s.node_selector, s.ray_accelerator_type) == (False, 3, 3, {}, None)


@pytest.mark.parametrize("gen", catalog.GENERATIONS, ids=lambda g: g.name)
def test_every_offered_shape_resolves_and_every_spelling_maps_back(gen):
    for topo in gen.topologies:
        s = catalog.resolve_slice(gen.name, topo)
        assert s.hosts >= 1 and s.devices == s.hosts * s.devices_per_host
        assert len(s.dims) == gen.dims
    for spelling in (gen.ray_accelerator_type, gen.gke_accelerator, gen.ray_version, *gen.aliases):
        assert catalog.canonical_accelerator(spelling) == gen.name
        assert catalog.canonical_accelerator(spelling.upper()) == gen.name


def test_host_count_rule_matches_ray():
    """hosts = chips / 4 except single-host v5e/v6e shapes (Ray get_chips_per_host)."""
    for gen in catalog.GENERATIONS:
        for topo in gen.topologies:
            s = catalog.resolve_slice(gen.name, topo)
            expected = 1 if topo in gen.single_host else max(1, s.chips // 4)
            assert s.hosts == expected, (gen.name, topo)


@pytest.mark.parametrize("acc,topo,tflops", [("v4", "2x2x2", 8 * 275), ("v5e", "4x4", 16 * 197),
                                             ("v5p", "2x2x1", 4 * 459), ("v6e", "2x4", 8 * 918),
                                             ("tpu7x", "2x2x2", 8 * 2307)])
def test_a_slices_peak_is_its_chips_times_the_generations_peak(acc, topo, tflops):
    """MFU's denominator: bf16 peak per chip (Cloud TPU's pages), chips not devices (TPU7x: 2 per chip)."""
    assert catalog.resolve_slice(acc, topo).peak_flops == tflops * 1e12
    assert catalog.resolve_slice("cpu", "4").peak_flops is None


@pytest.mark.parametrize("name,tflops", [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835), ("NVIDIA H200", 989),
    ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A100 80GB PCIe", 312), ("NVIDIA L4", 121),
    ("NVIDIA L40S", None), ("Tesla T4", None), ("cpu", None),   # not listed: no peak, so no MFU
])
def test_a_gpus_peak_is_found_by_its_device_name(name, tflops):
    assert catalog.gpu_peak_flops(name) == (tflops * 1e12 if tflops else None)


@pytest.mark.parametrize("acc,topo,cpu,memory,shm", [
    ("v4", "2x2x2", "64", "200Gi", "100Gi"), ("v5e", "4x4", "24", "96Gi", "48Gi"), ("v5p", "2x2x1", "64", "200Gi", "100Gi"),
    ("v6e", "4x4", "64", "200Gi", "100Gi"), ("tpu7x", "2x2x2", "64", "250Gi", "128Gi"), ("cpu", "2", "1", "4Gi", "1Gi"),
])
def test_a_slices_default_pod_sizes_are_its_generations(acc, topo, cpu, memory, shm):
    s = catalog.resolve_slice(acc, topo)
    assert (s.worker_pod.cpu, s.worker_pod.memory, s.worker_pod.shm) == (cpu, memory, shm)
    assert s.head_pod == (catalog.TPU_HEAD if s.is_tpu else catalog.CPU_HEAD)


def test_reference_sized_workers_are_v6e_and_tpu7x():
    """The generations whose worker sizes reference manifests fix (the CRD's shmSize description names them)."""
    assert [g.name for g in catalog.GENERATIONS if g.worker.from_reference] == ["v6e", "tpu7x"]
