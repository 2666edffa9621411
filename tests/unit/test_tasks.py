"""Tasks: deterministic prompt streams (across instances and processes), rewards, loading, errors."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from moerl.tasks import ByteTokenizer, HFTokenizer, Prompt, TaskError, load_task, safe_reward
from moerl.tasks.arithmetic import ArithmeticConfig, ArithmeticTask
from moerl.tasks.jsonl import JsonlConfig, JsonlTask
from moerl.tasks.rewards import exact_match, last_boxed, math_answer

ARITH = "moerl.tasks.arithmetic:ArithmeticTask"
REPO = Path(__file__).resolve().parents[2]
BYTES = ByteTokenizer()
EOS = BYTES.eos_token_id


def ids(text: str, eos: bool = True) -> list[int]:
    return BYTES.encode(text) + ([EOS] if eos else [])


def write_jsonl(tmp_path: Path, rows: list[object], name: str = "data.jsonl") -> str:
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


# ------------------------------------------------------------------------------------- byte tokenizer
def test_byte_tokenizer_round_trip_and_specials() -> None:
    text = "12+7= héllo ✓ 日本"
    encoded = BYTES.encode(text)
    assert BYTES.vocab_size == 259 and (BYTES.pad_token_id, BYTES.bos_token_id, BYTES.eos_token_id) == (0, 1, 2)
    assert all(3 <= i < 259 for i in encoded) and len(encoded) == len(text.encode())
    assert BYTES.decode(encoded) == text
    assert BYTES.decode([1] + encoded[:3] + [2, 0] + encoded[3:]) == text  # specials skipped, not cut
    assert BYTES.decode(BYTES.encode("é")[:1]) == "\ufffd"  # a cut-off character does not raise
    with pytest.raises(ValueError, match="300"):
        BYTES.decode([300])


# ------------------------------------------------------------------------------------- arithmetic
def test_arithmetic_deterministic_across_instances_and_distinct_ids() -> None:
    a, b = ArithmeticTask(ArithmeticConfig(seed=7, ops="+-*")), ArithmeticTask(ArithmeticConfig(seed=7, ops="+-*"))
    prompts = [a.prompt_at(i) for i in range(200)]
    assert prompts == [b.prompt_at(i) for i in range(200)]
    assert len({p.task_id for p in prompts}) == 200 and prompts[123].task_id == "arith-000123"
    problems = [re.fullmatch(r"(\d+)([-+*])(\d+)=", p.prompt_text) for p in prompts]
    assert all(problems) and {m[2] for m in problems if m} == set("+-*")
    assert all(0 <= int(m[1]) <= 20 and 0 <= int(m[3]) <= 20 and p.answer == str(eval(m[0][:-1]))
               for m, p in zip(problems, prompts) if m)
    other = ArithmeticTask(ArithmeticConfig(seed=8, ops="+-*"))
    assert [p.prompt_text for p in prompts] != [other.prompt_at(i).prompt_text for i in range(200)]
    assert prompts[5].prompt_token_ids == [BYTES.bos_token_id] + BYTES.encode(prompts[5].prompt_text)


def test_arithmetic_cursor_resume_reproduces_stream() -> None:
    task = ArithmeticTask(ArithmeticConfig(seed=1))
    first_run = [task.prompt_at(i) for i in range(50)]
    cursor = 30  # a checkpoint saved after 30 prompts; a fresh process resumes there
    resumed = ArithmeticTask(ArithmeticConfig(seed=1))
    assert [resumed.prompt_at(i) for i in range(cursor, 50)] == first_run[cursor:]
    assert all(p.index == i for i, p in enumerate(first_run))
    # random access order does not matter: no hidden iterator state
    assert resumed.prompt_at(7) == first_run[7] and resumed.prompt_at(3) == first_run[3]
    for bad in (-1, 1.0, True):
        with pytest.raises(TaskError, match="non-negative int"):
            task.prompt_at(bad)  # type: ignore[arg-type]


def test_arithmetic_reward_and_eos_handling() -> None:
    task = ArithmeticTask(ArithmeticConfig(seed=0))
    p = Prompt("arith-000000", 0, [], "12+7=", "19")
    assert task.reward(p, ids("19")) == 1.0
    assert task.reward(p, ids(" 19 \n")) == 1.0  # stripped
    assert task.reward(p, ids("19", eos=False)) == 1.0  # no EOS but exactly the answer
    assert task.reward(p, ids("19") + ids("garbage")) == 1.0  # everything after the first EOS ignored
    assert task.reward(p, ids("18")) == 0.0
    assert task.reward(p, ids("19 because")) == 0.0
    assert task.reward(p, ids("19", eos=False) + ids("5", eos=False)) == 0.0  # "195"
    assert task.reward(p, [EOS]) == 0.0 and task.reward(p, []) == 0.0


def test_arithmetic_sft_example_matches_prompt_and_reward() -> None:
    task = ArithmeticTask(ArithmeticConfig(seed=2, ops="+-", max_operand=50))
    for i in range(20):
        prompt_ids, target_ids = task.sft_example(i)
        prompt = task.prompt_at(i)
        assert prompt_ids == prompt.prompt_token_ids
        assert target_ids == BYTES.encode(prompt.answer) + [EOS] and target_ids[-1] == EOS
        assert task.reward(prompt, target_ids) == 1.0


def test_prompts_identical_across_processes_with_different_hash_seeds(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path, [{"prompt": f"q{i}", "answer": str(i)} for i in range(7)])
    script = (
        "import json, sys\n"
        "from moerl.tasks import load_task\n"
        f"a = load_task({ARITH!r}, {{'ops': '+-*'}}, seed=5)\n"
        f"j = load_task('moerl.tasks.jsonl:JsonlTask', {{'path': {data!r}}}, seed=5)\n"
        "print(json.dumps([[a.prompt_at(i).prompt_text for i in range(40)], "
        "[j.prompt_at(i).prompt_text for i in range(21)]]))\n"
    )
    outputs = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(REPO)}
        run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        outputs.append(json.loads(run.stdout))
    assert outputs[0] == outputs[1]
    here = [[load_task(ARITH, {"ops": "+-*"}, seed=5).prompt_at(i).prompt_text for i in range(40)],
            [JsonlTask(JsonlConfig(path=data, seed=5)).prompt_at(i).prompt_text for i in range(21)]]
    assert outputs[0] == here


# ------------------------------------------------------------------------------------- load_task
def test_load_task_by_dotted_path_both_spellings_and_seed() -> None:
    colon = load_task(ARITH, {"max_operand": 5, "ops": "*"}, seed=3)
    dot = load_task("moerl.tasks.arithmetic.ArithmeticTask", {"max_operand": 5, "ops": "*"}, seed=3)
    assert isinstance(colon, ArithmeticTask) and colon.config == ArithmeticConfig(max_operand=5, ops="*", seed=3)
    assert [colon.prompt_at(i) for i in range(10)] == [dot.prompt_at(i) for i in range(10)]
    assert load_task(ARITH, {"seed": 11}, seed=3).config.seed == 11  # an explicit task seed wins
    assert load_task(ARITH, None, seed=4).config == ArithmeticConfig(seed=4)


def test_load_task_errors() -> None:
    with pytest.raises(TaskError, match=r"cannot load task 'moerl.tasks.nope:X': No module named 'moerl.tasks.nope'"):
        load_task("moerl.tasks.nope:X", {}, seed=0)
    with pytest.raises(TaskError, match=r"cannot load task 'moerl.tasks.arithmetic:Nope': .*has no attribute 'Nope'"):
        load_task("moerl.tasks.arithmetic:Nope", {}, seed=0)
    with pytest.raises(TaskError, match="cannot load task 'nodots'"):
        load_task("nodots", {}, seed=0)
    with pytest.raises(TaskError, match="no dataclass `config_class`"):
        load_task("moerl.tasks.base:TaskError", {}, seed=0)
    with pytest.raises(TaskError, match=r"unknown option 'max_operandd'; valid options: max_operand, ops, seed"):
        load_task(ARITH, {"max_operandd": 3}, seed=0)
    with pytest.raises(TaskError, match=r"option 'max_operand' must be int, got '3'"):
        load_task(ARITH, {"max_operand": "3"}, seed=0)
    with pytest.raises(TaskError, match="'ops'"):
        load_task(ARITH, {"ops": "/"}, seed=0)
    with pytest.raises(TaskError, match="missing required option 'path'"):
        load_task("moerl.tasks.jsonl:JsonlTask", {}, seed=0)
    with pytest.raises(TaskError, match=r"unknown reward 'fuzzy': one of math, exact_match, boxed or a dotted path"):
        load_task("moerl.tasks.jsonl:JsonlTask", {"path": "x.jsonl", "reward": "fuzzy"}, seed=0)
    assert issubclass(TaskError, ValueError)


# ------------------------------------------------------------------------------------- safe_reward
@dataclass
class _StubConfig:
    value: float = 0.0


class _StubTask:
    config_class = _StubConfig

    def __init__(self, config: _StubConfig, result: object = None, exc: Exception | None = None) -> None:
        self.tokenizer, self.result, self.exc = BYTES, result, exc

    def prompt_at(self, index: int) -> Prompt:
        return Prompt(f"stub-{index}", index, [1], "", "")

    def reward(self, prompt: Prompt, completion_token_ids: list[int]) -> object:
        if self.exc is not None:
            raise self.exc
        return self.result


def test_safe_reward_errors_are_failures_not_zero() -> None:
    p = _StubTask(_StubConfig()).prompt_at(0)
    assert safe_reward(_StubTask(_StubConfig(), result=0.5), p, []) == (0.5, None)
    assert safe_reward(_StubTask(_StubConfig(), result=1), p, []) == (1.0, None)
    assert safe_reward(_StubTask(_StubConfig(), exc=KeyError("answer")), p, []) == (None, "KeyError: 'answer'")
    assert safe_reward(_StubTask(_StubConfig(), exc=ZeroDivisionError("boom")), p, []) == (None, "ZeroDivisionError: boom")
    for bad in (math.nan, math.inf, -math.inf):
        value, error = safe_reward(_StubTask(_StubConfig(), result=bad), p, [])
        assert value is None and error is not None and error.startswith("ValueError: reward is not finite")
    for bad in ("1.0", None, [1.0]):
        value, error = safe_reward(_StubTask(_StubConfig(), result=bad), p, [])
        assert value is None and error is not None and error.startswith("TypeError")
    task = ArithmeticTask()
    assert safe_reward(task, Prompt("a", 0, [], "1+1=", "2"), ids("2")) == (1.0, None)
    assert safe_reward(task, Prompt("a", 0, [], "1+1=", "2"), ids("3")) == (0.0, None)
    value, error = safe_reward(task, Prompt("a", 0, [], "1+1=", "2"), [999])  # id outside the vocab
    assert value is None and error is not None and error.startswith("ValueError") and "999" in error


# ------------------------------------------------------------------------------------- jsonl
def test_jsonl_shuffle_is_deterministic_and_covers_each_epoch(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, [{"prompt": f"q{i}", "answer": i} for i in range(10)] + [""])  # blank line ok
    a, b = JsonlTask(JsonlConfig(path=path, seed=3)), JsonlTask(JsonlConfig(path=path, seed=3))
    stream = [a.prompt_at(i) for i in range(30)]
    assert stream == [b.prompt_at(i) for i in range(30)]
    epochs = [[p.prompt_text for p in stream[e * 10:(e + 1) * 10]] for e in range(3)]
    assert all(sorted(e) == sorted(f"q{i}" for i in range(10)) for e in epochs)  # every row once per epoch
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled each epoch
    assert epochs[0] != [f"q{i}" for i in range(10)]
    assert len({p.task_id for p in stream}) == 30 and stream[12].task_id == "data-000012"
    assert [b.prompt_at(i) for i in range(25, 30)] == stream[25:]  # resume mid-epoch
    other_seed = JsonlTask(JsonlConfig(path=path, seed=4))
    assert [other_seed.prompt_at(i).prompt_text for i in range(10)] != epochs[0]
    ordered = JsonlTask(JsonlConfig(path=path, shuffle=False))
    assert [ordered.prompt_at(i).prompt_text for i in range(12)] == [f"q{i}" for i in range(10)] + ["q0", "q1"]
    p = ordered.prompt_at(3)
    assert p.answer == "3" and p.prompt_token_ids == [BYTES.bos_token_id] + BYTES.encode("q3")


def test_jsonl_reward_modes_and_custom_keys(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, [{"question": "2+2?", "solution": "4"}])
    math_task = load_task("moerl.tasks.jsonl:JsonlTask",
                          {"path": path, "prompt_key": "question", "answer_key": "solution"}, seed=0)
    p = math_task.prompt_at(0)
    assert p.prompt_text == "2+2?" and p.answer == "4"
    assert math_task.reward(p, ids("2+2 is \\boxed{4.0}")) == 1.0
    assert math_task.reward(p, ids("so 4") + ids("5")) == 1.0  # text after EOS ignored
    assert math_task.reward(p, ids("so 5")) == 0.0
    exact = JsonlTask(JsonlConfig(path=path, prompt_key="question", answer_key="solution", reward="exact_match"))
    assert exact.reward(p, ids(" 4\n")) == 1.0 and exact.reward(p, ids("so 4")) == 0.0
    prompt_ids, target_ids = exact.sft_example(0)
    assert prompt_ids == p.prompt_token_ids and target_ids == ids("4")


def test_jsonl_errors_name_file_and_line(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match=r"task data file '.*missing.jsonl' not found"):
        JsonlTask(JsonlConfig(path=str(tmp_path / "missing.jsonl")))
    bad_json = write_jsonl(tmp_path, [{"prompt": "a", "answer": "1"}, "", '{"prompt": "b", "answer":'], "bad.jsonl")
    with pytest.raises(TaskError, match=r"bad.jsonl:3: invalid JSON"):
        JsonlTask(JsonlConfig(path=bad_json))
    no_key = write_jsonl(tmp_path, [{"prompt": "a", "answer": "1"}, {"prompt": "b", "solution": "2"}], "nokey.jsonl")
    with pytest.raises(TaskError, match=r"nokey.jsonl:2: row has no 'answer' \(keys: prompt, solution\)"):
        JsonlTask(JsonlConfig(path=no_key))
    not_obj = write_jsonl(tmp_path, [[1, 2]], "list.jsonl")
    with pytest.raises(TaskError, match=r"list.jsonl:1: expected a JSON object"):
        JsonlTask(JsonlConfig(path=not_obj))
    empty = write_jsonl(tmp_path, [""], "empty.jsonl")
    with pytest.raises(TaskError, match="has no rows"):
        JsonlTask(JsonlConfig(path=empty))


# ------------------------------------------------------------------------------------- rewards
@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),  # boxed with nested braces
        ("\\boxed{x^2+1}", "1+x^2", 1.0),  # math-verify: the same expression in another order
        ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
        ("\\boxed{50}", "50\\%", 1.0),  # a percentage and its number
        ("\\boxed{50\\%}", "50", 1.0),
        ("\\boxed{x^2+2}", "1+x^2", 0.0),
        ("\\boxed{\\sqrt{3}/2}", "\\frac{\\sqrt{2}}{2}", 0.0),
        ("first \\boxed{7} then \\boxed{8", "7", 1.0),  # unclosed (cut off) box: the earlier one
        ("3 apples and 4 pears make 7", "7", 1.0),  # last number
        ("3 apples and 4 pears make 7 fruit", "4", 0.0),
        ("total: 1,000 dollars.", "1000", 1.0),  # thousands separators
        ("\\boxed{1,234,567}", "1234567", 1.0),
        ("it is 1/2", "0.5", 1.0),  # fractions
        ("\\boxed{-\\dfrac{3}{4}}", "-0.75", 1.0),
        ("the result is -3", "-3", 1.0),  # negative
        ("the result is -3", "3", 0.0),
        ("x = 3.0", "3", 1.0),
        ("$5$", "5", 1.0),
        ("\\boxed{0.3333333333}", "1/3", 1.0),  # within 1e-6 relative
        ("\\boxed{0.3334}", "1/3", 0.0),
        ("no numbers here", "5", 0.0),  # mismatch
        ("\\boxed{6}", "5", 0.0),
        ("\\boxed{ Paris. }", "paris", 1.0),  # normalised strings
        ("The answer is Paris", "paris", 0.0),  # no box, non-numeric: the whole text must match
        ("\\boxed{1e999999999}", "1", 0.0),  # absurd exponent: no hang
        ("\\boxed{}", "", 0.0),
    ],
)
def test_math_answer(completion: str, answer: str, expected: float) -> None:
    assert math_answer(completion, answer) == expected


def test_reward_helpers() -> None:
    assert last_boxed("a \\boxed{b{c}d} e") == "b{c}d" and last_boxed("none") is None
    assert exact_match("  42\n", "42") == 1.0 and exact_match("42.", "42") == 0.0 and exact_match("4 2", "42") == 0.0


# ------------------------------------------------------------------------------------- HF tokenizer
def _save_word_level_tokenizer(directory: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "hello": 4, "world": 5}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "pad_token": "<pad>",
              "bos_token": "<s>", "unk_token": "<unk>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def test_hf_tokenizer_from_raw_tokenizers_json(tmp_path: Path) -> None:
    _save_word_level_tokenizer(tmp_path)
    tok = HFTokenizer._from_tokenizers_json(tmp_path)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (0, 1, 2, 6)
    assert tok.encode("hello world") == [4, 5]
    assert tok.decode([1, 4, 5, 2]).split() == ["hello", "world"]


def test_hf_tokenizer_via_transformers(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    _save_word_level_tokenizer(tmp_path)
    tok = HFTokenizer.from_pretrained(tmp_path)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (0, 1, 2, 6)
    assert tok.encode("hello world") == [4, 5]
    assert tok.decode([1, 4, 5, 2]).split() == ["hello", "world"]
    task = ArithmeticTask(ArithmeticConfig(), tokenizer=tok)  # any Tokenizer plugs into a task
    assert task.prompt_at(0).prompt_token_ids[0] == 1
    with pytest.raises(TaskError, match="not found"):
        HFTokenizer.from_pretrained(tmp_path / "nope")


def test_a_task_module_that_raises_on_import_is_named(tmp_path, monkeypatch):
    (tmp_path / "broken_task_mod.py").write_text("raise RuntimeError('dataset file missing')\n")
    (tmp_path / "syntax_task_mod.py").write_text("def (:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TaskError, match=r"importing 'broken_task_mod' raised RuntimeError: dataset file missing"):
        load_task("broken_task_mod:Task", {}, seed=0)
    with pytest.raises(TaskError, match=r"cannot load task 'syntax_task_mod:Task': .*SyntaxError"):
        load_task("syntax_task_mod:Task", {}, seed=0)


# ------------------------------------------------------------------ rewards that exit, hang or return junk (issue 26)
class _ExitingTask(_StubTask):
    def reward(self, prompt: Prompt, completion_token_ids: list[int]) -> object:
        if completion_token_ids == [1]:
            raise SystemExit(3)
        if completion_token_ids == [2]:
            raise KeyboardInterrupt
        return 0.5


def test_a_reward_that_exits_fails_its_sample_not_its_worker() -> None:
    task = _ExitingTask(_StubConfig())
    p = task.prompt_at(0)
    assert safe_reward(task, p, [1]) == (None, "SystemExit: 3")
    assert safe_reward(task, p, [2]) == (None, "KeyboardInterrupt: ")
    assert safe_reward(task, p, [3]) == (0.5, None)


class _HangingTask(_StubTask):
    """A reward that hangs on completion [9] until released (or for ever)."""

    def __init__(self, config: _StubConfig) -> None:
        super().__init__(config)
        self.release = threading.Event()
        self.calls: list[list[int]] = []

    def reward(self, prompt: Prompt, completion_token_ids: list[int]) -> object:
        self.calls.append(list(completion_token_ids))
        if completion_token_ids == [9]:
            self.release.wait(60)
        return float(len(completion_token_ids))


def test_a_reward_past_its_deadline_fails_its_sample_and_the_rest_are_scored() -> None:
    from moerl.tasks.base import reward_error_kind
    from moerl.tasks.scoring import RewardScorer

    task = _HangingTask(_StubConfig())
    scorer = RewardScorer(task, timeout_s=0.3, max_hung=2)
    t0 = time.monotonic()
    out = scorer.score(task.prompt_at(0), [[1], [9], [1, 2], [1, 2, 3]])
    assert time.monotonic() - t0 < 10  # one deadline, not the hang
    assert out[0] == (1.0, None) and out[2:] == [(2.0, None), (3.0, None)]
    assert out[1][0] is None and "task.reward_timeout_s = 0.3 s" in out[1][1]
    assert reward_error_kind(out[1][1]) == "overran task.reward_timeout_s"
    assert scorer.hung() == 1
    task.release.set()  # the abandoned thread returns, scores nothing more, and ends
    deadline = time.monotonic() + 10
    while scorer.hung() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scorer.hung() == 0 and task.calls.count([1, 2]) == 1  # the hung thread never scored the rest again


def test_hung_rewards_cannot_pile_up_threads() -> None:
    from moerl.tasks.scoring import RewardScorer

    task = _HangingTask(_StubConfig())
    scorer = RewardScorer(task, timeout_s=0.1, max_hung=2)
    try:
        for _ in range(2):
            assert scorer.score(task.prompt_at(0), [[9]])[0][0] is None
        assert scorer.hung() == 2
        calls = len(task.calls)
        out = scorer.score(task.prompt_at(0), [[1], [2]])
        assert [r for r, _ in out] == [None, None] and "not started" in out[0][1] and len(task.calls) == calls
    finally:
        task.release.set()


def test_reward_error_kinds() -> None:
    from moerl.tasks.base import reward_error_kind

    p = _StubTask(_StubConfig()).prompt_at(0)
    for bad, kind in ((math.nan, "was not a finite real number"), ("x" * 10**4, "was not a finite real number"),
                      (None, "was not a finite real number")):
        _, error = safe_reward(_StubTask(_StubConfig(), result=bad), p, [])
        assert reward_error_kind(error) == kind and len(error) < 300
    _, error = safe_reward(_StubTask(_StubConfig(), exc=KeyError("answer")), p, [])
    assert reward_error_kind(error) == "raised"


# ----------------------------------------------------------------------------------------- held-out split (issue 35)
def test_held_out_problems_are_never_trained_on():
    """Two-digit sums: the eval split is every held-out problem (about held_out of them), training never draws
    one (neither RL prompts nor warm-start examples), and the split is the same for every seed."""
    task = ArithmeticTask(ArithmeticConfig(max_operand=99, held_out=0.2, seed=1))
    evals = {task.eval_prompt_at(i).prompt_text for i in range(task.eval_size)}
    assert len(evals) == task.eval_size and 1800 <= task.eval_size <= 2200
    trained = {task.prompt_at(i).prompt_text for i in range(3000)}
    sft = {BYTES.decode(task.sft_example(i)[0]) for i in range(1000)}
    assert len(trained) > 1500 and not trained & evals and not sft & evals
    other_seed = ArithmeticTask(ArithmeticConfig(max_operand=99, held_out=0.2, seed=7))
    assert [other_seed.eval_prompt_at(i).prompt_text for i in range(50)] == \
        [task.eval_prompt_at(i).prompt_text for i in range(50)]
    p = task.eval_prompt_at(3)
    a, b = map(int, p.prompt_text.rstrip("=").split("+"))
    assert p.answer == str(a + b) and task.eval_prompt_at(3 + task.eval_size).prompt_text == p.prompt_text


def test_held_out_zero_draws_both_splits_from_every_problem():
    task = ArithmeticTask(ArithmeticConfig(max_operand=9, held_out=0.0))
    assert task.eval_size is None
    evals = {task.eval_prompt_at(i).prompt_text for i in range(2000)}
    assert evals == {task.prompt_at(i).prompt_text for i in range(2000)} and len(evals) == 100


def test_a_large_problem_space_holds_out_an_endless_stream():
    task = ArithmeticTask(ArithmeticConfig(max_operand=999, held_out=0.5))
    assert task.eval_size is None
    from moerl.tasks.arithmetic import held_out

    assert all(held_out(task.eval_prompt_at(i).prompt_text.rstrip("="), 0.5) for i in range(100))
    assert not any(held_out(task.prompt_at(i).prompt_text.rstrip("="), 0.5) for i in range(100))


@pytest.mark.parametrize("options,match", [({"max_operand": 0, "held_out": 0.2}, "no held-out problem among the 1"),
                                           ({"held_out": 0.95}, r"'held_out' must be in \[0, 0.9\]")])
def test_a_split_that_leaves_a_side_empty_is_refused(options, match):
    with pytest.raises(TaskError, match=match):
        ArithmeticTask(ArithmeticConfig(**options))


def test_a_tokenizer_directory_with_custom_code_never_runs_it(tmp_path: Path, monkeypatch) -> None:
    """An `auto_map` in tokenizer_config.json made transformers ask "run the custom code? [y/N]" on stdin: a `y`
    ran the directory's Python, and on a terminal the question blocked (issue 37 item 5). Refused, in one line."""
    pytest.importorskip("transformers")
    import io

    _save_word_level_tokenizer(tmp_path)
    marker = tmp_path / "pwned"
    (tmp_path / "evil_tokenizer.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import PreTrainedTokenizerFast\nclass EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("tokenizer_class")
    config["auto_map"] = {"AutoTokenizer": [None, "evil_tokenizer.EvilTokenizer"]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 10))  # what piping `y` into the command did
    with pytest.raises(TaskError) as e:
        HFTokenizer.from_pretrained(tmp_path)
    assert not marker.exists()
    assert "\n" not in str(e.value) and "custom code" in str(e.value)


def test_every_transformers_load_refuses_remote_code() -> None:
    """Every from_pretrained call in moerl passes trust_remote_code=False (tokenizer, config, generation config)."""
    root = Path(__file__).resolve().parents[2] / "moerl"
    calls = []
    for path in root.rglob("*.py"):
        text = path.read_text()
        for m in re.finditer(r"\b(Auto\w+|GenerationConfig|PretrainedConfig)\.from_pretrained\(", text):
            end = text.index("\n\n", m.end()) if "\n\n" in text[m.end():] else len(text)
            calls.append((path.name, "trust_remote_code=False" in text[m.end():end]))
    assert calls and all(ok for _, ok in calls), calls
