"""The run config: a TOML file validated into typed structs, or one clear error.

One file describes a whole P/D deployment: N prefill and M decode servers
(TP/DP/DCP per side), the front end that routes across all of them, the
container every server runs in, the KV cache layout the prompt sweep is
computed from, and the checks. See examples/*.toml and docs/e2e.md.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from vllm_overlay.e2e.secret import masked_env
from vllm_overlay.errors import OverlayError
from vllm_overlay.tomlfile import decode_toml, read_toml

Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
# A host name or IP the other nodes reach this one at (no scheme, no port).
Address = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9.\-:\[\]]+$")]
Seconds = Annotated[float, msgspec.Meta(gt=0)]
Name = Annotated[str, msgspec.Meta(pattern=r"^[a-zA-Z0-9][\w.-]*$")]
EnvName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
# A run's id in its containers' names and labels (lower case letters, digits).
RunId = Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9]{0,16}$")]
Env = dict[EnvName, str]

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, Role] = ("prefill", "decode")

# The pinned vLLM (pin.toml) waits 600 s for the engine cores by default
# (VLLM_ENGINE_READY_TIMEOUT_S, vllm/envs.py); DeepSeek/Kimi-class models
# load and compile for longer, and vLLM's own ROCm P/D CI exports 3600.
# Applied unless the config sets it.
ENGINE_READY_TIMEOUT_S = 3600
# Where the cache volume is mounted in every server container, and the
# variables that point vLLM's, Triton's and the generic caches into it.
CACHE_MOUNT = "/cache"
CACHE_ENV = {
    "XDG_CACHE_HOME": CACHE_MOUNT,
    "VLLM_CACHE_ROOT": f"{CACHE_MOUNT}/vllm",
    "TRITON_CACHE_DIR": f"{CACHE_MOUNT}/triton",
}

# The uid and gid docker/Dockerfile's vLLM runs as (its `USER`): the cache
# directory is handed to it before the servers start.
IMAGE_UID = 2000

# The render group's id on the node, filled in there (servers.RENDER_GID_SH):
# `docker run --group-add NAME` resolves NAME in the image's /etc/group, not
# the host's, and `render` is a dynamic system group (109, 992, ... per
# host; the image may have none), so by name the process can miss the group
# that owns /dev/dri/renderD*. `video` is Debian's and Ubuntu's static gid 44
# on the host and in the image alike: by name it is right.
RENDER_GID = "@RENDER_GID@"

# `docker run` flags for a server when the config gives none: the unprivileged
# set of vLLM's ROCm P/D CI and MoRIIO usage doc. Host network and IPC (MoRIIO
# and NCCL address the host's NICs and shared memory), the GPU (kfd, dri) and
# RDMA (infiniband) devices with the groups that own them, IPC_LOCK and
# unlimited locked memory for registered KV buffers, no seccomp filter (ROCm's
# runtime needs syscalls the default profile blocks), a large stack and open
# file limit, and an init process that forwards signals and reaps children.
UNPRIVILEGED_FLAGS = (
    "--init",
    "--network", "host", "--ipc", "host",
    "--device", "/dev/kfd", "--device", "/dev/dri", "--device", "/dev/infiniband",
    "--group-add", "video", "--group-add", RENDER_GID,
    "--cap-add", "IPC_LOCK", "--cap-add", "SYS_PTRACE",
    "--security-opt", "seccomp=unconfined",
    "--ulimit", "memlock=-1:-1",
    "--ulimit", "nofile=1048576:1048576",
    "--ulimit", "stack=67108864",
)  # fmt: skip


# The AMD Pollara (ionic) RDMA userspace provider as rdma-core installs it:
# the provider library, its versioned base library, the driver entry.
IONIC_LIBS = (
    "/usr/lib/x86_64-linux-gnu/libibverbs/libionic-rdmav34.so",
    "/usr/lib/x86_64-linux-gnu/libionic.so.1",
    "/etc/libibverbs.d/ionic.driver",
)


class ConfigError(OverlayError):
    """The run config is missing, not TOML, or invalid."""


# Every string of the config reaches a command line, a batch script, an env
# file or a report: no control characters (a newline in a `#SBATCH` value
# starts a shell line of the job). The values below are also single words
# of a command line or a script, where a leading '-' would be read as an
# option and a shell character as code: each matches its pattern.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_CONTROL_NAMES = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab"}
_NOT_OPTION = re.compile(r"[^-].*", re.DOTALL)
_WORDS: list[tuple[re.Pattern[str], re.Pattern[str], str]] = [
    (
        re.compile(
            r"(prefill|decode)\.instances\[\d+\]\.reach\.ssh|router\.reach\.ssh"
        ),
        re.compile(r"([A-Za-z0-9_][A-Za-z0-9_.@:+-]*)?"),
        "an ssh destination (user@host or an alias: letters, digits, . _ - @ :) "
        "not beginning with '-'",
    ),
    (
        re.compile(r"container\.image"),
        re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]*"),
        "an image reference (letters, digits, . _ / : @ + -)",
    ),
    (
        re.compile(r"container\.base_image"),
        re.compile(r"([A-Za-z0-9][A-Za-z0-9._/:@+-]*)?"),
        "an image reference (letters, digits, . _ / : @ + -), or empty",
    ),
    (
        re.compile(r"container\.engine"),
        re.compile(r"[A-Za-z0-9_./][A-Za-z0-9_./+-]*"),
        "a program name or path (letters, digits, . _ / + -) not beginning with '-'",
    ),
    (
        re.compile(r"container\.shm_size"),
        re.compile(r"[0-9]+[bkmgBKMG]?"),
        "a size such as 64g",
    ),
    (
        re.compile(r"container\.cache_dir|nic\.counters_root"),
        re.compile(r"(/[^:\s]*)?"),
        "an absolute path without ':' or whitespace, or empty",
    ),
    (
        re.compile(r"nic\.userspace_libs\[\d+\]"),
        re.compile(r"/[A-Za-z0-9_./+-]*"),
        "an absolute path (letters, digits, _ . / + -)",
    ),
    (
        re.compile(r"container\.volumes\[\d+\]|model\.path|router\.toy_proxy"),
        _NOT_OPTION,
        "a path or host:container[:ro] mount, not beginning with '-' (it would be "
        "read as an option)",
    ),
    (
        re.compile(r"slurm\.time"),
        re.compile(r"[0-9]+([:-][0-9]+){0,3}|UNLIMITED|INFINITE"),
        "a Slurm time limit: minutes, [D-]HH:MM[:SS], UNLIMITED",
    ),
    (
        re.compile(r"slurm\.interface"),
        re.compile(r"([A-Za-z0-9_][A-Za-z0-9_.:@-]*)?"),
        "a network interface name (letters, digits, _ . : @ -) not beginning with '-'",
    ),
    (
        re.compile(r"slurm\.(partition|account)"),
        re.compile(r"([A-Za-z0-9_][A-Za-z0-9_.,-]*)?"),
        "a Slurm name (letters, digits, _ . , -) not beginning with '-'",
    ),
    (
        re.compile(r"slurm\.sbatch_options\[\d+\]"),
        re.compile(r"--?[A-Za-z].*", re.DOTALL),
        "an sbatch option beginning with '-'",
    ),
    (
        re.compile(r"slurm\.node_env\.<name>"),
        re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*"),
        "a Slurm node name (letters, digits, _ . -)",
    ),
]
# vLLM flags whose value is a secret: it belongs in the container env (which
# reaches the container by name), never on the server's command line.
_SECRET_FLAGS = {"--hf-token": "HF_TOKEN", "--api-key": "VLLM_API_KEY"}
_ARGS = re.compile(r"(model|prefill|decode|router)\.extra_args\[\d+\]")


def _strings(value: object, path: str) -> Iterator[tuple[str, str]]:
    """(field path, text) of every string in ``value``; a dict's keys are
    at ``path.<name>``."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, msgspec.Struct):
        for field in msgspec.structs.fields(value):
            sub = f"{path}.{field.name}" if path else field.name
            yield from _strings(getattr(value, field.name), sub)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield f"{path}.<name>", str(key)
            yield from _strings(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _strings(item, f"{path}[{i}]")


def text_problem(path: str, text: str) -> str | None:
    """Why ``text`` at ``path`` cannot go into a command line or a script,
    or None. Never quotes the text: it may be a secret."""
    bad = _CONTROL.search(text)
    if bad is not None:
        name = _CONTROL_NAMES.get(bad.group(), f"U+{ord(bad.group()):04X}")
        return f"contains {name}; control characters are not allowed"
    for field, pattern, what in _WORDS:
        if field.fullmatch(path) and not pattern.fullmatch(text):
            return f"must be {what}"
    if _ARGS.fullmatch(path) and text.split("=", 1)[0] in _SECRET_FLAGS:
        flag = text.split("=", 1)[0]
        return (
            f"{flag} would put a secret on a command line; set container.env "
            f"{_SECRET_FLAGS[flag]} instead (passed to the container by name)"
        )
    return None


def check_text(config: object) -> None:
    """Raise ValueError naming the first field that cannot go into a
    command line or a script as it is."""
    for path, text in _strings(config, ""):
        problem = text_problem(path, text)
        if problem is not None:
            raise ValueError(f"{path.replace('.<name>', ' (a name)')}: {problem}")


class Reach(msgspec.Struct, forbid_unknown_fields=True):
    """How the harness runs commands on a host: here, or over ssh."""

    # "user@host" (or an ssh config alias); empty: run locally on this node.
    ssh: str = ""
    ssh_options: list[str] = msgspec.field(
        default_factory=lambda: ["-o", "BatchMode=yes"]
    )


class Speculative(msgspec.Struct, forbid_unknown_fields=True):
    """`--speculative-config` of one side; it decides the lookahead slots
    that side's scheduler reserves past the prompt."""

    method: NonEmpty
    num_speculative_tokens: Positive
    # Set when the method alone does not decide it: a DSpark drafter that
    # does not sample from its anchor reserves one slot more.
    lookahead: NonNegative | None = None
    # Further `--speculative-config` keys, e.g. {"model": "/models/drafter"}.
    options: dict[str, str | int | float | bool] = msgspec.field(default_factory=dict)

    def as_json(self) -> str:
        spec = {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            **self.options,
        }
        return json.dumps(spec, separators=(",", ":"))

    def lookahead_slots(self) -> int:
        """`VllmConfig.num_lookahead_tokens` of the pinned vLLM for this method:
        fill-in drafting (DFlash) needs one bonus slot more; every other
        drafter that keeps its own KV reserves one slot per draft token."""
        if self.lookahead is not None:
            return self.lookahead
        if self.method == "dflash":
            return self.num_speculative_tokens + 1
        if self.method in ("eagle", "eagle3", "mtp", "dspark", "draft_model"):
            return self.num_speculative_tokens
        if self.method.endswith("_mtp"):  # vLLM renames these to "mtp"
            return self.num_speculative_tokens
        return 0


class Instance(msgspec.Struct, forbid_unknown_fields=True):
    """One server of a side, where the side's defaults do not fit: its node
    and anything that differs per node (RDMA devices, GID index, GPUs)."""

    # The address the other nodes and the front end reach it at; MoRIIO's
    # host_ip. Required by the ssh launcher; Slurm resolves it on the node.
    address: Address | None = None
    reach: Reach | None = None
    http_port: Port | None = None
    handshake_port: Port | None = None
    notify_port: Port | None = None
    visible_devices: str | None = None
    # Added to (and overriding) the side's env: e.g. MORI_RDMA_DEVICES and
    # MORI_IB_GID_INDEX of this node.
    env: Env = msgspec.field(default_factory=dict)


class Side(msgspec.Struct, forbid_unknown_fields=True):
    """Every prefill (kv_producer) or decode (kv_consumer) server."""

    # How many servers; with `instances` listed, their number.
    count: Positive = 1
    instances: list[Instance] = msgspec.field(default_factory=list)
    tp: Positive = 1
    dp: Positive = 1  # data-parallel ranks inside one server (one node)
    dcp: Positive = 1
    expert_parallel: bool = False
    speculative: Speculative | None = None
    http_port: Port = 8100
    handshake_port: Port = 6301
    notify_port: Port = 61005
    # GPUs the container may use (HIP_VISIBLE_DEVICES); empty: all of them.
    visible_devices: str = ""
    env: Env = msgspec.field(default_factory=dict)
    extra_args: list[str] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.instances:
            if self.count not in (1, len(self.instances)):
                raise ValueError(
                    f"count ({self.count}) differs from the {len(self.instances)} "
                    "instances listed"
                )
            self.count = len(self.instances)
        else:
            self.instances = [Instance() for _ in range(self.count)]
        if self.tp % self.dcp:
            raise ValueError(f"tp ({self.tp}) must be a multiple of dcp ({self.dcp})")

    @property
    def lookahead_slots(self) -> int:
        return self.speculative.lookahead_slots() if self.speculative else 0


FrontEnd = Literal["toy-proxy", "vllm-router"]
MaxTokens = Literal["auto", "exact", "minus-one"]


class Router(msgspec.Struct, forbid_unknown_fields=True):
    """The front end the P/D requests go through; the servers' MoRIIO
    heartbeats register with it."""

    # toy-proxy: vLLM's MoRIIO toy proxy from the image, which finishes the
    # prefill before it sends the decode (the order READ needs), what vLLM's
    # ROCm P/D CI runs by default. vllm-router: the router with MoRIIO
    # discovery; the report records which one ran.
    kind: FrontEnd = "toy-proxy"
    # The servers' `proxy_ip`; the harness sends requests here. Slurm: empty,
    # the first node of the job.
    address: Address | None = None
    bind: Address = "0.0.0.0"
    port: Port = 10001
    # Where the heartbeats register. The toy proxy listens on 36367 only.
    proxy_ping_port: Port = 36367
    prometheus_port: Port = 29000
    reach: Reach = msgspec.field(default_factory=Reach)
    policy: NonEmpty = "round_robin"
    # The toy proxy inside the image (vLLM's examples tree).
    toy_proxy: NonEmpty = (
        "/app/vllm/examples/disaggregated/disaggregated_serving/"
        "moriio_toy_proxy_server.py"
    )
    # false: run the front end as a process of the harness node, from the
    # harness's own environment, instead of a container of the image.
    container: bool = True
    # What the front end sends the decoder: the toy proxy and vllm-router's
    # MoRIIO READ router send `max_tokens - 1` (the prefill's one token is
    # counted), vllm-router's discovery path sends it unchanged. "auto"
    # measures it with a probe request before the checks; the P/D requests
    # then ask for one more token so both paths return exactly
    # checks.max_tokens tokens.
    max_tokens: MaxTokens = "auto"
    extra_args: list[str] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if (
            self.kind == "toy-proxy"
            and self.container
            and self.proxy_ping_port != 36367
        ):
            raise ValueError(
                "the image's toy proxy registers servers on port 36367 only"
            )


TransferMode = Literal["read", "write"]


class MoRIIO(msgspec.Struct, forbid_unknown_fields=True):
    """`kv_connector_extra_config` beyond the per-server ports."""

    # The transfer mode every server runs, sent as `read_mode` (vLLM runs
    # WRITE without it); vLLM ignores the VLLM_MORIIO_CONNECTOR_READ_MODE
    # environment variable.
    mode: TransferMode = "read"
    backend: str = "rdma"
    qp_per_transfer: Positive | None = None
    post_batch_size: int | None = None
    num_workers: Positive | None = None
    transfer_timeout: Seconds | None = None
    defer_timeout: Seconds | None = None
    # Seconds before an in-flight READ whose transfer never completes is
    # aborted on the decoder (the pinned MoRIIOConfig's recv_abort_timeout).
    recv_abort_timeout: Seconds | None = None
    # Seconds before a WRITE decoder cancels a write it has not received, and
    # then before it reuses the pages of one no prefiller acknowledged
    # cancelling (patch 0043's write_recv_timeout, write_quarantine_timeout).
    write_recv_timeout: Seconds | None = None
    write_quarantine_timeout: Seconds | None = None

    def __post_init__(self) -> None:
        if self.backend not in ("rdma", "xgmi"):
            raise ValueError(
                f"moriio.backend must be 'rdma' or 'xgmi', not {self.backend!r}"
            )


Pull = Literal["missing", "always", "never"]


class Container(msgspec.Struct, forbid_unknown_fields=True):
    """How every container of the run is started."""

    image: NonEmpty
    # The A/B base (`e2e --ab`): the same image built without the series
    # (`image build --series none`). "": the image's tag with its last
    # -SUFFIX replaced by -base (REPO:v0.34.0-overlay -> REPO:v0.34.0-base).
    base_image: str = ""
    engine: NonEmpty = "docker"
    # missing: pull when the node does not have the image; always; never.
    pull: Pull = "missing"
    shm_size: NonEmpty = "64g"
    # host:container[:ro] bind mounts; the model directory must be one of them.
    volumes: list[NonEmpty] = msgspec.field(default_factory=list)
    env: Env = msgspec.field(default_factory=dict)
    # `docker run` flags of the servers (default: the unprivileged set above);
    # `extra_run_flags` are appended, e.g. ["--privileged"] or mounts of the
    # host's RDMA userspace libraries.
    run_flags: list[NonEmpty] = msgspec.field(
        default_factory=lambda: list(UNPRIVILEGED_FLAGS)
    )
    extra_run_flags: list[NonEmpty] = msgspec.field(default_factory=list)
    # A host directory (on every node) mounted at /cache: torch.compile,
    # Triton and AITER JIT caches survive between runs. Empty: none.
    cache_dir: str = "/var/cache/vllm-moriio-e2e"
    name_prefix: Name = "moriio-e2e"
    # The run's id, in every container's name and labels (runid.py): a
    # fresh one per run (`--run-id` picks one), so a colleague's run of the
    # same config on shared nodes never shares a name with this one. "":
    # none (a pair deployed by hand, `--print-serve`).
    run_id: RunId = ""


class Model(msgspec.Struct, forbid_unknown_fields=True):
    path: NonEmpty  # as seen inside the container
    served_name: NonEmpty
    # tokenizer.json of the same model on the node running the harness.
    tokenizer: NonEmpty
    max_model_len: Positive = 32768
    # `--block-size` for `vllm serve`; 0: not passed (vLLM picks, e.g. the
    # hybrid models' page-aligned attention block).
    block_size: NonNegative = 16
    # KV bytes per token of the whole model (both legs agree); 0: unknown,
    # the report then gives transferred tokens only.
    kv_bytes_per_token: NonNegative = 0
    extra_args: list[str] = msgspec.field(default_factory=list)
    # A folder holding the model's config.json only (no weights), relative
    # to the config file: the CPU preflight builds vLLM's engine config
    # from it (e.g. examples/models/llama-3.1-70b).
    preflight_model: str = ""


class Layout(msgspec.Struct, forbid_unknown_fields=True):
    """The KV cache layout as vLLM builds it for this model: what the prompt
    sweep and the expected failures on the base are computed from."""

    # Tokens per attention page on one rank (before DCP); 0: model.block_size.
    block_size: NonNegative = 0
    # Sliding-window attention: window in tokens (0: none) and its page size
    # (0: block_size).
    sliding_window: NonNegative = 0
    window_block_size: NonNegative = 0
    # KDA/Mamba state groups: MoRIIO's hybrid READ path.
    hybrid: bool = False
    # Transferable attention groups (hybrid models can have several).
    attention_groups: Positive = 1
    # KV bytes per attention page of one rank, for page-count reports; 0:
    # derived from model.kv_bytes_per_token.
    page_bytes: NonNegative = 0
    # Ring KV cache spec kinds of this model (GLM-5.3-Flash's
    # CircularBufferSpec tail ring): refused at start when the simulator
    # found the pinned base refusing its ring layout (basestarts.py);
    # expect.SPEC_FIXES names the patch that accepts each.
    refused_specs: list[NonEmpty] = msgspec.field(default_factory=list)


class Accuracy(msgspec.Struct, forbid_unknown_fields=True):
    """A GSM8K-style second opinion: generated grade-school word problems,
    greedy, scored on the final number, through P/D and direct."""

    problems: NonNegative = 50  # 0: off
    shots: NonNegative = 4
    max_tokens: Positive = 256
    # P/D must score at least this, and no lower than the direct prefill by
    # more than `max_drop`.
    threshold: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.9
    max_drop: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.05


class Checks(msgspec.Struct, forbid_unknown_fields=True):
    max_tokens: Positive = 16
    sweep_max_len: Positive = 1024
    sweep_min_count: Positive = 100
    # Offsets around every page boundary k*P: lengths k*P + offset.
    boundary_offsets: list[int] = msgspec.field(default_factory=lambda: [-1, 0, 1, 2])
    # Lengths that must be in the sweep (e.g. ones that failed in the field).
    lengths: list[Positive] = msgspec.field(default_factory=list)
    needle_words: list[Positive] = msgspec.field(
        default_factory=lambda: [2000, 8000, 32000, 96000]
    )
    # Prefix-hit transfers: a second prompt shares this fraction of a first
    # one, so the decoder holds that prefix and loads only the rest.
    prefix_hit_fractions: list[Annotated[float, msgspec.Meta(gt=0, lt=1)]] = (
        msgspec.field(default_factory=lambda: [0.5])
    )
    prefix_hit_length: Positive = 4096
    repeat_length: Positive = 2000
    accuracy: Accuracy = msgspec.field(default_factory=Accuracy)
    seed: int = 0


class Timeouts(msgspec.Struct, forbid_unknown_fields=True):
    # Health wait per endpoint: at least VLLM_ENGINE_READY_TIMEOUT_S, so that
    # vLLM's own start-up timeout fires first and shows in the log.
    health_s: Seconds = 3600.0
    poll_s: Seconds = 5.0
    request_s: Seconds = 600.0
    pull_s: Seconds = 3600.0  # one image pull on one node
    command_s: Seconds = 120.0  # any other docker/ssh/slurm command


class Nic(msgspec.Struct, forbid_unknown_fields=True):
    """The decode nodes' RDMA NICs: per P/D request, the bytes they received
    (deltas of `port_rcv_data`, read on each node before and after)."""

    # The sysfs root of the RDMA devices' counters; "": not read.
    counters_root: str = "/sys/class/infiniband"
    # The host's NIC userspace provider bound into every server container
    # (vLLM's ROCm CI binds the host's libionic: the image's copy may not
    # match the NIC driver). auto: on when a server's MORI_RDMA_DEVICES
    # names an `ionic_*` device; on; off.
    userspace: Literal["auto", "on", "off"] = "auto"
    # The host files bound read-only at the same path (`--mount
    # type=bind,readonly`: a node without one fails the container's start
    # with docker's "bind source path does not exist", never a made-up
    # empty directory). Default: rdma-core's ionic provider on Debian/Ubuntu.
    userspace_libs: list[NonEmpty] = msgspec.field(
        default_factory=lambda: list(IONIC_LIBS)
    )


class Load(msgspec.Struct, forbid_unknown_fields=True):
    """The load phase: `vllm bench serve` against the front end, from a
    container of the image on the front end's host (over ssh, here, or as a
    Slurm job step on its node), every input length at every concurrency;
    TTFT/TPOT/ITL percentiles."""

    enabled: bool = True
    # The ISL/OSL and concurrencies of the upstream CI figures.
    input_lens: list[Positive] = msgspec.field(default_factory=lambda: [1024, 2048])
    output_len: Positive = 128
    concurrencies: list[Positive] = msgspec.field(default_factory=lambda: [32, 64])
    # Requests per cell: concurrency x this.
    prompts_per_concurrency: Positive = 4
    seed: int = 0
    timeout_s: Seconds = 1800.0  # one cell


class Slurm(msgspec.Struct, forbid_unknown_fields=True):
    """`--launcher slurm`: one sbatch job, one task per server node."""

    partition: str = ""
    account: str = ""
    time: NonEmpty = "04:00:00"
    # `--gres=gpu:N` per node; None: the largest server's TP x DP; 0: none.
    gpus_per_node: NonNegative | None = None
    # `--exclusive`: no other job on the nodes (their GPUs and NICs).
    exclusive: bool = True
    # Extra `#SBATCH` options, e.g. ["--constraint=mi355x"].
    sbatch_options: list[NonEmpty] = msgspec.field(default_factory=list)
    # The network interface whose IPv4 address is a node's address (MoRIIO
    # host_ip, the front end's address), e.g. "ens51f0np0". "": the one the
    # node routes its peer through (a server: the front end's address; the
    # front end's node: another node of the job).
    interface: str = ""
    # A command printing a node's address, run on every node; "": from
    # `interface`. Set, it wins.
    address_command: str = ""
    # Env per Slurm node name: RDMA devices and GID index differ per node.
    node_env: dict[NonEmpty, Env] = msgspec.field(default_factory=dict)
    # Seconds to wait for the job to leave the queue after scancel.
    cancel_s: Seconds = 120.0


class RunConfig(msgspec.Struct, forbid_unknown_fields=True):
    """A P/D deployment and its checks: see examples/*.toml."""

    name: Name
    container: Container
    model: Model
    prefill: Side
    decode: Side
    router: Router = msgspec.field(default_factory=Router)
    layout: Layout = msgspec.field(default_factory=Layout)
    moriio: MoRIIO = msgspec.field(default_factory=MoRIIO)
    checks: Checks = msgspec.field(default_factory=Checks)
    timeouts: Timeouts = msgspec.field(default_factory=Timeouts)
    slurm: Slurm = msgspec.field(default_factory=Slurm)
    nic: Nic = msgspec.field(default_factory=Nic)
    load: Load = msgspec.field(default_factory=Load)

    def __post_init__(self) -> None:
        check_text(self)
        if self.prefill.dcp != self.decode.dcp:
            raise ValueError("prefill.dcp and decode.dcp must match for READ")
        if self.layout.block_size == 0:
            if self.model.block_size == 0:
                raise ValueError(
                    "layout.block_size is required when model.block_size is 0"
                )
            self.layout.block_size = self.model.block_size
        if self.layout.sliding_window and self.prefill.dcp > 1:
            raise ValueError(
                "the pinned vLLM refuses decode context parallelism with a sliding "
                "window (its SlidingWindowManager asserts a DCP world size of 1)"
            )
        if not self.router.container and self.router.reach.ssh:
            raise ValueError(
                "router.container = false runs on the harness node: no ssh"
            )
        seen: dict[tuple[str, int], str] = {}
        for role in ROLES:
            side: Side = getattr(self, role)
            for i, inst in enumerate(side.instances):
                if inst.address is None:
                    continue
                key = (inst.address, inst.http_port or side.http_port)
                if key in seen:
                    raise ValueError(
                        f"{role}[{i}] and {seen[key]} share one address and http_port"
                    )
                seen[key] = f"{role}[{i}]"

    def side(self, role: Role) -> Side:
        return self.prefill if role == "prefill" else self.decode

    def check_addresses(self) -> None:
        """The ssh launcher needs every address up front."""
        missing = [
            f"{role}[{i}]"
            for role in ROLES
            for i, inst in enumerate(self.side(role).instances)
            if inst.address is None
        ]
        if self.router.address is None:
            missing.append("router")
        if missing:
            raise ConfigError(
                f"{self.name}: no address for {', '.join(missing)} (the ssh "
                "launcher needs every address; --launcher slurm resolves them)"
            )


def decode_config(data: bytes | str, source: str = "<config>") -> RunConfig:
    return decode_toml(data, RunConfig, source, "run config", ConfigError)


def load_config(path: Path) -> RunConfig:
    return read_toml(path, RunConfig, "config", ConfigError)


def encode_config(config: RunConfig) -> dict[str, object]:
    """The config as plain data, for the top of every report: every secret
    env value (container, sides, instances, Slurm nodes) shown as ``***``."""

    def mask(value: object, key: str = "") -> object:
        if isinstance(value, dict):
            if key == "env":
                return masked_env(value)
            if key == "node_env":
                return {node: masked_env(env) for node, env in value.items()}
            return {k: mask(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [mask(v) for v in value]
        return value

    data: dict[str, object] = msgspec.to_builtins(config)
    masked = mask(data)
    assert isinstance(masked, dict)
    return masked
