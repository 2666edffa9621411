"""The environment interface (moerl/tasks/env.py): answers checked, the observation delta cut from a chat template
equal to the ids of the whole rendering past the model's end-of-turn (Qwen3-style tool responses grouped in one
user turn), the ChatML fallback writing the same text, and a server-form environment (OpenEnv's HTTP shapes)
played against a local server on 127.0.0.1 started here on a free port."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from moerl.loop.episode import EpisodeLimits, EpisodeStart, run_episode
from moerl.rollout import SamplingParams
from moerl.rollout.types import Completion
from moerl.tasks import ByteTokenizer, HFTokenizer
from moerl.tasks.chat_delta import ChatMLRenderer, TemplateRenderer
from moerl.tasks.env import EnvError, check_step
from moerl.tasks.env_http import OpenEnvHTTPEnv
from moerl.tasks.guess import GuessEnv

# A ChatML template written for this test, with the behaviour that makes re-rendering unsafe: an assistant turn
# before the last user query loses its <think> block, and consecutive tool messages share one user turn.
TEMPLATE = (
    "{%- set last = namespace(i=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}{%- set last.i = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{%- set c = m.content %}"
    "{%- if loop.index0 < last.i and '</think>' in c %}{%- set c = c.split('</think>')[-1].lstrip() %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + c + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def chat_tokenizer():
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    byte = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    vocab = {s: i for i, s in enumerate(specials + sorted(alphabet))}
    model = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [], unk_token=None))
    model.pre_tokenizer, model.decoder = byte, tokenizers.decoders.ByteLevel()
    model.add_special_tokens(specials)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>", chat_template=TEMPLATE)
    return HFTokenizer(fast)


def test_delta_is_the_whole_renderings_tail_and_chatml_writes_the_same(chat_tokenizer):
    tok = chat_tokenizer
    history = [{"role": "user", "content": "what is 6*7?"},
               {"role": "assistant", "content": "<think>\nuse the tool\n</think>\n\n<tool_call>\n6*7\n</tool_call>"}]
    obs = [{"role": "tool", "content": "42"}, {"role": "tool", "content": "ok"}]
    delta = TemplateRenderer(tok).delta(obs)
    # What the model saw: the prompt and its own turn, ending in <|im_end|>; the delta follows it exactly.
    seen = tok.apply_chat_template(history[:1]) + tok.encode(history[1]["content"] + "<|im_end|>")
    assert tok.inner.decode(delta).startswith("\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n")
    assert tok.inner.decode(delta).endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    whole_text = tok.render_chat(history + obs)
    assert whole_text.endswith(tok.inner.decode(delta))
    # Re-rendering the whole history would differ: the template drops the earlier <think> block after a new query.
    assert "<think>" not in tok.render_chat(history + [{"role": "user", "content": "again"}])
    assert ChatMLRenderer(tok).delta(obs) == delta
    assert tok.encode(tok.inner.decode(seen + delta)) == seen + delta  # specials are hard token boundaries


def test_check_step_names_the_bad_field():
    assert check_step({"observations": None, "reward": None, "done": True}).reward == 0.0
    for bad, says in [({"reward": 1, "done": True}, "observations"),
                      ({"observations": [{"role": "tool"}], "reward": 0, "done": False}, "messages"),
                      ({"observations": [], "reward": float("nan"), "done": False}, "finite"),
                      ({"observations": [], "reward": 0, "done": 1}, "bool"), ("x", "dict")]:
        with pytest.raises(EnvError, match=says):
            check_step(bad)


class _Server(BaseHTTPRequestHandler):
    """OpenEnv's HTTP shapes over guess-the-number, one game per episode_id."""

    games: dict[str, GuessEnv] = {}

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/reset":
            self.games[body["episode_id"]] = GuessEnv({}, {"secret": 6 if body.get("seed") is None else body["seed"]})
            out = {"observation": {"text": "guess a number from 0 to 9"}, "reward": None, "done": False}
        else:
            step = self.games[body["episode_id"]].step(body["action"]["message"])
            text = step["observations"][0]["content"] if step["observations"] else None
            out = {"observation": {"text": text}, "reward": step["reward"], "done": step["done"]}
        raw = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args):
        pass


@pytest.fixture()
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_server_environment_plays_an_episode_through_the_same_driver(server):
    tok = ByteTokenizer()
    guesses = iter(["3", "8", "6"])  # a scripted model: lower than 6, higher, right

    def generate(prompt, sp, prefix):
        ids = tok.encode(next(guesses)) + [tok.eos_token_id]
        return Completion("r", prompt, prefix.token_ids + ids, prefix.logprobs + [-1.0] * len(ids),
                          prefix.versions + [0] * len(ids), finish_reason="stop")

    env = OpenEnvHTTPEnv({"url": server}, {"seed": 6})
    out = run_episode(generate, env, EpisodeStart([{"role": "system", "content": "play"}]),
                      SamplingParams(temperature=1.0, seed=0, stop_token_ids=(tok.eos_token_id,)),
                      ChatMLRenderer(tok), tok.decode, EpisodeLimits(max_turns=5, max_tokens=400))
    assert (out.status, out.reward, out.turns) == ("done", 0.8, 3), out.error  # two wrong guesses first
    text = tok.decode(out.completion.prompt_token_ids + out.completion.token_ids)
    assert "<|im_start|>tool\nguess a number" not in text  # the reset observation joins the prompt as a tool turn
    assert "<tool_response>\nguess a number from 0 to 9\n</tool_response>" in text
    obs = tok.decode([t for t, m in zip(out.completion.token_ids, out.completion.loss_mask) if not m])
    assert "higher" in obs and "lower" in obs


def test_server_that_is_gone_fails_the_episode():
    env = OpenEnvHTTPEnv({"url": "http://127.0.0.1:9", "timeout_s": 2.0}, {})
    with pytest.raises(EnvError, match="127.0.0.1:9/reset"):
        env.init([])
