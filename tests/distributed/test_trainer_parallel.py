"""PolicyTrainer on 2 and 4 gloo ranks against one process training on the whole batch.

Every data-parallel layout (FSDP2-sharded or replicated weights, with and without expert parallelism) must
step like the single process: same gradient norm, same weights after several AdamW steps (float32, up to
summation order). The weights are compared through `publish_state`, the path that feeds the rollout
workers, so the FSDP gather and the EP expert slices are checked too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dist_harness import preload, run_ranks
from moerl.model import build_model, tiny_config
from moerl.train.loss import LossConfig
from moerl.train.batching import split_by_tokens
from moerl.train.parallel import trainer_groups
from moerl.train.trainer import OptimConfig, PolicyTrainer, Sample, merge_rank_metrics

pytestmark = pytest.mark.distributed
LAYOUTS = [("fsdp", True), ("fsdp", False), ("replicate", True), ("replicate", False)]
STEPS, SAMPLES = 3, 8


@pytest.fixture(scope="module", autouse=True)
def forkserver() -> None:
    preload("moerl.model", "moerl.train.trainer", __name__)


def arch():
    return tiny_config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1])


def make(group=None, layout: str = "replicate", ep: bool | int = False, loss: LossConfig | None = None,
         micro_batch_tokens: int = 0, reduce_grads_once: bool = False, minibatches: int = 1) -> PolicyTrainer:
    """ep: True = experts split over every rank; an int = that EP size."""
    ep_size = (dist.get_world_size() if ep is True else int(ep)) if group is not None else 1
    groups = trainer_groups(max(ep_size, 1), "cpu") if group is not None else None
    model = build_model(arch(), seed=0, expert_parallel_group=groups.ep if groups else None,
                        dispatcher="all_to_all" if ep_size > 1 else "local")
    return PolicyTrainer(model, OptimConfig(lr=1e-3, weight_decay=0.01), loss or LossConfig(), groups=groups,
                         expert_bias_rate=1e-3, data_parallel=layout, micro_batch_tokens=micro_batch_tokens,
                         reduce_grads_once=reduce_grads_once, minibatches=minibatches)


def step_samples(step: int) -> list[Sample]:
    """The whole batch of a step: prompts and completions of different lengths, mixed-sign advantages, and
    the experts "rollout chose" (routing replay, as in the RL loop). Without replay a float-rounding
    difference between layouts can flip a near-tied top-k choice, and the comparison would test that."""
    g = torch.Generator().manual_seed(step)
    out = []
    for i in range(SAMPLES):
        p, c = 3 + i % 3, 2 + (i * 5) % 4
        routed = torch.rand(p + c - 1, 2, 8, generator=g).argsort(-1)[..., :2].to(torch.int16)  # [T, L, K]
        out.append(Sample(torch.randint(0, 64, (p,), generator=g).tolist(), torch.randint(0, 64, (c,), generator=g).tolist(),
                          (-torch.rand(c, generator=g) - 0.5).tolist(), float(i % 3 - 1), routed))
    return out


def run_steps(trainer: PolicyTrainer, rank: int, world: int) -> list[dict]:
    metrics = []
    for step in range(STEPS):
        share = split_by_tokens(step_samples(step), world)[rank]  # RayTrainerGroup.shard's split
        metrics.append(trainer.rl_step(share))
    return metrics


# what the merged metrics of W ranks must equal in one process on the whole batch (sums, extremes, token means)
MERGED_KEYS = ("loss/policy", "loss/pg", "tokens", "sequences", "is/behaviour_kl", "is/weight_mean", "is/weight_max",
               "is/weight_min", "policy/entropy", "policy/ratio_mean")


def layouts(world: int) -> list:
    """Every data-parallel layout; on 4 ranks also EP over pairs of ranks with FSDP across the pairs (2D mesh)."""
    return LAYOUTS + ([("fsdp", 2)] if world == 4 else [])


def layouts_worker(rank: int, world: int, out_dir: str) -> None:
    for layout, ep in layouts(world):
        trainer = make(dist.group.WORLD, layout, ep)
        sharded = [n for n, p in trainer.model.named_parameters() if isinstance(p, DTensor)]
        assert bool(sharded) == (layout == "fsdp"), (layout, sharded[:3])
        if ep is True:  # each expert slice on one rank only: its FSDP unit spans that one rank
            assert all(p.device_mesh.size() == 1 for n, p in trainer.model.named_parameters()
                       if ".experts." in n and isinstance(p, DTensor))
        metrics = run_steps(trainer, rank, world)
        torch.save({"metrics": [{k: v for k, v in m.items() if k in MERGED_KEYS or k in ("grad_norm", "rank_tokens")}
                                for m in metrics], "state": trainer.publish_state()},
                   Path(out_dir) / f"{layout}-{ep}-rank{rank}.pt")


@pytest.mark.parametrize("world", [2, 4])
def test_every_layout_steps_like_one_process(world, tmp_path):
    run_ranks(world, layouts_worker, str(tmp_path), timeout=240)
    ref = make()
    ref_metrics = run_steps(ref, 0, 1)
    ref_norms = [m["grad_norm"] for m in ref_metrics]
    want = ref.publish_state()
    E = ref.model.config.num_experts
    for layout, ep in layouts(world):
        got = [torch.load(tmp_path / f"{layout}-{ep}-rank{r}.pt") for r in range(world)]
        what = f"{world} ranks, {layout}, ep={ep}"
        torch.testing.assert_close([m["grad_norm"] for m in got[0]["metrics"]], ref_norms, rtol=1e-5, atol=0,
                                   msg=lambda m: f"{what} grad norm: {m}")
        for step, ref_m in enumerate(ref_metrics):  # the pool's merge of every rank's metrics = the whole batch's
            merged = merge_rank_metrics([got[r]["metrics"][step] for r in range(world)])
            for key in MERGED_KEYS:
                torch.testing.assert_close(float(merged[key]), float(ref_m[key]), rtol=1e-5, atol=1e-7,
                                           msg=lambda m: f"{what} step {step} {key}: {m}")
        ep_size = world if ep is True else int(ep)
        for name, w in want.items():
            if ep and ".experts." in name:  # EP rank e holds experts [e E/P, (e+1) E/P); the first replica sends
                g = torch.cat([got[r]["state"][name] for r in range(ep_size)])
                assert all(got[r]["state"][name].shape[0] == E // ep_size for r in range(ep_size))
                assert all(name not in got[r]["state"] for r in range(ep_size, world))
            else:
                g = got[0]["state"][name]
            assert not isinstance(g, DTensor)
            # atol: 3% of one AdamW step (lr 1e-3). Adam divides by the gradient's running RMS, so where a gradient
            # is near zero the float rounding of a different summation order (other ranks, other packing) is
            # magnified toward a whole step; the gradients themselves agree to 1e-6 (the micro-batch test below)
            torch.testing.assert_close(g, w, rtol=1e-4, atol=3e-5, msg=lambda m: f"{what} {name}: {m}")
        assert sorted(got[0]["state"]) == sorted(want)


# ---------------------------------------------------------------- micro-batches under data parallelism
def full_grads(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    """Every gradient whole (FSDP shards gathered: a collective); expert grads are this rank's EP slice."""
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            for n, p in trainer.model.named_parameters() if p.grad is not None}


