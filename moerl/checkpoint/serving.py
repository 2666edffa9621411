"""The files a served export needs besides the weights: the tokenizer's and generation_config.json.

They travel with every checkpoint (`hf/` under the step, written by the Checkpointer from the run's tokenizer
directory and `model.path`), so a checkpoint on S3 exports on a machine that has neither. Read back from storage
they are untrusted: export copies only the names in SERVING_FILES (never one it writes itself, never code), and
drops an `auto_map` from the JSON ones (custom classes a consumer with trust_remote_code=True would fetch and run).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from moerl.checkpoint.storage import CheckpointStore

SERVING_DIR = "hf"  # under a step: the source model's tokenizer files and generation_config.json
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt")
GENERATION_CONFIG = "generation_config.json"
SERVING_FILES = (*TOKENIZER_FILES, GENERATION_CONFIG)  # what export copies from `hf/`: these names, nothing else
_CODE_KEY = "auto_map"  # in tokenizer_config.json / generation_config.json: classes a consumer would import from code


def serving_files(model_path: str = "", tokenizer_dir: str | None = None) -> dict[str, bytes]:
    """The files a served export needs besides the weights: the tokenizer's (from the run's tokenizer directory,
    else the model's) and generation_config.json (the model's, else the tokenizer directory's). Absent ones are
    skipped: a random-init model with the byte tokenizer has none."""
    def read(directory: str | None, names: tuple[str, ...]) -> dict[str, bytes]:
        if not directory or not Path(directory).is_dir():
            return {}
        return {n: (Path(directory) / n).read_bytes() for n in names if (Path(directory) / n).is_file()}
    files = read(tokenizer_dir, TOKENIZER_FILES) or read(model_path, TOKENIZER_FILES)
    generation = read(model_path, (GENERATION_CONFIG,)) or read(tokenizer_dir, (GENERATION_CONFIG,))
    return files | generation


def checkpoint_serving_files(store: CheckpointStore, step: int, files: dict[str, int],
                              warn: Callable[[str], None]) -> dict[str, bytes]:
    """The files of `hf/` that export copies: those named in SERVING_FILES (at its top); the rest are left out,
    said in one warning (their keys checked already: plain, printable, short)."""
    prefix = SERVING_DIR + "/"
    names = sorted(n[len(prefix):] for n in files if n.startswith(prefix))
    skipped = [n for n in names if n not in SERVING_FILES]
    if skipped:
        warn(f"{store.step_path(step)}: left out {len(skipped)} file(s) under {SERVING_DIR}/ that are not tokenizer or "
             f"generation files export knows ({', '.join(map(repr, skipped[:5]))}{' ...' if len(skipped) > 5 else ''})")
    return {name: store.read_bytes(step, f"{prefix}{name}") for name in names if name in SERVING_FILES}


def without_code(name: str, data: bytes, warn: Callable[[str], None]) -> bytes:
    """`data` of a JSON serving file without an `auto_map` (custom classes a consumer with trust_remote_code=True
    would import from code that export never ships); other files as they are."""
    if not name.endswith(".json"):
        return data
    try:
        parsed = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return data  # not JSON: the consumer's loader says so; nothing in it can name code for transformers
    if not isinstance(parsed, dict) or _CODE_KEY not in parsed:
        return data
    warn(f"{name}: dropped its '{_CODE_KEY}' (custom code, which export never ships)")
    del parsed[_CODE_KEY]
    return (json.dumps(parsed, indent=2, ensure_ascii=False) + "\n").encode()


def used_byte_tokenizer(manifest: dict[str, Any]) -> bool:
    """Whether the run that wrote the manifest used the byte tokenizer (its recorded task.options; the shipped
    tasks' default)."""
    config = manifest.get("config")
    task = config.get("task") if isinstance(config, dict) else None
    options = task.get("options") if isinstance(task, dict) else None
    return isinstance(options, dict) and options.get("tokenizer", "byte") == "byte"
