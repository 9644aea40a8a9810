"""Config values that reach a shell, a command line or a batch script
(issue 41, finding 5): each field is fed a newline, a command substitution
and a leading '-'. A value is either refused at load with one line naming
the field, or it is data: the generated ssh commands and Slurm scripts,
executed here with stub programs, hand it on verbatim and never run it."""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.e2e.conftest import EXAMPLE, without_nulls
from vllm_overlay.e2e.config import ConfigError, decode_config, load_config
from vllm_overlay.e2e.plan import build_plan
from vllm_overlay.e2e.slurm import SlurmJob

Data = dict[str, Any]


def at(*keys: str | int) -> Callable[[Data, str], None]:
    """A setter of the field at ``keys`` in the config's data."""

    def put(data: Data, value: str) -> None:
        node: Any = data
        for key in keys[:-1]:
            node = node.setdefault(key, {}) if isinstance(key, str) else node[key]
        node[keys[-1]] = value

    return put


def node_name(data: Data, value: str) -> None:
    data.setdefault("slurm", {})["node_env"] = {value: {"A": "1"}}


def listed(*keys: str | int) -> Callable[[Data, str], None]:
    def put(data: Data, value: str) -> None:
        at(*keys)(data, [value])  # type: ignore[arg-type]

    return put


DECODE = ("decode", "instances", 0)
# field (as the error names it) -> (setter, accepts a leading '-', accepts
# shell characters): a field that accepts them must pass them on as data.
FIELDS: dict[str, tuple[Callable[[Data, str], None], bool, bool]] = {
    "slurm.time": (at("slurm", "time"), False, False),
    "slurm.partition": (at("slurm", "partition"), False, False),
    "slurm.account": (at("slurm", "account"), False, False),
    "slurm.sbatch_options[0]": (listed("slurm", "sbatch_options"), True, True),
    "slurm.node_env (a name)": (node_name, False, False),
    "slurm.node_env.n1.A": (at("slurm", "node_env", "n1", "A"), True, True),
    "decode.instances[0].reach.ssh": (at(*DECODE, "reach", "ssh"), False, False),
    "decode.instances[0].reach.ssh_options[0]": (
        listed(*DECODE, "reach", "ssh_options"),
        True,
        True,
    ),
    "decode.instances[0].env.MORI_RDMA_DEVICES": (
        at(*DECODE, "env", "MORI_RDMA_DEVICES"),
        True,
        True,
    ),
    "container.env.HF_TOKEN": (at("container", "env", "HF_TOKEN"), True, True),
    "container.image": (at("container", "image"), False, False),
    "container.engine": (at("container", "engine"), False, False),
    "container.shm_size": (at("container", "shm_size"), False, False),
    "container.cache_dir": (at("container", "cache_dir"), False, False),
    "container.volumes[0]": (listed("container", "volumes"), False, True),
    "container.extra_run_flags[0]": (
        listed("container", "extra_run_flags"),
        True,
        True,
    ),
    "container.name_prefix": (at("container", "name_prefix"), False, False),
    "model.path": (at("model", "path"), False, True),
    "model.served_name": (at("model", "served_name"), True, True),
    "model.extra_args[0]": (listed("model", "extra_args"), True, True),
    "decode.visible_devices": (at("decode", "visible_devices"), True, True),
    "router.toy_proxy": (at("router", "toy_proxy"), False, True),
    "router.extra_args[0]": (listed("router", "extra_args"), True, True),
}
# A command by design (it prints the node's address): one line, no more.
CODE_FIELDS = {"slurm.address_command": at("slurm", "address_command")}


def example_data() -> Data:
    data: Data = msgspec.to_builtins(load_config(EXAMPLE))
    data["slurm"]["address_command"] = "echo 127.0.0.1"
    return data


def toml(data: Data) -> str:
    return msgspec.toml.encode(without_nulls(data)).decode()


def refused(field: str, put: Callable[[Data, str], None], value: str) -> str:
    data = example_data()
    put(data, value)
    with pytest.raises(ConfigError) as info:
        decode_config(toml(data), "run.toml")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("run.toml: invalid run config: "), message
    # Named as the field, or as msgspec names a field its type refuses.
    assert f"config: {field}: " in message or f"`$.{field}`" in message, message
    return message


@pytest.mark.parametrize("field", sorted([*FIELDS, *CODE_FIELDS]))
def test_a_newline_is_refused_naming_the_field(field: str) -> None:
    put = FIELDS[field][0] if field in FIELDS else CODE_FIELDS[field]
    message = refused(field, put, "x\necho injected")
    assert "contains a newline" in message or "`$.container.name_prefix`" in message
    assert "injected" not in message  # the value is never echoed: it may be secret


