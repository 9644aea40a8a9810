"""The pair config: a TOML file validated into typed structs, or one clear error."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec

from vllm_overlay.errors import OverlayError
from vllm_overlay.tomlfile import decode_toml, read_toml

Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
# A host name or IP the other nodes reach this one at (no scheme, no port).
Address = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9.\-:\[\]]+$")]
Seconds = Annotated[float, msgspec.Meta(gt=0)]


class ConfigError(OverlayError):
    """The pair config is missing, not TOML, or invalid."""


class Reach(msgspec.Struct, forbid_unknown_fields=True):
    """How the harness runs commands on a host: here, or over ssh."""

    # "user@host" (or an ssh config alias); empty: run locally on this node.
    ssh: str = ""
    ssh_options: list[str] = msgspec.field(
        default_factory=lambda: ["-o", "BatchMode=yes"]
    )


class Server(msgspec.Struct, forbid_unknown_fields=True):
    """One vLLM server: the prefill (kv_producer) or decode (kv_consumer) leg."""

    address: Address
    http_port: Port
    reach: Reach = msgspec.field(default_factory=Reach)
    tp: Positive = 1
    dcp: Positive = 1
    handshake_port: Port = 6301
    notify_port: Port = 61005
    # GPUs the container may use (HIP_VISIBLE_DEVICES); empty: all of them.
    visible_devices: str = ""
    extra_args: list[str] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.tp % self.dcp:
            raise ValueError(f"tp ({self.tp}) must be a multiple of dcp ({self.dcp})")


class Router(msgspec.Struct, forbid_unknown_fields=True):
    """vllm-router in P/D mode; the servers' MoRIIO heartbeats register here."""

    address: Address  # the servers' `proxy_ip`; the harness sends requests here
    bind: Address = "0.0.0.0"
    port: Port = 30000
    proxy_ping_port: Port = 36367
    prometheus_port: Port = 29000
    reach: Reach = msgspec.field(default_factory=Reach)
    policy: NonEmpty = "round_robin"
    # false: run `vllm-router` as a process of the harness node (from the
    # harness's own environment) instead of a container of the image.
    container: bool = True
    extra_args: list[str] = msgspec.field(default_factory=list)


class MoRIIO(msgspec.Struct, forbid_unknown_fields=True):
    """`kv_connector_extra_config` beyond the per-server ports."""

    read_mode: bool = True
    backend: str = "rdma"
    qp_per_transfer: Positive | None = None
    post_batch_size: int | None = None
    num_workers: Positive | None = None
    transfer_timeout: Seconds | None = None
    defer_timeout: Seconds | None = None

    def __post_init__(self) -> None:
        if self.backend not in ("rdma", "xgmi"):
            raise ValueError(
                f"moriio.backend must be 'rdma' or 'xgmi', not {self.backend!r}"
            )


class Container(msgspec.Struct, forbid_unknown_fields=True):
    """How every container of the run is started."""

    image: NonEmpty
    engine: NonEmpty = "docker"
    shm_size: NonEmpty = "64g"
    # host:container[:ro] bind mounts; the model directory must be one of them.
    volumes: list[NonEmpty] = msgspec.field(default_factory=list)
    env: dict[str, str] = msgspec.field(default_factory=dict)
    name_prefix: Annotated[str, msgspec.Meta(pattern=r"^[a-zA-Z0-9][\w.-]*$")] = (
        "moriio-e2e"
    )


class Model(msgspec.Struct, forbid_unknown_fields=True):
    path: NonEmpty  # as seen inside the container
    served_name: NonEmpty
    # tokenizer.json of the same model on the node running the harness.
    tokenizer: NonEmpty
    max_model_len: Positive = 32768
    # Tokens per KV block on the servers (`--block-size`); the sweep puts
    # prompt lengths around every multiple of it (times dcp).
    block_size: Positive = 16
    # Extra block sizes of the layout (e.g. other cache groups' page sizes).
    extra_block_sizes: list[Positive] = msgspec.field(default_factory=list)
    # KV bytes per token of the whole model (both legs agree); 0: unknown,
    # the report then gives transferred tokens only.
    kv_bytes_per_token: Annotated[int, msgspec.Meta(ge=0)] = 0
    extra_args: list[str] = msgspec.field(default_factory=list)


class Checks(msgspec.Struct, forbid_unknown_fields=True):
    max_tokens: Positive = 16
    sweep_max_len: Positive = 1024
    sweep_min_count: Positive = 100
    # Offsets around every block boundary k*B: lengths k*B + offset.
    boundary_offsets: list[int] = msgspec.field(default_factory=lambda: [-1, 0, 1, 2])
    needle_words: list[Positive] = msgspec.field(
        default_factory=lambda: [2000, 8000, 32000, 96000]
    )
    seed: int = 0


class Timeouts(msgspec.Struct, forbid_unknown_fields=True):
    health_s: Seconds = 2400.0
    poll_s: Seconds = 5.0
    request_s: Seconds = 600.0


class PairConfig(msgspec.Struct, forbid_unknown_fields=True):
    """One 1P/1D pair: see examples/mi350x-pair.toml."""

    name: Annotated[str, msgspec.Meta(pattern=r"^[a-zA-Z0-9][\w.-]*$")]
    container: Container
    model: Model
    prefill: Server
    decode: Server
    router: Router
    moriio: MoRIIO = msgspec.field(default_factory=MoRIIO)
    checks: Checks = msgspec.field(default_factory=Checks)
    timeouts: Timeouts = msgspec.field(default_factory=Timeouts)

    def __post_init__(self) -> None:
        if (self.prefill.address, self.prefill.http_port) == (
            self.decode.address,
            self.decode.http_port,
        ):
            raise ValueError("prefill and decode share one address and http_port")
        if self.prefill.dcp != self.decode.dcp:
            raise ValueError("prefill.dcp and decode.dcp must match for READ")
        if not self.router.container and self.router.reach.ssh:
            raise ValueError(
                "router.container = false runs on the harness node: no ssh"
            )


def decode_config(data: bytes | str, source: str = "<config>") -> PairConfig:
    return decode_toml(data, PairConfig, source, "pair config", ConfigError)


def load_config(path: Path) -> PairConfig:
    return read_toml(path, PairConfig, "config", ConfigError)


def encode_config(config: PairConfig) -> dict[str, object]:
    """The config as plain data, for the top of every report."""
    data: dict[str, object] = msgspec.to_builtins(config)
    return data
