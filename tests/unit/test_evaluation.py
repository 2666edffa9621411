"""Evaluation during training (moerl/loop/evaluation.py): the eval set, pass@k, the schedule on held workers,
worker loss (re-run on the eval's other held workers, else partial), the controller training on meanwhile, and
the worker's side on a real engine: greedy evals are exact for the same weights whatever runs beside them."""

from __future__ import annotations

import itertools
import json
import threading

import pytest

from moerl.config import ConfigError, load_config
from moerl.loop.evaluation import (EvalPlan, EvalRequest, EvalResult, Evaluator, eval_metrics, eval_prompt_count,
                                   open_eval_set)
from moerl.tasks.arithmetic import ArithmeticConfig, ArithmeticTask
from moerl.tasks.base import TaskError, load_task
from tests.unit.test_controller import FakePool, controller

JSONL = "moerl.tasks.jsonl:JsonlTask"


# ------------------------------------------------------------------------------------------ metrics, eval sets
def result(chunk: int, indices, rewards, lengths=None, worker="w0") -> EvalResult:
    lengths = lengths or [[1] * len(r) for r in rewards]
    return EvalResult("eval-0", chunk, worker, "ok", list(indices), rewards, lengths)


def test_eval_metrics_pass_at_k_partial_and_chunk_order():
    a = result(0, [0, 1], [[0.0, 1.0], [0.0, 0.0]], [[2, 4], [3, 3]])
    b = result(1, [2], [[None, 1.0]], [[5, 1]])
    m = eval_metrics([a, b], planned=4, k=2)
    assert m["eval/reward"] == pytest.approx(2 / 5) and m["eval/pass@2"] == pytest.approx(2 / 3)
    assert m["eval/length"] == pytest.approx(18 / 6) and m["eval/samples_failed"] == 1
    assert m["eval/prompts"] == 3 and m["eval/partial"] == 1
    assert eval_metrics([b, a], planned=3, k=2) == {**m, "eval/partial": 0.0}  # the same numbers, in any order
    assert eval_metrics([], planned=2, k=1) == {"eval/prompts": 0.0, "eval/partial": 1.0, "eval/samples_failed": 0.0}


def test_held_out_split_and_eval_path_sets(tmp_path):
    task = ArithmeticTask(ArithmeticConfig(max_operand=999))
    held_out = open_eval_set(task, "arith", {}, "", seed=0)
    assert held_out.size is None and eval_prompt_count(None, 16) == 16
    assert [held_out.prompt(i).prompt_text for i in range(8)] != [task.prompt_at(i).prompt_text for i in range(8)]
    assert held_out.prompt(3) == ArithmeticTask(ArithmeticConfig(max_operand=999)).eval_prompt_at(3)  # pure
    with pytest.raises(TaskError, match="needs a finite eval set"):
        eval_prompt_count(None, 0)
    with pytest.raises(TaskError, match="has no 'path' option"):
        open_eval_set(task, "arith", {}, str(tmp_path / "x.jsonl"), seed=0)

    train, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": i + 1}) + "\n" for i in range(9)))
    evals.write_text("".join(json.dumps({"prompt": f"{i}*2=", "answer": 2 * i}) + "\n" for i in range(5)))
    jsonl = load_task(JSONL, {"path": str(train), "reward": "exact_match"}, seed=0)
    with pytest.raises(TaskError, match="no held-out split"):
        open_eval_set(jsonl, JSONL, {"path": str(train)}, "", seed=0)
    eval_set = open_eval_set(jsonl, JSONL, {"path": str(train), "reward": "exact_match"}, str(evals), seed=0)
    assert eval_set.size == 5 and eval_prompt_count(5, 0) == 5 and eval_prompt_count(5, 64) == 5
    assert [eval_set.prompt(i).prompt_text for i in range(5)] == [f"{i}*2=" for i in range(5)]  # file order
    right = eval_set.prompt(3)
    assert eval_set.score(right, jsonl.tokenizer.encode("6") + [jsonl.tokenizer.eos_token_id]) == (1.0, None)


