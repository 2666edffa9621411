"""Bring-your-own data: chat templates, JSONL / Parquet / saved HF datasets, configurable fields, weighted rewards.

The tokenizer is built here (a word-level `tokenizers` model saved with a chat template through transformers'
PreTrainedTokenizerFast): nothing is downloaded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from moerl.tasks import ByteTokenizer, HFTokenizer, TaskError, load_task, safe_reward

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TASK = "moerl.tasks.dataset:DatasetTask"
WORDS = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>", "system", "user", "assistant", "you", "are", "a", "helpful",
         "tutor", "what", "is", "2", "+", "3", "?", "5", "think", "no", "solve", "x", "="]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant {% if enable_thinking is defined and "
            "not enable_thinking %}no think {% endif %}{% endif %}")
Q = [{"role": "user", "content": "what is 2 + 3 ?"}]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    """A chat model's tokenizer directory, as `save_pretrained` writes it (chat template included)."""
    directory = tmp_path_factory.mktemp("chat_tok")
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    model.add_special_tokens(["<pad>", "<|im_start|>", "<|im_end|>"])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<|im_end|>", pad_token="<pad>",
                                                unk_token="<unk>", chat_template=TEMPLATE)
    fast.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def reference(chat_dir):
    """transformers' own tokenizer: the prompt ids must be exactly what its apply_chat_template returns."""
    tok = transformers.AutoTokenizer.from_pretrained(chat_dir, local_files_only=True)

    def ids(messages, **kwargs) -> list[int]:
        out = tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    return ids


def jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ------------------------------------------------------------------------------------- chat templates
def test_messages_rows_are_exactly_the_chat_template(tmp_path, chat_dir, reference):
    own_system = [{"role": "system", "content": "you are a tutor"}, *Q]
    data = jsonl(tmp_path / "chat.jsonl", [{"messages": Q, "answer": "5"}, {"messages": own_system, "answer": 5}])
    task = load_task(TASK, {"path": data, "tokenizer": str(chat_dir), "shuffle": False}, seed=0)
    assert isinstance(task.tokenizer, HFTokenizer) and task.tokenizer.chat_template == TEMPLATE
    p0, p1 = task.prompt_at(0), task.prompt_at(1)
    assert p0.prompt_token_ids == reference(Q) and p0.answer == "5" and p1.answer == "5"
    assert p0.prompt_text == "<|im_start|>user what is 2 + 3 ?<|im_end|> <|im_start|>assistant "
    assert p1.prompt_token_ids == reference(own_system)

    system = {"role": "system", "content": "you are a helpful tutor"}
    with_system = load_task(TASK, {"path": data, "tokenizer": str(chat_dir), "shuffle": False,
                                   "system_prompt": system["content"]}, seed=0)
    assert with_system.prompt_at(0).prompt_token_ids == reference([system, *Q])
    assert with_system.prompt_at(1).prompt_token_ids == reference(own_system)  # the row's own system message wins

    kwargs = load_task(TASK, {"path": data, "tokenizer": str(chat_dir), "shuffle": False,
                              "chat_template_kwargs": {"enable_thinking": False}}, seed=0)
    assert kwargs.prompt_at(0).prompt_token_ids == reference(Q, enable_thinking=False) != reference(Q)
    assert task.sft_example(0) == (p0.prompt_token_ids, task.tokenizer.encode("5") + [task.tokenizer.eos_token_id])


def test_text_prompts_are_wrapped_as_a_user_message_unless_told(tmp_path, chat_dir, reference, caplog):
    data = jsonl(tmp_path / "text.jsonl", [{"prompt": "what is 2 + 3 ?", "answer": "5"}])
    with caplog.at_level("WARNING", logger="moerl.tasks.dataset"):
        wrapped = load_task(TASK, {"path": data, "tokenizer": str(chat_dir)}, seed=0)
    assert "sent as one user message" in caplog.text and "wrap_text_prompts = false" in caplog.text
    assert wrapped.prompt_at(0).prompt_token_ids == reference(Q)
    raw = load_task(TASK, {"path": data, "tokenizer": str(chat_dir), "wrap_text_prompts": False}, seed=0)
    assert raw.prompt_at(0).prompt_token_ids == raw.tokenizer.encode("what is 2 + 3 ?")  # no BOS in this vocab
    assert raw.prompt_at(0).prompt_text == "what is 2 + 3 ?"
    with pytest.raises(TaskError, match="'system_prompt' cannot reach the text prompts"):
        load_task(TASK, {"path": data, "tokenizer": str(chat_dir), "wrap_text_prompts": False,
                         "system_prompt": "be brief"}, seed=0)


def test_chat_options_without_a_chat_template_are_refused(tmp_path):
    chat = jsonl(tmp_path / "chat.jsonl", [{"prompt": "q", "answer": "1"}, {"messages": Q, "answer": "5"}])
    with pytest.raises(TaskError, match=r"chat.jsonl' holds chat messages, but tokenizer 'byte' has no chat template"):
        load_task(TASK, {"path": chat}, seed=0)
    text = jsonl(tmp_path / "text.jsonl", [{"prompt": "q", "answer": "1"}])
    with pytest.raises(TaskError, match="'system_prompt' needs a tokenizer with a chat template"):
        load_task(TASK, {"path": text, "system_prompt": "be brief"}, seed=0)
    with pytest.raises(TaskError, match="may not set 'add_generation_prompt'"):
        load_task(TASK, {"path": text, "chat_template_kwargs": {"add_generation_prompt": False}}, seed=0)
    assert ByteTokenizer.chat_template is None