MICRO_LAYOUTS = (("fsdp", True, 9), ("fsdp", False, 1), ("replicate", True, 20), ("fsdp-once", True, 9))


def micro_worker(rank: int, world: int, out_dir: str) -> None:
    for layout, ep, budget in MICRO_LAYOUTS:
        # "fsdp-once": FSDP2's no-sync, one reduce-scatter after the last micro-batch (reduce_grads_once)
        trainer = make(dist.group.WORLD, layout.removesuffix("-once"), ep, micro_batch_tokens=budget,
                       reduce_grads_once=layout.endswith("-once"))
        trainer.optim_cfg.grad_clip = 0.0  # compare the raw gradients
        calls = count_calls(dist, REDUCE_SCATTERS)
        try:
            trainer.rl_step(split_by_tokens(step_samples(0), world)[rank])
        finally:
            calls.restore()
        torch.save({"grads": full_grads(trainer), "reduce_scatters": calls.n},
                   Path(out_dir) / f"micro-{layout}-{ep}-rank{rank}.pt")


# FSDP2's reduce-scatter: reduce_scatter_single from torch 2.12 on, reduce_scatter_tensor before
REDUCE_SCATTERS = ("reduce_scatter_tensor", "reduce_scatter_single")


class count_calls:
    """Counts the calls of the functions `names` of `owner` (those it has), patched in place until `restore`."""

    def __init__(self, owner, names: tuple[str, ...]) -> None:
        self.n, self.owner = 0, owner
        self.originals = {name: getattr(owner, name) for name in names if hasattr(owner, name)}
        for name, original in self.originals.items():
            setattr(owner, name, self._counted(original))

    def _counted(self, original):
        def counted(*args, **kwargs):
            self.n += 1
            return original(*args, **kwargs)
        return counted

    def restore(self) -> None:
        for name, original in self.originals.items():
            setattr(self.owner, name, original)


