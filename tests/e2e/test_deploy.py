"""docs/deploy.md: its commands are `e2e --print-serve`'s, which are the
E2E run's own `docker run` commands laid out one option per line."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import msgspec
import pytest

from tests.e2e.conftest import ALL_EXAMPLES, EXAMPLE, REPO
from vllm_overlay.cli import main
from vllm_overlay.e2e.config import load_config
from vllm_overlay.e2e.deploy import serve_text, shell_lines
from vllm_overlay.e2e.servers import (
    RENDER_GID,
    RENDER_GID_SH,
    container_name,
    docker_run_router,
    docker_run_server,
    servers,
)

DEPLOY = REPO / "docs" / "deploy.md"
_BLOCK = re.compile(r"<!-- print-serve: (\S+) -->\n```sh\n(.*?)```\n", re.DOTALL)


def _blocks() -> dict[str, str]:
    return dict(_BLOCK.findall(DEPLOY.read_text()))


def test_every_example_has_its_commands_in_the_guide() -> None:
    blocks = _blocks()
    assert sorted(blocks) == [str(p.relative_to(REPO)) for p in ALL_EXAMPLES]


@pytest.mark.parametrize("example", ALL_EXAMPLES, ids=lambda p: p.stem)
def test_the_guides_commands_are_print_serves(example: Path) -> None:
    block = _blocks()[str(example.relative_to(REPO))]
    assert block == serve_text(load_config(example)), (
        f"docs/deploy.md's block for {example.name} differs from "
        f"`vllm-overlay e2e --config {example.relative_to(REPO)} --print-serve`"
    )


def _commands(text: str) -> list[list[str]]:
    """The shell commands of ``text``: comment lines apart, continuation
    lines joined, split as the shell does."""
    commands: list[list[str]] = []
    current = ""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        current += line.removesuffix("\\")
        if not line.endswith("\\"):
            commands.append(shlex.split(current))
            current = ""
    assert not current
    return commands


@pytest.mark.parametrize("example", ALL_EXAMPLES, ids=lambda p: p.stem)
def test_print_serve_runs_the_e2e_runs_commands(example: Path) -> None:
    config = load_config(example)
    expected = [docker_run_router(config, container_name(config, "router"))]
    expected += [
        docker_run_server(config, s, container_name(config, s.name))
        for s in servers(config)
    ]
    # The servers' render group: its id, set on the node first.
    on_node = [
        ["$RENDER_GID" if w == RENDER_GID else w for w in argv] for argv in expected[1:]
    ]
    assert _commands(serve_text(config)) == [
        expected[0], shlex.split(RENDER_GID_SH), *on_node
    ]  # fmt: skip
    kv = [argv[argv.index("--kv-transfer-config") + 1] for argv in expected[1:]]
    roles = [msgspec.json.decode(k)["kv_role"] for k in kv]
    assert roles == ["kv_producer", "kv_consumer"]


def test_shell_lines_keep_each_option_with_its_value() -> None:
    argv = ["docker", "run", "--name", "x y", "--init"]
    argv += ["IMG", "serve", "/m", "--a", "1"]
    assert shell_lines(argv, "IMG") == [
        "docker run \\",
        "  --name 'x y' \\",
        "  --init \\",
        "  IMG \\",
        "  serve /m \\",
        "  --a 1",
    ]


def test_the_cli_prints_them(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["e2e", "--config", str(EXAMPLE), "--print-serve"]) == 0
    out = capsys.readouterr().out
    assert out == serve_text(load_config(EXAMPLE))
    assert out.splitlines()[-1].startswith("# e2e --print-serve llama-smoke: 3 ")


def test_without_addresses_it_is_one_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "no-router.toml"
    config.write_text(
        EXAMPLE.read_text().replace('[router]\naddress = "10.0.0.1"\n', "[router]\n")
    )
    assert main(["e2e", "--config", str(config), "--print-serve"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: --print-serve: llama-smoke: no address for router; the "
        "commands need every server's and the front end's address\n"
    )