# ------------------------------------------------------------------------------------- formats and fields
def _verl_rows() -> list[dict]:
    """verl's Parquet layout (examples/data_preprocess/gsm8k.py)."""
    return [{"data_source": "gsm8k", "prompt": [{"role": "user", "content": f"what is 2 + {i} ?"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(2 + i)},
             "extra_info": {"split": "train", "index": i}}
            for i in range(3)]


def test_parquet_in_verls_layout(tmp_path, chat_dir, reference):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    rows = _verl_rows()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    options = {"path": str(tmp_path / "train.parquet"), "answer_key": "reward_model.ground_truth",
               "tokenizer": str(chat_dir), "shuffle": False}
    task = load_task(TASK, options, seed=0)
    for i, row in enumerate(rows):
        p = task.prompt_at(i)
        assert p.prompt_token_ids == reference(row["prompt"]) and p.answer == row["reward_model"]["ground_truth"]
        assert p.task_id == f"train-{i:06d}"
    assert task.reward(task.prompt_at(1), task.tokenizer.encode("3") + [task.tokenizer.eos_token_id]) == 1.0

    shards = tmp_path / "shards"  # a directory of Parquet files reads as one table
    shards.mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:2]), shards / "part-0.parquet")
    pq.write_table(pa.Table.from_pylist(rows[2:]), shards / "part-1.parquet")
    assert len(load_task(TASK, {**options, "path": str(shards)}, seed=0).rows) == 3

    bad_rows = [{"question": "q", "reward_model": {"style": "rule"}}]
    pq.write_table(pa.Table.from_pylist(bad_rows), tmp_path / "bad.parquet")
    with pytest.raises(TaskError, match=r"bad.parquet row 0: row has no 'reward_model.ground_truth'"):
        load_task(TASK, {**options, "path": str(tmp_path / "bad.parquet"), "prompt_key": "question"}, seed=0)
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(TaskError, match=r"cannot read Parquet data '.*broken.parquet'"):
        load_task(TASK, {**options, "path": str(tmp_path / "broken.parquet")}, seed=0)


def test_saved_hf_datasets_directory(tmp_path, chat_dir, reference):
    datasets = pytest.importorskip("datasets")
    rows = _verl_rows()
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:2]),
                          "test": datasets.Dataset.from_list(rows[2:])}).save_to_disk(str(tmp_path / "dd"))
    options = {"answer_key": "reward_model.ground_truth", "tokenizer": str(chat_dir), "shuffle": False}
    task = load_task(TASK, {**options, "path": str(tmp_path / "ds")}, seed=0)
    assert [task.prompt_at(i).prompt_token_ids for i in range(3)] == [reference(r["prompt"]) for r in rows]
    test_split = load_task(TASK, {**options, "path": str(tmp_path / "dd"), "split": "test"}, seed=0)
    assert test_split.prompt_at(0).answer == "4" and len(test_split.rows) == 1
    with pytest.raises(TaskError, match=r"dd: no split 'validation' \(splits: train, test\)"):
        load_task(TASK, {**options, "path": str(tmp_path / "dd"), "split": "validation"}, seed=0)


def test_field_names_are_configurable_and_rows_checked(tmp_path):
    data = jsonl(tmp_path / "custom.jsonl", [{"question": "2+3?", "meta": {"solution": 5}},
                                             {"question": "2+2?", "meta": {"solution": "4"}}])
    task = load_task(TASK, {"path": data, "prompt_key": "question", "answer_key": "meta.solution",
                            "format": "jsonl", "shuffle": False}, seed=0)
    assert [(p.prompt_text, p.answer) for p in map(task.prompt_at, range(2))] == [("2+3?", "5"), ("2+2?", "4")]
    bad = [({"conversation": [{"role": "user"}], "answer": "1"},
            r"bad.jsonl:1: conversation\[0\] must be an object with string 'role' and 'content'"),
           ({"conversation": [], "answer": "1"}, r"'conversation' must be a non-empty list"),
           ({"prompt": 3, "answer": "1"}, r"'prompt' must be a string or a list of messages, got int"),
           ({"question": "q", "answer": "1"},
            r"row has neither 'prompt' nor 'conversation' \(keys: question, answer\)"),
           ({"prompt": "q", "answer": None}, r"'answer' is null")]
    for row, message in bad:
        with pytest.raises(TaskError, match=message):
            load_task(TASK, {"path": jsonl(tmp_path / "bad.jsonl", [row]), "messages_key": "conversation"}, seed=0)
    with pytest.raises(TaskError, match=r"option 'format' must be 'auto' \| 'jsonl' \| 'parquet' \| 'hf'"):
        load_task(TASK, {"path": data, "format": "csv"}, seed=0)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(TaskError, match="neither a saved Hugging Face dataset"):
        load_task(TASK, {"path": str(tmp_path / "empty_dir")}, seed=0)


