"""Claims the docs and docstrings make about the code, checked against it (issue 37 item 15): a file they name
exists, and a shape's parameter counts are what its model has."""

from __future__ import annotations

import re
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]


def test_the_image_recipe_docs_eks_md_names_exists_with_what_the_eks_path_needs() -> None:
    """docs/eks.md named a `Dockerfile` at the repository root that did not exist."""
    eks = (REPO / "docs" / "eks.md").read_text()
    named = set(re.findall(r"`([\w./-]*Dockerfile)`", eks)) | set(re.findall(r"-f (\S*Dockerfile)", eks))
    assert named == {"docker/Dockerfile"}, named
    recipe = (REPO / "docker" / "Dockerfile").read_text()
    for needed in ("FROM nvidia/cuda:", "efa_installer.sh", "/opt/amazon/ofi-nccl/lib", 'torch==2.13.0',
                   "/opt/moerl[launch,data]"):
        assert needed in recipe, needed
    assert ".venv" in (REPO / ".dockerignore").read_text().split()


def _counts(arch) -> tuple[float, float, float]:
    """(parameters, active per token, active without the input embedding), in billions: the embedding is a lookup,
    not a matmul (tied, it is the lm_head's matrix, which is one)."""
    from moerl.model import build_model

    model = build_model(arch, device="meta", init=False)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts + experts * arch.num_experts_per_tok // arch.num_experts
    lookup = 0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size
    return total / 1e9, active / 1e9, (active - lookup) / 1e9


def test_bench_trains_shape_is_described_by_its_real_parameter_counts() -> None:
    """bench/train.py called its shape "1.65B-active": it is about 0.40B active."""
    from moerl.bench import train
    from moerl.bench.options import parser

    total, active, core = _counts(train._arch(parser("train").parse_args([]), gpu=True))
    doc = train.__doc__
    assert "1.65B-active" not in doc
    assert f"{total:.2f}B parameters, {active:.2f}B of them active per\ntoken, {core:.2f}B without the input " in doc, (
        total, active, core)


def test_the_medium_presets_comment_states_its_counts() -> None:
    from moerl import run
    from moerl.config import load_config
    from moerl.tasks.arithmetic import ArithmeticTask

    total, _, core = _counts(run.model_architecture(load_config(None, ["--model.preset=medium"]), ArithmeticTask()))
    source = (REPO / "moerl" / "run.py").read_text()
    assert f"{total:.2f}B parameters at the byte vocabulary, {core:.2f}B of\n        # them active per token" in source


def test_the_eks_config_says_which_of_its_paths_ran_on_gloo_only() -> None:
    """configs/eks-p5en.toml relies on paths that have run on gloo only (issue 37 item 15): its header and
    docs/architecture.md's "Where each path has run" say so, naming each path the config turns on."""
    from moerl.config import load_config

    cfg = load_config(REPO / "configs" / "eks-p5en.toml", [])
    relies_on = []
    if cfg.ep.size > 1 and cfg.model.dispatcher == "all_to_all":
        relies_on.append("all_to_all EP")
    if cfg.train.num_ranks > 1 and cfg.train.data_parallel == "fsdp":
        relies_on.append("FSDP2 over many ranks")
        if cfg.ep.size > 1:
            relies_on.append("FSDP2 x EP")
    assert relies_on, "the EKS config no longer turns on a gloo-only path: revise its header and this test"
    header = " ".join(line.lstrip("# ") for line in (REPO / "configs" / "eks-p5en.toml").read_text().splitlines()
                      if line.startswith("#"))
    section = (REPO / "docs" / "architecture.md").read_text().split("## Where each path has run")[1]
    for text, where in ((header, "configs/eks-p5en.toml's header"), (section, "docs/architecture.md")):
        flat = " ".join(text.split())
        assert "gloo only" in flat, where
        for path in relies_on:
            assert path in flat, f"{where} does not name {path!r} as run on gloo only"