def test_eval_config_keys():
    cfg = load_config(None, ["--eval.every=5", "--eval.k=4", "--eval.temperature=0.8", "--eval.before_train",
                             "--train.dynamic_sampling=true"])
    assert cfg.eval.enabled and cfg.eval.k == 4 and cfg.train.dynamic_sampling_limit() == 4 * cfg.train.batch_groups
    assert not load_config(None).eval.enabled
    with pytest.raises(ConfigError, match="'eval.k' > 1 needs eval.temperature > 0"):
        load_config(None, ["--eval.every=5", "--eval.k=4"])
    with pytest.raises(ConfigError, match="'train.dynamic_sampling_max_extra' must be >= 0"):
        load_config(None, ["--train.dynamic_sampling_max_extra=-1"])


def test_plots_merge_an_eval_line_into_its_step(tmp_path):
    from moerl.runlog.plots import _metric_rows
    from moerl.runlog.run_log import RunLog

    with RunLog(tmp_path, tensorboard=False) as log:
        for step in (1, 2):
            log.log_step(step, {"reward/mean": 0.1 * step})
        log.log_step(2, {"eval/reward": 0.5})  # an eval of step 2's weights, logged after step 2
    rows = _metric_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["reward/mean"] == 0.2 and rows[1]["eval/reward"] == 0.5


# ------------------------------------------------------------------------------------------ the schedule
def score(index: int, sample: int) -> float:
    return float((index + sample) % 3 == 0)


class EvalPool(FakePool):
    """FakePool plus the eval side: a held worker takes no leases; eval chunks are scored by `score` and come back
    after `delay` polls, unless `fate(worker, request)` says otherwise ("lost", "wrong_version", "error", "hang")."""

    def __init__(self, ids, weights=None, auto=False, delay: int = 0) -> None:
        super().__init__(ids, weights, auto)
        self.held: set[str] = set()
        self.released: list[str] = []
        self.calls: dict[str, tuple[str, EvalRequest, int]] = {}  # ref -> (worker, request, polls left)
        self.requests: list[tuple[str, EvalRequest]] = []
        self.leased_while_held: list[str] = []
        self.delay, self.fate = delay, lambda worker, request: "ok"
        self._eval_refs = itertools.count()

    def ready_ids(self):
        return [w for w in super().ready_ids() if w not in self.held]

    def dispatch(self, worker_id, task):
        if worker_id in self.held:
            self.leased_while_held.append(worker_id)
        return super().dispatch(worker_id, task)

    def hold(self, worker_id):
        self.held.add(worker_id)

    def release(self, worker_id):
        self.held.discard(worker_id)
        self.released.append(worker_id)

    def run_eval(self, worker_id, request):
        if worker_id not in self.inflight_count:
            return None
        ref = f"eval-ref-{next(self._eval_refs)}"
        self.calls[ref] = (worker_id, request, self.delay)
        self.requests.append((worker_id, request))
        return ref

    def wait_eval(self, refs, timeout):
        out = []
        for ref in refs:
            worker, req, left = self.calls[ref]
            fate = self.fate(worker, req)
            if fate == "hang":
                continue
            if left > 0:
                self.calls[ref] = (worker, req, left - 1)
                continue
            if fate == "lost":
                out.append((ref, None, ConnectionError("actor died")))
            elif fate != "ok":
                out.append((ref, EvalResult(req.eval_id, req.chunk, worker, fate, error="boom"), None))
            else:
                rewards = [[score(i, j) for j in range(req.k)] for i in req.indices]
                out.append((ref, EvalResult(req.eval_id, req.chunk, worker, "ok", list(req.indices), rewards,
                                            [[i % 4 + 1] * req.k for i in req.indices]), None))
        return out


def evaluator(pool, **plan):
    settings = dict(every=2, before_train=False, prompts=10, k=2, temperature=1.0, workers=2, chunk=3)
    settings.update(plan)
    logged, messages = [], []
    ev = Evaluator(EvalPlan(**settings), pool, lambda step, m: logged.append((step, m)), messages.append)
    return ev, logged, messages


def expected(prompts: int, k: int) -> dict:
    rewards = [[score(i, j) for j in range(k)] for i in range(prompts)]
    return eval_metrics([result(0, range(prompts), rewards, [[i % 4 + 1] * k for i in range(prompts)])], prompts, k)


def scores(m: dict) -> dict:
    return {k: v for k, v in m.items() if k not in ("eval/seconds", "eval/version", "eval/workers_dropped")}


def run_to_end(ev: Evaluator, polls: int = 50) -> None:
    for _ in range(polls):
        ev.poll()


