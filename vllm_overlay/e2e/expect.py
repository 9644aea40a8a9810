"""What goes wrong on the base, per prompt length, for one deployment.

The mechanisms each patch of the series fixes (see their headers) depend on
a few numbers of the KV cache layout: the attention page (block size times
DCP), the sliding window and its page, the lookahead slots each side's
scheduler reserves past the prompt (speculative decoding), and whether the
model takes MoRIIO's hybrid (KDA/Mamba) READ path. From those numbers this
module gives, without vLLM:

- the start-up refusals of the base connector (as the simulator recorded
  them for the pinned base: ``basestarts.py``);
- for every prompt length N, the rules under which the decoder reads wrong KV;
- the prompt lengths worth sending: every residue class a rule depends on,
  the page boundaries, and lengths next to them that must pass;
- the attention pages a prefix-hit READ moves on the base and overlaid.

The rules are closed forms of what the CPU simulator (`vllm-overlay
simulate`, the real schedulers and connector) finds; tests/e2e checks them
against it. A layout outside what the rules cover says so instead of
guessing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from vllm_overlay.e2e import basestarts
from vllm_overlay.e2e.basestarts import HYBRID_PROBE, BaseStarts
from vllm_overlay.e2e.config import Checks, RunConfig
from vllm_overlay.text import count

# Patch slugs (file name without the number and .patch), so a renumbered
# series still matches.
HYBRID_GROUPS = "moriio-hybrid-read-multi-attention-groups"
TRIM_BEFORE_CLIP = "moriio-trim-prompt-blocks-before-sw-clip"
MISSING_PAGES = "moriio-hybrid-read-only-missing-attention-pages"
WINDOW_START = "moriio-read-keeps-sw-window-start"
RINGS = "moriio-read-rings-and-wrapped-state-groups"
# Group spec kinds the base connector refuses at start, and the patch that
# makes READ accept them.
SPEC_FIXES = {"CircularBufferSpec": RINGS}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def patch_slug(name: str) -> str:
    """``0002-moriio-x.patch`` -> ``moriio-x``."""
    stem = name.removesuffix(".patch")
    head, _, rest = stem.partition("-")
    return rest if head.isdigit() and rest else stem


@dataclass(frozen=True)
class Geometry:
    """The layout numbers the rules read, from a run config."""

    block: int  # attention page of one rank, in tokens
    dcp: int
    window: int  # 0: no sliding-window group
    window_block: int
    hybrid: bool
    attention_groups: int
    prefill_lookahead: int
    decode_lookahead: int
    spec_methods: tuple[str, ...]  # of both sides, for the hybrid gate
    refused_specs: tuple[str, ...] = ()

    @property
    def page(self) -> int:
        """Positions per full-attention page: block size times DCP."""
        return self.block * self.dcp

    @classmethod
    def of(cls, config: RunConfig) -> Geometry:
        lay = config.layout
        methods = tuple(
            s.speculative.method
            for s in (config.prefill, config.decode)
            if s.speculative is not None
        )
        return cls(
            block=lay.block_size,
            dcp=config.prefill.dcp,
            window=lay.sliding_window,
            window_block=lay.window_block_size or lay.block_size,
            hybrid=lay.hybrid,
            attention_groups=lay.attention_groups,
            prefill_lookahead=config.prefill.lookahead_slots,
            decode_lookahead=config.decode.lookahead_slots,
            spec_methods=methods,
            refused_specs=tuple(lay.refused_specs),
        )

    def describe(self) -> str:
        parts = [f"page {self.block}" + (f" x dcp {self.dcp}" if self.dcp > 1 else "")]
        if self.window:
            parts.append(f"window {self.window} (page {self.window_block})")
        if self.hybrid:
            parts.append(
                f"hybrid READ, {count(self.attention_groups, 'attention group')}"
            )
        la = f"lookahead prefill {self.prefill_lookahead} / decode "
        parts.append(f"{la}{self.decode_lookahead}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Rule:
    """One mechanism that makes a READ wrong (or refused) on the base."""

    id: str
    summary: str  # with this layout's numbers
    fixed_by: str = ""  # patch slug; "" when the series does not fix it
    open_issue: str = ""  # where the unfixed mechanism is tracked
    applies: Callable[[int], bool] = lambda n: False
    # Lengths that exercise the rule (and their neighbours that must pass).
    samples: Callable[[int, int], list[int]] = lambda max_len, per_class: []

    def fixed_in(self, slugs: Iterable[str]) -> bool:
        return bool(self.fixed_by) and self.fixed_by in set(slugs)

    def fix_text(self) -> str:
        if self.fixed_by:
            return f"fixed by {self.fixed_by}"
        return f"not fixed by the series ({self.open_issue})"


def spread(values: Sequence[int], count: int) -> list[int]:
    """At most ``count`` of ``values``, first and last included, evenly apart."""
    if len(values) <= count:
        return list(values)
    if count == 1:
        return [values[0]]
    step = (len(values) - 1) / (count - 1)
    return sorted({values[round(i * step)] for i in range(count)})


def refusals(geo: Geometry, starts: BaseStarts | None = None) -> list[Rule]:
    """Why the base connector refuses to start with this layout: each
    mechanism a simulator layout has (``basestarts.HYBRID_PROBE``) is refused
    when the simulator found the pinned base refusing that layout, in the
    simulator's words; a base that starts it refuses none of them."""
    starts = starts or basestarts.RECORDED
    said = starts.refusal(HYBRID_PROBE)
    if not said:
        return []
    where = f"the simulator's {HYBRID_PROBE} layout on vLLM {starts.vllm}: {said}"
    out: list[Rule] = []
    if geo.hybrid and geo.attention_groups > 1:
        out.append(
            Rule(
                "hybrid-attention-groups",
                f"hybrid READ with {geo.attention_groups} attention groups: "
                f"refused at start ({where})",
                fixed_by=HYBRID_GROUPS,
            )
        )
    other = sorted({m for m in geo.spec_methods if m != "dspark"})
    if geo.hybrid and other:
        out.append(
            Rule(
                "hybrid-speculation",
                f"hybrid READ with method={other[0]!r} speculative decoding: "
                f"refused at start ({where})",
                fixed_by=HYBRID_GROUPS,
            )
        )
    for kind in geo.refused_specs:
        fix = SPEC_FIXES.get(kind, "")
        out.append(
            Rule(
                "unsupported-spec",
                f"a {kind} group: the servers fail closed at start ({where})",
                fixed_by=fix,
                open_issue="" if fix else "the connector has no path for this spec",
            )
        )
    return out


