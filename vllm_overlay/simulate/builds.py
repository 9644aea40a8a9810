"""Which connector build each leg of a pair runs, and loading two in one
process.

A pair names the prefiller's build and the decoder's: ``base`` and
``overlay`` run one build on both legs; ``base->overlay`` (a base
prefiller, an overlaid decoder) and ``overlay->base`` are the two halves of
a rolling upgrade. A process running a pair of one build redirects vLLM's
moriio package to that build's directory (``tree.variant.use_moriio_dir``).
A process running a mixed pair imports both builds' modules, each from its
own directory under the package's own names (the connector imports its
siblings by absolute name), keeps each build's module objects, and puts one
build's in ``sys.modules`` and on the package while a leg is built
(``use``): vLLM's connector factory then imports that build's connector, and
every object of the leg keeps its own module's globals afterwards. The
connector has no run-time import of a sibling module (only
``TYPE_CHECKING`` ones), so a leg never reaches the other build's code.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec

from vllm_overlay.series.pin import MODULE_PACKAGE
from vllm_overlay.tree.variant import VariantError, use_moriio_dir

BUILDS = ("base", "overlay")
"""The builds a sweep can run: the pinned base and the overlaid files."""
ARROW = "->"
PRODUCER = "kv_producer"
CONSUMER = "kv_consumer"


class BuildPair(msgspec.Struct, frozen=True):
    """The connector build of each leg: the prefiller's and the decoder's."""

    prefill: str
    decode: str

    @property
    def mixed(self) -> bool:
        return self.prefill != self.decode

    @property
    def name(self) -> str:
        """``base``, ``overlay`` or ``PREFILL->DECODE`` when they differ: how
        reports, known gaps and ``--variant`` name the pair."""
        return f"{self.prefill}{ARROW}{self.decode}" if self.mixed else self.prefill

    def build_of(self, role: str) -> str:
        """The build of the leg of ``role`` (``kv_producer``/``kv_consumer``)."""
        return self.prefill if role == PRODUCER else self.decode

    @classmethod
    def parse(cls, text: str) -> BuildPair:
        """``NAME`` (both legs) or ``PREFILL->DECODE``; any build name (a
        test runs ``installed``)."""
        prefill, arrow, decode = text.strip().partition(ARROW)
        prefill, decode = prefill.strip(), decode.strip()
        if not prefill or (arrow and not decode):
            raise ValueError(f"{text!r} is not a build or PREFILL->DECODE")
        return cls(prefill, decode if arrow else prefill)


GROUPS = {
    "both": ("base", "overlay"),
    "mixed": ("base->overlay", "overlay->base"),
    "all": ("base", "overlay", "base->overlay", "overlay->base"),
}
"""Names ``--variant`` accepts for several pairs at once."""


def parse_pairs(text: str) -> list[BuildPair]:
    """``--variant``'s value: a comma list of ``base``, ``overlay``,
    ``base->overlay``, ``overlay->base``, ``both`` (the first two),
    ``mixed`` (the last two) or ``all``; each pair once, in the order given.
    A bad value is a ValueError saying why."""
    pairs: list[BuildPair] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        for name in GROUPS.get(part, (part,)):
            pair = BuildPair.parse(name)
            bad = [b for b in (pair.prefill, pair.decode) if b not in BUILDS]
            if bad:
                raise ValueError(
                    f"unknown build {bad[0]!r} in {part!r}; a pair is base, "
                    "overlay, base->overlay or overlay->base (or both, mixed, all)"
                )
            if pair not in pairs:
                pairs.append(pair)
    if not pairs:
        raise ValueError("no pair given (e.g. both, base->overlay or all)")
    return pairs


def builds_of(pairs: list[BuildPair]) -> list[str]:
    """The builds the pairs run, in ``BUILDS`` order."""
    used = {b for p in pairs for b in (p.prefill, p.decode)}
    return [b for b in BUILDS if b in used] + sorted(used - set(BUILDS))


class LoadedBuilds:
    """Every build of a mixed pair, its modules loaded in this process."""

    def __init__(self, dirs: Mapping[str, Path]) -> None:
        self.dirs = dict(dirs)
        self.modules: dict[str, dict[str, ModuleType]] = {}
        self.active: str | None = None
        prefix = MODULE_PACKAGE + "."
        for build, directory in self.dirs.items():
            use_moriio_dir(directory)
            importlib.import_module(prefix + "moriio_connector")
            package = sys.modules[MODULE_PACKAGE]
            own = {n: m for n, m in sys.modules.items() if n.startswith(prefix)}
            for name in own:
                del sys.modules[name]
                short = name[len(prefix) :]
                if short in vars(package):
                    delattr(package, short)
            self.modules[build] = own

    def use(self, build: str) -> None:
        """Make ``build``'s modules the package's (``sys.modules`` and the
        package's attributes)."""
        if build not in self.modules:
            raise VariantError(f"build {build!r} is not loaded in this process")
        package = sys.modules[MODULE_PACKAGE]
        package.__path__ = [str(self.dirs[build])]
        prefix = MODULE_PACKAGE + "."
        for name, module in self.modules[build].items():
            sys.modules[name] = module
            setattr(package, name[len(prefix) :], module)
        self.active = build


_PAIR: BuildPair | None = None
_LOADED: LoadedBuilds | None = None


def load_pair(pair: BuildPair, dirs: Mapping[str, Path]) -> None:
    """Load ``pair``'s builds in this process (once, before anything imports
    the moriio package): one build redirects the package to its directory;
    a mixed pair loads both (``LoadedBuilds``) and ``use_role`` picks one."""
    global _PAIR, _LOADED
    missing = [b for b in (pair.prefill, pair.decode) if b not in dirs]
    if missing:
        raise VariantError(f"pair {pair.name}: no directory for build {missing[0]!r}")
    if pair.mixed:
        _LOADED = LoadedBuilds({b: dirs[b] for b in (pair.prefill, pair.decode)})
        # One build stays active: an import of the package's modules before
        # a leg picks its own finds them, not a third copy.
        _LOADED.use(pair.prefill)
    else:
        use_moriio_dir(dirs[pair.prefill])
    _PAIR = pair


def loaded_pair() -> BuildPair | None:
    return _PAIR


def use_role(role: str) -> None:
    """Before building a leg of ``role``: make its build the package's. A
    process of one build (or none loaded: the installed package) has
    nothing to switch."""
    if _LOADED is not None and _PAIR is not None:
        _LOADED.use(_PAIR.build_of(role))


def module_of(obj: Any) -> dict[str, Any]:
    """The globals of the module that defined ``obj``'s class: its own
    build's, whichever build ``sys.modules`` holds now."""
    for value in vars(type(obj)).values():
        function = getattr(value, "__func__", value)
        globals_ = getattr(function, "__globals__", None)
        if isinstance(globals_, dict):
            return globals_
    return vars(sys.modules[type(obj).__module__])