# Shell scripts, not Pythons: a case runs a stub some twenty times. Each
# call appends its argv to a file under $STUB_LOG named by its shell's pid
# (an exec'd command keeps it), NUL-terminated after the number of
# arguments; printf never evaluates them.
RECORD = 'printf "%s\\0" "$#" "$0" "$@" >>"$STUB_LOG/$$"'
STUBS = {
    # Records its argv and succeeds; `image inspect` finds the image.
    "docker": RECORD,
    # Runs the remote command with sh, as sshd runs it with the login shell.
    "ssh": f'{RECORD}\neval "remote=\\${{$#}}"\nexec sh -c "$remote"',
    # One task: rank 0 on this node.
    "srun": (
        'for a do shift; case $a in --*) ;; *) set -- "$@" "$a" ;; esac; done\n'
        'SLURM_PROCID=0 exec "$@"'
    ),
}


@pytest.fixture
def stubs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STUBS.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "calls"
    log.mkdir()
    monkeypatch.setenv("STUB_LOG", str(log))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    return log


def calls(log: Path) -> list[list[str]]:
    """Every stub call's argv, the program by its name."""
    found = []
    for record in sorted(log.iterdir()):
        fields = record.read_bytes().decode().split("\0")
        assert fields.pop() == "", record
        while fields:
            count, program = int(fields[0]), Path(fields[1]).name
            found.append([program, *fields[2 : 2 + count]])
            assert len(found[-1]) == count + 1, record
            del fields[: 2 + count]
    return found


def run_everything(data: Data, tmp_path: Path) -> None:
    """Every clean/pull/start command of the ssh plan, and the Slurm job's
    batch script with its node script (rank 0), through the stubs."""
    config = decode_config(toml(data))
    secrets = {"HF_TOKEN": data["container"]["env"].get("HF_TOKEN", "")}
    for step in build_plan(config).setup:
        if step.action in ("clean", "pull", "start"):
            stdin = "".join(f"{secrets[n]}\n" for n in step.secret_env)
            subprocess.run(
                step.argv, input=stdin, text=True, capture_output=True, timeout=60,
                check=False,
            )  # fmt: skip
    job = SlurmJob(config, tmp_path / "run")
    job.write()
    for script in (job.batch, job.node):
        subprocess.run(["bash", "-n", str(script)], check=True)
    subprocess.run(
        ["bash", str(job.batch)], capture_output=True, timeout=60, check=False,
        env={**os.environ, "SLURM_PROCID": "0", "SLURMD_NODENAME": "n1"},
    )  # fmt: skip


@pytest.mark.parametrize(
    ("field", "value"),
    [
        (field, value)
        for field in sorted(FIELDS)
        for value in ("$(touch MARK)", "`touch MARK`;touch MARK", "-oX=$(touch MARK)")
    ],
)
def test_shell_characters_and_a_leading_dash_are_refused_or_inert(
    field: str, value: str, stubs: Path, tmp_path: Path
) -> None:
    put, dash_ok, shell_ok = FIELDS[field]
    if field == "slurm.sbatch_options[0]" and not value.startswith("-"):
        value = f"--comment={value}"  # an option, carrying shell characters
    if (value.startswith("-") and not dash_ok) or not shell_ok:
        message = refused(field, put, value)
        assert "MARK" not in message
        return
    data = example_data()
    put(data, value)
    run_everything(data, tmp_path)
    ran = calls(stubs)
    assert ran, "no command ran"
    assert not (tmp_path / "MARK").exists(), f"{field}: {value} ran"
    assert not (tmp_path / "run" / "slurm" / "MARK").exists()
    # The value arrived as data: verbatim inside one argument of a command.
    words = [w for argv in ran for w in argv]
    if field not in ("slurm.sbatch_options[0]", "container.env.HF_TOKEN"):
        assert any(value in w for w in words), (field, ran[:3])


def test_a_host_beginning_with_a_dash_is_refused_before_ssh_runs() -> None:
    text = EXAMPLE.read_text().replace(
        'reach = { ssh = "mi350x-b" }', 'reach = { ssh = "-oProxyCommand=sh" }'
    )
    with pytest.raises(ConfigError, match=r"decode\.instances\[0\]\.reach\.ssh: must"):
        decode_config(text)


def test_a_secret_flag_in_extra_args_is_refused() -> None:
    message = refused(
        "model.extra_args[0]", listed("model", "extra_args"), "--hf-token"
    )
    assert "--hf-token would put a secret on a command line" in message
    assert "set container.env HF_TOKEN instead" in message