def test_evals_run_when_due_on_held_workers_and_release_them():
    pool = EvalPool(["w0", "w1", "w2"])
    ev, logged, messages = evaluator(pool, every=2, before_train=True, workers=2)
    ev.start_of_run(0, 0)
    assert pool.held == {"w0", "w1"} and pool.ready_ids() == ["w2"]
    assert [(w, r.chunk, r.version, r.indices) for w, r in pool.requests] == [
        ("w0", 0, 0, [0, 1, 2]), ("w0", 1, 0, [3, 4, 5]), ("w1", 2, 0, [6, 7, 8]), ("w1", 3, 0, [9])]
    run_to_end(ev)
    assert pool.held == set() and sorted(pool.released) == ["w0", "w1"]
    ev.after_step(1, 1)
    assert pool.requests[4:] == []  # not due
    pool.delay = 2
    ev.after_step(2, 2)
    ev.poll()
    ev.after_step(4, 4)  # due while the eval of step 2 still runs: skipped, said
    run_to_end(ev)
    assert [step for step, _ in logged] == [0, 2] and "eval at step 4 skipped" in messages[0]
    for step, m in logged:
        assert m["eval/version"] == step
        assert scores(m) == expected(10, 2)


def test_an_eval_due_before_any_worker_is_ready_waits_while_its_weights_are_current():
    pool = EvalPool(["w0", "w1"])
    pool.leaving = ["w0", "w1"]  # not ready (starting)
    ev, logged, messages = evaluator(pool, before_train=True)
    ev.start_of_run(0, 0)
    ev.poll()
    assert pool.requests == [] and ev.waiting == (0, 0)
    pool.leaving = []  # up, holding version 0
    run_to_end(ev)
    assert [s for s, _ in logged] == [0] and pool.requests[0][1].version == 0
    pool.leaving = ["w0", "w1"]
    ev.after_step(2, 2)
    ev.after_step(3, 3)  # version 2 left the workers before any was ready: skipped, said
    ev.finish()
    assert [s for s, _ in logged] == [0] and "eval at step 2 skipped" in messages[-1] and ev.skipped == 1


@pytest.mark.parametrize("fate, partial", [("lost", False), ("wrong_version", False), ("error", True)])
def test_chunks_of_a_lost_worker_are_rerun_on_the_other_held_worker(fate, partial):
    pool = EvalPool(["w0", "w1", "w2"])
    pool.fate = lambda worker, req: fate if worker == "w0" else "ok"
    ev, logged, messages = evaluator(pool, workers=2)
    ev.after_step(2, 2)
    run_to_end(ev)
    (_, m), = logged
    if not partial:  # re-run on w1 at the same version: the same numbers as a clean eval
        assert {w for w, r in pool.requests[2:]} == {"w1"} and "w0" in pool.released
        assert m.pop("eval/workers_dropped") == 1
        assert scores(m) == expected(10, 2)
    else:  # a generation that fails is retried on its worker (max_attempts 2), then left out: partial
        assert m["eval/partial"] == 1 and m["eval/prompts"] == 4 and "left out" in messages[0]


def test_an_eval_whose_held_workers_are_all_lost_is_partial():
    pool = EvalPool(["w0", "w1"])
    pool.fate = lambda worker, req: "lost" if req.chunk > 0 else "ok"
    ev, logged, _ = evaluator(pool, workers=1, chunk=4)
    ev.after_step(2, 2)
    run_to_end(ev)
    (_, m), = logged
    assert m["eval/partial"] == 1 and m["eval/prompts"] == 4 and ev.running is None