@pytest.mark.parametrize("world", [2, 4])
def test_micro_batches_on_every_rank_give_the_whole_batch_gradient(world, tmp_path):
    run_ranks(world, micro_worker, str(tmp_path), timeout=240)
    ref = make()
    ref.optim_cfg.grad_clip = 0.0
    ref.rl_step(step_samples(0))
    want = full_grads(ref)
    scatters: dict[str, int] = {}
    for layout, ep, _ in MICRO_LAYOUTS:
        saved = [torch.load(tmp_path / f"micro-{layout}-{ep}-rank{r}.pt") for r in range(world)]
        got = [x["grads"] for x in saved]
        scatters[layout] = saved[0]["reduce_scatters"]
        for name, w in want.items():
            g = torch.cat([got[r][name] for r in range(world)]) if ep and ".experts." in name else got[0][name]
            err = float((g.double() - w.double()).norm() / w.double().norm().clamp(min=1e-30))
            assert err <= 1e-6, f"{world} ranks, {layout}, ep={ep}, {name}: relative error {err:.2e}"
    # the same units and budget: no-sync reduce-scatters once per unit, the default once per unit and micro-batch
    assert 0 < scatters["fsdp-once"] < scatters["fsdp"], scatters


# ---------------------------------------------------------------- the loss knobs under data parallelism
KNOBS = LossConfig(aggregation="seq-mean-token-mean", entropy_coef=0.05)


def knobs_worker(rank: int, world: int, out_dir: str) -> None:
    trainer = make(dist.group.WORLD, "fsdp", ep=True, loss=KNOBS)
    norms = [m["grad_norm"] for m in run_steps(trainer, rank, world)]
    torch.save({"norms": norms, "state": trainer.publish_state()}, Path(out_dir) / f"knobs-rank{rank}.pt")


def test_sequence_mean_and_entropy_bonus_step_like_one_process(tmp_path):
    """The seq-mean normaliser counts sequences over all ranks, and the entropy term reaches the gradient."""
    run_ranks(2, knobs_worker, str(tmp_path), timeout=180)
    ref, plain = make(loss=KNOBS), make()
    ref_norms, plain_norms = ([m["grad_norm"] for m in run_steps(t, 0, 1)] for t in (ref, plain))
    got = [torch.load(tmp_path / f"knobs-rank{r}.pt") for r in range(2)]
    torch.testing.assert_close(got[0]["norms"], ref_norms, rtol=1e-5, atol=0)
    assert abs(ref_norms[0] - plain_norms[0]) > 1e-3 * plain_norms[0], "the knobs did not change the gradient"
    for name, w in ref.publish_state().items():
        g = torch.cat([got[r]["state"][name] for r in range(2)]) if ".experts." in name else got[0]["state"][name]
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------- off-policy corrections under data parallelism
OFF_POLICY = LossConfig(trust_region="proximal", is_correction="m2po", m2_threshold=0.02, ess_lr_scaling=True)


