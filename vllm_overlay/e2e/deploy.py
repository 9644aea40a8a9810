"""`vllm-overlay e2e --config F --print-serve`: the commands that start a
run's front end and servers, for a deployment by hand.

They are the E2E plan's own commands (``servers.docker_run_router`` and
``servers.docker_run_server``: the container flags, the RDMA env and the
`vllm serve` line with its `--kv-transfer-config`), laid out one option per
line. docs/deploy.md holds this output for every example; a test keeps the
two equal.
"""

from __future__ import annotations

import shlex

from vllm_overlay.e2e.config import RENDER_GID, ConfigError, RunConfig
from vllm_overlay.e2e.servers import (
    RENDER_GID_SH,
    container_name,
    docker_run_router,
    docker_run_server,
    router_command,
    servers,
)
from vllm_overlay.text import count

_INDENT = "  "


def _word(token: str) -> str:
    return '"$RENDER_GID"' if token == RENDER_GID else shlex.quote(token)


def shell_lines(argv: list[str], image: str) -> list[str]:
    """``argv`` as one shell command over several lines: every ``--option``
    with its value on a line of its own, the image on its own line, and
    the command run in it on the next."""
    groups: list[list[str]] = []
    previous = ""
    for token in argv:
        new = (
            not groups
            or token.startswith("--")
            or token == image
            or (previous == image and bool(image))
        )
        if new:
            groups.append([token])
        else:
            groups[-1].append(token)
        previous = token
    lines = [" ".join(_word(t) for t in group) for group in groups]
    return [
        (_INDENT if i else "") + line + (" \\" if i < len(lines) - 1 else "")
        for i, line in enumerate(lines)
    ]


def serve_text(config: RunConfig) -> str:
    """The front end's and every server's command, each under a comment
    naming it and its host; the last line sums them up."""
    try:
        config.check_addresses()
    except ConfigError as e:
        raise ConfigError(
            f"--print-serve: {str(e).split(' (', 1)[0]}; the commands need "
            "every server's and the front end's address"
        ) from None
    c, r = config.container, config.router
    front = f"http://{r.address}:{r.port}"
    out = [
        f"# {config.name}: {config.prefill.count} prefill x "
        f"{config.decode.count} decode, image {c.image}",
    ]
    assert r.address is not None
    if r.container:
        out.append(f"# the front end ({r.kind}), on {r.address}")
        name = container_name(config, "router")
        out += shell_lines(docker_run_router(config, name), c.image)
    else:
        out.append(f"# the front end ({r.kind}), on {r.address}, outside a container")
        out += shell_lines(router_command(config, place="container"), "")
    if any(RENDER_GID in docker_run_server(config, s, "") for s in servers(config)):
        out += [
            "# on each server's node first: its render group's id (by number:",
            "# `--group-add render` would resolve the name in the image)",
            RENDER_GID_SH,
        ]
    for s in servers(config):
        kv_role = "kv_producer" if s.role == "prefill" else "kv_consumer"
        parallel = f"TP {s.tp}" + (f", DP {s.dp}" if s.dp > 1 else "")
        parallel += f", DCP {s.dcp}" if s.dcp > 1 else ""
        out.append(f"# {s.name} ({kv_role}, {parallel}), on {s.address}")
        name = container_name(config, s.name)
        out += shell_lines(docker_run_server(config, s, name), c.image)
    n = len(servers(config)) + 1
    out.append(
        f"# e2e --print-serve {config.name}: {count(n, 'command')}; requests go to "
        f"{front}/v1/completions once every server's /health answers 200"
    )
    return "\n".join(out) + "\n"
