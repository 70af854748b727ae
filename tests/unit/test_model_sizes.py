"""tpuft.api.model_sizes: the arithmetic of what fits, and that the fit table (bench/lora_fit.py) and
`tpuft validate` give the same numbers."""
import dataclasses
import importlib.util
import json
import math

import pytest

from tests.factories import small_object
from tests.paths import REPO
from tpuft.api import catalog, model_sizes, spec
from tpuft.cli import cli_core
from tpuft.api.model_sizes import GB, GIB, LORA, Run


def _bench():
    loaded = importlib.util.spec_from_file_location("lora_fit", REPO / "bench" / "lora_fit.py")
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("model", "published"), [
    (model_sizes.LLAMA_3_2_1B, 1.24e9), (model_sizes.LLAMA_3_2_3B, 3.21e9), (model_sizes.LLAMA_3_1_8B, 8.03e9),
    (model_sizes.LLAMA_3_1_70B, 70.55e9), (model_sizes.GEMMA_3_1B, 1.00e9)])
def test_parameter_counts_match_the_published_sizes(model, published):
    assert model.parameters() == pytest.approx(published, rel=0.005)


def test_known_models_are_found_by_hugging_face_id_only():
    assert model_sizes.known("google/gemma-3-27b-it") is model_sizes.GEMMA_3_27B
    assert model_sizes.known("Meta-Llama/Llama-3.1-8B-Instruct") is model_sizes.LLAMA_3_1_8B
    assert model_sizes.known("google/gemma-4-E2B-it") is None
    assert model_sizes.known("gs://bucket/gemma-3-27b-it") is None
    assert set(model_sizes.BY_HF_ID.values()) == set(model_sizes.MODELS)


def test_quantities():
    assert model_sizes.quantity_bytes("200Gi") == 200 * GIB
    assert model_sizes.quantity_bytes("96G") == 96e9
    assert model_sizes.quantity_bytes("1024") == 1024
    with pytest.raises(ValueError):
        model_sizes.quantity_bytes("12X")


def test_lora_holds_the_frozen_base_in_bf16_on_a_tpu_and_in_fp32_on_cpu():
    m = model_sizes.LLAMA_3_1_8B
    p, a = m.parameters(), m.lora_parameters(16)
    tpu = model_sizes.fit(m, catalog.resolve_slice("v6e", "4x4"), Run(method=LORA))
    assert tpu.hbm.need == pytest.approx((2 * p + 16 * a) / 16 / GB)
    cpu = model_sizes.fit(m, catalog.resolve_slice("cpu", "2"), Run(method=LORA))
    assert cpu.hbm is None   # the pod holds the state: fp32 base, adapters with their moments
    assert cpu.training.need == pytest.approx((4 * p + 16 * a + 2 * cpu.step.total) / 2 / GIB
                                              + model_sizes.CPU_WORKER_RUNTIME_GIB)
    assert cpu.training.have == pytest.approx(4 * 0.95)   # the catalog's 4Gi cpu pod, less Ray's 5%


def test_each_rank_loads_only_its_shard_so_more_hosts_hold_less_each():
    m, overhead = model_sizes.GEMMA_3_27B, 4 * model_sizes.RANK_OVERHEAD_GIB
    small, large = (model_sizes.fit(m, catalog.resolve_slice("v6e", t)) for t in ("4x4", "4x8"))
    assert small.load.need - overhead == pytest.approx(4 * m.parameters() / 4 / GIB)   # 4 of 16 ranks' fp32 shards
    assert large.load.need - overhead == pytest.approx((small.load.need - overhead) / 2)
    assert small.export.need == large.export.need   # pod 0 gathers the whole model either way


def test_a_single_host_slice_holds_every_rank_in_one_pod():
    shape = catalog.resolve_slice("v6e", "2x4")
    f = model_sizes.fit(model_sizes.GEMMA_3_27B, shape)
    assert shape.hosts == 1
    assert f.load.need == pytest.approx(4 * model_sizes.GEMMA_3_27B.parameters() / GIB
                                        + 8 * model_sizes.RANK_OVERHEAD_GIB)


def test_the_results_file_is_what_the_bench_computes():
    bench = _bench()
    fresh = bench.table(16, model_sizes.HBM_RESERVE, model_sizes.RANK_OVERHEAD_GIB)
    assert json.loads((REPO / "bench" / "results" / "lora_fit.json").read_text()) == json.loads(json.dumps(fresh))


