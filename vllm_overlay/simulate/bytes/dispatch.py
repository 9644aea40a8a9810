"""Hand a sweep's configurations to its zygotes as they finish theirs.

Each variant's configurations wait in a queue (``variant_orders``: the
model families first for one variant, last for the other). A zygote gets
one on stdin when it starts and another each time it reports one done;
when its variant has none left its stdin is closed and it ends. A zygote's
place (its port range) then goes to a new zygote of the variant with the
most configurations still queued, if that is at least ``HELPER_ITEMS``: the
base refuses more configurations than the overlay and finishes first, and
the overlay no longer runs its last minute alone on one core.
"""

from __future__ import annotations

import queue
import subprocess
import threading
import traceback
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from vllm_overlay.simulate import procs
from vllm_overlay.simulate.bytes.report import ConfigItem, ConfigReport

HELPER_ITEMS = 12
"""Queued configurations worth starting a zygote for: one spends about ten
seconds importing vLLM before it runs anything, and a mechanism layout's
configuration takes one to three."""

Launch = Callable[[str, tuple[int, int]], "subprocess.Popen[str]"]
"""Start a zygote of a variant on a port range, reading its plan from
stdin (``--plan -``)."""


def order(
    items: Iterable[ConfigItem], families: Collection[str], families_first: bool = True
) -> list[ConfigItem]:
    """A variant's configurations in the order they are handed out, otherwise
    in plan order: a model family's (its real geometry: hundreds of MiB a
    rank, up to a second a case) first or last, and a mechanism layout's with
    more rank processes first. A sweep gives its variants opposite orders
    (``variant_orders``)."""
    return sorted(
        items,
        key=lambda item: (
            (item.layout.partition("/")[0] in families) != families_first,
            -(item.p_tp + item.d_tp),
        ),
    )


def variant_orders(
    items: list[ConfigItem], families: Collection[str], variants: list[str]
) -> dict[str, list[ConfigItem]]:
    """Each variant's order: the last variant (the overlay, which runs the
    most configurations) takes the model families first, the one before it
    last, and so on back. Two zygotes then rarely compare and copy families'
    buffers at the same time (they share the memory bandwidth), and the
    longest variant ends on short configurations, which a helper can share."""
    last = len(variants) - 1
    return {
        variant: order(items, families, families_first=(last - k) % 2 == 0)
        for k, variant in enumerate(variants)
    }


_ITEM = msgspec.json.Encoder()


@dataclass(eq=False)
class _Zygote:
    variant: str
    proc: subprocess.Popen[str]
    ports: tuple[int, int]
    label: str
    tail: list[str] = field(default_factory=list)
    error: str | None = None
    """Why reading its output failed (not how the process ended)."""


class Dispatcher:
    """Runs ``queues`` (variant -> its configurations, in the order they are
    handed out) on zygotes started by ``launch``: ``per_variant`` of each
    variant at first, one per port range in ``ranges`` at most. Every line
    a zygote writes after ``mark`` goes to ``sink``; a zygote that exits
    non-zero stops the others and raises with its last lines."""

    def __init__(
        self,
        queues: dict[str, list[ConfigItem]],
        launch: Launch,
        ranges: list[tuple[int, int]],
        per_variant: int,
        sink: Callable[[Any], None],
        mark: str,
        decoder: msgspec.json.Decoder[Any],
        helper_items: int = HELPER_ITEMS,
    ) -> None:
        self._queues = {variant: deque(items) for variant, items in queues.items()}
        self._launch = launch
        self._free = list(ranges)
        self._per_variant = per_variant
        self._sink = sink
        self._mark = mark
        self._decoder = decoder
        self._helper_items = helper_items
        self._lock = threading.Lock()
        self._running: list[_Zygote] = []
        self._ended: queue.Queue[_Zygote] = queue.Queue()
        self.started: list[str] = []
        """Each zygote's variant, in the order they started."""

    def run(self) -> None:
        try:
            for variant in self._queues:
                for _ in range(self._per_variant):
                    self._start(variant)
            while self._running:
                zygote = self._ended.get()
                self._running.remove(zygote)
                code = zygote.proc.wait()
                if zygote.error is not None or code != 0:
                    why = zygote.error or "".join(zygote.tail)
                    raise RuntimeError(f"{zygote.label} exited {code}:\n{why}")
                self._free.append(zygote.ports)
                self._help()
        finally:
            procs.stop([zygote.proc for zygote in self._running])

    def _help(self) -> None:
        """Fill free places with zygotes of the variants that have the most
        configurations queued, while that is worth a zygote."""
        while self._free:
            with self._lock:
                variant = max(self._queues, key=lambda v: len(self._queues[v]))
                if len(self._queues[variant]) < self._helper_items:
                    return
            self._start(variant)

    def _start(self, variant: str) -> None:
        with self._lock:
            if not self._queues[variant] or not self._free:
                return
            ports = self._free.pop(0)
        number = self.started.count(variant) + 1
        self.started.append(variant)
        proc = self._launch(variant, ports)
        zygote = _Zygote(variant, proc, ports, f"byte simulator {variant} #{number}")
        self._running.append(zygote)
        self._feed(zygote)
        threading.Thread(target=self._read, args=(zygote,), daemon=True).start()

    def _feed(self, zygote: _Zygote) -> None:
        """The variant's next configuration on the zygote's stdin, or the
        end of its stdin when there is none."""
        with self._lock:
            waiting = self._queues[zygote.variant]
            item = waiting.popleft() if waiting else None
        stdin = zygote.proc.stdin
        assert stdin is not None
        try:
            if item is None:
                stdin.close()
            else:
                stdin.write(_ITEM.encode(item).decode() + "\n")
                stdin.flush()
        except OSError:  # it died: its reader reports how
            pass

    def _read(self, zygote: _Zygote) -> None:
        stdout = zygote.proc.stdout
        assert stdout is not None
        try:
            for line in stdout:
                if not line.startswith(self._mark):
                    zygote.tail.append(line)
                    del zygote.tail[:-30]
                    continue
                value = self._decoder.decode(line[len(self._mark) :])
                self._sink(value)
                if isinstance(value, ConfigReport):
                    self._feed(zygote)
        except Exception:
            zygote.error = traceback.format_exc()
            zygote.proc.kill()
        finally:
            zygote.proc.wait()
            self._ended.put(zygote)
