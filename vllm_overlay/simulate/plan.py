"""What a simulate sweep runs: the plan each worker gets (``PlanItem``, parsed
values), the parsing of ``--lengths``/``--hits``, and where each build's
moriio files come from (``base_files``, ``overlay_files``, ``sources``).
The driver (``run.py``, ``bytes/run.py``) and the workers (``worker.py``,
``bytes/zygote.py``) both import it.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

import msgspec

from vllm_overlay.checkout import Checkout
from vllm_overlay.errors import OverlayError
from vllm_overlay.series.pin import MODULE_DIR
from vllm_overlay.simulate.builds import BuildPair, builds_of
from vllm_overlay.simulate.layouts import BASE_LAYOUTS
from vllm_overlay.simulate.writes import READ, Mode
from vllm_overlay.tree.apply import overlay_texts
from vllm_overlay.tree.materialize import BaseSource

Sources = dict[str, tuple[dict[str, str], str]]
"""Variant name -> (its moriio files by name, where they came from)."""

DEFAULT_LENGTHS = "1-4096/17"
FAMILY_LENGTHS = "1-4096/67"
"""Default for the model families: their real layer counts give up to ~50
groups, and a case costs the real scheduler's time per group and page."""
DEFAULT_HITS = "0,50,89.7,100"


class PlanItem(msgspec.Struct, frozen=True):
    """One layout's share of a worker's job, its values parsed."""

    layout: str
    lengths: tuple[int, ...]
    """Prompt lengths, ascending."""
    hits: tuple[float, ...]
    """Decoder prefix hits as fractions (0.5 for 50 %)."""
    whole: bool = False
    """Run every case itself instead of from its small ones (``shrink.py``)."""
    fault: str | None = None
    """Run this fault mode's cases (``faults.py``) instead of the sweep's."""
    pair: BuildPair | None = None
    """The connector build of each leg; None: the process's one build."""
    mode: Mode = READ
    """The connector's mode (``writes.py``): READ or WRITE."""

    @classmethod
    def of(
        cls,
        layout: str,
        lengths: str,
        hits: str,
        whole: bool = False,
        fault: str | None = None,
    ) -> PlanItem:
        """An item from ``--lengths``/``--hits`` text (a ValueError says
        what is wrong with it)."""
        return cls(
            layout,
            tuple(parse_lengths(lengths)),
            tuple(parse_hits(hits)),
            whole,
            fault,
        )


def default_lengths(layout_names: list[str]) -> dict[str, str]:
    """Lengths per layout when none are given: every 17th for the mechanism
    layouts, every 67th for the model families."""
    return {
        name: DEFAULT_LENGTHS if name.split("/")[0] in BASE_LAYOUTS else FAMILY_LENGTHS
        for name in layout_names
    }


def _whole_number(value: str, part: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"{part!r} is not a length, a range a-b or a range a-b/step"
        ) from None


