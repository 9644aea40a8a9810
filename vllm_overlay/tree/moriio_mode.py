"""Which MoRIIO transfer mode a `vllm serve` process runs, for the banner.

vLLM loads its general plugins (the banner) before it builds its config, so
the banner reads the mode from the process's own command line: the JSON of
`--kv-transfer-config`. MoRIIO runs READ when
`kv_connector_extra_config.read_mode` is true ("true" or "1", any case) and
WRITE otherwise (vLLM's default); it ignores the old environment variable
VLLM_MORIIO_CONNECTOR_READ_MODE. A process started without the option
(vLLM's spawned engine and worker processes) cannot tell.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

OPTION = "--kv-transfer-config"
OLD_ENV = "VLLM_MORIIO_CONNECTOR_READ_MODE"


class KvTransferConfig(msgspec.Struct):
    """The part of `--kv-transfer-config` the mode depends on."""

    kv_connector: str | None = None
    kv_connector_extra_config: dict[str, Any] = msgspec.field(default_factory=dict)


def option_value(argv: Sequence[str]) -> str | None:
    """The last `--kv-transfer-config` value on ``argv`` (as argparse takes
    it), or None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == OPTION and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(OPTION + "="):
            value = arg[len(OPTION) + 1 :]
    return value


def mode_line(
    argv: Sequence[str], environ: Mapping[str, str]
) -> tuple[int, str] | None:
    """The level and text of the banner's mode line for a process started
    with ``argv``, or None when its command line configures no MoRIIO
    connector."""
    value = option_value(argv)
    if value is None:
        return None
    try:
        config = msgspec.json.decode(value, type=KvTransferConfig)
    except msgspec.DecodeError as e:
        return (
            logging.WARNING,
            f"vllm-moriio-overlay: cannot tell the MoRIIO mode: {OPTION}: {e}",
        )
    if config.kv_connector != "MoRIIOConnector":
        return None
    read_mode = config.kv_connector_extra_config.get("read_mode")
    if read_mode is None:
        text = "MoRIIO mode WRITE (read_mode unset: vLLM's default)"
    elif str(read_mode).strip().lower() in ("true", "1"):
        text = f"MoRIIO mode READ (read_mode {read_mode!r})"
    else:
        text = f"MoRIIO mode WRITE (read_mode {read_mode!r})"
    level = logging.INFO
    if OLD_ENV in environ:
        level = logging.WARNING
        text += f"; {OLD_ENV} is set and ignored by vLLM"
    return level, f"vllm-moriio-overlay: {text}"
