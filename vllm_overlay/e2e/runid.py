"""A run's identity on the nodes: the id in its containers' names and
labels, and the owner label by which `e2e --reap` finds the stale
containers of one's own runs, never a colleague's."""

from __future__ import annotations

import getpass
import os
import re
import secrets
import time

import msgspec

from vllm_overlay.e2e.config import RunConfig

LABEL_RUN = "vllm-overlay.e2e.run"
LABEL_NAME = "vllm-overlay.e2e.name"
LABEL_OWNER = "vllm-overlay.e2e.owner"


def new_run_id() -> str:
    """Month, day, hour, minute and four random hex digits: sortable, and
    two runs started in the same minute still differ."""
    return time.strftime("%m%d%H%M") + secrets.token_hex(2)


def owner() -> str:
    """Who runs the harness, as a label value (the user name, else the uid)."""
    try:
        name = getpass.getuser()
    except (KeyError, OSError):
        name = ""
    clean = re.sub(r"[^A-Za-z0-9_.-]", "", name)
    return clean or f"uid{os.getuid()}"


def with_run_id(config: RunConfig, run_id: str = "") -> RunConfig:
    """``config`` with ``run_id`` (default: the config's own, else a fresh one)."""
    chosen = run_id or config.container.run_id or new_run_id()
    container = msgspec.structs.replace(config.container, run_id=chosen)
    return msgspec.structs.replace(config, container=container)


def run_prefix(config: RunConfig) -> str:
    """What every container (and the Slurm job) of every run of ``config``
    is named by: ``PREFIX-NAME``."""
    return f"{config.container.name_prefix}-{config.name}"


def run_name(config: RunConfig) -> str:
    """``PREFIX-NAME-RUNID`` (``PREFIX-NAME`` without a run id)."""
    rid = config.container.run_id
    return f"{run_prefix(config)}-{rid}" if rid else run_prefix(config)


def label_flags(config: RunConfig) -> list[str]:
    """`docker run` labels of a run's containers: its id, its config's
    prefix and its owner; none without a run id."""
    if not config.container.run_id:
        return []
    return [
        "--label", f"{LABEL_RUN}={config.container.run_id}",
        "--label", f"{LABEL_NAME}={run_prefix(config)}",
        "--label", f"{LABEL_OWNER}={owner()}",
    ]  # fmt: skip