def parse_lengths(text: str) -> list[int]:
    """``1-4096``, ``1-4096/13`` (every 13th), ``251,377`` or a mix. A bad
    value is a ValueError saying why."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        rng, _, step = part.partition("/")
        lo, _, hi = rng.partition("-")
        first = _whole_number(lo, part)
        last = _whole_number(hi or lo, part)
        every = _whole_number(step or "1", part)
        if first < 1:
            raise ValueError(f"a prompt length is at least 1, not {first}")
        if last < first:
            raise ValueError(f"a range a-b needs a <= b, not {first} > {last}")
        if every < 1:
            raise ValueError(f"a step is at least 1, not {every}")
        out.update(range(first, last + 1, every))
    if not out:
        raise ValueError("no length given (e.g. 1-4096, 1-4096/17 or 251,377)")
    return sorted(out)


def parse_hits(text: str) -> list[float]:
    """Percentages, e.g. ``0,50,89.7,100`` -> fractions. A bad value is a
    ValueError saying why."""
    hits = []
    for part in (x.strip() for x in text.split(",")):
        if not part:
            continue
        try:
            percent = float(part)
        except ValueError:
            raise ValueError(f"{part!r} is not a percentage") from None
        if not 0 <= percent <= 100:
            raise ValueError(f"a hit is 0 to 100 %, not {part}")
        hits.append(percent / 100)
    if not hits:
        raise ValueError("no hit given (e.g. 0,50,100)")
    return hits


class OverlaySourceError(OverlayError):
    """``--overlay-from`` names no complete build of the moriio package."""


def _by_name(texts: dict[str, str]) -> dict[str, str]:
    return {Path(path).name: text for path, text in texts.items()}


def base_files(
    source: BaseSource | None = None, checkout: Checkout | None = None
) -> tuple[dict[str, str], str]:
    """The pinned base moriio files (by file name), checked against the pin,
    and where they came from (see ``BaseSource``)."""
    checkout = checkout or Checkout.find()
    resolved = (source or BaseSource()).resolved()
    bases = resolved.load(checkout.pin, checkout.series)
    # Reports name the base by the pin its files were checked against, not
    # by a path on the machine that ran them (the README quotes them).
    vllm = checkout.pin.vllm
    origin = f"wheel {resolved.wheel.name}" if resolved.wheel else "installed package"
    return _by_name(bases.texts), f"vLLM {vllm.version} ({vllm.git_commit}, {origin})"


def overlay_files(
    base: dict[str, str], source: str | None = None, checkout: Checkout | None = None
) -> tuple[dict[str, str], str]:
    """Overlaid moriio files.

    ``source``: ``series`` (default: this checkout's patch series applied to
    ``base``), a directory holding the files, or ``REPO@REF`` (a patch-stack
    branch, e.g. ``/work/scratch/stack@p0003``).
    """
    if source is None or source == "series":
        checkout = checkout or Checkout.find()
        pin, series = checkout.pin, checkout.series
        full = {path: base[Path(path).name] for path in pin.files}
        texts = dict(base)
        texts.update(_by_name(overlay_texts(full, series)))
        names = ", ".join(p.name.split("-")[0] for p in series.patches)
        return texts, f"series {series.series_id} ({names or 'empty'})"
    # Every file the pin names (the series may touch any of them): a build
    # of the connector with another build's engine is not a build.
    if Path(source).is_dir():
        d = Path(source)
        missing = [name for name in base if not (d / name).is_file()]
        if missing:
            raise OverlaySourceError(
                f"--overlay-from {d}: holds no {missing[0]} (a file the pin names)"
            )
        return {name: (d / name).read_text() for name in base}, str(d)
    repo_s, _, ref = source.partition("@")
    files = {}
    for name in base:
        shown = subprocess.run(
            ["git", "-C", repo_s, "show", f"{ref}:{MODULE_DIR}/{name}"],
            capture_output=True,
            text=True,
        )
        if shown.returncode:
            raise OverlaySourceError(
                f"--overlay-from {source}: {shown.stderr.strip() or 'git show failed'}"
            )
        files[name] = shown.stdout
    commit = subprocess.run(
        ["git", "-C", repo_s, "rev-parse", "--short", ref],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return files, f"{repo_s}@{ref} ({commit})"


def sources(
    variants: Sequence[str],
    base_source: BaseSource | None = None,
    overlay_source: str | None = None,
    checkout: Checkout | None = None,
) -> Sources:
    """The files of every build the pairs ``variants`` run (``base``,
    ``overlay``, ``base->overlay``...), by build."""
    builds = builds_of([BuildPair.parse(v) for v in variants])
    out: Sources = {}
    base = base_files(base_source, checkout)
    if "base" in builds:
        out["base"] = base
    if "overlay" in builds:
        out["overlay"] = overlay_files(base[0], overlay_source, checkout)
    return out


def where_pairs(sources: Sources, variants: Sequence[str]) -> dict[str, str]:
    """Pair name -> where its builds' files came from (for reports)."""
    out = {}
    for variant in variants:
        pair = BuildPair.parse(variant)
        if pair.mixed:
            out[variant] = (
                f"prefill {pair.prefill}: {sources[pair.prefill][1]}; "
                f"decode {pair.decode}: {sources[pair.decode][1]}"
            )
        else:
            out[variant] = sources[pair.prefill][1]
    return out
