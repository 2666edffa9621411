"""Token-exact turns: the ids of an observation alone (the delta), rendered by the model's chat template.

An episode's history is never rendered again: the tokens the model sampled stay as sampled, and after each turn
only the delta is appended (Qwen3's template, for one, drops earlier `<think>` blocks when it renders a whole
history, which would change tokens the model already saw). The delta is what the template writes after the
model's end-of-turn token for the observation messages, up to and including the next assistant generation prompt:
for Qwen3, `\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n`.

`TemplateRenderer` cuts it out of the tokenizer's own template: it renders a stand-in history whose assistant
message is a sentinel, plus the observation, and keeps the text after the sentinel and its end-of-turn token. The
text is encoded alone; special tokens are hard token boundaries, so this equals the ids of the whole rendering
after the end-of-turn token for ChatML templates (Qwen, tested). `ChatMLRenderer` writes Qwen3's syntax directly
for tokenizers without a template (the byte tokenizer of the CPU examples); its model stops on EOS, which stands
for `<|im_end|>`.
"""

from __future__ import annotations

from typing import Any, Protocol

from moerl.tasks.base import TaskError, Tokenizer

_SENTINEL = "\u2063moerl-turn\u2063"  # invisible separators: never in a real transcript
_END_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")


class Renderer(Protocol):
    def prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """The first prompt's ids, with the assistant's generation prompt."""

    def delta(self, observations: list[dict[str, str]]) -> list[int]:
        """The ids to append after the model's end-of-turn token: the observations and the next generation prompt."""


class TemplateRenderer:
    """Deltas cut from a Hugging Face tokenizer's chat template (`HFTokenizer`)."""

    def __init__(self, tokenizer: Any, **template_kwargs: Any) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise TaskError("TemplateRenderer needs a tokenizer with a chat template; use ChatMLRenderer")
        self.tokenizer, self.kwargs = tokenizer, template_kwargs

    def prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, **self.kwargs)

    def delta(self, observations: list[dict[str, str]]) -> list[int]:
        if not observations:
            raise TaskError("an observation needs at least one message to render")
        history = [{"role": "user", "content": "."}, {"role": "assistant", "content": _SENTINEL}]
        text = self.tokenizer.render_chat(history + list(observations), **self.kwargs)
        at = text.find(_SENTINEL)
        if at < 0:
            raise TaskError("the chat template dropped the assistant turn; cannot cut an observation out of it")
        rest = text[at + len(_SENTINEL):]
        end = next((e for e in _END_TEXTS if rest.startswith(e)), None)
        if end is None:
            raise TaskError(f"the chat template ends an assistant turn with {rest[:20]!r}, not a known end token")
        return self.tokenizer.encode(rest[len(end):])


class ChatMLRenderer:
    """Qwen3's ChatML text for a tokenizer without a template: tool messages as `<tool_response>` blocks inside one
    user turn (as Qwen3's template groups consecutive tool messages), other roles as their own turns."""

    def __init__(self, tokenizer: Tokenizer, system: str = "") -> None:
        self.tokenizer, self.system = tokenizer, system

    @staticmethod
    def text(messages: list[dict[str, str]]) -> str:
        out, i = [], 0
        while i < len(messages):
            if messages[i]["role"] == "tool":
                blocks = []
                while i < len(messages) and messages[i]["role"] == "tool":
                    blocks.append(f"<tool_response>\n{messages[i]['content']}\n</tool_response>")
                    i += 1
                out.append("<|im_start|>user\n" + "\n".join(blocks) + "<|im_end|>\n")
            else:
                out.append(f"<|im_start|>{messages[i]['role']}\n{messages[i]['content']}<|im_end|>\n")
                i += 1
        return "".join(out) + "<|im_start|>assistant\n"

    def prompt(self, messages: list[dict[str, str]]) -> list[int]:
        bos = [self.tokenizer.bos_token_id] if self.tokenizer.bos_token_id is not None else []
        return bos + self.tokenizer.encode(self.text(messages))

    def delta(self, observations: list[dict[str, str]]) -> list[int]:
        if not observations:
            raise TaskError("an observation needs at least one message to render")
        return self.tokenizer.encode("\n" + self.text(observations))


def renderer_for(tokenizer: Any, **template_kwargs: Any) -> Renderer:
    """The template's deltas where the tokenizer has a chat template, else Qwen3's ChatML written out."""
    if getattr(tokenizer, "chat_template", None) is not None:
        return TemplateRenderer(tokenizer, **template_kwargs)
    return ChatMLRenderer(tokenizer)





class CompactRenderer:
    """No chat markup: each message's content on a line of its own (the first prompt after BOS). For small CPU
    examples on the byte tokenizer, where ChatML's markers would be most of every episode's tokens."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def prompt(self, messages: list[dict[str, str]]) -> list[int]:
        bos = [self.tokenizer.bos_token_id] if self.tokenizer.bos_token_id is not None else []
        return bos + self.tokenizer.encode("".join(m["content"] + "\n" for m in messages))

    def delta(self, observations: list[dict[str, str]]) -> list[int]:
        if not observations:
            raise TaskError("an observation needs at least one message to render")
        return self.tokenizer.encode("".join(m["content"] + "\n" for m in observations))
__all__ = ["ChatMLRenderer", "CompactRenderer", "Renderer", "TemplateRenderer", "renderer_for"]
