"""`vllm-overlay rebase`: move the series onto a newer vLLM base.

Each patch, in series order, is classified against the new base:

- ``clean``: applies exactly where its hunks say;
- ``offset``: applies, every line identical, but some hunks moved (named,
  with their offsets);
- ``upstream``: every hunk landed: the new base holds it, by evidence
  (``landed``: its post-image verbatim, or the lines it adds in order and
  the lines it removes gone, around where it would sit). Proposed for
  removal, with the evidence; never reverse-applied;
- ``partly upstream``: some hunks landed and the rest apply: the rest (the
  remainder) is carried. Or the patch landed *in another form*
  (``anotherform``: upstream merged the change its own way): each hunk's
  state is said (landed, changed upstream, still to carry, conflicting),
  the 3-way merge is written as for a conflict, and the series cannot move
  until a hand-refreshed remainder is given (``--refreshed``, used in the
  patch's place); the patches above are assessed with it set aside;
- ``conflict``: some hunk neither landed nor applies. A 3-way merge (``git
  merge-file``: new base, old base, old base with the hunks that did not
  land) is written with conflict markers to the work directory, with its
  three inputs, and each hunk that does not apply is named with why;
- ``blocked``: not assessed, because an earlier patch conflicts in a file it
  touches (its starting text on the new base is unknown).

A new base that is the pinned base with the whole series applied (an
overlaid install) is said in one line, and nothing is done.

The chain on the new base carries clean/offset patches and remainders
forward and skips upstream ones (and sets aside a patch landed in another
form). Only when no patch conflicts, is blocked or needs a hand, and with
``--write``, the pin (new version, hashes, wheel), the refreshed
patches (hunk headers and ``index`` lines recomputed against the new base; a
remainder's hunks rendered anew) and the records of dropped patches
(``patches/dropped/<slug>.dep3``: the header, ``Applied-Upstream`` filled
in) are written, and upstream patches leave the series. Otherwise the
repository is left untouched and the exit status is 1.

The modules: ``newbase`` (the base to rebase onto: a wheel, a tree, a
version fetched with pip), ``landed`` (the evidence that a hunk landed),
``classify`` (one patch's files against the new base), ``anotherform``
(whether a patch landed in another form), ``refreshed`` (a hand-refreshed
remainder given with ``--refreshed``), ``seriesref`` (the series read from
a git ref, ``--series-ref``), ``plan`` (the series walked patch by patch,
and what ``--write`` writes) and ``report`` (the result, as a table and as
JSON).
"""
