"""Checkpoints: resumable (DCP for the sharded model and optimizer, plus the learner's
and coordinator's state) and the final Hugging Face directory.

A checkpoint is written under `step_NNNNNN.partial` and renamed when every file is
complete: the rename is the commit point, so `--resume` never sees a half-written one.
Just before it, rank 0 writes `manifest.json` (run/checkpoints.py): a committed
checkpoint whose files were damaged later is detected, set aside as `step_N.damaged`,
and `--resume` falls back to the newest intact one.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import msgpack
import msgspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from async_rl.run.checkpoints import CheckpointError, check_partition, complete_checkpoints, write_manifest

STATE_FILE = "coordinator.json"  # learner counters + coordinator state, written by rank 0
BUFFER_FILE = "buffer.msgpack"  # the replay buffer's groups, in wire format
log = logging.getLogger("async_rl.learner.checkpoint")

Parts = dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]


def _sharded_state(parts: Parts) -> dict:
    state = {}
    for name, (model, optimizer) in parts.items():
        state[name], state[f"{name}_optim"] = get_state_dict(model, optimizer)
    return state


def save_checkpoint(path: Path, parts: Parts, state: dict | None,
                    write_extra: Callable[[Path], None] | None = None, keep: int | None = None) -> None:
    """Collective: every learner rank calls it. `parts` names each trained (model,
    optimizer) pair, e.g. {"model": ..., "critic": ...}, stored as NAME and NAME_optim in
    one DCP checkpoint. Rank 0 passes `state` (JSON) and `write_extra(dir)` for its own
    files, commits (see _commit) and only then keeps the newest `keep` checkpoints. When
    rank 0 fails, every rank raises and nothing is committed."""
    tmp = path.with_name(path.name + ".partial")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state_dicts = _sharded_state(parts)
    try:
        with _one_line_errors(path, state_dicts):
            dcp.save(state_dicts, checkpoint_id=str(tmp))
    except CheckpointError:
        if dist.get_rank() == 0:  # never resumed from; its room may be what the run's status needs
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    dist.barrier()
    error = None
    if dist.get_rank() == 0:
        try:
            _commit(tmp, path, state, write_extra, keep)
        except Exception as err:  # re-raised below, once the other ranks have heard of it
            error = err
    # In place of a barrier: the other ranks learn that rank 0 failed and stop now,
    # instead of waiting in a barrier until the collective timeout.
    outcome = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(outcome, src=0)
    if error is not None:
        raise error
    if outcome[0] is not None:
        raise CheckpointError(f"{path.name} not committed: rank 0 failed ({outcome[0]})")


@contextlib.contextmanager
def _one_line_errors(path: Path, state: dict):
    """DCP reports a failed save or load as a CheckpointException: a BaseException (an
    `except Exception` misses it) whose text is every rank's traceback. Re-raise it as a
    CheckpointError naming the checkpoint, the first failure and, when the file system
    holding it has less room left than the checkpoint's tensors, that (torch's writer
    reports a full disk as an "unexpected pos" RuntimeError)."""
    try:
        yield
    except CheckpointException as err:
        failures = [exc for exc, _ in err.failures.values()] or [err]
        first = failures[0]
        text = str(first).splitlines()[0] if str(first) else ""
        reason = f"checkpoint {path}: {type(first).__name__}: {text}"
        needed = _tensor_bytes(state)
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(path.parent).free
            if free < needed:
                reason += f" (its file system has {free / 2**20:.1f} MiB free, the checkpoint needs about " \
                          f"{needed / 2**20:.1f} MiB)"
        raise CheckpointError(reason) from None


def _tensor_bytes(state) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_tensor_bytes(v) for v in state)
    return 0


def _commit(tmp: Path, path: Path, state: dict | None, write_extra: Callable[[Path], None] | None,
            keep: int | None) -> None:
    """Rank 0's part of save_checkpoint, once the DCP shards are in `tmp`."""
    if write_extra is not None:
        write_extra(tmp)
    (tmp / STATE_FILE).write_text(json.dumps(state or {}, indent=1))
    if state and "coordinator" in state:
        # Read back what is about to be committed: the buffer file must decode in full
        # and, with the state, account for every admitted slot. A checkpoint with a
        # hole would make a resumed learner wait forever for a slot nobody generates.
        check_partition(state["coordinator"], [index for index, _, _ in read_groups(tmp / BUFFER_FILE)])
    write_manifest(tmp)  # last: it marks the directory complete
    _fsync_dir(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    _fsync_dir(path.parent)  # the commit is on disk before rotation deletes anything
    if keep:
        # `path` is verified (its manifest was computed from the files read back) and
        # committed; `.damaged` and `.partial` directories are never listed, so never
        # counted nor deleted.
        for old in complete_checkpoints(path.parent)[:-keep]:
            if old != path:
                shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(path: Path, parts: Parts) -> dict:
    """Collective: load the sharded model/optimizer pairs in place (resharding to this
    world size if it changed) and return the JSON state (read first: a garbled one
    raises CheckpointError before the shards are loaded)."""
    try:
        saved = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as err:  # ValueError: also a decode error
        raise CheckpointError(f"{path.name}/{STATE_FILE}: unreadable ({type(err).__name__}: {err})") from None
    if type(saved) is not dict:
        raise CheckpointError(f"{path.name}/{STATE_FILE}: not a JSON object")
    state = _sharded_state(parts)
    with _one_line_errors(path, {}):
        dcp.load(state, checkpoint_id=str(path))
    for name, (model, optimizer) in parts.items():
        set_state_dict(model, optimizer, model_state_dict=state[name], optim_state_dict=state[f"{name}_optim"])
    return saved


class _BufferRecord(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """One buffered group in the buffer file: ``[index, version, frames]``, the message
    in its wire encoding."""

    index: int  # admission index
    version: int
    frames: list[memoryview]  # decoded as views of the record's bytes, no copy


_RECORD_DECODER = msgspec.msgpack.Decoder(_BufferRecord)


def write_groups(path: Path, groups: list[tuple[int, int, object]]) -> None:
    """Stream (admission index, version, message) records to `path`, each message in
    its wire encoding: the same validating decoder reads them back, nothing is pickled."""
    from async_rl.wire import encode

    encoder = msgspec.msgpack.Encoder()
    with open(path, "wb") as out:
        for index, version, msg in groups:
            out.write(encoder.encode(_BufferRecord(index, version, encode(msg))))


def read_groups(path: Path) -> list[tuple[int, int, object]]:
    """The records of a write_groups file, all of them or an error: CheckpointError when
    the file is missing, truncated or not a sequence of records, WireError when a
    record's message does not validate."""
    from async_rl.wire import WireError, WireLimits, decode

    limits = WireLimits()
    groups = []
    try:
        with open(path, "rb") as f:
            size, start = os.fstat(f.fileno()).st_size, 0
            # msgspec decodes one whole object: msgpack's streaming unpacker only finds
            # where each record ends (skipping it unread), msgspec then reads it strictly.
            splitter = msgpack.Unpacker(f, max_buffer_size=limits.max_message_bytes + 2**20)
            while start < size:
                try:
                    splitter.skip()
                except msgpack.OutOfData:
                    raise CheckpointError(f"{path.name}: truncated after {len(groups)} records "
                                          f"({size - start} trailing bytes of {size})") from None
                end = splitter.tell()
                try:
                    record = _RECORD_DECODER.decode(os.pread(f.fileno(), end - start, start))
                except msgspec.ValidationError:
                    raise CheckpointError(f"{path.name}: record {len(groups)} is not [index, version, frames]"
                                          ) from None
                try:
                    groups.append((record.index, record.version, decode(record.frames, limits)))
                except WireError as err:
                    raise WireError(err.reason, f"{path.name} record {len(groups)}: {err.detail}") from None
                start = end
    except (CheckpointError, WireError):
        raise
    except OSError as err:
        raise CheckpointError(f"{path.name}: unreadable ({err.strerror or err})") from None
    except (msgpack.UnpackException, msgspec.DecodeError, ValueError) as err:  # ValueError: also bad UTF-8
        raise CheckpointError(f"{path.name}: garbled after {len(groups)} records ({type(err).__name__})") from None
    return groups


def save_hf_model(params, source: str | Path, tokenizer, out_dir: Path, dtype: torch.dtype | None = None,
                  config=None, extra: dict[str, str] | None = None) -> None:
    """Write an HF model directory, atomically: the (name, full tensor) stream `params`
    (cast to `dtype` when given, and config.json saying so) as model.safetensors, with
    the config and generation config of the model directory `source` (the architecture
    the parameters belong to) and `tokenizer`. Tied weights appear once in `params` and
    are re-tied on load, as `save_pretrained` does. `config`: another config to write
    (a reward model's, its architecture a head on `source`'s); `extra`: more files, by
    name and text."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, GenerationConfig

    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {name: t.detach().to(device="cpu", dtype=dtype or t.dtype).contiguous() for name, t in params}
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    config = config if config is not None else AutoConfig.from_pretrained(str(source))
    config.dtype = dtype or next(iter(tensors.values())).dtype
    config.save_pretrained(tmp)
    if (Path(source) / "generation_config.json").exists():
        GenerationConfig.from_pretrained(str(source)).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for name, text in (extra or {}).items():
        (tmp / name).write_text(text)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
