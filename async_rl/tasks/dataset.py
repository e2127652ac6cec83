"""Users' prompts as a Hugging Face dataset (`task.name: dataset`), read with the
`datasets` library from a local file or folder: parquet, arrow, csv or JSON lines, or a
folder written by `save_to_disk` (a Dataset, or a DatasetDict of splits).

`prompt_column` holds the prompt (a string, or a chat: a list of {"role", "content"}
turns ending with the user's), `answer_column` the answer; every other column becomes
the prompt's `fields` (rows.py), which the environment factory reads and a reward
receives by naming them, so a dataset made for verl or skyrl-gym (its `reward_model`,
`extra_info`, `db_id` columns) feeds their environments as it is. Held-out prompts come
from `eval_split` when given, else a fixed `eval_fraction` of the split.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from async_rl.tasks.base import RewardFn
from async_rl.tasks.rows import Row, RowsTask, held_out, row_of

FORMATS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json", ".jsonl": "json"}


def load_split(path: str | Path, split: str) -> Any:
    """One split of the dataset at `path`, or ValueError in one line: a missing path, a
    format `datasets` does not read, a split the dataset lacks."""
    path = Path(path)
    try:
        import datasets
    except ImportError:
        raise ValueError("task.name=dataset needs the datasets package: pip install 'async-rl[data]'") from None
    datasets.disable_progress_bars()
    if path.is_dir():
        try:
            loaded = datasets.load_from_disk(str(path))
        except FileNotFoundError:
            raise ValueError(f"{path}: not a folder written by save_to_disk (no dataset_info.json or "
                             "dataset_dict.json)") from None
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f"{path}: no split {split!r} (it has {', '.join(loaded) or 'none'})")
            return loaded[split]
        return loaded
    if not path.is_file():
        raise ValueError(f"{path}: no such file or folder")
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"{path}: a dataset file must end in {', '.join(FORMATS)} (or be a save_to_disk folder)")
    try:
        # A file is one split of its own, named "train" by `datasets` whatever it holds.
        return datasets.load_dataset(kind, data_files=str(path), split="train")
    except Exception as err:  # a file the reader cannot parse
        first = (str(err).splitlines() or [type(err).__name__])[0]
        if "corresponds to no data" in first:  # what `datasets` says of a file without rows
            raise ValueError(f"{path} ({split}): no rows") from None
        raise ValueError(f"{path}: datasets cannot read it as {kind} ({type(err).__name__}: {first})") from None


def dataset_rows(path: str | Path, split: str, prompt_column: str, answer_column: str,
                 answer_required: bool) -> list[Row]:
    data = load_split(path, split)
    columns = set(data.column_names)
    if prompt_column not in columns:
        raise ValueError(f"{path} ({split}): no column {prompt_column!r} (task.prompt_column); it has "
                         f"{', '.join(sorted(columns))}")
    if answer_required and answer_column not in columns:
        raise ValueError(f"{path} ({split}): no column {answer_column!r} (task.answer_column); it has "
                         f"{', '.join(sorted(columns))}")
    if len(data) == 0:
        raise ValueError(f"{path} ({split}): no rows")
    return [row_of(obj, f"{path} ({split}) row {k}", prompt=prompt_column, answer=answer_column,
                   answer_required=answer_required)
            for k, obj in enumerate(data)]


class DatasetTask(RowsTask):
    def __init__(self, *, seed: int, path: str | Path, split: str = "train", prompt_column: str = "prompt",
                 answer_column: str = "answer", eval_split: str | None = None, eval_fraction: float = 0.1,
                 eval_seed: int = 0, reward: str | RewardFn | None = None) -> None:
        required = reward is not None
        rows = dataset_rows(path, split, prompt_column, answer_column, required)
        if eval_split is not None:
            train, held = rows, dataset_rows(path, eval_split, prompt_column, answer_column, required)
        else:
            train, held = held_out(rows, eval_fraction, eval_seed, f"{path} ({split})", "task.eval_split",
                                   "task.eval_fraction")
        self.path = Path(path)
        super().__init__(seed, train, held, reward)
