"""The parts of `train` (operators/objective.py): each built-in pipeline's train node (built on the one
skeleton, pipelines/skeleton.py) resolves to exactly the flags it passed before the parts existed and computes
exactly the same loss; a part's given fields override its preset's; the former flat flags are refused naming
the part field that replaces each; the entropy bonus; clear errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from plexrl.batch import Advantages, LogProbs, Rollouts, TrainStats
from plexrl.errors import ConfigError
from plexrl.graph import PipelineGraph
from plexrl.job.load import load_job
from plexrl.operator import OpContext
from plexrl.operators.losses import masked_mean, policy_loss
from plexrl.operators.objective import MOVED, PRESETS, Normaliser, Objective, resolve
from plexrl.pipelines.dapo import dapo
from plexrl.pipelines.dr_grpo import dr_grpo
from plexrl.pipelines.grpo import grpo
from plexrl.pipelines.grpo_tools import grpo_tools
from plexrl.pipelines.gspo import gspo
from plexrl.pipelines.ppo import ppo
from plexrl.pipelines.reinforce_pp import reinforce_pp
from plexrl.pipelines.rloo import rloo
from plexrl.pipelines.skeleton import PARTS

# `train`'s keyword defaults before the parts (commit df532a2), and what each pipeline passed on top of them
OLD_TRAIN: dict[str, Any] = {
    "lr": 1e-3, "clip_eps": 0.2, "kl_coef": 0.0, "max_grad_norm": 1.0, "weight_decay": 0.0, "minibatches": 1,
    "epochs": 1, "clip_eps_high": None, "dual_clip": None, "ratio_level": "token", "kl_estimator": "k3",
    "loss_agg": "token_mean", "norm_length": None, "adam_beta1": 0.9, "adam_beta2": 0.999,
    "skip_zero_advantage": True, "skip_norm": "full",
}  # fmt: skip
_OPT = {"lr": 3e-4, "minibatches": 2, "adam_beta2": 0.98}
OLD_PIPELINES: list[tuple[str, Any, dict[str, Any]]] = [
    ("grpo", lambda: grpo(), {**_OPT, "epochs": 1, "max_grad_norm": 1.0, "loss_agg": "token_mean"}),
    ("grpo_kl", lambda: grpo(kl={"coef": 0.05}), {**_OPT, "kl_coef": 0.05}),
    ("grpo_tools", lambda: grpo_tools(), {**_OPT, "loss_agg": "token_mean", "skip_zero_advantage": True}),
    ("dr_grpo", lambda: dr_grpo(), {**_OPT, "loss_agg": "seq_sum_token_mean", "norm_length": 6.0}),
    ("dapo", lambda: dapo(), {**_OPT, "clip_eps_high": 0.28, "skip_norm": "kept"}),
    ("gspo", lambda: gspo(), {**_OPT, "clip_eps": 3e-4, "clip_eps_high": 4e-4, "ratio_level": "sequence",
                              "loss_agg": "seq_mean"}),
    ("rloo", lambda: rloo(), {**_OPT, "minibatches": 1, "loss_agg": "seq_mean"}),
    ("reinforce_pp", lambda: reinforce_pp(), {**_OPT, "kl_estimator": "k2", "skip_zero_advantage": False}),
    ("reinforce_pp_kl", lambda: reinforce_pp(kl={"coef": 0.05}), {**_OPT, "kl_coef": 0.05, "kl_estimator": "k2",
                                                             "skip_zero_advantage": False}),
    ("ppo", lambda: ppo(), {**_OPT, "loss_agg": "token_mean"}),
]  # fmt: skip
PROMPT, WIDTH = 2, 4
LENGTHS = [4, 2, 3, 1]
ADV = torch.tensor([1.5, -0.5, -2.0, 0.75])  # no zero: no row is skipped


def tiny_rollouts() -> Rollouts:
    n, cols = len(LENGTHS), PROMPT + WIDTH
    ids = torch.zeros(n, cols, dtype=torch.long)
    attn = torch.zeros(n, cols, dtype=torch.long)
    resp = torch.zeros(n, cols)
    attn[:, :PROMPT] = 1
    for i, k in enumerate(LENGTHS):
        ids[i, PROMPT : PROMPT + k] = torch.arange(1, k + 1)
        attn[i, PROMPT : PROMPT + k] = 1
        resp[i, PROMPT : PROMPT + k] = 1
    return Rollouts(
        input_ids=ids, attention_mask=attn, response_mask=resp, behaviour_logprobs=-resp, prompt_len=PROMPT,
        response_lengths=torch.tensor(LENGTHS), finish_reasons=["stop"] * n, completions=["x"] * n,
        answers=["x"] * n, group_size=2, temperature=1.0,
    )  # fmt: skip


def policy_logp(rollouts: Rollouts) -> torch.Tensor:
    """Fixed policy log-probs: the behaviour's moved by up to +-1 (some ratios beyond every clip)."""
    g = torch.Generator().manual_seed(0)
    shift = (torch.rand(rollouts.input_ids.shape, generator=g) - 0.5) * 2.0
    return rollouts.behaviour_logprobs + shift * rollouts.response_mask


