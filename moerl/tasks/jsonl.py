"""`moerl.tasks.jsonl:JsonlTask`: the first name of `moerl.tasks.dataset:DatasetTask`, which reads JSONL,
Parquet and saved Hugging Face datasets with the same options; kept so existing configs load unchanged."""

from moerl.tasks.dataset import DatasetConfig as JsonlConfig
from moerl.tasks.dataset import DatasetTask as JsonlTask

__all__ = ["JsonlConfig", "JsonlTask"]