def wrong_kv_rules(geo: Geometry) -> tuple[list[Rule], str]:
    """Rules under which the decoder reads wrong KV for a prompt of N tokens,
    and, when the layout is outside what they cover, why."""
    if geo.hybrid or not geo.window:
        # Hybrid READ prefills N-1 tokens and keeps a window's ring whole;
        # full attention alone pairs by position (the simulator finds no
        # wrong length for these layouts on the base).
        return [], ""
    if geo.prefill_lookahead not in (0, geo.decode_lookahead):
        # The simulator finds the prefiller's lookahead tail changes nothing
        # when it is none or the decoder's (the same lengths fail: tests/e2e/
        # test_expect.py runs both); other pairs are not checked.
        return [], (
            f"a sliding window with {geo.prefill_lookahead} lookahead slots on "
            f"the prefill servers and {geo.decode_lookahead} on the decode "
            "servers is outside these rules (they hold for none on the prefill "
            "side or the same on both): run `vllm-overlay simulate` with a "
            "matching layout"
        )
    w, b, la = geo.window, geo.window_block, geo.decode_lookahead
    per_window = cdiv(w, b) + 1

    def window_start(n: int) -> bool:
        # Blocks the prefiller of N tokens freed, and the first block of the
        # clipped list: a clip reaching below the window pairs a freed block.
        freed = max(n - w + 1, 0) // b
        clip_start = max(cdiv(n, b) - per_window, 0)
        start_freed = n - w >= b - 1 and (n - w + 1) % b == 0
        return start_freed or clip_start < freed

    def window_start_samples(max_len: int, per_class: int) -> list[int]:
        hits = list(range(w + b - 1, max_len + 1, b))
        chosen = spread(hits, per_class)
        return sorted({m for n in chosen for m in (n - 1, n, n + 1) if m <= max_len})

    rules = [
        Rule(
            "window-start",
            f"(N - {w} + 1) % {b} == 0: the prefiller frees the block of the "
            f"decoder's window start (position N-{w}) before it hands over its "
            "table, and the decoder reads vLLM's null block there; or the "
            f"clip of {per_window} blocks reaches below the window and pairs "
            "the null block on both legs",
            fixed_by=WINDOW_START,
            applies=window_start,
            samples=window_start_samples,
        )
    ]
    if la:

        def shift(n: int) -> bool:
            blocks = cdiv(n + la, b)
            return blocks > cdiv(n, b) and blocks > per_window

        def shift_samples(max_len: int, per_class: int) -> list[int]:
            out: list[int] = []
            # Every residue of (N-1) % B in the shifted class, and the one
            # below it (a control that must pass).
            for r in range(max(b - la - 1, 0), b):
                ns = [n for n in range(r + 1, max_len + 1, b)]
                if r >= b - la:
                    ns = [n for n in ns if shift(n)]
                out += spread(ns, per_class)
            return out

        rules.insert(
            0,
            Rule(
                "lookahead-shift",
                f"(N-1) % {b} >= {b - la} and N + {la} > {per_window * b}: the "
                f"decoder's {la} lookahead slots add a block to its window list "
                "only, and the clipped lists pair one block apart",
                fixed_by=TRIM_BEFORE_CLIP,
                applies=shift,
                samples=shift_samples,
            ),
        )
    return rules, ""