def test_the_end_of_the_run_waits_for_an_eval_bounded():
    pool = EvalPool(["w0", "w1"], delay=3)
    ev, logged, _ = evaluator(pool)
    ev.after_step(2, 2)
    ev.finish()
    assert [s for s, _ in logged] == [2] and logged[0][1]["eval/partial"] == 0
    pool.fate = lambda worker, req: "hang"
    ev, logged, messages = evaluator(pool, timeout_s=0.3)
    ev.after_step(4, 4)
    ev.finish()
    assert logged[0][1]["eval/partial"] == 1 and "not finished within" in messages[0] and not pool.held


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_the_controller_trains_on_while_an_eval_holds_a_worker(mode):
    ctl, _, _ = controller(workers=("w0", "w1"), auto=True, mode=mode, steps=6, batch_groups=2,
                               max_inflight_per_worker=2)
    pool = EvalPool(["w0", "w1"], ctl.weights, auto=True, delay=1)  # an eval takes two loop passes
    ctl.workers = pool
    steps_at_eval: list[int] = []
    logged = []

    def on_eval(step, m):
        steps_at_eval.append(ctl.state.step)
        logged.append((step, m))

    ctl.evaluator = Evaluator(EvalPlan(every=2, before_train=True, prompts=5, k=1, temperature=0.0, workers=1,
                                       chunk=8), pool, on_eval)
    state = ctl.run()
    assert [s for s, _ in logged] == [0, 2, 4, 6] and [m["eval/version"] for _, m in logged] == [0, 2, 4, 6]
    assert all(m["eval/partial"] == 0 for _, m in logged)
    assert pool.leased_while_held == [] and pool.held == set()
    assert any(at > step for at, (step, _) in zip(steps_at_eval, logged))  # trained on while an eval ran
    assert state.counters["samples_trained"] == 6 * 2 * 2  # eval samples are never trained or counted
    assert sum(len(s) for s in ctl.trainer.steps) == 24 and ctl.steps_logged == [1, 2, 3, 4, 5, 6]


# ------------------------------------------------------------------------------------------ the worker's side
class TokenTask(ArithmeticTask):
    """A reward that tells completions apart (a random model never answers a sum right): equal rewards, same tokens."""

    def reward(self, prompt, completion_token_ids):
        return sum((i + 1) * t for i, t in enumerate(completion_token_ids)) % 997 / 997


@pytest.fixture(scope="module")
def engine_runner():
    import torch

    from moerl.actors.engine_thread import EngineThread
    from moerl.actors.eval_runner import EvalRunner
    from moerl.model import build_model, tiny_config
    from moerl.rollout import Engine, EngineConfig, SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a rollout worker runs; two threads on a busy 2-core box spin for seconds
    task = TokenTask(ArithmeticConfig(max_operand=99))
    tok = task.tokenizer
    model = build_model(tiny_config(vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                                    max_position_embeddings=32), seed=0)
    engine = EngineThread(Engine(model, EngineConfig(max_batch_size=8, max_seq_len=32), version=3))
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=[tok.eos_token_id])
    yield engine, EvalRunner("w0", engine, task, "moerl.tasks.arithmetic:ArithmeticTask", {"max_operand": 99},
                             sampling, seed=0)
    engine.stop()
    torch.set_num_threads(threads)


def test_worker_eval_is_exact_for_the_same_weights_whatever_runs_beside_it(engine_runner):
    from moerl.rollout import SamplingParams

    engine, runner = engine_runner
    idle = threading.Event()
    for k, temperature in ((1, 0.0), (3, 1.0)):  # greedy, and sampled with per-sample seeds
        alone = runner.run(EvalRequest("eval-3", 0, 3, list(range(10)), k, temperature, ""), idle)
        assert alone.status == "ok" and [len(r) for r in alone.rewards] == [k] * 10
        assert len({x for r in alone.rewards for x in r}) > 5  # the completions differ: the check below means something
        noise = [engine.submit([1, 2, 3, 4], SamplingParams(max_new_tokens=6, seed=s), f"train/{s}")
                 for s in range(5)]  # training requests in the same batches
        parts: dict[int, EvalResult] = {}

        def chunk(c: int, indices: list[int], k: int = k, temperature: float = temperature, parts=parts) -> None:
            parts[c] = runner.run(EvalRequest("eval-3", c, 3, indices, k, temperature, ""), idle)

        threads = [threading.Thread(target=chunk, args=(c, ix)) for c, ix in ((0, [7, 8, 9]), (1, list(range(7))))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        [f.result(timeout=60) for f in noise]
        assert eval_metrics(list(parts.values()), 10, k) == eval_metrics([alone], 10, k)
        assert sorted(n for p in parts.values() for n in p.lengths) == sorted(alone.lengths)


def test_worker_eval_refuses_other_weights(engine_runner):
    _, runner = engine_runner
    stale = runner.run(EvalRequest("eval-4", 0, 4, [0], 1, 0.0, "", wait_s=0.05), threading.Event())
    assert stale.status == "wrong_version" and "holds weights version 3" in stale.error
    stopping = threading.Event()
    stopping.set()
    assert runner.run(EvalRequest("eval-3", 0, 3, [0], 1, 0.0, ""), stopping).status == "preempted"