# ------------------------------------------------------------------------------------- weighted rewards
def test_weighted_reward_list_with_dotted_paths(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def short(completion, answer):\n    return 1.0 if len(completion) < 20 else 0.0\n"
        "class Graders:\n    @staticmethod\n    def half(completion, answer):\n        return 0.5\n"
        "def broken(completion, answer):\n    return 'yes'\n"
        "NOT_A_FUNCTION = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = jsonl(tmp_path / "d.jsonl", [{"prompt": "2+3?", "answer": "5"}])
    reward = [{"name": "math", "weight": 1.0}, {"name": "boxed", "weight": 0.25}, "my_rewards:short",
              {"name": "my_rewards.Graders.half", "weight": 2}]
    task = load_task(TASK, {"path": data, "reward": reward}, seed=0)
    p, tok = task.prompt_at(0), task.tokenizer

    def score(text: str) -> float:
        return task.reward(p, tok.encode(text) + [tok.eos_token_id])
    assert score("\\boxed{5}") == 1.0 + 0.25 + 1.0 + 1.0
    assert score("it is 5") == 1.0 + 0.0 + 1.0 + 1.0
    assert score("\\boxed{4}, a long wrong answer") == 0.0 + 0.25 + 0.0 + 1.0
    failing = load_task(TASK, {"path": data, "reward": ["math", "my_rewards:broken"]}, seed=0)
    value, error = safe_reward(failing, p, tok.encode("5"))
    assert value is None and error == "TypeError: reward 'my_rewards:broken' returned str 'yes', expected a number"
    for spec, message in [("my_rewards:nope", r"cannot load reward 'my_rewards:nope': .*no attribute 'nope'"),
                          ("my_rewards.NOT_A_FUNCTION", "reward 'my_rewards.NOT_A_FUNCTION' is not callable"),
                          ([{"name": "math", "weight": "high"}], "reward 'math': weight must be a number"),
                          ([{"fn": "math"}], "option 'reward': expected a name"), ([], "empty list")]:
        with pytest.raises(TaskError, match=message):
            load_task(TASK, {"path": data, "reward": spec}, seed=0)
    assert "my_rewards" in sys.modules


def test_a_weighted_reward_list_round_trips_through_moerl_config(tmp_path):
    import tomllib

    from moerl.config import dump_toml, load_config
    toml = tmp_path / "run.toml"
    toml.write_text('[task]\nname = "moerl.tasks.dataset:DatasetTask"\n'
                    'options = { path = "d.jsonl", reward = [{ name = "math", weight = 1.0 }, "boxed"], '
                    'chat_template_kwargs = { enable_thinking = false } }\n')
    options = tomllib.loads(dump_toml(load_config(str(toml), [])))["task"]["options"]
    assert options == {"path": "d.jsonl", "reward": [{"name": "math", "weight": 1.0}, "boxed"],
                       "chat_template_kwargs": {"enable_thinking": False}}


def _doc_blocks(doc: str, lang: str) -> list[str]:
    text = (Path(__file__).resolve().parents[2] / doc).read_text()
    return [b.split("\n", 1)[1] for b in text.split("```")[1::2] if b.startswith(lang + "\n")]


@pytest.mark.parametrize("doc", ["docs/tasks.md", "README.md"])
def test_the_docs_examples_run_as_written(doc, tmp_path, chat_dir, reference, monkeypatch):
    """docs/architecture.md's policy example; docs/tasks.md's Parquet example written, then read through its config
    (and through the README's shorter one), with a local chat tokenizer standing in for Qwen's (no download) and the
    tiny random model (model.path empty)."""
    from moerl.config import load_config

    monkeypatch.chdir(tmp_path)
    exec(compile(_doc_blocks("docs/architecture.md", "python")[0], "the policy example", "exec"), {})
    parquet = next(b for b in _doc_blocks("docs/tasks.md", "python") if "pq.write_table" in b)
    (tmp_path / "data").mkdir()
    exec(compile(parquet, "the Parquet example", "exec"), {})
    toml = _doc_blocks(doc, "toml")[0].replace('"models/Qwen3-30B-A3B"', f'"{chat_dir}"')
    toml = toml.replace(f'path = "{chat_dir}"', 'path = ""')  # [model]: the random-init tiny model
    (tmp_path / "my_run.toml").write_text(toml)
    cfg = load_config(str(tmp_path / "my_run.toml"), [])
    task = load_task(cfg.task.name, dict(cfg.task.options), seed=0)
    prompt = task.prompt_at(0)
    messages = [{"role": "system", "content": "Put your final answer in \\boxed{}."}] * (doc == "docs/tasks.md") + [
        {"role": "user", "content": "What is 7 * 6?"}]
    assert prompt.answer == "42"
    kwargs = {"enable_thinking": False} if doc == "docs/tasks.md" else {}  # the README's shorter config leaves it out
    assert prompt.prompt_token_ids == reference(messages, **kwargs)