def test_the_fit_table_and_validate_use_the_same_numbers():
    bench = _bench()
    table = bench.table(16, model_sizes.HBM_RESERVE, model_sizes.RANK_OVERHEAD_GIB)
    row = next(r for r in table["rows"] if r["model"] == "Gemma 3 27B")
    full = row["fits"]["v6e 4x4"]["full"]
    assert not full["fits"] and row["fits"]["v6e 4x4"]["verdict"] == "LoRA only (full: HBM)"
    tft = spec.parse(small_object("big", "default", model="google/gemma-3-27b-it"))   # v6e 4x4, full
    (warning,) = cli_core.fit_warnings(tft)
    assert f"needs about {full['hbmGbPerChip']:.3g} GB of HBM per chip" in warning
    row = next(r for r in table["rows"] if r["model"] == "Llama 3.1 70B")
    merged = row["fits"]["v6e 4x4"]["loraMerged"]
    tft = spec.parse(small_object("big", "default", model="meta-llama/Llama-3.1-70B",
                                  training={"method": "lora"}, export={"merge": True}))
    (warning,) = cli_core.fit_warnings(tft)
    assert f"needs about {merged['hostGibExport']:.3g} GiB of memory in worker pod 0 at export" in warning
    assert row["fits"]["v6e 4x4"]["verdict"] == "LoRA, not merged (full: HBM, export; merged: export)"


# TinyLlama's shape, as bench/sharded_load.py builds it by default; examples/local-cpu-lora.yaml's step: 4 x 128 tokens
BENCH_1B = model_sizes.ModelShape("bench 1.1B", 32000, 2048, 5632, 22, 32, 4, 64, False)
DEMO_TOKENS = 4 * 128


def test_a_cpu_step_keeps_every_layer_s_activations_unless_they_are_recomputed():
    kept = model_sizes.step_memory(BENCH_1B, Run(method=LORA, tokens=DEMO_TOKENS)).kept
    recomputed = model_sizes.step_memory(BENCH_1B, Run(method=LORA, tokens=DEMO_TOKENS,
                                                       activation_checkpointing=True)).kept
    per_layer = DEMO_TOKENS * 4 * (16 * 2048 + 5 * 5632 + 2 * 256)   # LoRA: each projection's dropout keeps a copy
    assert kept == 22 * per_layer
    assert recomputed == 22 * DEMO_TOKENS * 4 * 2048 + per_layer   # each layer's input, and one layer at a time
    full = model_sizes.step_memory(BENCH_1B, Run(tokens=DEMO_TOKENS)).kept
    assert full == 22 * DEMO_TOKENS * 4 * (8 * 2048 + 4 * 5632 + 2 * 256)
    twice = model_sizes.step_memory(BENCH_1B, Run(method=LORA, tokens=2 * DEMO_TOKENS)).kept
    assert twice == 2 * kept


def test_a_cpu_step_holds_the_logits_and_the_gathered_weights():
    step = model_sizes.step_memory(BENCH_1B, Run(method=LORA, tokens=DEMO_TOKENS))
    assert step.logits == 3 * DEMO_TOKENS * 32000 * 4   # fp32: logits, log-softmax, their gradient
    assert step.output == 32000 * 2048 * 4   # the output layer whole, a copy beside the rank's shard
    layer = 2048 * 2048 * 2 + 2 * 2048 * 256 + 3 * 2048 * 5632 + 2 * 2048
    assert step.layer == 2 * 4 * layer   # one layer gathered: all-gather output and its copy
    tied = model_sizes.step_memory(model_sizes.LLAMA_3_2_1B, Run(method=LORA))
    assert tied.output == 128256 * 2048 * 4 and tied.kept == tied.logits == 0


def test_a_1b_lora_step_on_two_4gi_cpu_workers_is_told_to_recompute_activations():
    """The held-out run of issue 59: a 1.1B fp32 Llama, LoRA, 2 CPU workers of 4Gi, 4 x 128 tokens a step."""
    shape = catalog.resolve_slice("cpu", "2")
    run = Run(method=LORA, rank=8, pod_memory="4Gi", tokens=DEMO_TOKENS)
    kept = model_sizes.fit(BENCH_1B, shape, run)
    assert not kept.training.fits
    recomputed = model_sizes.fit(BENCH_1B, shape, dataclasses.replace(run, activation_checkpointing=True))
    assert recomputed.training.need < kept.training.need - 2   # 22 layers' activations against one's
    (warning,) = model_sizes.warnings("/models/tinyllama", kept)
    assert "memory per worker pod in training" in warning
    assert f"set spec.training.activationCheckpointing: true (then about {recomputed.training.need:.3g} GiB)" in warning
    assert "a smaller spec.training.batchSizePerDevice or maxSeqLength" in warning