def off_policy_worker(rank: int, world: int, out_dir: str) -> None:
    trainer = make(dist.group.WORLD, "fsdp", ep=True, loss=OFF_POLICY, minibatches=2)
    metrics = run_steps(trainer, rank, world)
    torch.save({"metrics": metrics, "state": trainer.publish_state()}, Path(out_dir) / f"off-rank{rank}.pt")


def test_minibatches_m2po_and_ess_scaling_step_like_one_process(tmp_path, monkeypatch):
    """Two updates per step with the proximal clip, M2PO's cutoff over every rank's tokens and the ESS-scaled step:
    2 ranks (FSDP x EP) step like one process whose updates take the same samples (each update the union of the
    ranks' shares), so the gathered cutoff and the all-reduced ESS are the whole batch's."""
    from moerl.train import trainer as trainer_module
    from moerl.train.batching import split_contiguous

    run_ranks(2, off_policy_worker, str(tmp_path), timeout=180)

    def unions(samples, parts):  # update j of one process = the ranks' update-j shares together
        per_rank = [split_contiguous(share, parts) for share in split_by_tokens(samples, 2)]
        return [per_rank[0][j] + per_rank[1][j] for j in range(parts)]

    monkeypatch.setattr(trainer_module, "split_contiguous", unions)
    ref = make(loss=OFF_POLICY, minibatches=2)
    ref_metrics = run_steps(ref, 0, 1)
    got = [torch.load(tmp_path / f"off-rank{r}.pt") for r in range(2)]
    for step, want in enumerate(ref_metrics):
        merged = merge_rank_metrics([got[r]["metrics"][step] for r in range(2)])
        for key in ("grad_norm", "is/ess", "optim/lr_scale", "is/masked_frac", "policy/clip_frac", "loss/policy"):
            torch.testing.assert_close(float(merged[key]), float(want[key]), rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"step {step} {key}: {m}")
        assert want["optim/updates"] == 2.0 and want["is/ess"] < 0.99 and want["is/masked_frac"] > 0
    for name, w in ref.publish_state().items():
        g = torch.cat([got[r]["state"][name] for r in range(2)]) if ".experts." in name else got[0]["state"][name]
        torch.testing.assert_close(g, w, rtol=1e-4, atol=3e-5, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------- checkpoints do not depend on the layout
def _weights(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    from tests.unit.test_checkpoint_trainer import snapshot

    return {k: v for k, v in snapshot(trainer).items() if k.startswith(("model/", "optim/"))}


def checkpoint_worker(rank: int, world: int, path: str, out_dir: str) -> None:
    from moerl.checkpoint import load_trainer_state, save_trainer_state

    fsdp = make(dist.group.WORLD, "fsdp")
    run_steps(fsdp, rank, world)
    save_trainer_state(fsdp, path, use_async=True).result()
    saved = _weights(fsdp)
    replicated = make(dist.group.WORLD, "replicate")
    load_trainer_state(replicated, path)
    got = _weights(replicated)
    assert sorted(got) == sorted(saved)
    assert all(torch.equal(got[k], saved[k]) for k in saved), [k for k in saved if not torch.equal(got[k], saved[k])][:3]
    if rank == 0:
        torch.save(saved, Path(out_dir) / "saved.pt")


def test_fsdp_checkpoint_loads_replicated_and_in_one_process(tmp_path):
    from moerl.checkpoint import load_trainer_state

    run_ranks(2, checkpoint_worker, str(tmp_path / "ckpt"), str(tmp_path), timeout=180)
    saved = torch.load(tmp_path / "saved.pt")
    single = make()
    load_trainer_state(single, str(tmp_path / "ckpt"))
    got = _weights(single)
    assert sorted(got) == sorted(saved)
    assert all(torch.equal(got[k], saved[k]) for k in saved)
    assert single.steps_done == STEPS