@dataclass
class RecordingEngine:
    """Calls the loss once on the whole batch with fixed log-probs and entropies; records it and the
    optimiser's arguments."""

    entropy: torch.Tensor
    weight_version: int = 0
    calls: list[tuple[torch.Tensor, dict[str, float], dict[str, Any]]] = field(default_factory=list)

    def train_step(self, batch: dict[str, torch.Tensor], loss_fn: Any, **kwargs: Any) -> dict[str, float]:
        logp = policy_logp(tiny_rollouts())  # every row is kept (no zero advantage)
        loss, stats = loss_fn(batch, logp, self.entropy)
        self.calls.append((loss.detach(), stats, kwargs))
        self.weight_version += 1
        return {"steps": 1.0}


def train_node(graph: PipelineGraph) -> Any:
    return next(n for n in graph.nodes if n.name == "train")


def flags_of(obj: Objective) -> dict[str, Any]:
    """An objective as the former flat flags of `train` (`MOVED` read backwards): what the same update took
    before the parts."""
    dumped = obj.model_dump()
    return {flag: dumped[part][field] for flag, (part, field) in ((f, m.split(".")) for f, m in MOVED.items())}


def objective_of(node: Any) -> Objective:
    """The objective a train node's parameters resolve to (its parts keep which fields they were given)."""
    return resolve(node.params.objective, {k: getattr(node.params, k) for k in PARTS})


def run_train(node: Any, params: Any, entropy: torch.Tensor | None = None) -> RecordingEngine:
    ro = tiny_rollouts()
    engine = RecordingEngine(entropy=torch.zeros_like(ro.response_mask) if entropy is None else entropy)
    inputs: dict[str, Any] = {"rollouts": ro, "advantages": Advantages(values=ADV)}
    if "ref_logprobs" in node.inputs:
        inputs["ref_logprobs"] = LogProbs(values=ro.behaviour_logprobs - 0.3 * ro.response_mask)
    ctx = OpContext(job_id="t", iteration=0, node="train", job_seed=0, engine=engine)
    out = node.operator.run(ctx, inputs, params)
    assert isinstance(out, TrainStats) and out.stats["rows"] == len(LENGTHS)
    return engine


@pytest.mark.parametrize(("name", "build", "old"), OLD_PIPELINES, ids=[c[0] for c in OLD_PIPELINES])
def test_pipeline_train_node_computes_the_loss_it_did_before(name: str, build: Any, old: dict[str, Any]) -> None:
    flags = {**OLD_TRAIN, **old}
    node = train_node(build())
    assert node.params.objective != "default"  # each pipeline names its preset
    assert flags_of(objective_of(node)) == {**flags, "entropy_coef": 0.0}
    engine = run_train(node, node.params)
    ((loss, stats, kwargs),) = engine.calls
    ro = tiny_rollouts()
    mask = ro.response_mask
    denominator = None
    if flags["skip_zero_advantage"] and flags["skip_norm"] == "full":
        count = float(mask.sum()) if flags["loss_agg"] == "token_mean" else float(len(LENGTHS))
        denominator = count / flags["minibatches"]
    ref = ro.behaviour_logprobs - 0.3 * mask if flags["kl_coef"] > 0 else None
    want, want_stats = policy_loss(
        policy_logp(ro), ro.behaviour_logprobs, ADV, mask, clip_eps=flags["clip_eps"],
        clip_eps_high=flags["clip_eps_high"], dual_clip=flags["dual_clip"], ratio_level=flags["ratio_level"],
        ref_logp=ref, kl_coef=flags["kl_coef"], kl_estimator=flags["kl_estimator"], agg=flags["loss_agg"],
        norm_length=flags["norm_length"], denominator=denominator,
    )  # fmt: skip
    assert torch.equal(loss, want.detach()), name
    assert {k: stats[k] for k in want_stats} == want_stats
    assert (want_stats["kl"] > 0) == (flags["kl_coef"] > 0)
    assert want_stats["clip_frac"] > 0  # the batch exercises the clip
    assert kwargs["lr"] == flags["lr"] and kwargs["betas"] == (flags["adam_beta1"], flags["adam_beta2"])
    for key in ("weight_decay", "max_grad_norm", "minibatches", "epochs"):
        assert kwargs[key] == flags[key], key


