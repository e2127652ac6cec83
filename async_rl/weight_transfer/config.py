"""The sync section: how and how often the learner's weights reach the actors."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from async_rl.config.section import Section


class SyncConfig(Section):
    every: int = Field(1, ge=1, description="Send weights to the actors every this many learner steps.")
    bucket_mb: float = Field(16.0, gt=0.0, description="Flat bucket size of a sync (vLLM actors: its packed buffer size).")
    double_buffer: bool = Field(True, description="Two bucket sets on rank 0, so publishing never waits for a sync in flight.")
    stage_on_actors: bool = Field(True, description="Actors receive into a second set, so a broken-off sync leaves them whole.")
    in_flight: bool = Field(False, description="Also apply new weights between decode steps, not only between batches.")
    in_flight_poll_s: float = Field(0.05, ge=0.0, description="With in_flight: ask the hub for new weights at most this often.")
    timeout_s: float = Field(60.0, gt=0.0, description="Timeout of a sync's rendezvous and transfers.")
    verify: bool = Field(True, description="Every actor checks the weights it received against rank 0's fingerprint before using them.")
    transport: Literal["auto", "gloo", "nccl", "cuda_ipc"] = Field("auto", description="`auto`: gloo on CPU; CUDA IPC on the learner's GPU, else NCCL.")
