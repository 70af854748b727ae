"""Adapters on a shared base, judged: whether a LoRA fine-tune may publish to the base it names, whether
its adapter replaces the one served under its name, and what the base serves. Pure, like tpuft.controller.phases,
which acts on these answers (docs/serving.md, "Adapters on a shared base").
"""
from __future__ import annotations

from dataclasses import dataclass

from tpuft.api.constants import PublishWhen, ServeEngine
from tpuft.controller.observed import PeerObs, PublishedObs
from tpuft.api.spec import TPUFinetune
from tpuft.api.status import Training as TrainingProgress


def base_mismatch(tft: TPUFinetune, base: PeerObs) -> str | None:
    """Why `base` cannot serve this fine-tune's adapter (None: it can): another model, no room for
    adapters, a LoRA rank above what it serves, or engine vllm (its pods, where the publish RayJob
    runs, hold the vLLM serving image, which has no tpuft_workload)."""
    publish, where = tft.spec.publish, f"{tft.meta.namespace}/{base.name}"
    assert publish is not None, "base_mismatch needs spec.publish"
    if not base.adapters:
        return (f"spec.publish.to: {where} serves no adapters (it has no spec.serve.adapters with spec.serve.enabled): "
                "name a base that does, or add spec.serve.adapters to it")
    if base.engine == ServeEngine.VLLM.value:
        return (f"spec.publish.to: {where} serves with engine vllm, and publishing to it is not supported: the "
                "publish RayJob runs on the base's serving pods, whose vLLM image has no tpuft_workload to copy the "
                "adapter with; serve the base with spec.serve.engine transformers, or serve this fine-tune on its "
                "own (spec.serve instead of spec.publish)")
    if base.model != tft.spec.model:
        return (f"spec.publish.to: {where} serves {base.model!r}, and this fine-tune trains an adapter for "
                f"{tft.spec.model!r}: an adapter only fits the model it was trained on; name a base serving "
                f"{tft.spec.model!r}, or set spec.model to {base.model!r}")
    lora = tft.spec.training.lora
    if lora is not None and base.max_rank is not None and lora.rank > base.max_rank:
        return (f"spec.training.lora.rank {lora.rank} is above {where}'s spec.serve.adapters.maxRank "
                f"({base.max_rank}): lower the rank, or raise the base's maxRank")
    return None


def eval_loss(tft: TPUFinetune, training: TrainingProgress | None) -> float | None:
    """The eval loss of the exported model, as status.training records it: the best one with
    spec.evaluation.keepBest (that checkpoint is exported), else the final one."""
    if training is None or tft.spec.evaluation is None:
        return None
    return training.best_eval_loss if tft.spec.evaluation.keep_best else training.eval_loss


def served(published: tuple[PublishedObs, ...], adapter: str, uid: str) -> PublishedObs | None:
    """The publication served under `adapter`: the newest one of another fine-tune."""
    found = [p for p in published if p.adapter == adapter and p.uid != uid]
    return max(found, key=lambda p: (p.published_at, p.source), default=None)


def newer(published: tuple[PublishedObs, ...], adapter: str, uid: str, at: str, source: str) -> PublishedObs | None:
    """A publication of another fine-tune under the same name after this one's (at, source): it supersedes it."""
    latest = served(published, adapter, uid)
    return latest if latest is not None and (latest.published_at, latest.source) > (at, source) else None


@dataclass(frozen=True)
class Verdict:
    promote: bool
    message: str


def _loss(value: float | None) -> str:
    return "none" if value is None else f"{value:.4f}"


def gate(when: str, margin: float, loss: float | None, eval_set: str | None,
         current: PublishedObs | None) -> Verdict:
    """Whether a fine-tune's adapter replaces the one served under its name (`current`, None: none is).
    ifBetter: only a lower eval loss on the same eval set, by more than `margin`; the reason names both
    figures (or both eval sets)."""
    if current is None:
        return Verdict(True, "no adapter is served under this name")
    if when == PublishWhen.ALWAYS.value:
        return Verdict(True, f"spec.publish.when always: replaces {current.source} (eval loss "
                             f"{_loss(current.eval_loss)})")
    if current.eval_set != eval_set:
        return Verdict(False, f"eval loss not comparable: this fine-tune's eval set is {eval_set!r}, the served "
                              f"{current.source}'s is {current.eval_set!r}; evaluate both on the same "
                              "spec.evaluation, or set spec.publish.when: always")
    if loss is None or current.eval_loss is None:
        return Verdict(False, f"eval loss {_loss(loss)} cannot be compared with the served {current.source}'s "
                              f"{_loss(current.eval_loss)}: both need an eval loss, or set spec.publish.when: always")
    if loss < current.eval_loss - margin:
        return Verdict(True, f"eval loss {_loss(loss)} beats the served {current.source}'s {_loss(current.eval_loss)} "
                             f"by more than the margin {margin:g} (eval set {eval_set})")
    return Verdict(False, f"eval loss {_loss(loss)} does not beat the served {current.source}'s "
                          f"{_loss(current.eval_loss)} by more than the margin {margin:g} (eval set {eval_set}); "
                          f"{current.source} stays served")


def latest_per_adapter(published: tuple[PublishedObs, ...]) -> tuple[PublishedObs, ...]:
    """What a base serves: per adapter name, the newest publication, sorted by name."""
    by_name: dict[str, PublishedObs] = {}
    for p in published:
        held = by_name.get(p.adapter)
        if held is None or (p.published_at, p.source) > (held.published_at, held.source):
            by_name[p.adapter] = p
    return tuple(by_name[name] for name in sorted(by_name))
