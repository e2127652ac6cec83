"""The transport and security sections: the hub's sockets, and CURVE on them."""
from __future__ import annotations

from pydantic import Field, model_validator

from async_rl.config.section import Section


class TransportConfig(Section):
    host: str = Field("127.0.0.1", description="Interface the hub binds (loopback by default).")
    hub_port: int = Field(0, ge=0, le=65535, description="Hub ROUTER port (0 = ephemeral).")
    experience_port: int = Field(0, ge=0, le=65535, description="Experience PULL port (0 = ephemeral).")
    hwm: int = Field(64, ge=1, description="ZeroMQ high-water mark on experience sockets (actors block beyond).")
    timeout_s: float = Field(30.0, gt=0.0, description="Send/receive timeout of every socket operation.")
    store_port: int = Field(0, ge=0, le=65535, description="Port of the weight-sync TCPStore on rank 0 (0 = ephemeral).")


class SecurityConfig(Section):
    curve: bool = Field(False, description="ZeroMQ CURVE on the hub's sockets: encrypted, actors need the client key.")
    keys_dir: str | None = Field(None, description="Directory made by `async-rl keys DIR` (needed with curve).")

    @model_validator(mode="after")
    def _keys_for_curve(self) -> SecurityConfig:
        if self.curve and not self.keys_dir:
            raise ValueError("security.keys_dir: required when security.curve=true (make keys with `async-rl keys DIR`)")
        return self