def test_former_flat_flags_are_refused_naming_the_part_that_replaces_each() -> None:
    """`train` is composed of parts only: each of its 18 former flags, in a node's params or a built-in
    pipeline's, is an error that names the part field to set instead; nothing else of the config is lost."""
    op = train_node(grpo()).operator
    raw = {flag: 1 for flag in MOVED}
    params, problems = op.check_params({**raw, "objective": "grpo"}, "nodes.train")
    assert params is None and len(problems) == len(MOVED) == 18
    for problem in problems:
        flag = problem.where.rsplit(".", 1)[1]
        part, field = MOVED[flag].split(".")
        assert f"`{flag}` is no longer a parameter of train: set `{part}: {{{field}: ...}}`" in problem.message
    with pytest.raises(ConfigError) as err:
        load_job({"pipeline": {"name": "dapo", "params": {"lr": 1e-4, "clip_eps_low": 0.1, "batch_size": 8}}})
    (problem,) = err.value.problems
    assert problem.where == "pipeline.params"
    assert "`clip_eps_low` -> `policy: {clip_eps: ...}`" in problem.message
    assert "`lr` -> `optimiser: {lr: ...}`" in problem.message
    assert flags_of(resolve("default")) == {**OLD_TRAIN, "entropy_coef": 0.0}  # train without a part: as before


def test_a_parts_given_fields_override_its_presets_field_by_field() -> None:
    obj = resolve("dapo", {"policy": {"clip_eps": 0.1}, "optimiser": {"lr": 1e-4}})
    assert (obj.policy.clip_eps, obj.policy.clip_eps_high, obj.normaliser.skip_norm) == (0.1, 0.28, "kept")
    assert (obj.optimiser.lr, obj.optimiser.minibatches, obj.optimiser.beta2) == (1e-4, 2, 0.98)
    # the same from YAML, through a pipeline and train's parameters (a part knows the fields it was given)
    loaded = load_job({"pipeline": {"name": "dapo", "params": {"optimiser": {"lr": 1e-4}}}})
    node = train_node(loaded.graph)
    assert objective_of(node) == resolve("dapo", {"optimiser": {"lr": 1e-4}})
    assert loaded.graph.describe()[-2]["params"]["optimiser"] == {"lr": 1e-4}  # describe shows what was given


def test_entropy_bonus_is_subtracted_aggregated_like_the_policy_loss() -> None:
    ro = tiny_rollouts()
    entropy = torch.linspace(0.1, 2.0, ro.response_mask.numel()).view_as(ro.response_mask)
    node = train_node(dr_grpo())  # seq_sum_token_mean: the bonus shares the constant norm_length
    ((base, base_stats, _),) = run_train(node, node.params, entropy).calls
    assert "entropy_bonus" not in base_stats  # coef 0 (every preset): nothing added
    raw = {**node.params.model_dump(exclude_unset=True), "entropy": {"coef": 0.1}}
    params, problems = node.operator.check_params(raw, "nodes.train")
    assert not problems
    ((loss, stats, _),) = run_train(node, params, entropy).calls
    bonus = masked_mean(entropy, ro.response_mask, "seq_sum_token_mean", 6.0, len(LENGTHS) / 2)
    assert stats["entropy_bonus"] == pytest.approx(float(bonus))
    assert float(loss) == pytest.approx(float(base) - 0.1 * float(bonus), abs=1e-6)
    # the bonus's gradient raises the entropy: d loss / d entropy = -coef / count on response tokens
    ent = entropy.clone().requires_grad_()
    obj = resolve("grpo", {"entropy": {"coef": 0.5}})
    out, _ = obj.loss(policy_logp(ro), ro.behaviour_logprobs, ADV, ro.response_mask, ent)
    (grad,) = torch.autograd.grad(out, ent)
    n_tokens = float(ro.response_mask.sum())
    assert torch.allclose(grad, -0.5 * ro.response_mask / n_tokens)


def test_bad_parts_are_clear_errors() -> None:
    op = train_node(grpo()).operator
    for raw, where, words in [
        ({"objective": "ppo2"}, "objective", "'grpo'"),
        ({"policy": {"clip_eps": 2.0}}, "policy.clip_eps", "less than 1"),
        (
            {"normaliser": {"aggregation": "token_mean"}},
            "normaliser",
            "'aggregation' of Normaliser; known fields: agg,",
        ),
        ({"entropy": {"coef": -0.1}}, "entropy.coef", "greater than or equal to 0"),
    ]:
        _, problems = op.check_params(raw, "nodes.train")
        assert [p.where for p in problems] == [f"nodes.train.params.{where}"], raw
        assert words in problems[0].message
    with pytest.raises(ValueError, match="unknown objective preset 'nope'; known presets: default, grpo"):
        resolve("nope")
    with pytest.raises(ValueError, match="unknown objective part 'clip'; known parts: policy"):
        resolve("grpo", {"clip": {"eps": 0.1}})
    with pytest.raises(ValueError, match=r"(?s)invalid objective .*policy.clip_eps_high"):
        resolve("grpo", {"policy": {"clip_eps_high": 20.0}})
    assert Normaliser() == PRESETS["grpo"].normaliser  # frozen parts compare by value
    with pytest.raises(ValueError, match="frozen"):
        PRESETS["grpo"].kl.coef = 1.0


def test_dapo_passes_its_entropy_bonus_to_train_and_none_by_default() -> None:
    def entropy_of(graph: PipelineGraph) -> float:
        return objective_of(train_node(graph)).entropy.coef

    assert entropy_of(dapo()) == 0.0
    assert entropy_of(dapo(entropy={"coef": 0.003})) == 0.003
