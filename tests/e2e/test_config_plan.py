"""The run config's validation and the commands of the ssh-launched plan:
the reviewed dry run, the container flags, per-node env, topology."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from tests.e2e.conftest import EXAMPLE, FIXTURES, REPO
from vllm_overlay.cli import main
from vllm_overlay.e2e.cli import series_patches
from vllm_overlay.e2e.config import (
    IMAGE_UID,
    UNPRIVILEGED_FLAGS,
    ConfigError,
    RunConfig,
    decode_config,
    load_config,
)
from vllm_overlay.e2e.plan import Plan, Step, build_plan
from vllm_overlay.e2e.runid import owner
from vllm_overlay.e2e.servers import router_command, serve_command, servers

UPSTREAM_FLAGS = (
    "--cap-add IPC_LOCK",
    "--security-opt seccomp=unconfined",
    "--device /dev/infiniband",
    "--group-add @RENDER_GID@",
    "--ulimit memlock=-1:-1",
    "--ulimit nofile=1048576:1048576",
)
CACHE_ENV = (
    "VLLM_ENGINE_READY_TIMEOUT_S=3600",
    "VLLM_CACHE_ROOT=/cache/vllm",
    "TRITON_CACHE_DIR=/cache/triton",
    "XDG_CACHE_HOME=/cache",
)


def starts(plan: Plan) -> dict[str, Step]:
    return {s.what: s for s in plan.setup if s.action == "start"}


def test_dry_run_matches_the_reviewed_plan(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["e2e", "--config", str(EXAMPLE), "--dry-run", "--run-id", "r0test"]
    assert main(argv) == 0
    # The reviewed plan names the series id of this checkout and who runs it
    # (the owner label of every container).
    series = series_patches()
    assert series is not None
    expected = (FIXTURES / "llama-smoke.plan.txt").read_text()
    expected = expected.replace("{series}", series[0]).replace("{owner}", owner())
    assert capsys.readouterr().out == expected


def test_plan_order() -> None:
    plan = build_plan(load_config(EXAMPLE))
    actions = [(s.what, s.action) for s in plan.setup]
    assert [a for _, a in actions[:3]] == ["clean"] * 3
    assert [w for w, a in actions if a == "pull"] == ["node", "node"]
    assert [w for w, a in actions if a == "start"] == [
        "router",
        "prefill-0",
        "decode-0",
    ]
    assert [w for w, a in actions if a == "wait"] == ["prefill-0", "decode-0", "router"]
    last_pull = max(i for i, (_, a) in enumerate(actions) if a == "pull")
    assert last_pull < actions.index(("router", "start"))
    assert [s.what for s in plan.teardown] == ["decode-0", "prefill-0", "router"]
    decode = starts(plan)["decode-0"]
    assert decode.argv[:3] == ["ssh", "-o", "BatchMode=yes"]


def test_servers_run_unprivileged_with_upstream_flags() -> None:
    # Defect 6: no --privileged; vLLM's ROCm CI set: IPC_LOCK, seccomp off,
    # the GPU and RDMA devices and groups, memlock/nofile limits.
    for what, step in starts(build_plan(load_config(EXAMPLE))).items():
        joined = " ".join(step.argv)
        assert "--privileged" not in joined
        if what == "router":
            continue
        assert " ".join(UNPRIVILEGED_FLAGS) in joined
        for flag in UPSTREAM_FLAGS:
            assert flag in joined, flag


def with_container(config: RunConfig, **kw: object) -> RunConfig:
    return msgspec.structs.replace(
        config, container=msgspec.structs.replace(config.container, **kw)
    )


def test_docker_flags_are_configurable() -> None:
    config = with_container(
        load_config(EXAMPLE),
        run_flags=["--network", "host", "--device", "/dev/kfd"],
        extra_run_flags=["--privileged", "--volume", "/usr/lib/libionic.so.1:/l:ro"],
    )
    prefill = starts(build_plan(config))["prefill-0"].argv
    at = prefill.index("--name") + 2
    assert prefill[at : at + 9] == [
        "--network", "host", "--device", "/dev/kfd", "--privileged",
        "--volume", "/usr/lib/libionic.so.1:/l:ro", "--shm-size", "64g",
    ]  # fmt: skip


def test_cache_volume_and_engine_timeout_in_every_server() -> None:
    # Defects 3 and 6: vLLM's engine-ready timeout raised to upstream's 3600 s;
    # the compile caches live in a host directory mounted at /cache.
    plan = build_plan(load_config(EXAMPLE))
    for what in ("prefill-0", "decode-0"):
        argv = starts(plan)[what].argv
        joined = " ".join(argv)
        assert "--volume /var/cache/vllm-moriio-e2e:/cache" in joined
        for env in CACHE_ENV:
            assert f"--env {env}" in joined, (what, env)
    # The config's own value wins; no cache dir, no cache volume or env.
    config = with_container(
        load_config(EXAMPLE), env={"VLLM_ENGINE_READY_TIMEOUT_S": "7200"}, cache_dir=""
    )
    joined = " ".join(starts(build_plan(config))["prefill-0"].argv)
    assert "VLLM_ENGINE_READY_TIMEOUT_S=7200" in joined
    assert "/cache" not in joined and "3600" not in joined


def test_the_cache_directory_is_handed_to_the_image_user() -> None:
    # The image's vLLM runs as uid IMAGE_UID; docker creates a missing bind
    # mount source as root. Before any server starts, every server node's
    # cache directory is chowned from a root container of the image.
    plan = build_plan(load_config(EXAMPLE))
    actions = [(s.what, s.action, s.where) for s in plan.setup]
    prepares = [s for s in plan.setup if s.action == "prepare"]
    assert [s.where for s in prepares] == ["local", "mi350x-b"]
    owner = f"{IMAGE_UID}:{IMAGE_UID}"
    assert prepares[0].argv[-6:] == [
        "--volume", "/var/cache/vllm-moriio-e2e:/cache",
        load_config(EXAMPLE).container.image, "-R", owner, "/cache",
    ]  # fmt: skip
    assert "--user 0 --entrypoint chown" in " ".join(prepares[0].argv)
    first_start = next(i for i, a in enumerate(actions) if a[1] == "start")
    last_pull = max(i for i, a in enumerate(actions) if a[1] == "pull")
    assert last_pull < actions.index(("node", "prepare", "local")) < first_start
    no_cache = with_container(load_config(EXAMPLE), cache_dir="")
    assert not [s for s in build_plan(no_cache).setup if s.action == "prepare"]


def test_rdma_env_per_node() -> None:
    # Defect 5: every node its own MORI_RDMA_DEVICES / MORI_IB_GID_INDEX.
    text = EXAMPLE.read_text().replace(
        'reach = { ssh = "mi350x-b" }\nenv = { MORI_RDMA_DEVICES = "ionic_0,ionic_1,'
        'ionic_2,ionic_3,ionic_4,ionic_5,ionic_6,ionic_7", MORI_IB_GID_INDEX = "1" }',
        'reach = { ssh = "mi350x-b" }\nenv = { MORI_RDMA_DEVICES = "mlx5_0,mlx5_3", '
        'MORI_IB_GID_INDEX = "3" }',
    )
    assert "mlx5_0" in text
    plan = build_plan(decode_config(text))
    prefill = " ".join(starts(plan)["prefill-0"].argv)
    decode = " ".join(starts(plan)["decode-0"].argv)
    assert (
        "MORI_RDMA_DEVICES=ionic_0,ionic_1" in prefill
        and "MORI_IB_GID_INDEX=1" in prefill
    )
    assert (
        "MORI_RDMA_DEVICES=mlx5_0,mlx5_3" in decode and "MORI_IB_GID_INDEX=3" in decode
    )


@pytest.mark.parametrize("policy", ["missing", "always", "never"])
def test_pull_policy(policy: str) -> None:
    config = with_container(load_config(EXAMPLE), pull=policy)
    pulls = [s for s in build_plan(config).setup if s.action == "pull"]
    if policy == "never":
        assert pulls == []
        return
    assert [p.where for p in pulls] == ["local", "mi350x-b"]
    assert all(p.timeout_s == 3600 for p in pulls)
    image = config.container.image
    if policy == "always":
        assert pulls[0].argv == ["docker", "pull", image]
    else:
        assert pulls[0].argv[:2] == ["sh", "-c"]
        assert f"docker image inspect {image}" in pulls[0].argv[2]


TOPOLOGY = """
name = "xpyd"
[container]
image = "img"
[model]
path = "/m"
served_name = "m"
tokenizer = "/t.json"
[prefill]
tp = 4
dp = 2
expert_parallel = true
http_port = 8100
[[prefill.instances]]
address = "10.0.0.1"
[[prefill.instances]]
address = "10.0.0.2"
reach = { ssh = "b" }
[decode]
tp = 8
http_port = 8200
[[decode.instances]]
address = "10.0.0.3"
reach = { ssh = "c" }
[[decode.instances]]
address = "10.0.0.4"
reach = { ssh = "d" }
http_port = 8300
[router]
kind = "vllm-router"
address = "10.0.0.1"
port = 30000
"""


def test_n_prefill_by_m_decode_with_tp_dp_per_side() -> None:
    # Defect 10: 2 prefill (TP4 x DP2, expert parallel) x 2 decode (TP8), one
    # front end across all of them.
    config = decode_config(TOPOLOGY)
    plan = build_plan(config)
    assert list(starts(plan)) == [
        "router",
        "prefill-0",
        "prefill-1",
        "decode-0",
        "decode-1",
    ]
    waits = [s.url for s in plan.setup if s.action == "wait"]
    assert waits == [
        "http://10.0.0.1:8100/health", "http://10.0.0.2:8100/health",
        "http://10.0.0.3:8200/health", "http://10.0.0.4:8300/health",
        "http://10.0.0.1:30000/health",
    ]  # fmt: skip
    assert [s.where for s in plan.setup if s.action == "pull"] == [
        "local",
        "b",
        "c",
        "d",
    ]
    p0 = serve_command(config, servers(config)[0])
    assert p0[p0.index("--tensor-parallel-size") + 1] == "4"
    assert p0[p0.index("--data-parallel-size") + 1] == "2"
    assert "--enable-expert-parallel" in p0
    d1 = serve_command(config, servers(config)[3])
    assert "--data-parallel-size" not in d1
    kv = json.loads(d1[d1.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_extra_config"]["host_ip"] == "10.0.0.4"
    assert kv["kv_connector_extra_config"]["http_port"] == 8300
    # The router routes MoRIIO notifications to the right DP rank.
    router = router_command(config)
    assert router[router.index("--intra-node-data-parallel-size") + 1] == "2"


TP = "tp = 8\nhttp_port = 8200"
ROUTER = 'address = "10.0.0.1"\n\n[checks]'
SHM = 'shm_size = "64g"'
# case: (text in the example, replacement, error message part)
BAD = {
    "unknown section": ("[decode]", "[nodecode]", "unknown field `nodecode`"),
    "bad port": (
        "http_port = 8200",
        "http_port = 70000",
        "<= 65535 - at `$.decode.http_port`",
    ),
    "bad type": (TP, TP.replace("8", '"eight"', 1), "Expected `int`"),
    "dcp": (TP, TP.replace("\n", "\ndcp = 3\n"), "multiple of dcp"),
    "backend": (
        'mode = "read"',
        'mode = "read"\nbackend = "tcp"',
        "must be 'rdma' or 'xgmi'",
    ),
    "mode": ('mode = "read"', 'mode = "pull"', "moriio.mode"),
    "env name": ('HF_HUB_OFFLINE = "1"', '"HF HUB" = "1"', "in `$.container.env`"),
    "pull": (SHM, f'{SHM}\npull = "sometimes"', "`$.container.pull`"),
    "front end": (
        ROUTER,
        ROUTER.replace("\n", '\nkind = "nginx"\n', 1),
        "`$.router.kind`",
    ),
    "not toml": ("[router]", "[router", "not valid TOML"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_is_one_clear_error(case: str, tmp_path: Path) -> None:
    old, new, message = BAD[case]
    text = EXAMPLE.read_text()
    assert old in text, old
    path = tmp_path / "run.toml"
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: ")
    assert "\n" not in str(info.value)


def test_bad_config_exits_non_zero_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.toml"
    path.write_text(EXAMPLE.read_text().replace("http_port = 8200", "http_port = 0"))
    assert main(["e2e", "--config", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ">= 1 - at `$.decode.http_port`" in err


def test_same_endpoint_twice_is_refused() -> None:
    text = EXAMPLE.read_text().replace('address = "10.0.0.2"', 'address = "10.0.0.1"')
    text = text.replace("http_port = 8200", "http_port = 8100")
    with pytest.raises(
        ConfigError, match=r"prefill\[0\] share one address and http_port"
    ):
        decode_config(text)


def test_the_ssh_launcher_needs_every_address(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "run.toml"
    path.write_text(EXAMPLE.read_text().replace('address = "10.0.0.2"\n', ""))
    assert main(["e2e", "--config", str(path), "--dry-run"]) == 2
    assert "no address for decode[0]" in capsys.readouterr().err
    # Slurm resolves addresses on the nodes.
    assert main(["e2e", "--config", str(path), "--dry-run", "--launcher", "slurm"]) == 0


def test_a_window_with_dcp_is_refused_like_vllm_does() -> None:
    text = (Path(EXAMPLE).parent / "dsv4-pro-1p1d.toml").read_text()
    text = text.replace("tp = 8\nhttp_port", "tp = 8\ndcp = 2\nhttp_port")
    with pytest.raises(
        ConfigError, match="refuses decode context parallelism with a sliding window"
    ):
        decode_config(text)


def test_dry_run_warns_when_the_tokenizer_is_not_on_this_machine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The harness loads model.tokenizer on the machine it runs on, before
    anything starts: the dry run there says when it is missing."""
    config = load_config(EXAMPLE)
    assert not Path(config.model.tokenizer).exists()
    assert main(["e2e", "--config", str(EXAMPLE), "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert (
        f"warning: model.tokenizer {config.model.tokenizer}: no such file here" in err
    )
    here = tmp_path / "tokenizer.json"
    here.write_text("{}")
    local = tmp_path / "local.toml"
    local.write_text(EXAMPLE.read_text().replace(config.model.tokenizer, str(here), 1))
    assert main(["e2e", "--config", str(local), "--dry-run"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_the_dry_runs_summary_is_its_last_line_even_after_a_warning() -> None:
    """docs/e2e.md: the last line of every dry run sums it up; a warning
    about a missing local file comes before it (both streams to one)."""
    run = subprocess.run(
        [sys.executable, "-m", "vllm_overlay.cli", "e2e", "--config", str(EXAMPLE)]
        + ["--dry-run"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=True,
    )
    lines = run.stdout.rstrip("\n").splitlines()
    assert any(line.startswith("warning: model.tokenizer") for line in lines)
    assert lines[-1].startswith("e2e dry run llama-smoke: "), lines[-1]


def test_ionic_nodes_get_the_hosts_nic_userspace_provider(tmp_path: Path) -> None:
    import msgspec as _msgspec

    from vllm_overlay.e2e.config import IONIC_LIBS, load_config
    from vllm_overlay.e2e.servers import docker_run_server
    from vllm_overlay.e2e.servers import servers as all_servers

    config = load_config(EXAMPLE)  # MORI_RDMA_DEVICES=ionic_0,...: auto binds
    server = all_servers(config)[0]
    argv = docker_run_server(config, server, "x")
    mounts = [argv[i + 1] for i, a in enumerate(argv) if a == "--mount"]
    assert mounts == [f"type=bind,source={p},target={p},readonly" for p in IONIC_LIBS]
    assert argv.index("--mount") < argv.index("--entrypoint")
    off = _msgspec.structs.replace(
        config, nic=_msgspec.structs.replace(config.nic, userspace="off")
    )
    assert "--mount" not in docker_run_server(off, server, "x")
    # No ionic device named: auto binds nothing; on binds what is listed.
    plain = _msgspec.structs.replace(
        config,
        prefill=_msgspec.structs.replace(config.prefill, env={}, instances=[
            _msgspec.structs.replace(i, env={}) for i in config.prefill.instances]),
        decode=_msgspec.structs.replace(config.decode, env={}, instances=[
            _msgspec.structs.replace(i, env={}) for i in config.decode.instances]),
    )  # fmt: skip
    assert "--mount" not in docker_run_server(plain, all_servers(plain)[0], "x")
    lib = tmp_path / "libx.so"
    forced = _msgspec.structs.replace(
        plain,
        nic=_msgspec.structs.replace(
            plain.nic, userspace="on", userspace_libs=[str(lib)]
        ),
    )
    argv = docker_run_server(forced, all_servers(forced)[0], "x")
    assert f"type=bind,source={lib},target={lib},readonly" in argv


def test_a_userspace_lib_must_be_an_absolute_path(tmp_path: Path) -> None:
    from vllm_overlay.e2e.config import ConfigError, load_config

    text = EXAMPLE.read_text().replace(
        "[nic]\n", '[nic]\nuserspace_libs = ["-v/etc:/etc"]\n'
    )
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"nic\.userspace_libs\[0\]"):
        load_config(path)


def test_the_render_group_goes_by_the_nodes_id(
    example_config: RunConfig, tmp_path: Path
) -> None:
    # `--group-add render` would name the image's group; the start command
    # puts the node's own id there: the group owning /dev/dri/renderD*,
    # else the node's `render` group; a node with neither keeps the name.
    from vllm_overlay.e2e.plan import with_render_gid
    from vllm_overlay.e2e.servers import RENDER_GID

    start = next(
        s
        for s in build_plan(example_config).setup
        if s.action == "start" and s.what == "prefill-0"
    )
    assert start.argv[:2] == ["sh", "-c"]  # the render gid wrapper (no secrets)
    assert RENDER_GID in start.argv and "render" not in start.argv
    argv = with_render_gid(["echo", "--group-add", "video", "--group-add", RENDER_GID])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()

    def group_add(stat: str, getent: str) -> tuple[str, str]:
        for name, body in (("stat", stat), ("getent", getent)):
            (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
            (bin_dir / name).chmod(0o755)
        done = subprocess.run(
            argv, env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        return done.stdout.strip(), done.stderr.strip()

    render_node = group_add("echo 109", "echo render:x:992:")
    assert render_node == ("--group-add video --group-add 109", "")
    assert group_add("exit 1", "echo render:x:992:")[0].endswith("--group-add 992")
    out, err = group_add("exit 1", "exit 2")
    assert out.endswith("--group-add render")
    assert "no /dev/dri/renderD* and no render group" in err
    # Without the placeholder (run_flags of one's own) nothing is wrapped.
    assert with_render_gid(["docker", "run"]) == ["docker", "run"]
