"""The byte simulator's verdict on the overlay: one line and an exit status.

The rules of ``simulate/verdict.py``, per configuration: an overlay
configuration that starts must move no wrong or stray byte (``wrong KV``),
crash in no case and not be refused at its first transfer (``errors``), and
run at least one case (``no cases``), unless ``docs/known-gaps.toml`` lists
it. A gap of ``scope = "bytes"`` names a layout (every configuration of it),
``layout mode``, ``layout mode P->D`` or the whole configuration name as the
table prints it (``glm read 1->2 LBNHC``). A configuration refused at start
is no failure; a run where every overlay configuration was refused is. The
base is not judged: it is what the series fixes. A pair with a base decoder
(``overlay->base``) moves wrong bytes only where the base pair of the same
configuration moves right ones, as in ``simulate/verdict.py``; in a run
without the base pair its wrong bytes cannot be judged (they may be vLLM's
own decoder's): the verdict says so and does not count them as failures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_overlay.simulate.bytes.report import (
    BytesReport,
    ConfigItem,
    ConfigReport,
    config_name,
    fault_failures,
)
from vllm_overlay.simulate.verdict import (
    KnownGap,
    Problem,
    WrongCases,
    base_decoder,
    beyond_base,
    escape_problems,
    gap_index,
    judged,
    shown,
    wrong_cases,
)
from vllm_overlay.text import count


def names(item: ConfigItem) -> tuple[str, ...]:
    """Every name a known gap may give this configuration, widest first."""
    mode = f"{item.layout} {item.mode}"
    return (item.layout, mode, f"{mode} {item.p_tp}->{item.d_tp}", config_name(item))


def problems(
    r: ConfigReport, base_wrong: WrongCases | None = None
) -> list[tuple[Problem, str]]:
    """What is wrong with one configuration's run, each with its detail;
    ``base_wrong``: the base pair's wrong cases of the configuration, for a
    pair with a base decoder."""
    if r.refused_at_start is not None:
        return []
    if r.cases == 0:
        return [("no cases", "ran no case")]
    out: list[tuple[Problem, str]] = []
    if base_decoder(r.variant):
        own, _ = beyond_base(wrong_cases(r.wrong_lengths), base_wrong)
        if own:
            where = "" if base_wrong is None else " where the base pair moves right"
            detail = f"wrong or stray bytes in {count(len(own), 'case')}{where}"
            out.append(("wrong KV", detail))
    elif r.wrong_cases:
        out.append(
            ("wrong KV", f"wrong or stray bytes in {r.wrong_cases} of {r.cases} cases")
        )
    out.extend(fault_problems(r))
    crashes = r.error_cases - r.escape_cases
    if r.refused is not None and crashes:
        out.append(("errors", f"refused at the first transfer: {r.refused[:120]}"))
    elif crashes:
        out.append(("errors", f"crashes in {crashes} of {r.cases} cases"))
    out.extend(escape_problems(r.escape_cases, r.cases))
    return out


def fault_problems(r: ConfigReport) -> list[tuple[Problem, str]]:
    """A transport fault configuration's faulted requests computed on wrong
    bytes, never finished, or leaving blocks held (the request next to it is
    judged as any case's request)."""
    o = r.fault_outcomes
    out: list[tuple[Problem, str]] = []
    if o.get("wrong"):
        out.append(
            (
                "wrong KV",
                f"a faulted request computed on wrong bytes in {o['wrong']} of "
                f"{r.cases} cases",
            )
        )
    if o.get("hung"):
        out.append(
            ("errors", f"a faulted request hung in {o['hung']} of {r.cases} cases")
        )
    if r.leak_cases:
        out.append(("errors", f"blocks left held in {r.leak_cases} of {r.cases} cases"))
    return out


@dataclass
class BytesVerdict:
    judged: int = 0
    refused: int = 0
    failures: list[str] = field(default_factory=list)
    known: list[str] = field(default_factory=list)
    base_decoder_wrong: int = 0
    """Wrong cases of base-decoder pairs that the base pair has too."""
    base_fault_failures: int = 0
    """Failed transport fault cases of the base pair (vLLM's own MoRIIO:
    reported, not judged)."""
    unjudged: list[str] = field(default_factory=list)
    """Base-decoder configurations with wrong bytes in a run without the
    base pair to tell the overlay's from vLLM's own."""

    @property
    def exit_code(self) -> int:
        return 1 if self.failures else 0

    def line(self) -> str:
        known = f"; {len(self.known)} known gap(s)" if self.known else ""
        if self.base_decoder_wrong:
            known += (
                f"; {self.base_decoder_wrong} wrong case(s) of base decoders "
                "where the base pair is wrong too"
            )
        if self.base_fault_failures:
            known += (
                f"; base (vLLM's own MoRIIO, not judged): "
                f"{count(self.base_fault_failures, 'fault case')} failed"
            )
        if self.unjudged:
            known += (
                f"; cannot judge {count(len(self.unjudged), 'configuration')} of "
                "base decoders with wrong bytes without the base pair (add base "
                f"to --variant): {', '.join(self.unjudged[:3])}"
                + (", ..." if len(self.unjudged) > 3 else "")
            )
        if self.failures:
            shown = "; ".join(self.failures[:6])
            more = len(self.failures) - 6
            shown += f"; and {more} more" if more > 0 else ""
            return (
                f"simulate-bytes: FAILED: the overlay falls short in "
                f"{len(self.failures)} configuration(s): {shown}{known}"
            )
        if not self.judged:
            return "simulate-bytes: no overlay configuration ran: nothing to judge"
        ran = self.judged - self.refused
        if self.unjudged:
            return (
                "simulate-bytes: not judged in full: the overlay moves the right "
                f"bytes in every other configuration that starts ({ran} run, "
                f"{self.refused} refused at start){known}"
            )
        return (
            f"simulate-bytes: ok: the overlay moves the right bytes in every "
            f"configuration that starts ({self.judged - self.refused} run, "
            f"{self.refused} refused at start){known}"
        )


def judge(report: BytesReport, gaps: list[KnownGap]) -> BytesVerdict:
    """The verdict on the overlay configurations of ``report``."""
    by_key = gap_index([g for g in gaps if g.scope == "bytes"])
    verdict = BytesVerdict()
    rows = [r for r in report.configs if judged(r.variant)]
    if not any(judged(v) for v in report.variants):
        return verdict
    base_wrong = {
        config_name(r.item): wrong_cases(r.wrong_lengths)
        for r in report.configs
        if r.variant == "base" and r.refused_at_start is None
    }
    verdict.base_fault_failures = sum(
        fault_failures(r)
        for r in report.configs
        if r.variant == "base" and r.refused_at_start is None and r.item.fault
    )
    for r in rows:
        verdict.judged += 1
        verdict.refused += r.refused_at_start is not None
        base = base_wrong.get(config_name(r.item))
        found = problems(r, base)
        if base_decoder(r.variant) and r.refused_at_start is None:
            verdict.base_decoder_wrong += beyond_base(
                wrong_cases(r.wrong_lengths), base
            )[1]
            if "base" not in report.variants and r.wrong_cases:
                verdict.unjudged.append(shown(config_name(r.item), r.variant))
                found = [(p, d) for p, d in found if p != "wrong KV"]
        for problem, detail in found:
            gap = next(
                (
                    g
                    for name in names(r.item)
                    if (g := by_key.get((name, problem, r.variant))) is not None
                ),
                None,
            )
            name = shown(config_name(r.item), r.variant)
            if gap is None:
                verdict.failures.append(f"{name} {detail}")
            else:
                verdict.known.append(f"{name} {problem} ({gap.tracked_by})")
    if not rows or not any(r.cases for r in rows):
        verdict.failures.append("no case ran: every configuration was refused at start")
    return verdict
