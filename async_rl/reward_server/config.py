"""The `reward_server` section: where the reward server runs and how it batches."""
from __future__ import annotations

from pydantic import Field

from async_rl.config.section import Section


class RewardServerConfig(Section):
    endpoint: str | None = Field(None, pattern=r"^tcp://[^:/]+:\d+$", description="tcp://HOST:PORT of a reward server started by hand (`async-rl reward-server CONFIG --bind ...`); null = `async-rl train` starts one on a free loopback port when a component has placement: server.")
    max_batch: int = Field(32, ge=1, le=1024, description="Most samples the server scores in one forward pass.")
    max_tokens: int = Field(16384, ge=1, description="Most tokens in one batch, summed over its samples (as the scorer tokenizes them); a longer sample is scored alone.")
    max_wait_ms: float = Field(5.0, ge=0.0, le=10_000.0, description="How long the first sample of a batch may wait for more before the batch is scored.")
    device: str = Field("cpu", description="The server's device (`cpu`, `cuda`, `cuda:1`: on a GPU machine, one the learner and actors do not use).")
    threads: int = Field(1, ge=1, description="torch intra-op threads of the server (CPU).")
    max_restarts: int = Field(3, ge=0, description="Restarts of a server that exits or stops answering (0 = never: its components' samples are then unscorable, and reward.max_error_frac stops the run).")
    start_timeout_s: float = Field(300.0, gt=0.0, description="How long the launcher waits for the server to load its models.")
    heartbeat_timeout_s: float = Field(120.0, gt=0.0, description="A server whose loop has been silent this long (a hung forward pass) is killed and restarted.")


ENDPOINT_ENV = "ASYNC_RL_REWARD_SERVER"  # the endpoint of the server `async-rl train` started, for its actors


def with_server_endpoints(components: list[dict], section: RewardServerConfig) -> list[dict]:
    """`components` (reward.components as dicts), those of placement: server told where the
    server is: reward_server.endpoint, else the one the launcher started. ValueError when
    there is none."""
    import os

    endpoint = section.endpoint or os.environ.get(ENDPOINT_ENV)
    served = [c["name"] for c in components if c.get("placement") == "server"]
    if served and not endpoint:
        raise ValueError(f"reward.components ({served[0]}): placement: server, and no reward server: start the run "
                         f"with `async-rl train`, or set reward_server.endpoint to one started by hand")
    return [dict(c, server_endpoint=endpoint) if c.get("placement") == "server" else c for c in components]