@dataclass(frozen=True)
class Verdict:
    """The expectation for one prompt length."""

    length: int
    base: tuple[str, ...]  # ids of the rules that make it fail on the base
    overlay: tuple[str, ...]  # ... and with the series given


class Expectations:
    """Every rule for one deployment, and the verdict per length."""

    def __init__(
        self,
        geo: Geometry,
        series: Sequence[str] | None = None,
        starts: BaseStarts | None = None,
    ) -> None:
        self.geo = geo
        # Slugs of the series the overlay carries; None: unknown (the
        # rules' own fixed_by is trusted).
        self.series = None if series is None else [patch_slug(s) for s in series]
        starts = starts or basestarts.RECORDED
        self.base_version = starts.vllm
        self.refusals = refusals(geo, starts)
        self.rules, self.not_modelled = wrong_kv_rules(geo)

    def fixed(self, rule: Rule) -> bool:
        if self.series is None:
            return bool(rule.fixed_by)
        return rule.fixed_in(self.series)

    @property
    def refused_on_base(self) -> bool:
        return bool(self.refusals)

    @property
    def refused_overlaid(self) -> list[Rule]:
        return [r for r in self.refusals if not self.fixed(r)]

    def verdict(self, n: int) -> Verdict:
        base = tuple(r.id for r in self.rules if r.applies(n))
        overlay = tuple(r.id for r in self.rules if r.applies(n) and not self.fixed(r))
        return Verdict(n, base, overlay)

    def rule(self, rule_id: str) -> Rule:
        return next(r for r in [*self.refusals, *self.rules] if r.id == rule_id)


def sweep_lengths(geo: Geometry, checks: Checks, per_class: int = 8) -> list[int]:
    """The prompt lengths to send: the config's own, ``k*P + offset`` around
    every page boundary, up to ``per_class`` lengths of every residue class a
    rule depends on (with neighbours that must pass), topped up with evenly
    spaced lengths to at least ``sweep_min_count``."""
    max_len = checks.sweep_max_len
    lengths = {n for n in checks.lengths if n <= max_len}
    offsets = set(checks.boundary_offsets)
    if geo.hybrid:
        # The hybrid prefiller computes N-1 tokens: its boundaries sit one
        # token later.
        offsets |= {o + 1 for o in offsets}
    pages = {geo.page} | ({geo.window_block} if geo.window else set())
    for p in pages:
        for k in range(1, max_len // p + 1):
            lengths.update(k * p + o for o in offsets if 2 <= k * p + o <= max_len)
    rules, _ = wrong_kv_rules(geo)
    for rule in rules:
        lengths.update(n for n in rule.samples(max_len, per_class) if n >= 2)
    if len(lengths) < checks.sweep_min_count:
        room = [n for n in range(2, max_len + 1) if n not in lengths]
        need = checks.sweep_min_count - len(lengths)
        if len(room) < need:
            raise ValueError(
                f"only {len(lengths) + len(room)} lengths fit in {max_len} tokens"
            )
        lengths.update(spread(room, need))
    return sorted(lengths)


@dataclass(frozen=True)
class PrefixRead:
    """Attention pages a prefix-hit READ moves, per full-attention group."""

    length: int
    local_hit: int  # tokens the decoder already holds
    external: int  # tokens it loads
    pages_base: int
    pages_overlay: int


def prefix_read(geo: Geometry, length: int, shared: int) -> PrefixRead:
    """A prompt of ``length`` tokens whose first ``shared`` tokens the
    decoder holds from an earlier request: its hit is whole pages, at most
    N-1 tokens (the decoder recomputes the last one). The base reads every
    prompt page; hybrid READ with the series reads only the pages holding
    [N-1-E, N-1). Non-hybrid READ re-reads the hit on both (issue 14)."""
    p = geo.page
    hit = min(shared // p * p, (length - 1) // p * p)
    external = length - 1 - hit
    every = cdiv(length - 1, p)
    missing = every - hit // p
    return PrefixRead(length, hit, external, every, missing if geo.hybrid else every)