def test_validate_counts_the_spec_s_tokens_and_activation_checkpointing():
    """Off, validate suggests turning it on; left out on cpu, it counts what the workers will decide
    (on here: the step with every layer's activations kept does not fit), as when it is set."""
    doc = dict(accelerator="cpu", topology="2", model="meta-llama/Llama-3.2-1B",
               training={"method": "lora", "batchSizePerDevice": 4, "maxSeqLength": 128, "activationCheckpointing": False})

    def training_warnings(**training) -> list[str]:
        parsed = spec.parse(small_object("one", "default", **{**doc, "training": {**doc["training"], **training}}))
        return [w for w in cli_core.fit_warnings(parsed) if "in training" in w]

    (kept,) = training_warnings()
    assert "set spec.training.activationCheckpointing: true" in kept
    (recomputed,) = training_warnings(activationCheckpointing=True)
    assert "activationCheckpointing" not in recomputed
    training = dict(doc["training"])
    del training["activationCheckpointing"]
    doc["training"] = training
    assert training_warnings() == [recomputed]


@pytest.mark.parametrize("results, hidden, layers", [
    ("sharded_load_0.15b_lora_step.json", 1024, 8), ("sharded_load_0.15b_lora_step_ac.json", 1024, 8),
    ("sharded_load_1b_lora_4gi.json", 2048, 22)])
