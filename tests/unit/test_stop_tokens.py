"""Stop tokens: several per request, from the tokenizer (EOS, `<|im_end|>`...) and the checkpoint's
generation_config.json (an int or a list), and the engine ending a request on any of them."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from moerl.model import CheckpointError, MoEModelConfig, build_model, read_stop_token_ids
from moerl.rollout import Engine, EngineConfig, SamplingParams
from moerl.run import run_stop_token_ids
from moerl.tasks import ByteTokenizer, HFTokenizer, completion_text, stop_token_ids

PROMPT = [3, 14, 15, 9, 26]


@pytest.fixture(scope="module")
def model():
    cfg = MoEModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=16, initializer_range=0.1)
    return build_model(cfg, seed=3).eval()


def test_sampling_params_take_a_list_or_one_id_as_a_tuple():
    assert SamplingParams().stop_token_ids == ()
    assert SamplingParams(stop_token_ids=[5, 7]).stop_token_ids == (5, 7)
    assert SamplingParams(stop_token_ids=2).stop_token_ids == (2,)
    with pytest.raises(ValueError, match=r"SamplingParams\.stop_token_ids \[2\.0\]"):
        SamplingParams(stop_token_ids=[2.0]).validate(vocab_size=10)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=11)])
def test_a_request_stops_on_the_second_of_two_stop_ids(model, sampling):
    base = Engine(model, EngineConfig(max_seq_len=64)).generate([PROMPT], SamplingParams(max_new_tokens=24,
                                                                                         **sampling))[0]
    stop = base.token_ids[5]
    first = base.token_ids.index(stop)
    absent = next(t for t in range(64) if t not in base.token_ids)  # the first id never comes
    params = [SamplingParams(max_new_tokens=24, stop_token_ids=ids, **sampling)
              for ids in ((absent, stop), [stop], (absent,))]
    outs = Engine(model, EngineConfig(max_seq_len=64)).generate([PROMPT] * 3, params)
    assert outs[0].finish_reason == "stop" and outs[0].token_ids == base.token_ids[: first + 1]
    assert outs[1].token_ids == outs[0].token_ids and outs[1].logprobs == outs[0].logprobs
    assert outs[2].finish_reason == "length" and outs[2].token_ids == base.token_ids


def _write(directory: Path, name: str, content) -> None:
    (directory / name).write_text(content if isinstance(content, str) else json.dumps(content))


def test_generation_config_eos_as_a_list_an_int_or_from_config_json(tmp_path):
    _write(tmp_path, "config.json", {"model_type": "qwen3_moe", "eos_token_id": 151643})
    assert read_stop_token_ids(tmp_path) == (151643,)  # no generation_config.json: config.json's
    _write(tmp_path, "generation_config.json", {"eos_token_id": [151645, 151643, 151645], "do_sample": True})
    assert read_stop_token_ids(tmp_path) == (151645, 151643)  # the list, in order, once each
    _write(tmp_path, "generation_config.json", {"eos_token_id": 151645})
    assert read_stop_token_ids(tmp_path) == (151645,)
    _write(tmp_path, "generation_config.json", {"temperature": 0.7})  # none there: config.json's
    assert read_stop_token_ids(tmp_path) == (151643,)
    assert read_stop_token_ids(tmp_path / "missing") == ()
    for bad in ({"eos_token_id": "151645"}, {"eos_token_id": [1, -2]}, {"eos_token_id": [True]}):
        _write(tmp_path, "generation_config.json", bad)
        with pytest.raises(CheckpointError, match=r"generation_config\.json: eos_token_id must be"):
            read_stop_token_ids(tmp_path)
    _write(tmp_path, "generation_config.json", "{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_stop_token_ids(tmp_path)


def _chat_tokenizer_dir(directory: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<pad>": 0, "<|endoftext|>": 1, "<|im_end|>": 2, "<unk>": 3, "hello": 4, "world": 5}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<pad>", "<|endoftext|>", "<|im_end|>"])
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<pad>",
              "unk_token": "<unk>"}
    _write(directory, "tokenizer_config.json", config)


def test_chat_tokenizer_stops_on_im_end_and_endoftext(tmp_path):
    _chat_tokenizer_dir(tmp_path)
    raw = HFTokenizer._from_tokenizers_json(tmp_path)
    assert raw.eos_token_id == 2 and raw.stop_token_ids == (2, 1)  # EOS first; unknown names are left out
    assert stop_token_ids(raw) == (2, 1) and stop_token_ids(ByteTokenizer()) == (2,)
    assert completion_text(raw, [4, 1, 5, 2]) == "hello"  # cut at the first stop of any kind
    assert stop_token_ids(SimpleNamespace(eos_token_id=7)) == (7,)  # a tokenizer without the field
    pytest.importorskip("transformers")
    hf = HFTokenizer.from_pretrained(tmp_path)
    assert hf.stop_token_ids == (2, 1)


def test_the_run_stops_on_the_tokenizer_and_the_checkpoint_ids(tmp_path):
    _write(tmp_path, "generation_config.json", {"eos_token_id": [200, 2]})
    task = SimpleNamespace(tokenizer=ByteTokenizer())
    cfg = SimpleNamespace(model=SimpleNamespace(path=str(tmp_path)))
    assert run_stop_token_ids(cfg, task) == (2, 200)
    cfg.model.path = ""
    assert run_stop_token_ids(cfg, task) == (2,)
