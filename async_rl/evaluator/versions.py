"""The folder the learner and its evaluator share (RUN_DIR/evaluator/):

    config.yaml           the run's config, for the evaluator
    v000010.safetensors   the weights of version 10 as the actors receive them, in the evaluator's dtype
    v000010.json          {version, time, names}: written last, so its presence says the weights are whole
    v000010.result.json   the evaluator's metrics line for version 10
    progress              touched while the evaluator starts and after each chunk of held-out prompts:
                          a starting evaluator and a long round are progress, not a stall

Every file appears by an atomic rename, so neither side ever reads half of one. The
learner logs a result and removes that version's files; a version's `time` is the
learner's clock when it made the version, which is what time-to-accuracy counts (not
when the score arrived).
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not imported at run time: the evaluator marks its progress before torch has loaded
    import torch

FOLDER = "evaluator"
CONFIG_FILE = "config.yaml"
PROGRESS_FILE = "progress"
STARTUP_MARK_S = 1.0  # how often a starting evaluator touches the progress file
STARTUP_LIMIT_S = 600.0  # a startup longer than this is no longer progress: the learner's timeout applies


def mark_progress(folder: Path) -> None:
    (folder / PROGRESS_FILE).touch()


def mark_progress_while_starting(folder: Path) -> threading.Event:
    """Touch the progress file every STARTUP_MARK_S until the returned event is set (or
    STARTUP_LIMIT_S have passed): what the evaluator does while the interpreter, torch and
    its engines load, so that the learner's final wait does not take a starting
    evaluator for a stalled one."""
    ready = threading.Event()
    deadline = time.monotonic() + STARTUP_LIMIT_S

    def mark() -> None:
        while time.monotonic() < deadline:
            try:
                mark_progress(folder)
            except OSError:  # the folder is gone: the run is over
                return
            if ready.wait(STARTUP_MARK_S):
                return

    threading.Thread(target=mark, daemon=True, name="evaluator-starting").start()
    return ready


def version_file(folder: Path, version: int, suffix: str) -> Path:
    return folder / f"v{version:06d}{suffix}"


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def versions_in(folder: Path, suffix: str) -> list[int]:
    """The versions that have a file ending in `suffix`, oldest first."""
    return sorted(int(p.name[1:7]) for p in folder.glob(f"v[0-9][0-9][0-9][0-9][0-9][0-9]{suffix}"))


class VersionStore:
    """The learner's side: saves versions off the training thread, collects results."""

    def __init__(self, folder: Path, config_yaml: str, dtype: torch.dtype, resumed_at: int | None = None):
        """`resumed_at`: the version a resumed run continues from; what the stopped run
        saved or scored past it is dropped (those versions will be made again)."""
        self.folder, self.dtype = folder, dtype
        folder.mkdir(parents=True, exist_ok=True)
        write_atomically(folder / CONFIG_FILE, config_yaml)
        for path in folder.glob("v*"):
            if path.name[1:7].isdigit() and (resumed_at is None or int(path.name[1:7]) > resumed_at):
                path.unlink()
        self.pending = set(versions_in(folder, ".json"))  # saved, not yet logged
        self._writer: threading.Thread | None = None
        self.error: BaseException | None = None

    def saver(self, version: int, time_s: float) -> Callable[[Iterator[tuple[str, torch.Tensor]]], None]:
        """What the gather of `version`'s weights streams into: a CPU copy of each tensor,
        written to disk by a thread while training goes on (one save at a time)."""
        def consume(params) -> None:
            tensors = {name: t.detach().to("cpu", self.dtype, copy=True).contiguous() for name, t in params}
            self.flush()
            self.pending.add(version)
            self._writer = threading.Thread(target=self._write, args=(version, time_s, tensors), daemon=True,
                                            name=f"save-version-{version}")
            self._writer.start()
        return consume

    def _write(self, version: int, time_s: float, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        try:
            weights = version_file(self.folder, version, ".safetensors")
            tmp = weights.with_name(weights.name + ".tmp")
            save_file(tensors, str(tmp), metadata={"format": "pt"})
            os.replace(tmp, weights)
            write_atomically(version_file(self.folder, version, ".json"),
                             json.dumps({"version": version, "time": round(time_s, 3), "names": list(tensors)}))
        except BaseException as err:  # a full disk: the next look at the results says so
            self.error = err
            self.pending.discard(version)

    def flush(self) -> None:
        """Until the last save is on disk."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def last_progress(self) -> float:
        """The wall-clock time of the evaluator's last chunk (0 before its first)."""
        try:
            return (self.folder / PROGRESS_FILE).stat().st_mtime
        except FileNotFoundError:
            return 0.0

    def results(self) -> list[dict]:
        """The evaluator's lines since the last call, oldest version first; their files go."""
        lines = []
        for version in versions_in(self.folder, ".result.json"):
            path = version_file(self.folder, version, ".result.json")
            try:
                lines.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue  # a line that cannot be read is a lost line, not a lost run
            finally:
                for suffix in (".safetensors", ".json", ".result.json"):
                    version_file(self.folder, version, suffix).unlink(missing_ok=True)
            self.pending.discard(version)
        return lines


def load_version(folder: Path, version: int) -> tuple[dict, list[torch.Tensor]]:
    """The evaluator's side: (the version's json, its tensors in the order they were gathered)."""
    from safetensors.torch import load_file

    meta = json.loads(version_file(folder, version, ".json").read_text())
    tensors = load_file(str(version_file(folder, version, ".safetensors")))
    return meta, [tensors[name] for name in meta["names"]]


def unscored(folder: Path) -> list[int]:
    """Saved versions without a result yet, oldest first."""
    done = set(versions_in(folder, ".result.json"))
    return [v for v in versions_in(folder, ".json") if v not in done]