def test_the_step_prediction_is_the_bench_s_and_covers_what_it_measured(results, hidden, layers):
    """bench/sharded_load.py's runs (2 CPU ranks, each in its own cgroup): the StepMemory terms it
    recorded are what step_memory gives now, and the predicted peak of Ray's used is at most 15%
    above the measured one, never below it."""
    (row,) = json.loads((REPO / "bench" / "results" / results).read_text())["rows"]
    shape = model_sizes.ModelShape("bench", 32000, hidden, int(hidden * 2.75), layers, hidden // 64,
                                   max(1, hidden // 512), 64, False)
    step = model_sizes.step_memory(shape, Run(method=LORA, rank=8, tokens=row["batch"] * row["seq"],
                                              activation_checkpointing=row["activation_checkpointing"]))
    predicted = row["predicted_mib"]
    assert [predicted[k] for k in ("output", "layer", "kept", "logits")] == [
        round(getattr(step, k) / 2**20) for k in ("output", "layer", "kept", "logits")]
    measured = max(row["pod_mib"][phase]["ray_used"] for phase in ("forward", "backward", "step"))
    assert measured <= predicted["peak"] <= 1.15 * measured
    if row["limit_mib"]:
        assert measured < 0.95 * row["limit_mib"]   # below Ray's memory monitor's threshold


def test_the_fit_table_predicts_the_held_out_run_s_worker_pods():
    """bench/sharded_load_pods.py: the held-out 1.1B LoRA run through `tpuft demo` on the local cluster
    (2 CPU workers of 4Gi, 4 x 128 tokens, activations recomputed): it succeeded, and the training
    figure is at most 5% above the worse worker pod's peak of Ray's used, never below it, and below
    what Ray's memory monitor lets a 4Gi pod use, as the run was."""
    result = json.loads((REPO / "bench" / "results" / "sharded_load_pods.json").read_text())
    assert (result["phase"], result["memory"], result["predicted"]["activation_checkpointing"]) == (
        "Succeeded", "4Gi", True)
    run = Run(method=LORA, rank=8, tokens=result["batch"] * result["seq"], pod_memory=result["memory"],
              activation_checkpointing=True)
    f = model_sizes.fit(BENCH_1B, catalog.resolve_slice("cpu", "2"), run)
    measured = result["worst_worker"]["peak_mib"]["ray_used"]
    assert measured <= f.training.need * 1024 <= 1.05 * measured
    assert f.training.fits and f.training.have * 1024 == pytest.approx(0.95 * 4096)


def test_a_pod_holds_what_ray_s_memory_monitor_lets_it_and_the_warning_names_the_limit_needed():
    """Past 95% of a pod's limit Ray's memory monitor kills a worker (the held-out run in 4Gi pods was
    killed at 3893 MiB of Ray's used): a figure fits below that, and a warning names the whole-Gi
    limit under which it would."""
    shape = catalog.resolve_slice("cpu", "2")
    run = Run(method=LORA, rank=8, tokens=DEMO_TOKENS, activation_checkpointing=True, pod_memory="3Gi")
    small = model_sizes.fit(BENCH_1B, shape, run)
    assert small.training.have == pytest.approx(3 * 0.95) and not small.training.fits
    (warning,) = model_sizes.warnings("/models/tinyllama", small)
    assert "more than the 2.85 GiB a pod of 3 GiB may use (95%" in warning
    assert f"to at least {math.ceil(small.training.need / 0.95)}Gi" in warning
    assert model_sizes.limit_for(3.8) == "4Gi" and model_sizes.limit_for(3.81) == "5Gi"


def test_validate_reads_a_local_model_folder_s_config(tmp_path):
    """spec.model as a folder on this machine (a local cluster's hostPath): `tpuft validate` reads its
    config.json, and warns when a worker pod is too small for the step."""
    (tmp_path / "config.json").write_text(json.dumps(TINYLLAMA_CONFIG))
    doc = dict(accelerator="cpu", topology="2", model=str(tmp_path),
               training={"method": "lora", "lora": {"rank": 8, "alpha": 16}, "batchSizePerDevice": 4,
                         "maxSeqLength": 128, "activationCheckpointing": True},
               resources={"worker": {"limits": {"memory": "3Gi"}}})
    (warning,) = [w for w in cli_core.fit_warnings(spec.parse(small_object("one", "default", **doc)))
                  if "in training" in w]
    assert warning.startswith(f"warning: spec.model {tmp_path} (1.1B parameters) needs about")
    assert "raise spec.resources.worker.limits.memory to at least 4Gi" in warning
    doc["resources"] = {"worker": {"limits": {"memory": "4Gi"}}}
    assert not [w for w in cli_core.fit_warnings(spec.parse(small_object("one", "default", **doc)))
                if "in training" in w]
    doc["model"] = str(tmp_path / "missing")
    assert cli_core.fit_warnings(spec.parse(small_object("one", "default", **doc))) == []


# TinyLlama's shape: the held-out ~1B run's (bench/sharded_load.py's default)
TINYLLAMA_CONFIG = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                    "num_attention_heads": 32, "num_key_value_heads": 4, "tie_word_embeddings": False}


def test_a_config_json_gives_the_tables_shape_a_multimodal_one_its_text_part():
    tiny_llama = model_sizes.shape_of(TINYLLAMA_CONFIG)
    assert (tiny_llama.hidden, tiny_llama.head_dim, tiny_llama.kv_heads, tiny_llama.tied) == (2048, 64, 4, False)
    assert 1.09e9 < tiny_llama.parameters() < 1.11e9
    gemma = model_sizes.shape_of({"text_config": {"vocab_size": 262208, "hidden_size": 2560, "intermediate_size": 10240,
                                                  "num_hidden_layers": 34, "num_attention_heads": 8,
                                                  "num_key_value_heads": 4, "head_dim": 256}})
    assert gemma.parameters() == model_sizes.GEMMA_3_4B.parameters()
    assert model_sizes.shape_of({"hidden_size": 64}) is None   # a size left out: no guess


@pytest.mark.parametrize("pod_memory, config, on", [
    ("4Gi", TINYLLAMA_CONFIG, True),     # the held-out run: only with activations recomputed
    ("64Gi", TINYLLAMA_CONFIG, False),
    ("4Gi", {**TINYLLAMA_CONFIG, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 1}, False),   # a small model keeps them
])
def test_left_out_on_cpu_activation_checkpointing_is_on_only_when_a_step_would_not_fit(pod_memory, config, on):
    run = Run(method=LORA, rank=8, tokens=4 * 128)
    assert model_sizes.recompute_needed(model_sizes.shape_of(config), 2, pod_memory, run) is on


def test_activation_checkpointing_left_out_is_on_for_tpus_and_left_to_the_workers_on_cpu():
    tpu = spec.parse(small_object("t", "ns"))
    cpu = spec.parse(small_object("c", "ns", accelerator="cpu", topology="2"))
    chosen = spec.parse(small_object("c", "ns", accelerator="cpu", topology="2",
                                     training={"activationCheckpointing": False}))
    assert (tpu.spec.training.activation_checkpointing, cpu.spec.training.activation_checkpointing,
            chosen.spec.training.activation_checkpointing) == (True, None, False)
