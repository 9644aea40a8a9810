"""What MoRIIO needs of the image beyond vLLM, checked from inside it
(`image verify --rdma`): MoRI's Python package imports, libibverbs has a
provider for a NIC (a driver entry in /etc/libibverbs.d with its provider
library, what MoRI's libibverbs loads; the host's may be bound over it,
see docs/e2e.md `[nic]`), and vLLM's MoRIIO toy proxy starts and listens."""

from __future__ import annotations

import importlib
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from vllm_overlay.image.checks import Check, last_line

# Where vllm/vllm-openai-rocm keeps vLLM's examples (the E2E front end).
TOY_PROXY = (
    "/app/vllm/examples/disaggregated/disaggregated_serving/moriio_toy_proxy_server.py"
)
DRIVERS = "etc/libibverbs.d"
LIB_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib64", "usr/lib")


def check_mori() -> Check:
    try:
        module = importlib.import_module("mori")
    except Exception as e:  # noqa: BLE001 - any import failure is the verdict
        return Check("mori", False, f"import mori: {last_line(e)}")
    return Check("mori", True, f"mori from {Path(module.__file__ or '?').parent}")


def ibverbs_providers(root: Path = Path("/")) -> list[str]:
    """The providers with a driver entry and a provider library."""
    found: list[str] = []
    for entry in sorted((root / DRIVERS).glob("*.driver")):
        words = entry.read_text(errors="replace").split()
        if words[:1] != ["driver"] or len(words) < 2:
            continue
        name = words[1]
        libs = [
            lib
            for d in LIB_DIRS
            for lib in (root / d / "libibverbs").glob(f"lib{name}-rdmav*.so")
        ]
        if libs:
            found.append(name)
    return found


def check_ibverbs(root: Path = Path("/")) -> Check:
    providers = ibverbs_providers(root)
    if not providers:
        return Check(
            "ibverbs-provider",
            False,
            f"no libibverbs provider: no {root / DRIVERS}/*.driver with its "
            "lib<name>-rdmav*.so",
        )
    return Check("ibverbs-provider", True, f"providers: {', '.join(providers)}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_toy_proxy(
    path: str = TOY_PROXY, timeout_s: float = 60.0, python: str = sys.executable
) -> Check:
    """Start the toy proxy on a free port; it passes once the port accepts
    a connection, and is stopped then."""
    if not Path(path).is_file():
        return Check("toy-proxy", False, f"{path}: no such file")
    port = free_port()
    proc = subprocess.Popen(
        [python, path, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                err = (proc.stderr.read() if proc.stderr else b"").decode(
                    errors="replace"
                )
                tail = err.strip().splitlines()[-1:] or ["no output"]
                return Check(
                    "toy-proxy", False, f"exited {proc.returncode}: {tail[0][:200]}"
                )
            try:
                with socket.create_connection(("127.0.0.1", port), 1.0):
                    return Check("toy-proxy", True, f"{path} listens on port {port}")
            except OSError:
                time.sleep(0.2)
        return Check("toy-proxy", False, f"not listening after {timeout_s:g}s")
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def rdma_checks(toy_proxy: str = TOY_PROXY, root: Path = Path("/")) -> Sequence[Check]:
    return [check_mori(), check_ibverbs(root), check_toy_proxy(toy_proxy)]
