"""Tasks: deterministic prompt streams with verifiable rewards, loaded by dotted path.

See `moerl.tasks.base` for the protocol; built-ins are `moerl.tasks.arithmetic:ArithmeticTask`
(synthetic, download-free) and `moerl.tasks.dataset:DatasetTask` (local JSONL / Parquet / saved HF datasets,
chat templates, weighted rewards; `moerl.tasks.jsonl:JsonlTask` is its earlier name).
"""

from moerl.tasks.base import (
    Prompt,
    Task,
    TaskError,
    Tokenizer,
    completion_text,
    derive_seed,
    load_task,
    safe_reward,
    stop_token_ids,
)
from moerl.tasks.tokenizer import ByteTokenizer, HFTokenizer, make_tokenizer

__all__ = [
    "ByteTokenizer", "HFTokenizer", "Prompt", "Task", "TaskError", "Tokenizer", "completion_text",
    "derive_seed", "load_task", "make_tokenizer", "safe_reward", "stop_token_ids",
]
